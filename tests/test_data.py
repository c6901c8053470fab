"""Tests of moe_jax.data: corpus, token files, deterministic resumable batching."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from moe_jax import data
from moe_jax.data import stdlib_corpus

SMALL = 200_000  # max_bytes that keeps the stdlib tests fast


def _cfg(**overrides):
  cfg = dict(source="stdlib", path="", val_path="", token_dtype="uint16",
             val_fraction=0.05, max_bytes=SMALL, seq_len=16, batch_size=8,
             seed=0)
  cfg.update(overrides)
  return cfg


# ----- import hygiene -----


def test_import_is_numpy_only():
  code = ("import sys, moe_jax.data; "
          "bad = [m for m in sys.modules if m == 'jax' or m.startswith('jax.')"
          " or m.startswith('flax')]; assert not bad, bad")
  subprocess.run([sys.executable, "-c", code], check=True,
                 cwd=os.path.dirname(os.path.dirname(__file__)))


# ----- stdlib corpus -----


def test_constants():
  assert (data.PAD, data.BOS, data.EOS, data.VOCAB_SIZE) == (256, 257, 258, 259)


def test_stdlib_files_clean_and_sorted():
  files = data.list_stdlib_files()
  assert files == sorted(files) and len(files) > 100
  assert "os.py" in files
  for f in files:
    parts = f.split("/")
    assert f.endswith(".py")
    assert not set(parts[:-1]) & stdlib_corpus.EXCLUDED_DIRS, f


def test_stdlib_deterministic():
  a = data.load_stdlib_splits(max_bytes=SMALL)
  stdlib_corpus._build.cache_clear()  # Force a real rebuild, not the cache.
  b = data.load_stdlib_splits(max_bytes=SMALL)
  for k in ("train", "val"):
    np.testing.assert_array_equal(a[k], b[k])
    assert a[k].dtype == np.uint16


def test_stdlib_split_by_file_full_corpus():
  info = data.stdlib_split_info()
  train, val = set(info["train_files"]), set(info["val_files"])
  assert val and train and not train & val
  assert sorted(train | val) == data.list_stdlib_files()
  splits = data.load_stdlib_splits()
  for k in ("train", "val"):
    toks = splits[k]
    assert toks.size == info[f"{k}_tokens"]
    # One BOS and one EOS per file, stream starts/ends on a document boundary.
    assert (toks == data.BOS).sum() == info[f"{k}_num_files"]
    assert (toks == data.EOS).sum() == info[f"{k}_num_files"]
    assert toks[0] == data.BOS and toks[-1] == data.EOS
    eos = np.flatnonzero(toks == data.EOS)[:-1]
    assert (toks[eos + 1] == data.BOS).all()
    assert toks.max() < data.VOCAB_SIZE and not (toks == data.PAD).any()
    assert info[f"{k}_bytes"] == (toks < 256).sum()


def test_stdlib_max_bytes_is_exact_prefix():
  full = data.load_stdlib_splits()
  small = data.load_stdlib_splits(max_bytes=SMALL)
  n_val = round(SMALL * 0.05)
  assert small["val"].size == n_val and small["train"].size == SMALL - n_val
  for k in ("train", "val"):
    np.testing.assert_array_equal(small[k], full[k][:small[k].size])
  assert not small["train"].flags.writeable  # Cached arrays are shared.


def test_documents_on_fake_root(tmp_path):
  files = {"a.py": b"print(1)\n", "pkg/b.py": b"x = 2\n", "pkg/c.py": b"",
           "z.py": b"\xff\x00", "test/t.py": b"no", "__pycache__/p.py": b"no",
           "site-packages/s.py": b"no", "readme.txt": b"no",
           "_sysconfigdata_x.py": b"no"}
  for rel, content in files.items():
    p = tmp_path / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(content)
  listed = data.list_stdlib_files(str(tmp_path))
  assert listed == ["a.py", "pkg/b.py", "pkg/c.py", "z.py"]
  splits = data.load_stdlib_splits(0.5, root=str(tmp_path))
  info = data.stdlib_split_info(0.5, root=str(tmp_path))
  train_f, val_f = stdlib_corpus.split_files(listed, 0.5)
  assert (list(info["train_files"]), list(info["val_files"])) == (train_f,
                                                                  val_f)
  for k, fs in (("train", train_f), ("val", val_f)):
    assert fs  # Never an empty split.
    want = []
    for f in fs:
      want += [data.BOS] + list(files[f]) + [data.EOS]
    np.testing.assert_array_equal(splits[k], np.array(want, np.uint16))


def test_split_membership_is_hash_of_path():
  files = data.list_stdlib_files()
  _, val = stdlib_corpus.split_files(files, 0.05)
  _, val_big = stdlib_corpus.split_files(files, 0.2)
  assert set(val) <= set(val_big)  # Nested: a path's hash decides alone.
  for f in val:
    assert stdlib_corpus.file_hash_fraction(f) < 0.05


# ----- batching -----


def _tokens(n=1000):
  return (np.arange(n) % 251).astype(np.uint16)


def test_targets_are_shifted_inputs():
  toks = data.load_stdlib_splits(max_bytes=SMALL)["train"]
  b = data.TokenBatcher(toks, seq_len=32, batch_size=4, seed=3)
  batch = b.batch_at(7)
  assert batch["inputs"].shape == batch["targets"].shape == (4, 32)
  assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
  for row, s in enumerate(b.global_starts(7)):
    np.testing.assert_array_equal(batch["inputs"][row], toks[s:s + 32])
    np.testing.assert_array_equal(batch["targets"][row], toks[s + 1:s + 33])


def test_window_starts_stay_in_range():
  toks = _tokens(20)
  b = data.TokenBatcher(toks, seq_len=19, batch_size=64, seed=0)
  assert (b.global_starts(0) == 0).all()  # Only one window fits.
  b = data.TokenBatcher(toks, seq_len=10, batch_size=512, seed=0)
  starts = b.global_starts(1)
  assert starts.min() == 0 and starts.max() == 20 - 10 - 1


def test_batch_at_is_pure():
  b = data.TokenBatcher(_tokens(), seq_len=8, batch_size=4, seed=1)
  first = b.batch_at(5)
  for _ in range(7):
    next(b)
  again = data.TokenBatcher(_tokens(), 8, 4, seed=1).batch_at(5)
  for k in ("inputs", "targets"):
    np.testing.assert_array_equal(first[k], b.batch_at(5)[k])
    np.testing.assert_array_equal(first[k], again[k])
  assert not np.array_equal(b.batch_at(5)["inputs"], b.batch_at(6)["inputs"])
  other_seed = data.TokenBatcher(_tokens(), 8, 4, seed=2).batch_at(5)
  assert not np.array_equal(first["inputs"], other_seed["inputs"])


def test_resume_is_exact():
  ref = data.TokenBatcher(_tokens(), seq_len=8, batch_size=4, seed=9)
  run = [next(ref) for _ in range(10)]
  b = data.TokenBatcher(_tokens(), seq_len=8, batch_size=4, seed=9)
  for _ in range(4):
    next(b)
  state = b.get_state()
  assert state == {"step": 4}
  resumed = data.TokenBatcher(_tokens(), seq_len=8, batch_size=4, seed=9)
  resumed.set_state({"step": np.asarray(state["step"])})  # As restored.
  for want in run[4:]:
    got = next(resumed)
    np.testing.assert_array_equal(got["inputs"], want["inputs"])
    np.testing.assert_array_equal(got["targets"], want["targets"])
  assert resumed.get_state() == {"step": 10}


def test_process_sharding_partitions_global_batch():
  toks = _tokens()
  glob = data.TokenBatcher(toks, seq_len=8, batch_size=12, seed=4)
  for count in (1, 2, 3, 4):
    parts = [data.TokenBatcher(toks, 8, 12, seed=4, process_index=i,
                               process_count=count) for i in range(count)]
    for step in (0, 3):
      want = glob.batch_at(step)
      for k in ("inputs", "targets"):
        got = np.concatenate([p.batch_at(step)[k] for p in parts])
        np.testing.assert_array_equal(got, want[k])
      assert parts[0].batch_at(step)["inputs"].shape == (12 // count, 8)
  with pytest.raises(ValueError, match="divisible by process_count"):
    data.TokenBatcher(toks, 8, 12, process_index=0, process_count=5)
  with pytest.raises(ValueError, match="process_index"):
    data.TokenBatcher(toks, 8, 12, process_index=2, process_count=2)


def test_eval_batches_contiguous_and_deterministic():
  toks = _tokens(1000)
  seq, bs = 10, 4
  batches = list(data.eval_batches(toks, seq, bs))
  # (1000 - 1) // 10 = 99 windows -> 24 full batches, the rest dropped.
  assert len(batches) == data.num_eval_batches(1000, seq, bs) == 24
  inputs = np.concatenate([b["inputs"] for b in batches]).reshape(-1)
  targets = np.concatenate([b["targets"] for b in batches]).reshape(-1)
  np.testing.assert_array_equal(inputs, toks[:24 * bs * seq])
  np.testing.assert_array_equal(targets, toks[1:24 * bs * seq + 1])
  again = list(data.eval_batches(toks, seq, bs, max_batches=3))
  assert len(again) == 3
  for a, b in zip(again, batches):
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
  # Process slices of each eval batch partition it too.
  halves = [list(data.eval_batches(toks, seq, bs, process_index=i,
                                   process_count=2)) for i in range(2)]
  for b, h0, h1 in zip(batches, *halves):
    np.testing.assert_array_equal(
        np.concatenate([h0["inputs"], h1["inputs"]]), b["inputs"])
  with pytest.raises(ValueError, match="no full batch"):
    data.eval_batches(toks[:30], seq, bs)


# ----- unigram baseline -----


def test_unigram_bits_per_byte_closed_form():
  train = np.array([0, 0, 1, 2, 2, 2])
  ev = np.array([0, 1, 3, 2])
  v, k = 4, 1.0
  counts = np.array([2, 1, 3, 0])
  p = (counts + k) / (6 + k * v)
  want = -np.mean(np.log2(p[ev]))
  got = data.unigram_bits_per_byte(train, ev, v, smoothing=k)
  assert math.isclose(got, want, rel_tol=1e-12)
  # Uniform eval under a uniform model: log2(V) bits.
  assert math.isclose(data.unigram_bits_per_byte(np.arange(8), np.arange(8), 8),
                      3.0)
  with pytest.raises(ValueError, match="outside"):
    data.unigram_bits_per_byte(train, np.array([4]), v)


def test_unigram_baseline_on_stdlib_is_sane():
  s = data.load_stdlib_splits(max_bytes=SMALL)
  bpb = data.unigram_bits_per_byte(s["train"], s["val"], data.VOCAB_SIZE)
  assert 3.0 < bpb < 6.0


# ----- token files -----


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_round_trip(tmp_path, dtype):
  ids = np.arange(1000, dtype=dtype) * 7 % (60000 if dtype == "uint16"
                                             else 100_000)
  path = tmp_path / f"toks.{dtype}"
  ids.tofile(path)
  mm = data.load_token_file(str(path), dtype)
  assert isinstance(mm, np.memmap) and mm.dtype == np.dtype(dtype)
  np.testing.assert_array_equal(mm, ids)
  s = data.load_token_file_splits(str(path), dtype, val_fraction=0.1)
  np.testing.assert_array_equal(s["train"], ids[:900])
  np.testing.assert_array_equal(s["val"], ids[900:])
  vpath = tmp_path / "val.bin"
  ids[:50].tofile(vpath)
  s = data.load_token_file_splits(str(path), dtype, val_path=str(vpath))
  assert s["train"].size == 1000 and s["val"].size == 50
  train, val, train_toks, vocab = data.make_datasets(
      _cfg(source="token_file", path=str(path), token_dtype=dtype,
           val_fraction=0.1))
  assert vocab == int(ids.max()) + 1 and val.size == 100
  assert train_toks.size == 900 and next(train)["inputs"].shape == (8, 16)


def test_token_file_errors(tmp_path):
  path = tmp_path / "odd.bin"
  path.write_bytes(b"\x00" * 7)
  with pytest.raises(ValueError, match="data.token_dtype"):
    data.load_token_file(str(path), "int8")
  with pytest.raises(ValueError, match="not a multiple"):
    data.load_token_file(str(path), "uint16")
  with pytest.raises(FileNotFoundError, match="nope.bin"):
    data.load_token_file(str(tmp_path / "nope.bin"))
  (tmp_path / "empty.bin").write_bytes(b"")
  with pytest.raises(ValueError, match="empty"):
    data.load_token_file(str(tmp_path / "empty.bin"))
  with pytest.raises(data.TokenFileError, match="data.path: .* not a regular"):
    data.load_token_file(str(tmp_path))


def test_unreadable_token_file_names_the_field(tmp_path, monkeypatch):
  from moe_jax.data import token_file
  path = tmp_path / "ids.bin"
  path.write_bytes(b"\x00" * 8)

  def denied(*args, **kwargs):
    raise PermissionError(13, "Permission denied")
  # chmod would not stop root (the tests may run as root): refuse the open.
  monkeypatch.setattr(token_file, "open", denied, raising=False)
  with pytest.raises(data.TokenFileError,
                     match="data.val_path: cannot read token file .*ids.bin"
                     ".*Permission denied"):
    data.load_token_file(str(path), field="data.val_path")


# ----- make_datasets -----


def test_make_datasets_stdlib():
  train, val, train_toks, vocab = data.make_datasets(_cfg())
  assert vocab == data.VOCAB_SIZE
  ref = data.load_stdlib_splits(max_bytes=SMALL)
  np.testing.assert_array_equal(val, ref["val"])
  np.testing.assert_array_equal(train_toks, ref["train"])
  assert next(train)["inputs"].shape == (8, 16)
  # Attribute-style configs (ConfigDict-like) work too.
  class Obj:
    pass
  obj = Obj()
  obj.__dict__.update(_cfg(max_bytes=0, seq_len=4, batch_size=2))
  _, val_full, _, _ = data.make_datasets(obj)
  assert val_full.size == data.stdlib_split_info()["val_tokens"]


@pytest.mark.parametrize("overrides, field", [
    (dict(source="x"), r"data.source must be one of \['stdlib', 'token_file'\]"),
    (dict(seq_len=0), "data.seq_len"),
    (dict(seq_len=2.5), "data.seq_len"),
    (dict(batch_size=0), "data.batch_size"),
    (dict(val_fraction=0.0), "data.val_fraction"),
    (dict(val_fraction=1.5), "data.val_fraction"),
    (dict(max_bytes=-1), "data.max_bytes"),
    (dict(seed=-1), "data.seed"),
    (dict(seq_len=20_000), "data.seq_len"),  # Val split (10k) too small.
    (dict(source="token_file", path=""), "data.path"),
    (dict(source="token_file", path="/nonexistent/x.bin",
          token_dtype="int64"), "data.token_dtype"),
])
def test_bad_configs_name_the_field(overrides, field):
  with pytest.raises(ValueError, match=field):
    data.make_datasets(_cfg(**overrides))


def test_missing_required_field():
  cfg = _cfg()
  del cfg["seq_len"]
  with pytest.raises(ValueError, match="data.seq_len is required"):
    data.make_datasets(cfg)
