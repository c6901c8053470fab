"""Gradient accumulation (train.microbatches) equals the full-batch step.

Every microbatch routes with the old router bias and the bias update runs once
on statistics accumulated over the microbatches, so M passes over B/M rows
must give the loss, gradients, updated params and updated router bias of one
pass over B rows, up to fp32 reduction order. Top-k routing ties could in
principle flip between the two (different matmul shapes); the fixed seed
keeps them apart, and the check of the router state would show a flip.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import assert_config_error, load_config
from moe_jax.model import build_model
from moe_jax.train.optimizer import make_optimizer, make_schedule
from moe_jax.train.step import (abstract_train_state, init_train_state,
                                make_train_step, split_microbatches)

RTOL, ATOL = 1e-5, 1e-6


def _record_grads() -> optax.GradientTransformation:
  """Passes updates through and keeps them as its state (the raw grads)."""
  return optax.GradientTransformation(
      lambda params: jax.tree.map(jnp.zeros_like, params),
      lambda updates, state, params=None: (updates, updates))


def _config(balancing: str, estimator: str = "exact"):
  # Two MLA layers with plain residuals: the smallest model with two MoE
  # routers (compiles in seconds); the KDA layers do not see microbatches.
  config = load_config("default.py", "tiny,smoke,all_mla,standard_residual")
  config.model.moe.balancing = balancing
  config.model.moe.qb_estimator = estimator
  config.train.warmup_steps = 0  # lr > 0 at step 0, so params move
  # Adam's first update is lr * g / (|g| + eps), so an entry's error is
  # lr * dg / eps for small |g|: the fp32 reduction-order error dg ~ 2e-9 of
  # a gradient entry (see _assert_tree_close) gives 6e-4 with eps = 1e-8, but
  # 6e-8 with eps = 1e-4, under ATOL. The grads themselves are checked too.
  config.train.eps = 1e-4
  return config


_RESULTS = {}  # (balancing, estimator, microbatches) -> outputs: compile once


def _step_outputs(config, microbatches: int, batch):
  key = (config.model.moe.balancing, config.model.moe.qb_estimator,
         microbatches)
  if key not in _RESULTS:
    _RESULTS[key] = _run_step(config, microbatches, batch)
  return _RESULTS[key]


def _run_step(config, microbatches: int, batch):
  model = build_model(config)
  tx = optax.chain(_record_grads(), make_optimizer(config.train))
  state = init_train_state(model, tx, jax.random.PRNGKey(0),
                           config.data.seq_len)
  step = jax.jit(make_train_step(model, tx, config.model.moe,
                                 make_schedule(config.train),
                                 microbatches=microbatches))
  new_state, metrics = step(state, batch)
  return jax.device_get((state, new_state, metrics))


def _batch(config):
  rng = np.random.default_rng(1)
  shape = (config.data.batch_size, config.data.seq_len)
  return {"inputs": rng.integers(0, 256, shape).astype(np.int32),
          "targets": rng.integers(0, 256, shape).astype(np.int32)}


def _assert_tree_close(a, b, what, scaled_atol=False):
  """allclose per leaf; scaled_atol: atol = ATOL x the leaf's max |b|.

  A gradient entry is a sum over tokens, so its rounding error scales with
  the summands, not with the (possibly cancelled) result: for grads the
  absolute tolerance is relative to the leaf's scale.
  """
  assert jax.tree.structure(a) == jax.tree.structure(b), what
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a),
                          jax.tree.leaves(b)):
    atol = ATOL * float(np.abs(y).max()) if scaled_atol else ATOL
    np.testing.assert_allclose(
        x, y, rtol=RTOL, atol=atol,
        err_msg=f"{what}{jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("balancing,estimator,microbatches", [
    ("qb", "exact", 4),     # the running merge of thresholds over > 2 passes
    ("qb", "histogram", 2),
    ("sign", "exact", 2),
])
def test_microbatches_match_full_batch(balancing, estimator, microbatches):
  config = _config(balancing, estimator)
  batch = _batch(config)
  old, full, m_full = _step_outputs(config, 1, batch)
  _, acc, m_acc = _step_outputs(config, microbatches, batch)

  np.testing.assert_allclose(m_acc["loss"], m_full["loss"], rtol=RTOL)
  np.testing.assert_allclose(m_acc["grad_norm"], m_full["grad_norm"],
                             rtol=RTOL)
  # opt_state[0] of the chain is the raw gradient (see _record_grads).
  _assert_tree_close(acc.opt_state[0], full.opt_state[0], "grads",
                     scaled_atol=True)
  _assert_tree_close(acc.params, full.params, "params")
  _assert_tree_close(acc.router_state, full.router_state, "router_state")
  for key in m_full:
    if key.startswith("maxvio/"):  # summed loads: the same integer counts
      np.testing.assert_allclose(m_acc[key], m_full[key], rtol=1e-6)
  # Not vacuous: the step moved the params and the router bias.
  assert not np.allclose(full.params["head"]["kernel"],
                         old.params["head"]["kernel"])
  for layer in ("layer_0_moe", "layer_1_moe"):
    assert np.abs(full.router_state[layer]["router"]["bias"]).max() > 1e-4


def test_split_microbatches_is_strided():
  batch = {"inputs": np.arange(12).reshape(6, 2)}
  out = split_microbatches(batch, 3)["inputs"]
  assert out.shape == (3, 2, 2)
  np.testing.assert_array_equal(out[1], [[2, 3], [8, 9]])  # rows 1 and 4
  with pytest.raises(ValueError, match="train.microbatches=4"):
    split_microbatches(batch, 4)


@pytest.mark.parametrize("value,match", [
    (0, r"train.microbatches must be in \[1, inf\]"),
    (3, r"train.microbatches=3 must divide data.batch_size=4; allowed values: "
        r"the divisors of 4 \(\[1, 2, 4\]\)"),
])
def test_bad_microbatches_error(value, match):
  assert_config_error("train.microbatches", value, match)


def test_qb_window_over_steps_equals_one_big_batch(tmp_path):
  """QB over a time window (model.moe.qb_window_steps / qb_update_every).

  With the params frozen (zero updates), a period of 3 steps whose window
  holds the last 2 must leave the bias of one plain step over those 2
  batches at once (histogram counts add up exactly), keep the old bias in
  between, and resume exactly from a checkpoint taken inside the window.
  """
  from moe_jax.balancing import WINDOW_KEY
  from moe_jax.train.checkpoint import Checkpointer, abstract_like
  config = _config("qb", "histogram")
  tx = optax.set_to_zero()  # frozen params: the router scores stay put
  rng = np.random.default_rng(2)
  shape = (config.data.batch_size, config.data.seq_len)
  batches = [{k: rng.integers(0, 256, shape).astype(np.int32)
              for k in ("inputs", "targets")} for _ in range(3)]
  big = jax.tree.map(lambda a, b: np.concatenate([a, b]), *batches[1:])

  plain = init_train_state(build_model(config), tx, jax.random.PRNGKey(0),
                           config.data.seq_len)
  assert WINDOW_KEY not in plain.router_state   # defaults: no window
  want, _ = jax.jit(make_train_step(build_model(config), tx,
                                    config.model.moe))(plain, big)

  config.model.moe.qb_window_steps = 2
  config.model.moe.qb_update_every = 3
  model = build_model(config)
  state = init_train_state(model, tx, jax.random.PRNGKey(0),
                           config.data.seq_len)
  step = jax.jit(make_train_step(model, tx, config.model.moe))
  states = [state]
  for b in batches:
    states.append(step(states[-1], b)[0])
  win = [s.router_state[WINDOW_KEY]["layer_0_moe"]["router"]
         for s in states]
  bias = [s.router_state["layer_0_moe"]["router"]["bias"] for s in states]
  # Step 0 is outside the window; step 1 fills it; step 2 updates, empties.
  assert float(win[1]["qb_tokens"]) == 0.0
  assert float(win[2]["qb_tokens"]) == np.prod(shape)
  assert float(win[3]["qb_tokens"]) == 0.0
  for b in bias[1:3]:
    np.testing.assert_array_equal(np.asarray(b), np.asarray(bias[0]))
  routers = {k: v for k, v in states[3].router_state.items()
             if k != WINDOW_KEY}
  _assert_tree_close(routers, want.router_state, "router_state")
  assert np.abs(np.asarray(bias[3])).max() > 1e-4

  # Microbatches inside the window's steps: the same counts, the same bias.
  step_mb = jax.jit(make_train_step(model, tx, config.model.moe,
                                    microbatches=2))
  state_mb = state
  for b in batches:
    state_mb = step_mb(state_mb, b)[0]
  _assert_tree_close(state_mb.router_state, states[3].router_state,
                     "router_state with microbatches")
  # The restore target of train.loop (abstract_train_state) has the window.
  abstract = abstract_train_state(model, tx, jax.random.PRNGKey(0),
                                  config.data.seq_len)
  assert (jax.tree.structure(abstract.router_state)
          == jax.tree.structure(state.router_state))
  # Resume inside the window: the checkpoint carries step and window.
  ckpt = Checkpointer(str(tmp_path))
  ckpt.save(2, states[2], {}, {})
  ckpt.wait()
  restored, _, _ = ckpt.restore(2, abstract_like(states[2]))
  ckpt.close()
  resumed, _ = step(restored, batches[2])
  _assert_tree_close(resumed.router_state, states[3].router_state,
                     "resumed router_state")


@pytest.mark.parametrize("field,value,match", [
    ("model.moe.qb_update_every", 0,
     r"model.moe.qb_update_every must be in \[1, inf\]"),
    ("model.moe.qb_window_steps", 2,
     r"model.moe.qb_window_steps must be in \[1, "
     r"model.moe.qb_update_every=1\]"),
    ("model.moe.qb_update_every", 4,
     r"model.moe.qb_update_every > 1 .* needs model.moe.balancing='qb' with "
     r"model.moe.qb_estimator='histogram'"),
])
def test_bad_qb_window_error(field, value, match):
  assert_config_error(field, value, match)
