"""Length-extrapolation evaluation: generators, scoring, the CLI's core.

The generators are checked against their contract (needle at the requested
depth, answers that are the hidden values); the accuracy bookkeeping with
oracle scorers (always right, always wrong, right on the first digit only);
the model scorer against a plain forward on a tiny random model.
"""
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_config
from moe_jax.data import BOS
from moe_jax.eval import long_context as lc
from moe_jax.eval.step import token_cross_entropy
from moe_jax.model import build_model

# Two sequences per cell, scored one per forward: one compilation per
# length, shared with the ladder's stage-end evaluation (test_curriculum.py).
SAMPLES = 2


def _oracle(offset: int = 0, first_only: bool = False) -> lc.Scorer:
  """Predicts the targets (+ offset); first_only: right on the first
  passkey digit only."""
  def scorer(inputs, targets):
    pred = targets + offset
    if first_only:  # targets[:, -1] is no token's answer
      pred = pred.copy()
      pred[:, -lc.PASSKEY_DIGITS:-1] += 1
    return np.zeros(targets.shape, np.float32), pred
  return scorer


@pytest.mark.parametrize("length", [lc.passkey_overhead() + 1, 300])
@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_passkey_example_hides_the_key_at_the_depth(length, depth):
  ex = lc.passkey_example(length, depth, seed=5, index=1)
  tokens, key = ex["tokens"], ex["key"]
  assert tokens.shape == (length,) and tokens[0] == BOS
  assert len(key) == lc.PASSKEY_DIGITS and key.isdigit()
  n_filler = length - lc.passkey_overhead()
  assert ex["needle_start"] == 1 + round(depth * n_filler)
  needle = lc.PASSKEY_NEEDLE.format(key=key).encode()
  start = ex["needle_start"]
  assert bytes(tokens[start:start + len(needle)].tolist()) == needle
  assert bytes(tokens[ex["answer_start"]:].tolist()) == key.encode()
  question = lc.PASSKEY_QUESTION.encode()
  assert bytes(tokens[ex["answer_start"] - len(question):
                      ex["answer_start"]].tolist()) == question
  # The filler around the needle is the filler text, cut where it was.
  filler = bytes(np.concatenate([tokens[1:start],
                                 tokens[start + len(needle):
                                        ex["answer_start"] - len(question)]]
                                ).tolist())
  assert filler == (lc.PASSKEY_FILLER * length).encode()[:n_filler]
  again = lc.passkey_example(length, depth, seed=5, index=1)
  np.testing.assert_array_equal(again["tokens"], tokens)
  keys = {lc.passkey_example(length, depth, seed=5, index=i)["key"]
          for i in range(8)}
  assert len(keys) > 1


def test_passkey_bad_inputs_are_clear_errors():
  with pytest.raises(ValueError, match="too short.*allowed: lengths >= "):
    lc.passkey_example(lc.passkey_overhead(), 0.5, seed=0)
  with pytest.raises(ValueError, match=r"depth must be in \[0, 1\]"):
    lc.passkey_example(200, 1.5, seed=0)


@pytest.mark.parametrize("length,pairs", [(9, 2), (64, 8), (300, 58)])
def test_mqar_example_answers_are_the_pairs_values(length, pairs):
  ex = lc.mqar_example(length, pairs, seed=3, index=2)
  tokens, mask = ex["tokens"], ex["answer_mask"]
  assert tokens.shape == mask.shape == (length,) and tokens[0] == BOS
  assert mask.sum() == pairs and len(ex["pairs"]) == pairs
  kv = tokens[1:1 + 2 * pairs].reshape(pairs, 2)
  assert dict(kv.tolist()) == ex["pairs"]
  for t in np.flatnonzero(mask):  # each answer is the value of its key
    assert ex["pairs"][int(tokens[t - 1])] == tokens[t]
  queried = tokens[np.flatnonzero(mask) - 1]
  assert sorted(queried.tolist()) == sorted(ex["pairs"])
  noise = tokens[1 + 2 * pairs:length - 2 * pairs]
  assert set(noise.tolist()) <= set(lc.MQAR_NOISE)
  assert set(kv[:, 0].tolist()) <= set(lc.MQAR_KEYS)
  assert set(kv[:, 1].tolist()) <= set(lc.MQAR_VALUES)
  np.testing.assert_array_equal(
      lc.mqar_example(length, pairs, seed=3, index=2)["tokens"], tokens)
  with pytest.raises(ValueError, match="too short for"):
    lc.mqar_example(4 * pairs, pairs, seed=3)


def test_accuracies_of_oracle_scorers():
  lengths, depths = [120, 150], [0.0, 0.5, 1.0]
  right = lc.passkey_accuracy(_oracle(), lengths, depths, 3)
  wrong = lc.passkey_accuracy(_oracle(1), lengths, depths, 3)
  first = lc.passkey_accuracy(_oracle(first_only=True), lengths, depths, 3)
  assert right["accuracy"].shape == (2, 3)
  assert (right["accuracy"] == 1).all() and (right["digit_accuracy"] == 1
                                             ).all()
  assert (wrong["accuracy"] == 0).all() and (wrong["digit_accuracy"] == 0
                                             ).all()
  assert (first["accuracy"] == 0).all()
  np.testing.assert_allclose(first["digit_accuracy"], 1 / lc.PASSKEY_DIGITS)
  mq = lc.mqar_accuracy(_oracle(), [16, 64], [2, 8], 3)
  assert mq["accuracy"].shape == (2, 2)
  assert mq["accuracy"][0].tolist() == [1, 1] and mq["accuracy"][1, 1] == 1
  assert np.isnan(mq["accuracy"][1, 0])  # 16 tokens hold no 8 pairs
  assert (lc.mqar_accuracy(_oracle(1), [64], [8], 3)["accuracy"] == 0).all()


def test_position_buckets_cover_every_position():
  assert lc.position_buckets(32, 512) == [
      (0, 4), (4, 8), (8, 16), (16, 32), (32, 64), (64, 128), (128, 256),
      (256, 512)]
  assert lc.position_buckets(32, 100)[-1] == (64, 100)


@pytest.fixture(scope="module")
def random_model():
  """(model, params, router_state) of the tiny hybrid, random numpy params."""
  config = load_config("default.py", "tiny,smoke")
  model = build_model(config)
  shapes = nn.meta.unbox(jax.eval_shape(
      model.init, jax.random.PRNGKey(0), jnp.zeros((1, 32), jnp.int32)))
  rng = np.random.default_rng(0)
  fill = lambda s: jnp.asarray(  # noqa: E731
      rng.standard_normal(s.shape) / np.sqrt(max(s.shape[0], 1))
      if len(s.shape) > 1 else 1 + 0.1 * rng.standard_normal(s.shape),
      s.dtype)
  return (model, jax.tree.map(fill, shapes["params"]),
          jax.tree.map(fill, shapes["router_state"]))


def test_scorer_and_task_outputs_on_a_tiny_random_model(random_model):
  model, params, router_state = random_model
  scorer = lc.batched(lc.make_scorer(model, params, router_state), 1)
  seqs = np.stack([lc.mqar_example(33, 4, seed=0, index=i)["tokens"]
                   for i in range(SAMPLES)])
  ce, pred = scorer(seqs[:, :-1], seqs[:, 1:])
  assert ce.shape == pred.shape == (SAMPLES, 32)
  forward = jax.jit(model.apply)
  for row in range(SAMPLES):
    logits = forward({"params": params, "router_state": router_state},
                     jnp.asarray(seqs[row:row + 1, :-1]))[0]
    np.testing.assert_allclose(
        ce[row], token_cross_entropy(logits, jnp.asarray(seqs[row, 1:])),
        rtol=1e-5)
    np.testing.assert_array_equal(pred[row], np.argmax(logits, -1))

  # Every task at one length (32), so that nothing else compiles; the
  # passkey prompt needs more: the CLI test below runs it at 128.
  tokens = np.random.default_rng(1).integers(0, 256, 1000)
  rows = lc.loss_by_position(scorer, tokens, 8, 32, SAMPLES)
  assert [(r["lo"], r["hi"]) for r in rows] == lc.position_buckets(8, 32)
  assert sum(r["tokens"] for r in rows) == SAMPLES * 32
  assert all(np.isfinite(r["loss"]) for r in rows)
  mq = lc.mqar_accuracy(scorer, [32], [4, 8], SAMPLES)
  assert mq["accuracy"].shape == (2, 1) and np.isnan(mq["accuracy"][1, 0])
  assert 0 <= mq["accuracy"][0, 0] <= 1
  assert "n/a" in lc.mqar_table(mq)
  with pytest.raises(ValueError, match="fewer than 2 windows of max_len"):
    lc.loss_by_position(scorer, tokens[:33], 8, 32, SAMPLES)


def test_cli_core_evaluates_a_tiny_checkpoint(smoke_run, tmp_path):
  from experiments.evaluate_long import evaluate_long
  _, workdir, _ = smoke_run  # trained at 32 tokens, checkpoint 6
  out = str(tmp_path / "long")
  res = evaluate_long(workdir, out=out, factors=(1, 4), depths=(0.0, 1.0),
                      samples=SAMPLES, mqar_pairs=(4, 16), batch_size=1)
  assert res["step"] == 6 and res["train_len"] == 32
  assert res["loss"][-1]["hi"] == 128
  assert res["passkey"]["lengths"] == [128]  # 32 is shorter than a prompt
  acc = np.asarray(res["passkey"]["accuracy"])
  assert acc.shape == (1, 2) and ((acc >= 0) & (acc <= 1)).all()
  assert np.asarray(res["mqar"]["accuracy"]).shape == (2, 2)
  with open(os.path.join(out, "long_context.md")) as f:
    text = f.read()
  assert "Loss against position" in text and "Passkey" in text and (
      "MQAR" in text)
  assert os.path.exists(os.path.join(out, "results.json"))
  pytest.importorskip("matplotlib")
  assert sorted(os.path.basename(p) for p in res["figures"]) == [
      "loss_by_position.png", "mqar.png", "passkey.png"]
  # The same checkpoint with MLA queries scaled past the training length:
  # the same loss up to 32 tokens, another one beyond.
  logn = evaluate_long(workdir, out=str(tmp_path / "logn"), tasks=("loss",),
                       factors=(1, 4), samples=SAMPLES, logn_scale_len=32)
  assert logn["logn_scale_len"] == 32 and res["logn_scale_len"] == 0
  for a, b in zip(res["loss"], logn["loss"]):
    assert a["hi"] == b["hi"]
    if a["hi"] <= 32:
      assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), a
  assert res["loss"][-1]["loss"] != logn["loss"][-1]["loss"]


def test_training_length_is_the_checkpoints_stage_even_in_older_configs():
  import ml_collections
  from experiments.evaluate_long import train_length
  saved = load_config("default.py", "tiny,smoke").to_dict()
  saved["curriculum"] = {"stages": "32:3,64:3"}  # saved before other fields
  config = ml_collections.ConfigDict(saved)
  assert [train_length(config, s) for s in (1, 3, 4, 6)] == [32, 32, 64, 64]
  del saved["curriculum"]  # saved before the curriculum existed
  assert train_length(ml_collections.ConfigDict(saved), 6) == 32
