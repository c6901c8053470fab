"""Expert-parallel MoE equals the single-device MoE (docs/design.md §8).

The MoE runs under `jax.set_mesh` with an 'expert' axis on 8 fake CPU
devices (experts split over it, tokens all-to-all'd) and is compared with the
same MoE, same params and router state, without a mesh: outputs, gradients
wrt params and inputs, and the router statistics.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from flax import traverse_util

from conftest import init_moe
from moe_jax.layers.expert_parallel import (
    expert_parallel_experts, ragged_experts)
from moe_jax.layers.moe import MoE, _loop_experts

B, T, D, E, K, F = 2, 8, 16, 8, 2, 12
RTOL, ATOL = 1e-5, 1e-5

CONFIGS = {
    "shared_qb": dict(num_shared=1, d_shared=10, balancing="qb",
                      route_scale=1.5),
    "latent_aux": dict(expert_latent_dim=8, balancing="aux",
                       aux_loss_coef=0.1, top_k=3),
}
MESHES = [((8,), ("expert",), AxisType.Explicit),
          ((2, 4), ("data", "expert"), AxisType.Auto)]


def _moe(**kw):
  cfg = dict(d_model=D, num_experts=E, top_k=K, d_expert=F)
  cfg.update(kw)
  return MoE(**cfg)


@functools.lru_cache(maxsize=None)
def _value_and_grad(model):
  """jit(value_and_grad) of <y, ct> (+ aux loss) wrt (params, x); + stats."""

  def f(params, state, x, ct):
    y, s = model.apply({"params": params, "router_state": state}, x,
                       mutable=["router_stats"])
    stats = s["router_stats"]
    aux = sum(jnp.sum(v) for k, v in traverse_util.flatten_dict(stats).items()
              if k[-1] == "aux_loss")
    return jnp.sum(y * ct) + aux, (y, stats)

  return jax.jit(jax.value_and_grad(f, argnums=(0, 2), has_aux=True))


def _mesh(shape, names, axis_type=AxisType.Explicit):
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


def _check_equal(model, mesh, params, state, x, ct, expect_ep=True):
  (_, (y_ref, st_ref)), (gp_ref, gx_ref) = _value_and_grad(model)(
      params, state, x, ct)
  with jax.set_mesh(mesh):
    (_, (y, st)), (gp, gx) = _value_and_grad(model)(params, state, x, ct)
    jaxpr = str(jax.make_jaxpr(model.apply)(
        {"params": params, "router_state": state}, x))
  assert ("all_to_all" in jaxpr) == expect_ep
  np.testing.assert_allclose(y, y_ref, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(gx, gx_ref, rtol=RTOL, atol=ATOL)
  for path, g in traverse_util.flatten_dict(gp_ref).items():
    np.testing.assert_allclose(traverse_util.flatten_dict(gp)[path], g,
                               rtol=RTOL, atol=ATOL, err_msg=str(path))
    assert np.any(np.asarray(g) != 0), path
  # Routing statistics are global: the same with and without the mesh.
  for path, s in traverse_util.flatten_dict(st_ref).items():
    np.testing.assert_allclose(traverse_util.flatten_dict(st)[path], s,
                               rtol=1e-6, atol=1e-6, err_msg=str(path))
  return st


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("mesh_shape,mesh_names,axis_type", MESHES)
def test_ep_moe_matches_unsharded(name, mesh_shape, mesh_names, axis_type):
  x = jax.random.normal(jax.random.PRNGKey(1), (B, T, D))
  ct = jax.random.normal(jax.random.PRNGKey(2), (B, T, D))
  model = _moe(**CONFIGS[name])
  params, state = init_moe(model, x)
  _check_equal(model, _mesh(mesh_shape, mesh_names, axis_type), params, state,
               x, ct)


def test_ep_worst_case_routing_is_dropless():
  """A bias sends every token to the two experts of device 0: the capacity
  (all local tokens) still fits them and nothing is dropped."""
  x = jax.random.normal(jax.random.PRNGKey(3), (B, T, D))
  ct = jax.random.normal(jax.random.PRNGKey(4), (B, T, D))
  model = _moe(**CONFIGS["shared_qb"])
  params, _ = init_moe(model, x, seed=1)
  state = {"router": {"bias": jnp.zeros((E,)).at[:2].set(10.0)}}
  st = _check_equal(model, _mesh((8,), ("expert",)), params, state, x, ct)
  np.testing.assert_array_equal(st["router"]["load"][:2], [B * T, B * T])


def test_fallback_when_experts_do_not_divide_the_axis():
  """E = 6 on expert = 4: the single-device dispatch (no all_to_all)."""
  x = jax.random.normal(jax.random.PRNGKey(5), (B, T, D))
  ct = jax.random.normal(jax.random.PRNGKey(6), (B, T, D))
  model = _moe(num_experts=6, balancing="none")
  params, state = init_moe(model, x)
  # Auto axes: the single-device dispatch is left to the compiler (under
  # Explicit axes jax 0.10 cannot infer ragged_dot's output sharding).
  _check_equal(model, _mesh((2, 4), ("data", "expert"), AxisType.Auto),
               params, state, x, ct, expect_ep=False)


def test_capacity_factor_drops_exactly_the_overflow():
  """capacity c: per (source device, destination device), tokens routed to
  the destination beyond the first `cap` (in token order) lose its experts."""
  n_dev, n = 8, 64
  n_local = n // n_dev
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((n, D)), jnp.float32)
  # Skewed routing: most first slots on device 0's experts.
  idx = np.stack([rng.choice([0, 1, 2], n), rng.integers(3, E, n)], -1)
  w = jnp.asarray(rng.uniform(0.1, 1.0, (n, K)), jnp.float32)
  wg, wu = (jnp.asarray(rng.standard_normal((E, D, F)) / 4, jnp.float32)
            for _ in range(2))
  wd = jnp.asarray(rng.standard_normal((E, F, D)) / 4, jnp.float32)
  mesh = _mesh((n_dev,), ("expert",))
  factor = 1.0
  cap = int(np.ceil(factor * n_local * K / n_dev))  # 2 rows per destination
  keep = np.ones((n, K), bool)
  for s in range(n_dev):
    for d in range(n_dev):
      tokens = [i for i in range(s * n_local, (s + 1) * n_local)
                if np.any(idx[i] == d)]  # E_l = 1: expert d lives on d
      for i in tokens[cap:]:
        keep[i] &= idx[i] != d
  assert not keep.all()  # the test drops something
  ep = jax.jit(functools.partial(expert_parallel_experts, mesh=mesh,
                                 capacity_factor=factor))
  y = ep(x, jnp.asarray(idx, jnp.int32), w, wg, wu, wd)
  y_ref = _loop_experts(x, jnp.asarray(idx), jnp.where(keep, w, 0.0), wg, wu,
                        wd)
  np.testing.assert_allclose(y, y_ref, rtol=RTOL, atol=ATOL)
  # Dropless default on the same inputs: the full single-device result.
  y_full = jax.jit(functools.partial(expert_parallel_experts, mesh=mesh))(
      x, jnp.asarray(idx, jnp.int32), w, wg, wu, wd)
  np.testing.assert_allclose(
      y_full, ragged_experts(x, jnp.asarray(idx, jnp.int32), w, wg, wu, wd),
      rtol=RTOL, atol=ATOL)


def test_errors_are_clear():
  mesh = _mesh((8,), ("expert",))
  x = jnp.zeros((16, D))
  idx = jnp.zeros((16, K), jnp.int32)
  w = jnp.zeros((16, K))
  wg = jnp.zeros((6, D, F))
  wd = jnp.zeros((6, F, D))
  with pytest.raises(ValueError, match="not divisible"):
    expert_parallel_experts(x, idx, w, wg, wg, wd, mesh=mesh)
  wg, wd = jnp.zeros((E, D, F)), jnp.zeros((E, F, D))
  with pytest.raises(ValueError, match="cannot be split"):
    expert_parallel_experts(x[:4], idx[:4], w[:4], wg, wg, wd, mesh=mesh)
  with pytest.raises(ValueError, match="not in the mesh"):
    expert_parallel_experts(x, idx, w, wg, wg, wd, mesh=mesh,
                            expert_axis="ep")
  with pytest.raises(ValueError, match="capacity_factor"):
    expert_parallel_experts(x, idx, w, wg, wg, wd, mesh=mesh,
                            capacity_factor=0.0)


def test_auto_grouped_matmul_resolution(monkeypatch):
  """'auto': ragged_dot off a GPU; on a GPU Mosaic where its kernels apply
  (Hopper, bf16, widths multiples of 64), else the Triton kernels for widths
  multiples of 16, else ragged_dot. Named choices pass through."""
  from moe_jax.layers import expert_parallel as ep
  bf16 = jnp.bfloat16
  assert ep.resolve_grouped_matmul("auto", (1024, 384), bf16) == "ragged_dot"
  assert ep.resolve_grouped_matmul("mosaic", (96,), bf16) == "mosaic"
  monkeypatch.setattr(ep.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(ep, "mosaic_gpu_available", lambda: True)
  assert ep.resolve_grouped_matmul("auto", (1024, 384), bf16) == "mosaic"
  assert ep.resolve_grouped_matmul("auto", (512, 96), bf16) == "pallas"
  assert ep.resolve_grouped_matmul("auto", (1024, 384),
                                   jnp.float32) == "pallas"
  assert ep.resolve_grouped_matmul("auto", (512, 40), bf16) == "ragged_dot"
  monkeypatch.setattr(ep, "mosaic_gpu_available", lambda: False)  # Ampere
  assert ep.resolve_grouped_matmul("auto", (1024, 384), bf16) == "pallas"
  with pytest.raises(ValueError, match="grouped_matmul must be one of"):
    ep.resolve_grouped_matmul("cutlass")
