"""One-token decoding steps: Pallas kernels (interpret mode) vs the oracles.

Shapes: K=48 (padded to 64 inside), V=96 (3 V blocks of 32), fp32 and bf16.
Chaining steps must reproduce the per-token recurrence over a sequence.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.linear_attention import (
    gla_step, kda_step, naive_recurrent_gla, naive_recurrent_kda,
    recurrent_step_gla, recurrent_step_kda)
from pallas_kernels.linear_attention.gla.step import gla_step_pallas
from pallas_kernels.linear_attention.kda.step import kda_step_pallas

B, H, K, V = 2, 3, 48, 96


def make(seed, t=None, dtype=jnp.float32):
  """q, k, v, g, beta (with a T axis when t is given) and a state."""
  rng = np.random.default_rng(seed)
  lead = (B, H) if t is None else (B, t, H)
  q = rng.standard_normal(lead + (K,))
  k = rng.standard_normal(lead + (K,))
  k = k / np.linalg.norm(k, axis=-1, keepdims=True)
  v = rng.standard_normal(lead + (V,))
  g = -5.0 / (1.0 + np.exp(-rng.standard_normal(lead + (K,))))
  beta = 1.0 / (1.0 + np.exp(-rng.standard_normal(lead)))
  s = 0.5 * rng.standard_normal((B, H, K, V))
  cast = lambda x, dt=dtype: jnp.asarray(x, dt)  # noqa: E731
  return (cast(q), cast(k), cast(v), cast(g, jnp.float32),
          cast(beta, jnp.float32), cast(s, jnp.float32))


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5),
                                       (jnp.bfloat16, 1e-2)])
def test_kda_step_matches_reference(dtype, tol):
  q, k, v, g, beta, s = make(0, dtype=dtype)
  o, s_new = kda_step_pallas(q, k, v, g, beta, s, scale=0.4, interpret=True)
  o_ref, s_ref = recurrent_step_kda(q, k, v, g, beta, s, scale=0.4)
  assert o.dtype == dtype and s_new.dtype == jnp.float32
  assert s_new.shape == s.shape
  assert np.all(np.isfinite(np.asarray(o, np.float32)))
  assert rel_err(o.astype(jnp.float32), o_ref.astype(jnp.float32)) < tol
  assert rel_err(s_new, s_ref) < tol


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5),
                                       (jnp.bfloat16, 1e-2)])
def test_gla_step_matches_reference(dtype, tol):
  q, k, v, g, _, s = make(1, dtype=dtype)
  o, s_new = gla_step_pallas(q, k, v, g, s, interpret=True)
  o_ref, s_ref = recurrent_step_gla(q, k, v, g, s)
  assert rel_err(o.astype(jnp.float32), o_ref.astype(jnp.float32)) < tol
  assert rel_err(s_new, s_ref) < tol


def test_chained_steps_equal_the_recurrence():
  # Five tokens through the public ops (interpret backend), from a state.
  t = 5
  q, k, v, g, beta, s0 = make(2, t=t)
  o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=s0)
  og_ref, sg_ref = naive_recurrent_gla(q, k, v, g, initial_state=s0)
  s, sg, outs, outs_g = s0, s0, [], []
  for i in range(t):
    o, s = kda_step(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], s,
                    backend="interpret")
    og, sg = gla_step(q[:, i], k[:, i], v[:, i], g[:, i], sg,
                      backend="interpret")
    outs.append(o)
    outs_g.append(og)
  np.testing.assert_allclose(jnp.stack(outs, 1), o_ref, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(s, s_ref, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(jnp.stack(outs_g, 1), og_ref, rtol=1e-4,
                             atol=1e-5)
  np.testing.assert_allclose(sg, sg_ref, rtol=1e-4, atol=1e-5)


def test_auto_backend_is_the_xla_step_on_cpu():
  q, k, v, g, beta, s = make(3)
  o, s_new = kda_step(q, k, v, g, beta, s)   # backend="auto"
  o_ref, s_ref = recurrent_step_kda(q, k, v, g, beta, s)
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(o, o_ref)
    np.testing.assert_array_equal(s_new, s_ref)


def test_bad_inputs():
  q, k, v, g, beta, s = make(4)
  with pytest.raises(ValueError, match="backend must be one of"):
    kda_step(q, k, v, g, beta, s, backend="cuda")
  with pytest.raises(ValueError, match="state must have shape"):
    kda_step_pallas(q, k, v, g, beta, s[:, :, :16], interpret=True)
  with pytest.raises(ValueError, match="beta must"):
    kda_step_pallas(q, k, v, g, beta[:, :1], s, interpret=True)
  with pytest.raises(ValueError, match="beta must be given"):
    kda_step_pallas(q, k, v, g, None, s, interpret=True)
  with pytest.raises(ValueError, match="k must have the same shape"):
    gla_step_pallas(q, k[..., :16], v, g, s, interpret=True)
  with pytest.raises(ValueError, match="K a multiple of 16"):
    gla_step_pallas(q[..., :40], k[..., :40], v, g[..., :40],
                    s[:, :, :40], interpret=True)
  with pytest.raises(ValueError, match="rank 3"):
    kda_step_pallas(q[None], k, v, g, beta, s, interpret=True)
