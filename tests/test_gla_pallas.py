"""Pallas GLA forward (bounded decay) in interpret mode vs the oracles.

CPU interpret mode is slow: tiny shapes, each configuration compiled once.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.linear_attention import (
    available_backends, chunk_gla_ref, gla, naive_recurrent_gla)

B, T, H, K, V = 1, 100, 2, 16, 32  # 2 chunks, the last one partly filled
G_MIN = -5.0


def make_inputs(seed, t=T, dk=K, dv=V):
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape)  # noqa: E731
  q = normal(B, t, H, dk)
  k = normal(B, t, H, dk)
  k = k / np.linalg.norm(k, axis=-1, keepdims=True)
  v = normal(B, t, H, dv)
  g = G_MIN / (1.0 + np.exp(-(2.0 * normal(B, t, H, dk) - 1.0)))  # -5 sigmoid
  s0 = 0.5 * normal(B, H, dk, dv)
  return tuple(jnp.asarray(a, jnp.float32) for a in (q, k, v, g, s0))


@functools.partial(jax.jit, static_argnames=("backend",))
def run_gla(q, k, v, g, s0, backend="interpret"):
  return gla(q, k, v, g, initial_state=s0, backend=backend, g_min=G_MIN)


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_registered():
  assert "interpret" in available_backends("gla")
  assert "pallas" in available_backends("gla")
  assert "interpret" not in available_backends("kda")


def test_forward_fp32_matches_oracles():
  q, k, v, g, s0 = make_inputs(0)
  o, s = run_gla(q, k, v, g, s0)
  o_ref, s_ref = chunk_gla_ref(q, k, v, g, initial_state=s0)
  o_naive, s_naive = naive_recurrent_gla(q, k, v, g, initial_state=s0)
  assert o.shape == (B, T, H, V) and o.dtype == jnp.float32
  assert s.shape == (B, H, K, V) and s.dtype == jnp.float32
  for want_o, want_s in ((o_ref, s_ref), (o_naive, s_naive)):
    np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s, want_s, rtol=1e-4, atol=1e-5)


def test_forward_bf16_and_k_not_pow2():
  # bf16 inputs, K=48 (padded to 64 inside), V=16, T=80: the bf16 dot path.
  q, k, v, g, s0 = make_inputs(1, t=80, dk=48, dv=16)
  qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
  o, s = run_gla(qb, kb, vb, g, s0)
  assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
  up = lambda x: x.astype(jnp.float32)  # noqa: E731
  o_ref, s_ref = naive_recurrent_gla(up(qb), up(kb), up(vb), g,
                                     initial_state=s0)
  assert rel_err(o, o_ref) < 1e-2
  assert rel_err(s, s_ref) < 1e-2


def test_gradients_equal_reference():
  q, k, v, g, s0 = make_inputs(2)
  w = jnp.asarray(np.random.default_rng(3).standard_normal((B, T, H, V)),
                  jnp.float32)

  def loss(fn, q, k, v, g, s0):
    o, s = fn(q, k, v, g, s0)
    return jnp.sum(o * w) + jnp.sum(s ** 2)

  pallas_fn = lambda *a: gla(*a[:4], initial_state=a[4],  # noqa: E731
                             backend="interpret", g_min=G_MIN)
  ref_fn = lambda *a: chunk_gla_ref(*a[:4], initial_state=a[4])  # noqa: E731
  got = jax.jit(jax.grad(functools.partial(loss, pallas_fn),
                         argnums=(0, 1, 2, 3, 4)))(q, k, v, g, s0)
  want = jax.jit(jax.grad(functools.partial(loss, ref_fn),
                          argnums=(0, 1, 2, 3, 4)))(q, k, v, g, s0)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_strict_causality_in_partial_last_tile():
  # T=100: the last tile holds rows 96..99 (of 96..111). Perturb rows 98, 99:
  # outputs of rows < 98 must be bit-identical.
  q, k, v, g, s0 = make_inputs(0)
  o, _ = run_gla(q, k, v, g, s0)
  rng = np.random.default_rng(9)
  bump = lambda x: x.at[:, 98:].add(  # noqa: E731
      jnp.asarray(rng.standard_normal(x[:, 98:].shape), jnp.float32))
  g2 = jnp.minimum(g.at[:, 98:].set(G_MIN * 0.99), 0.0)
  o2, _ = run_gla(bump(q), bump(k), bump(v), g2, s0)
  np.testing.assert_array_equal(np.asarray(o[:, :98]), np.asarray(o2[:, :98]))
  assert not np.array_equal(np.asarray(o[:, 98:]), np.asarray(o2[:, 98:]))


@pytest.mark.parametrize("g_min", [None, -8.0, -5.6])
def test_bounded_path_refuses_bad_g_min(g_min):
  q, k, v, g, _ = make_inputs(0, t=16)
  with pytest.raises(ValueError, match=r"g_min.*\[-5\.5, 0\)"):
    gla(q, k, v, g, backend="interpret", g_min=g_min)


def test_k_not_multiple_of_16():
  q, k, v, g, _ = make_inputs(0, t=16, dk=24)
  with pytest.raises(ValueError, match="K a multiple of 16"):
    gla(q, k, v, g, backend="interpret", g_min=G_MIN)


def test_chunk_size_not_64():
  q, k, v, g, _ = make_inputs(0, t=16)
  with pytest.raises(ValueError, match="chunk_size"):
    gla(q, k, v, g, backend="interpret", g_min=G_MIN, chunk_size=32)
