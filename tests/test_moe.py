"""Sparse MoE: ragged dispatch == loop reference; router state/stats wiring."""
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from conftest import init_moe
from moe_jax.layers.moe import MoE, SwiGLU

B, T, D, E, K, F = 2, 8, 16, 8, 2, 12


def _moe(dispatch="ragged", **kw):
  cfg = dict(d_model=D, num_experts=E, top_k=K, d_expert=F, num_shared=1,
             d_shared=10, balancing="qb", route_scale=1.5, dispatch=dispatch)
  cfg.update(kw)
  return MoE(**cfg)


def _x(seed=0, dtype=jnp.float32):
  return jax.random.normal(jax.random.PRNGKey(seed), (B, T, D), dtype)


@functools.lru_cache(maxsize=None)
def _fwd(model, stats=False):
  """jit(apply), optionally with router_stats mutable; one per model."""

  def f(params, state, x):
    variables = {"params": params, "router_state": state}
    if stats:
      y, s = model.apply(variables, x, mutable=["router_stats"])
      return y, s["router_stats"]
    return model.apply(variables, x)

  return jax.jit(f)


@functools.lru_cache(maxsize=None)
def _value_and_grad(model):
  """jit(value_and_grad) of <y, cotangent> wrt (params, x); one per model."""

  def f(params, state, x, ct):
    y = model.apply({"params": params, "router_state": state}, x)
    return jnp.sum(y.astype(jnp.float32) * ct), y

  return jax.jit(jax.value_and_grad(f, argnums=(0, 2), has_aux=True))


def test_ragged_matches_loop_values_and_grads():
  x = _x()
  ragged, loop = _moe("ragged"), _moe("loop")
  params, state = init_moe(ragged, x)
  ct = jax.random.normal(jax.random.PRNGKey(7), (B, T, D))
  (_, y_r), (gp_r, gx_r) = _value_and_grad(ragged)(params, state, x, ct)
  (_, y_l), (gp_l, gx_l) = _value_and_grad(loop)(params, state, x, ct)
  chex.assert_shape(y_r, (B, T, D))
  np.testing.assert_allclose(y_r, y_l, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(gx_r, gx_l, rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(gp_r, gp_l, rtol=1e-5, atol=1e-5)
  # Every param gets a gradient (the router through the combine weights).
  for path, g in traverse_util.flatten_dict(gp_r).items():
    assert np.any(np.asarray(g) != 0), path


def test_pallas_grouped_matmul_matches_loop():
  """The Pallas grouped matmul (interpreted) inside the MoE == the loop."""
  x = _x(3)
  pallas = _moe("ragged", d_expert=16, grouped_matmul="interpret")
  loop = _moe("loop", d_expert=16)
  params, state = init_moe(pallas, x)
  ct = jax.random.normal(jax.random.PRNGKey(8), (B, T, D))
  (_, y_p), (gp_p, gx_p) = _value_and_grad(pallas)(params, state, x, ct)
  (_, y_l), (gp_l, gx_l) = _value_and_grad(loop)(params, state, x, ct)
  np.testing.assert_allclose(y_p, y_l, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(gx_p, gx_l, rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(gp_p, gp_l, rtol=1e-5, atol=1e-5)


def test_shared_expert_on_off():
  x = _x(1)
  with_shared = _moe(num_shared=2, d_shared=5)  # one SwiGLU of width 10
  params, state = init_moe(with_shared, x)
  chex.assert_shape(params["shared"]["gate"]["kernel"], (D, 10))
  y = _fwd(with_shared)(params, state, x)
  routed = {k: v for k, v in params.items() if k != "shared"}
  without = _moe(num_shared=0)
  assert "shared" not in jax.eval_shape(without.init, jax.random.PRNGKey(0),
                                        x)["params"]
  y0 = _fwd(without)(routed, state, x)
  shared = jax.jit(SwiGLU(10).apply)({"params": params["shared"]}, x)
  np.testing.assert_allclose(y, y0 + shared, rtol=1e-5, atol=1e-5)
  assert not np.allclose(y, y0)


def test_bf16_ragged_close_to_loop():
  x = _x(2, jnp.bfloat16)
  ragged, loop = (_moe(d, dtype=jnp.bfloat16) for d in ("ragged", "loop"))
  params, state = init_moe(ragged, x)
  y_r = _fwd(ragged)(params, state, x)
  y_l = _fwd(loop)(params, state, x)
  assert y_r.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(y_r, np.float32),
                             np.asarray(y_l, np.float32), rtol=5e-2, atol=5e-2)


def test_router_state_is_not_a_param_and_gets_no_gradient():
  x = _x()
  model = _moe()
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), x)
  assert shapes["router_state"]["router"]["bias"].shape == (E,)
  param_paths = set(traverse_util.flatten_dict(shapes["params"]))
  assert not any("bias" in p for p in param_paths)
  params, state = init_moe(model, x)
  _, (gp, _) = _value_and_grad(model)(params, state, x, jnp.ones((B, T, D)))
  assert set(traverse_util.flatten_dict(gp)) == param_paths


def test_bias_changes_routing():
  x = _x(3)
  model = _moe()
  params, state = init_moe(model, x)
  _, stats = _fwd(model, True)(params, state, x)
  load = stats["router"]["load"]
  assert float(load.sum()) == B * T * K
  assert float(load[3]) < B * T  # not already picked by every token
  state = {"router": {"bias": jnp.zeros((E,)).at[3].set(10.0)}}
  y, stats = _fwd(model, True)(params, state, x)
  assert float(stats["router"]["load"][3]) == B * T
  assert np.all(np.isfinite(y))


def test_stats_emitted_only_when_mutable():
  x = _x()
  model = _moe()
  params, state = init_moe(model, x)
  y = _fwd(model)(params, state, x)  # eval path: no router_stats needed
  y2, stats = _fwd(model, True)(params, state, x)
  np.testing.assert_allclose(y, y2)
  rs = stats["router"]
  assert set(rs) == {"load", "qb_target"}
  chex.assert_shape(rs["qb_target"], (E,))
  np.testing.assert_allclose(float(rs["qb_target"].mean()), 0.0, atol=1e-6)


def test_aux_loss_emitted_and_differentiable():
  x = _x(4)
  coef = 0.1
  model = _moe(balancing="aux", aux_loss_coef=coef)
  params, state = init_moe(model, x)

  @jax.jit
  @jax.value_and_grad
  def aux(p):
    _, stats = model.apply({"params": p, "router_state": state}, x,
                           mutable=["router_stats"])
    rs = stats["router_stats"]["router"]
    assert set(rs) == {"load", "aux_loss"}
    return rs["aux_loss"]

  val, g = aux(params)
  chex.assert_shape(val, ())
  # E * sum f P is 1 for uniform routing, larger when skewed, < E.
  assert 0.5 * coef < float(val) < E * coef
  assert float(jnp.abs(g["router"]["kernel"]).sum()) > 0
  # The aux loss reaches only the router.
  assert float(jnp.abs(g["w_up"]).sum()) == 0.0


def test_top_k_larger_than_experts_raises():
  with pytest.raises(ValueError, match="top_k"):
    jax.eval_shape(_moe(top_k=E + 1, balancing="none").init,
                   jax.random.PRNGKey(0), _x())


@pytest.mark.parametrize("dispatch", ["ragged", "loop"])
def test_latent_experts_with_identity_projection_equal_plain_moe(dispatch):
  """expert_latent_dim = D with identity down/up projections and the same
  experts must give the plain MoE, values and input gradients."""
  x = _x(3)
  plain = _moe(dispatch)
  latent = _moe(dispatch, expert_latent_dim=D)
  params, state = init_moe(plain, x, seed=4)
  lat_params = dict(params)
  lat_params["latent_down"] = {"kernel": jnp.eye(D)}
  lat_params["latent_up"] = {"kernel": jnp.eye(D)}
  ct = jax.random.normal(jax.random.PRNGKey(9), x.shape)
  (_, y0), (_, gx0) = _value_and_grad(plain)(params, state, x, ct)
  (_, y1), (g1, gx1) = _value_and_grad(latent)(lat_params, state, x, ct)
  np.testing.assert_allclose(y1, y0, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(gx1, gx0, rtol=1e-5, atol=1e-5)
  assert np.any(g1["latent_down"]["kernel"])  # the projections are trained


def test_latent_experts_shrink_expert_params():
  x = _x(5)
  shapes = nn.meta.unbox(jax.eval_shape(_moe(expert_latent_dim=4).init,
                                        jax.random.PRNGKey(0), x))["params"]
  assert shapes["w_gate"].shape == (E, 4, F)
  assert shapes["w_down"].shape == (E, F, 4)
  assert shapes["latent_down"]["kernel"].shape == (D, 4)
  assert shapes["latent_up"]["kernel"].shape == (4, D)
  model = _moe(expert_latent_dim=4)
  y = _fwd(model)(*init_moe(model, x), x)
  assert y.shape == x.shape and np.all(np.isfinite(y))


def test_few_tokens_gather_path_matches_loop_values_and_grads():
  # B*T*K = 4 <= E: the ragged dispatch gathers the routed experts' weights
  # (the decode step's path) instead of sorting into grouped matmuls.
  x = jax.random.normal(jax.random.PRNGKey(3), (2, 1, D))
  ragged, loop = _moe("ragged"), _moe("loop")
  params, state = init_moe(ragged, x)
  ct = jax.random.normal(jax.random.PRNGKey(4), x.shape)
  (_, y_r), (gp_r, gx_r) = _value_and_grad(ragged)(params, state, x, ct)
  (_, y_l), (gp_l, gx_l) = _value_and_grad(loop)(params, state, x, ct)
  assert np.isfinite(np.asarray(y_r)).all()
  np.testing.assert_allclose(y_r, y_l, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(gx_r, gx_l, rtol=1e-4, atol=1e-5)
  chex.assert_trees_all_close(gp_r, gp_l, rtol=1e-4, atol=1e-5)
