"""pick: take_along_axis's values and gradient, with no scatter in the step."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_config
from moe_jax.eval.step import token_cross_entropy
from moe_jax.layers.pick import pick


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pick_equals_take_along_axis_values_and_grads(dtype):
  kx, ki, kc = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(kx, (3, 5, 37), jnp.float32).astype(dtype)
  x = x.at[0, 0, 3].set(jnp.inf)          # never picked: must not leak
  idx = jax.random.randint(ki, (3, 5, 4), 4, 37)
  idx = idx.at[1, 2].set(jnp.array([36, 4, 36, 7]))  # repeats, both ends
  ct = jax.random.normal(kc, (3, 5, 4), jnp.float32).astype(dtype)
  ref = jnp.take_along_axis(x, idx, axis=-1)
  np.testing.assert_array_equal(pick(x, idx), ref)          # exact
  g = jax.grad(lambda x: jnp.sum(pick(x, idx) * ct))(x)
  g_ref = jax.grad(lambda x: jnp.sum(
      jnp.take_along_axis(x, idx, axis=-1) * ct))(x)
  np.testing.assert_array_equal(g, g_ref)
  jaxpr = str(jax.make_jaxpr(jax.grad(
      lambda x: jnp.sum(pick(x, idx) * ct)))(x))
  assert "scatter" not in jaxpr
  with pytest.raises(ValueError, match="must agree on every axis"):
    pick(x, idx[:2])


def test_cross_entropy_matches_log_softmax():
  logits = 5 * jax.random.normal(jax.random.PRNGKey(1), (2, 7, 259))
  targets = jax.random.randint(jax.random.PRNGKey(2), (2, 7), 0, 259)
  ref = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None],
                             axis=-1)[..., 0]
  np.testing.assert_allclose(token_cross_entropy(logits, targets), ref,
                             rtol=1e-6, atol=1e-6)
  g = jax.grad(lambda l: token_cross_entropy(l, targets).sum())(logits)
  want = jax.nn.softmax(logits) - jax.nn.one_hot(targets, 259)
  np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)


def test_train_step_scatters_only_the_token_permutation():
  # The router's top-k weights and the loss pick by one-hot sums; what is
  # left is the MoE's inverse permutation (unique int32 indices), one per
  # MoE layer (and its recompute under remat).
  from moe_jax import sharding
  from moe_jax.data import make_datasets
  from moe_jax.train.loop import build_train_step
  from moe_jax.train.step import init_train_state
  c = load_config("default.py", "tiny,smoke")
  setup = build_train_step(c)
  state = init_train_state(setup.model, setup.tx, setup.rng, c.data.seq_len,
                           shardings=setup.state_shardings)
  batch = next(make_datasets(dict(c.data.to_dict(), seed=c.seed))[0])
  batch = sharding.shard_batch(batch, setup.batch_sharding, c.data.batch_size)
  text = setup.train_step.lower(state, batch).as_text()
  scatters = re.findall(r'"stablehlo.scatter"\([^)]*\).*?\}\)\s*:\s*\(([^)]*)\)',
                        text, re.S)
  assert scatters, "the MoE's inverse permutation should be one scatter"
  for operands in scatters:
    assert operands.split(",")[0].strip().endswith("xi32>"), operands
  assert "unique_indices = false" not in text


def test_token_permutation_is_a_bare_gather_both_ways():
  """permute_rows (the MoE's token order <-> expert order): values and
  gradient of a[perm // slots], lowered with neither a scatter nor an
  out-of-bounds select."""
  from moe_jax.layers.expert_parallel import permute_rows
  a = jax.random.normal(jax.random.PRNGKey(3), (6, 4))
  perm = jax.random.permutation(jax.random.PRNGKey(4), 12).astype(jnp.int32)
  inv = jnp.argsort(perm).astype(jnp.int32)
  ct = jax.random.normal(jax.random.PRNGKey(5), (12, 4))
  np.testing.assert_array_equal(permute_rows(a, perm, inv, 2), a[perm // 2])
  f = lambda a: jnp.sum(permute_rows(a, perm, inv, 2) * ct)  # noqa: E731
  np.testing.assert_allclose(jax.grad(f)(a),
                             jax.grad(lambda a: jnp.sum(a[perm // 2] * ct))(a),
                             rtol=1e-6)
  text = jax.jit(jax.grad(f)).lower(a).as_text()
  assert "scatter" not in text and "select" not in text
