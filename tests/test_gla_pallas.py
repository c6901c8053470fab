"""Pallas GLA (forward + backward kernels) in interpret mode vs the oracles.

CPU interpret mode is slow: tiny shapes (T=100: two chunks, the last one
partly filled; an initial state), each configuration compiled once. Both
intra-chunk paths are covered: bounded (dense diagonal tiles) and unbounded
(position-pair diagonal tiles).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.linear_attention import (
    available_backends, chunk_gla_ref, gla, naive_recurrent_gla)
from pallas_kernels.linear_attention.gla.chunk import gla_pallas
from pallas_kernels.linear_attention.gla.tuning import Tuning

B, T, H, K, V = 1, 100, 2, 16, 32
G_MIN = -5.0
PATHS = {"bounded": G_MIN, "unbounded": None}
# Small blocks so that every grid axis has several blocks and the chunk
# kernels, grad_k included, loop over two K slices (K=32).
SMALL = Tuning(block_k=16, pass_bk=16, pass_bv=16, bv=16, grad_bv=16,
               grad_k_bk=16)


def make_inputs(seed, t=T, dk=K, dv=V, g_low=G_MIN):
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape)  # noqa: E731
  q = normal(B, t, H, dk)
  k = normal(B, t, H, dk)
  k = k / np.linalg.norm(k, axis=-1, keepdims=True)
  v = normal(B, t, H, dv)
  g = g_low / (1.0 + np.exp(-(2.0 * normal(B, t, H, dk) - 1.0)))  # low*sigmoid
  s0 = 0.5 * normal(B, H, dk, dv)
  return tuple(jnp.asarray(a, jnp.float32) for a in (q, k, v, g, s0))


@functools.partial(jax.jit, static_argnames=("g_min", "tune"))
def run_pallas(q, k, v, g, s0, g_min=G_MIN, tune=Tuning()):
  return gla_pallas(q, k, v, g, scale=None, initial_state=s0, chunk_size=64,
                    g_min=g_min, interpret=True, tune=tune)


def loss(fn, w, q, k, v, g, s0):
  o, s = fn(q, k, v, g, s0)
  return jnp.sum(o.astype(jnp.float32) * w) + jnp.sum(s ** 2)


@functools.partial(jax.jit, static_argnames=("g_min", "tune"))
def grads_pallas(w, q, k, v, g, s0, g_min=G_MIN, tune=Tuning()):
  fn = functools.partial(run_pallas, g_min=g_min, tune=tune)
  return jax.grad(functools.partial(loss, fn, w), argnums=(0, 1, 2, 3, 4))(
      q, k, v, g, s0)


@jax.jit
def grads_ref(w, q, k, v, g, s0):
  fn = lambda *a: chunk_gla_ref(*a[:4], initial_state=a[4])  # noqa: E731
  return jax.grad(functools.partial(loss, fn, w), argnums=(0, 1, 2, 3, 4))(
      q, k, v, g, s0)


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert np.all(np.isfinite(a)), "NaN/inf in the kernel's result"
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_registered():
  assert {"interpret", "pallas"} <= set(available_backends("gla"))


@pytest.mark.parametrize("path", sorted(PATHS))
def test_forward_fp32_matches_oracles(path):
  q, k, v, g, s0 = make_inputs(0)
  o, s = run_pallas(q, k, v, g, s0, g_min=PATHS[path])
  assert o.shape == (B, T, H, V) and o.dtype == jnp.float32
  assert s.shape == (B, H, K, V) and s.dtype == jnp.float32
  for want_o, want_s in (chunk_gla_ref(q, k, v, g, initial_state=s0),
                         naive_recurrent_gla(q, k, v, g, initial_state=s0)):
    np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s, want_s, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_gradients_fp32_match_reference(path):
  q, k, v, g, s0 = make_inputs(2)
  w = jnp.asarray(np.random.default_rng(3).standard_normal((B, T, H, V)),
                  jnp.float32)
  got = grads_pallas(w, q, k, v, g, s0, g_min=PATHS[path])
  want = grads_ref(w, q, k, v, g, s0)
  for name, a, b in zip(("dq", "dk", "dv", "dg", "ds0"), got, want):
    assert rel_err(a, b) < 1e-4, name
    # dg = reverse cumsum of (q dq - k dk): compare against its scale.
    np.testing.assert_allclose(a, b, rtol=1e-4,
                               atol=1e-4 * float(jnp.max(jnp.abs(b))))


@pytest.mark.parametrize("path", sorted(PATHS))
def test_largest_head_dims_values_and_gradients(path):
  # K = V = 256, the largest head dims the op accepts, at the default
  # tuning (fp32, an initial state, one partly filled chunk of two).
  t = 70
  q, k, v, g, s0 = make_inputs(4, t=t, dk=256, dv=256)
  o, s = run_pallas(q, k, v, g, s0, g_min=PATHS[path])
  o_ref, s_ref = naive_recurrent_gla(q, k, v, g, initial_state=s0)
  assert rel_err(o, o_ref) < 1e-4 and rel_err(s, s_ref) < 1e-4
  w = jnp.asarray(np.random.default_rng(5).standard_normal((B, t, H, 256)),
                  jnp.float32)
  got = grads_pallas(w, q, k, v, g, s0, g_min=PATHS[path])
  want = grads_ref(w, q, k, v, g, s0)
  for name, a, b in zip(("dq", "dk", "dv", "dg", "ds0"), got, want):
    assert rel_err(a, b) < 1e-4, name


@pytest.mark.parametrize(
    "tune", [SMALL, dataclasses.replace(SMALL, grad_k_bk=32)],
    ids=["small", "grad_k_bk32"])
def test_many_blocks_and_k_slices_unbounded_and_bounded(tune):
  # K=32, V=32 with 16-wide blocks: multi-block grids in every kernel, two
  # K slices inside the chunk kernels, values and gradients; grad_k at the
  # same K slice width or at its own (grad_k_bk=32: one slice where the
  # other kernels take two).
  q, k, v, g, s0 = make_inputs(4, dk=32)
  w = jnp.asarray(np.random.default_rng(5).standard_normal((B, T, H, V)),
                  jnp.float32)
  want_o, want_s = chunk_gla_ref(q, k, v, g, initial_state=s0)
  want_g = grads_ref(w, q, k, v, g, s0)
  for g_min in (G_MIN, None):
    o, s = run_pallas(q, k, v, g, s0, g_min=g_min, tune=tune)
    assert rel_err(o, want_o) < 1e-5 and rel_err(s, want_s) < 1e-5
    got = grads_pallas(w, q, k, v, g, s0, g_min=g_min, tune=tune)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "ds0"), got, want_g):
      assert rel_err(a, b) < 1e-4, (g_min, name)


@pytest.mark.parametrize("path", ["bounded", "unbounded"])
def test_bf16_values_and_gradients_and_k_not_pow2(path):
  # bf16 inputs, K=48 (padded to 64 inside), V=16, T=80: the bf16 dot path.
  # dg is the sensitive one: q dq - k dk cancels within a chunk, so dL/db
  # is formed term by term from the same rounded dot operands on both sides
  # (with q dq - k dk formed apart, dg's error was ~2.4e-2, H200, T=1000).
  q, k, v, g, s0 = make_inputs(1, t=80, dk=48, dv=16)
  qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
  up = lambda x: x.astype(jnp.float32)  # noqa: E731
  o, s = run_pallas(qb, kb, vb, g, s0, g_min=PATHS[path])
  assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
  o_ref, s_ref = naive_recurrent_gla(up(qb), up(kb), up(vb), g,
                                     initial_state=s0)
  assert rel_err(o, o_ref) < 1e-2
  assert rel_err(s, s_ref) < 1e-2
  w = jnp.asarray(np.random.default_rng(6).standard_normal((B, 80, H, 16)),
                  jnp.float32)
  got = grads_pallas(w, qb, kb, vb, g, s0, g_min=PATHS[path])
  want = grads_ref(w, up(qb), up(kb), up(vb), g, s0)
  assert got[0].dtype == jnp.bfloat16 and got[3].dtype == jnp.float32
  for name, a, b in zip(("dq", "dk", "dv", "dg", "ds0"), got, want):
    err = rel_err(up(a), b)
    print(path, name, err)
    assert err < 1e-2, name


def test_unbounded_path_handles_very_negative_decay():
  # g down to -40 per step: the bounded tiling would overflow; the
  # position-pair diagonal does not.
  q, k, v, g, s0 = make_inputs(7, g_low=-40.0)
  o, s = run_pallas(q, k, v, g, s0, g_min=None)
  o_ref, s_ref = naive_recurrent_gla(q, k, v, g, initial_state=s0)
  assert rel_err(o, o_ref) < 1e-4 and rel_err(s, s_ref) < 1e-4


def test_g_below_g_min_is_clamped():
  # Policy: the bounded op computes with max(g, g_min); clamped entries get
  # zero gradient.
  q, k, v, g, s0 = make_inputs(8)
  g_low = g.at[:, 10:20].set(-9.0)
  o, _ = run_pallas(q, k, v, g_low, s0)
  o_want, _ = chunk_gla_ref(q, k, v, jnp.maximum(g_low, G_MIN),
                            initial_state=s0)
  np.testing.assert_allclose(o, o_want, rtol=1e-4, atol=1e-5)
  w = jnp.ones((B, T, H, V), jnp.float32)
  dg = grads_pallas(w, q, k, v, g_low, s0)[3]
  assert np.all(np.asarray(dg[:, 10:20]) == 0.0)
  assert np.any(np.asarray(dg[:, 20:]) != 0.0)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_strict_causality_in_partial_last_tile(path):
  # T=100: the last tile holds rows 96..99 (of 96..111). Perturb rows 98, 99:
  # outputs of rows < 98 must be bit-identical.
  q, k, v, g, s0 = make_inputs(0)
  o, _ = run_pallas(q, k, v, g, s0, g_min=PATHS[path])
  rng = np.random.default_rng(9)
  bump = lambda x: x.at[:, 98:].add(  # noqa: E731
      jnp.asarray(rng.standard_normal(x[:, 98:].shape), jnp.float32))
  g2 = jnp.minimum(g.at[:, 98:].set(G_MIN * 0.99), 0.0)
  o2, _ = run_pallas(bump(q), bump(k), bump(v), g2, s0, g_min=PATHS[path])
  np.testing.assert_array_equal(np.asarray(o[:, :98]), np.asarray(o2[:, :98]))
  assert not np.array_equal(np.asarray(o[:, 98:]), np.asarray(o2[:, 98:]))


@pytest.mark.parametrize("g_min", [-8.0, -5.6, 0.0])
def test_bounded_path_refuses_bad_g_min(g_min):
  q, k, v, g, _ = make_inputs(0, t=16)
  with pytest.raises(ValueError, match=r"g_min"):
    gla(q, k, v, g, backend="interpret", g_min=g_min)


def test_positive_g_is_refused():
  q, k, v, g, _ = make_inputs(0, t=16)
  with pytest.raises(ValueError, match=r"g .*must be <= 0"):
    gla(q, k, v, g.at[0, 3, 0, 0].set(0.5), backend="interpret", g_min=G_MIN)


def test_bad_shapes_are_refused():
  q, k, v, g, _ = make_inputs(0, t=16)
  with pytest.raises(ValueError, match="q must have rank 4"):
    gla(q[0], k, v, g, backend="interpret", g_min=G_MIN)
  with pytest.raises(ValueError, match="k must have the same shape as q"):
    gla(q, k[:, :8], v, g, backend="interpret", g_min=G_MIN)


def test_k_not_multiple_of_16():
  q, k, v, g, _ = make_inputs(0, t=16, dk=24)
  with pytest.raises(ValueError, match="K a multiple of 16"):
    gla(q, k, v, g, backend="interpret", g_min=G_MIN)


def test_chunk_size_not_64():
  q, k, v, g, _ = make_inputs(0, t=16)
  with pytest.raises(ValueError, match="chunk_size"):
    gla(q, k, v, g, backend="interpret", g_min=G_MIN, chunk_size=32)


@pytest.mark.parametrize("field, value, match", [
    ("block_k", 24, "a power of two"), ("pass_bv", 8, "a power of two"),
    ("grad_bv", 0, "a power of two"), ("pass_bk", 48, "a power of two"),
    ("grad_k_warps", 0, ">= 1"), ("grad_k_bk", 8, "a power of two"),
    ("state_pass", "cuda", r"one of \('auto', 'triton', 'mosaic'\)")])
def test_bad_tuning_is_refused(field, value, match):
  q, k, v, g, s0 = make_inputs(0, t=16)
  tune = Tuning(**{field: value})
  with pytest.raises(ValueError, match=f"tune.{field} must be {match}"):
    gla_pallas(q, k, v, g, scale=None, initial_state=s0, chunk_size=64,
               g_min=G_MIN, interpret=True, tune=tune)
