"""Tests of moe_jax.data.retrieval: passkey / MQAR rows in training batches."""
import numpy as np
import pytest

from configs import default
from moe_jax import config_validation
from moe_jax.config_validation import ConfigError, validate_config
from moe_jax.data import BOS, EOS, TokenBatcher, make_datasets, retrieval
from moe_jax.data.pipeline import batcher_kwargs, packing_kwargs

SEQ = 128
BATCH = 8


@pytest.fixture(scope="module")
def train_tokens():
  """Letters and spaces in documents of 50..400 bytes (BOS ... EOS): no
  digit, so a key can only come from the needle."""
  rng = np.random.default_rng(0)
  parts = []
  while sum(p.size for p in parts) < 60_000:
    body = rng.choice(np.frombuffer(b"abcdefgh ", np.uint8),
                      rng.integers(50, 400))
    parts.append(np.concatenate([[BOS], body, [EOS]]).astype(np.uint16))
  return np.concatenate(parts)


def _doc(batch, row):
  return np.append(batch["inputs"][row], batch["targets"][row, -1])


def test_zero_fraction_is_the_batch_without_retrieval(train_tokens):
  plain = TokenBatcher(train_tokens, SEQ, BATCH, seed=3)
  zero = TokenBatcher(train_tokens, SEQ, BATCH, seed=3, retrieval_fraction=0.0,
                      retrieval_kinds="passkey,mqar")
  for step in (0, 7):
    for key in ("inputs", "targets"):
      np.testing.assert_array_equal(plain.batch_at(step)[key],
                                    zero.batch_at(step)[key])
  # The default config adds no keyword: the main job's data is unchanged.
  cfg = default.get_config()
  assert cfg.data.retrieval_fraction == 0.0
  assert batcher_kwargs(cfg.data) == packing_kwargs(cfg.data) == {}


def test_zero_fraction_make_datasets_bit_identical():
  cfg = dict(source="stdlib", max_bytes=100_000, seq_len=32, batch_size=4,
             seed=1)
  old, *_ = make_datasets(cfg)  # a config saved before the fields existed
  new, *_ = make_datasets(dict(cfg, retrieval_fraction=0.0,
                               retrieval_kinds="passkey"))
  for step in (0, 5):
    a, b = old.batch_at(step), new.batch_at(step)
    assert a.keys() == b.keys()
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])


def test_retrieval_rows_replace_only_their_rows(train_tokens):
  plain = TokenBatcher(train_tokens, SEQ, 32, seed=5)
  mixed = TokenBatcher(train_tokens, SEQ, 32, seed=5, retrieval_fraction=0.25,
                       retrieval_kinds="passkey,mqar")
  counts = []
  for step in range(6):
    rows = retrieval.retrieval_rows(5, step, 32, 0.25)
    a, b = plain.batch_at(step), mixed.batch_at(step)
    np.testing.assert_array_equal(a["inputs"][~rows], b["inputs"][~rows])
    np.testing.assert_array_equal(a["targets"][~rows], b["targets"][~rows])
    for row in np.flatnonzero(rows):
      want = retrieval.retrieval_document(train_tokens, SEQ + 1,
                                          ("passkey", "mqar"), 5, step, row)
      np.testing.assert_array_equal(_doc(b, row), want["tokens"])
      np.testing.assert_array_equal(b["inputs"][row, 1:],
                                    b["targets"][row, :-1])
    counts.append(rows.sum())
  assert 0.1 < np.mean(counts) / 32 < 0.4, counts
  every = TokenBatcher(train_tokens, SEQ, 4, seed=5, retrieval_fraction=1.0)
  assert (every.batch_at(0)["inputs"][:, 0] == BOS).all()


def test_deterministic_resumable_and_split_over_processes(train_tokens):
  kw = dict(seed=2, retrieval_fraction=0.5, retrieval_kinds="passkey,mqar")
  run = TokenBatcher(train_tokens, SEQ, BATCH, **kw)
  batches = [next(run) for _ in range(4)]
  resumed = TokenBatcher(train_tokens, SEQ, BATCH, **kw)
  resumed.set_state({"step": np.asarray(2)})
  for want in batches[2:]:
    got = next(resumed)
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])
  halves = [TokenBatcher(train_tokens, SEQ, BATCH, process_index=i,
                         process_count=2, **kw).batch_at(3) for i in (0, 1)]
  np.testing.assert_array_equal(
      np.concatenate([h["inputs"] for h in halves]), batches[3]["inputs"])
  other_seed = TokenBatcher(train_tokens, SEQ, BATCH, **dict(kw, seed=9))
  assert not np.array_equal(other_seed.batch_at(0)["inputs"],
                            batches[0]["inputs"])


def test_passkey_needle_answer_and_filler(train_tokens):
  cuts = []
  for row in range(40):
    doc = retrieval.retrieval_document(train_tokens, SEQ + 1, ("passkey",),
                                       0, 4, row)
    tokens, key, cut = doc["tokens"], doc["key"], doc["cut"]
    text = bytes(tokens[1:].astype(np.uint8))
    needle = retrieval.PASSKEY_NEEDLE.format(key=key).encode()
    question = retrieval.PASSKEY_QUESTION.encode()
    assert tokens.shape == (SEQ + 1,) and tokens[0] == BOS
    assert len(key) == retrieval.PASSKEY_DIGITS and key.isdigit()
    s = doc["needle_start"]
    assert bytes(tokens[s:s + len(needle)].astype(np.uint8)) == needle
    assert text.endswith(question + key.encode())
    assert doc["answer_start"] == SEQ + 1 - retrieval.PASSKEY_DIGITS
    # The filler is the training split's window, document markers as
    # newlines; it holds no digit (the key is only in the needle).
    filler = np.concatenate([tokens[1:s], tokens[s + len(needle):
                                                 -len(question) - len(key)]])
    start = doc["filler_start"]
    window = train_tokens[start:start + filler.size].astype(np.int32)
    np.testing.assert_array_equal(filler, np.where(window >= 256, 10, window))
    assert not any(chr(t).isdigit() for t in filler)
    cuts.append(cut / filler.size)
  assert min(cuts) < 0.15 and max(cuts) > 0.85  # depth spans the document


def test_mqar_document(train_tokens):
  doc = retrieval.mqar_document(train_tokens, 200,
                                np.random.default_rng(1))
  tokens, mask, pairs = doc["tokens"], doc["answer_mask"], doc["pairs"]
  assert tokens.shape == (200,) and tokens[0] == BOS and mask.sum() == len(
      pairs)
  n = len(pairs)
  np.testing.assert_array_equal(tokens[1:1 + 2 * n:2], list(pairs))
  for pos in np.flatnonzero(mask):  # each queried value follows its key
    assert pairs[tokens[pos - 1]] == tokens[pos]
  assert (tokens[1:] < 256).all()


def test_packed_documents_retrieval_row_is_one_segment(train_tokens):
  kw = dict(seed=0, packing="documents", document_start_token=BOS)
  plain = TokenBatcher(train_tokens, SEQ, 16, **kw).batch_at(1)
  mixed = TokenBatcher(train_tokens, SEQ, 16, retrieval_fraction=0.5,
                       **kw).batch_at(1)
  rows = retrieval.retrieval_rows(0, 1, 16, 0.5)
  assert rows.any() and (~rows).any()
  assert (mixed["segment_ids"][rows] == 0).all()
  np.testing.assert_array_equal(mixed["segment_ids"][~rows],
                                plain["segment_ids"][~rows])
  assert plain["segment_ids"][rows].max() > 0  # their windows had several


def test_batcher_errors(train_tokens):
  for bad in (-0.1, 1.5, "0.1", True):
    with pytest.raises(ValueError, match=r"data.retrieval_fraction.*\[0, 1\]"):
      TokenBatcher(train_tokens, SEQ, 4, retrieval_fraction=bad)
  for bad in ("passkey,foo", "", "passkey,passkey"):
    with pytest.raises(ValueError, match="data.retrieval_kinds.*passkey"):
      TokenBatcher(train_tokens, SEQ, 4, retrieval_fraction=0.1,
                   retrieval_kinds=bad)
  with pytest.raises(ValueError, match=r"data.seq_len=64 .*passkey.*>= 105"):
    TokenBatcher(train_tokens, 64, 4, retrieval_fraction=0.1)
  TokenBatcher(train_tokens, 64, 4, retrieval_fraction=0.1,
               retrieval_kinds="mqar")
  with pytest.raises(ValueError, match="data.retrieval_fraction > 0 needs "
                     "data.source='stdlib'"):
    make_datasets(dict(source="token_file", path="x.bin", seq_len=8,
                       batch_size=2, retrieval_fraction=0.1))


def test_config_validation():
  assert config_validation.RETRIEVAL_MIN_SEQ_LEN == {
      k: retrieval.min_seq_len(k) for k in retrieval.RETRIEVAL_KINDS}
  validate_config(default.get_config("curriculum"))
  cases = [
      ("smoke", {"retrieval_fraction": 1.5},
       r"data.retrieval_fraction must be in \[0.0, 1.0\], got 1.5"),
      ("smoke", {"retrieval_fraction": 0.1, "retrieval_kinds": "passkey,x"},
       "data.retrieval_kinds must be .*'passkey', 'mqar'"),
      ("smoke", {"retrieval_fraction": 0.1},
       "data.seq_len=32 is too short for a passkey .*seq_len >= 105"),
      ("curriculum", {"seq_len": 64, "batch_size": 64},
       r"curriculum.stages\[0\] \(seq_len 64\) is too short for a passkey"),
  ]
  for variant, fields, match in cases:
    cfg = default.get_config(variant)
    if variant == "curriculum":
      cfg.curriculum.stages = "64:120,1024:40,4096:20"
    cfg.data.update(fields)
    with pytest.raises(ConfigError, match=match):
      validate_config(cfg)


def test_eval_asks_the_training_question():
  from moe_jax.eval import long_context  # pylint: disable=g-import-not-at-top
  assert long_context.PASSKEY_NEEDLE is retrieval.PASSKEY_NEEDLE
  assert long_context.PASSKEY_QUESTION is retrieval.PASSKEY_QUESTION
  assert long_context.passkey_overhead() == retrieval.min_seq_len("passkey")
  # Its filler is held out: the repeated sentences, not corpus text.
  assert long_context.PASSKEY_FILLER not in retrieval.PASSKEY_NEEDLE
