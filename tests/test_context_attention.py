"""Token mixers under context parallelism equal the unsharded layers.

Gated MLA (latent all-gather, global causal positions) and the KDA layer
(context-parallel KDA op) run under `jax.set_mesh` with a 'context' axis on 8
fake CPU devices and are compared, same params, with the plain layers run
without a mesh: outputs and gradients wrt params and inputs, also on packed
documents (segment ids: the plain layers mask attention, short convs and the
KDA state by document).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from moe_jax.layers.context_attention import context_parallel_latent_attention
from moe_jax.layers.kda import KDA
from moe_jax.layers.mla import GatedMLA

B, D = 2, 16
RTOL, ATOL = 1e-4, 1e-5

MLA_CONFIGS = {
    "nope": dict(num_heads=2, kv_lora_rank=8, qk_nope_head_dim=8,
                 v_head_dim=4),
    # + queries scaled from position 5 on (logn_scale_len).
    "rope_qlora_logn": dict(num_heads=2, kv_lora_rank=8, qk_nope_head_dim=4,
                            v_head_dim=8, qk_rope_head_dim=4, q_lora_rank=6,
                            logn_scale_len=5),
}


def _segment_ids(t, starts):
  """[B, T] int segment ids with documents starting at starts[row]."""
  ids = np.zeros((B, t), np.int32)
  for row, row_starts in enumerate(starts):
    ids[row, row_starts] = 1
  return np.cumsum(ids, axis=1).astype(np.int32)


def _value_and_grad(model):
  """jit(value_and_grad) of <y, ct> wrt (params, x)."""

  def loss(params, x, ct, segment_ids):
    y = model.apply(params, x, segment_ids=segment_ids)
    return jnp.sum(y * ct), y

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def _compare(model, mesh, t, seed=0, segment_ids=None):
  x = jax.random.normal(jax.random.PRNGKey(seed), (B, t, D))
  ct = jax.random.normal(jax.random.PRNGKey(seed + 1), (B, t, D))
  params = jax.jit(model.init)(jax.random.PRNGKey(2), x)
  (_, y_ref), (gp_ref, gx_ref) = _value_and_grad(model)(params, x, ct,
                                                        segment_ids)
  with jax.set_mesh(mesh):
    # Init under the mesh builds the same params (same paths and inits).
    params_cp = jax.jit(model.init)(jax.random.PRNGKey(2), x)
    (_, y), (gp, gx) = _value_and_grad(model)(params, x, ct, segment_ids)
    # The parallel path really ran (not the plain fallback).
    assert "all_gather" in str(jax.make_jaxpr(model.apply)(params, x))
  assert "all_gather" not in str(jax.make_jaxpr(model.apply)(params, x))
  jax.tree_util.tree_map(np.testing.assert_array_equal, params_cp, params)
  assert np.all(np.isfinite(y)) and np.all(np.isfinite(gx))
  np.testing.assert_allclose(y, y_ref, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(gx, gx_ref, rtol=RTOL, atol=ATOL)
  flat, flat_ref = (jax.tree_util.tree_leaves_with_path(g)
                    for g in (gp, gp_ref))
  for (path, g), (_, g_ref) in zip(flat, flat_ref):
    assert np.all(np.isfinite(g)), jax.tree_util.keystr(path)
    np.testing.assert_allclose(g, g_ref, rtol=RTOL, atol=ATOL,
                               err_msg=jax.tree_util.keystr(path))
    assert np.abs(np.asarray(g_ref)).max() > 0, jax.tree_util.keystr(path)


@pytest.mark.parametrize("name", sorted(MLA_CONFIGS))
@pytest.mark.parametrize("mesh_shape,mesh_names,axis_type,packed", [
    ((8,), ("context",), AxisType.Explicit, False),
    ((2, 4), ("data", "context"), AxisType.Auto, False),
    ((8,), ("context",), AxisType.Explicit, True),
])
def test_mla_context_parallel_matches_unsharded(name, mesh_shape, mesh_names,
                                                axis_type, packed):
  model = GatedMLA(d_model=D, **MLA_CONFIGS[name])
  mesh = jax.make_mesh(mesh_shape, mesh_names,
                       axis_types=(axis_type,) * len(mesh_shape))
  # 3 tokens per device: starts at device 1's first token, twice on device
  # 2 (the last document spans devices 2 to 6), and mid-device in row 1.
  segment_ids = _segment_ids(24, [[3, 7, 8, 20], [5, 12]]) if packed else None
  _compare(model, mesh, t=8 * 3, segment_ids=segment_ids)


@pytest.mark.parametrize("packed", [False, True], ids=["one_doc", "packed"])
def test_kda_layer_context_parallel_matches_unsharded(packed):
  """Packed: the short convs (automatic sharding) and the op (shard_map)
  both see document starts at and inside device boundaries."""
  model = KDA(d_model=D, num_heads=2, chunk_size=16, backend="xla")
  mesh = jax.make_mesh((2, 4), ("data", "context"))
  segment_ids = (_segment_ids(96, [[10, 24, 90], [30, 35, 48]]) if packed
                 else None)
  _compare(model, mesh, t=4 * 24, segment_ids=segment_ids)


def test_latent_attention_causality_uses_global_positions():
  """Perturbing the latent at position p changes outputs at >= p only."""
  t, h, r, dn = 16, 2, 4, 4
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((1, t, h, dn)), jnp.float32)
  c = jnp.asarray(rng.standard_normal((1, t, r)), jnp.float32)
  w_uk, w_uv = (jnp.asarray(rng.standard_normal((r, h, dn)), jnp.float32)
                for _ in range(2))
  mesh = jax.make_mesh((8,), ("context",))
  f = jax.jit(functools.partial(context_parallel_latent_attention,
                                scale=0.5, mesh=mesh))
  p = 9  # on device 4 (2 positions per device)
  o = np.asarray(f(q, c, w_uk, w_uv))
  o2 = np.asarray(f(q, c.at[:, p].add(1.0), w_uk, w_uv))
  changed = np.abs(o2 - o).max(axis=(0, 2, 3)) > 1e-6
  np.testing.assert_array_equal(changed, np.arange(t) >= p)
  # First position attends to itself only: softmax over one key.
  v0 = jnp.einsum("r,rhd->hd", c[0, 0], w_uv)
  np.testing.assert_allclose(o[0, 0], v0, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="not divisible"):
    f(q[:, :12], c[:, :12], w_uk, w_uv)


def test_mla_under_mesh_accepts_sequence_sharded_input():
  """Inputs already sharded over (data, context), as in the train step."""
  model = GatedMLA(d_model=D, **MLA_CONFIGS["nope"])
  x = jax.random.normal(jax.random.PRNGKey(5), (B, 24, D))
  params = jax.jit(model.init)(jax.random.PRNGKey(2), x)
  y_ref = jax.jit(model.apply)(params, x)
  mesh = jax.make_mesh((2, 4), ("data", "context"))
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P("data", "context")))
    y = jax.jit(model.apply)(params, xs)
  np.testing.assert_allclose(y, y_ref, rtol=RTOL, atol=ATOL)
