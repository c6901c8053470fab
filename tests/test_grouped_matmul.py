"""Pallas grouped matmul (interpret mode) against the masked-dense reference.

Tiny shapes that still cover: a partial last row tile, tiles straddling
group boundaries, empty groups (leading, middle, trailing), rows past the
last group (zeros), several K steps, both operand orders, fp32 and bf16,
values and both gradients.
"""
import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import (Tuning, gmm, gmm_reference, tgmm,
                                           tgmm_reference, visits)
from pallas_kernels.grouped_matmul.layout import SCHEDULES

# 16-row tiles, 16-wide K steps: M = 70 rows is 5 tiles, the last partial.
TUNE = Tuning(block_m=16, block_n=16, block_k=16, tgmm_block_k=16,
              tgmm_block_n=16)
TUNES = {s: dataclasses.replace(TUNE, schedule=s) for s in SCHEDULES}
M, K, N = 70, 32, 48
SIZES = (0, 11, 0, 23, 17, 13, 0)   # sum 64 < 70: six rows in no group


def _operands(seed, dtype, transpose_rhs=False):
  kx, kw, kc = jax.random.split(jax.random.PRNGKey(seed), 3)
  e = len(SIZES)
  w_shape = (e, N, K) if transpose_rhs else (e, K, N)
  return (jax.random.normal(kx, (M, K), dtype),
          jax.random.normal(kw, w_shape, dtype),
          jax.random.normal(kc, (M, N), jnp.float32),
          jnp.asarray(SIZES, jnp.int32))


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert np.all(np.isfinite(a)), "non-finite output"
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5),
                                       (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gmm_values_and_grads_match_reference(dtype, tol, transpose_rhs,
                                              schedule):
  x, w, ct, sizes = _operands(int(transpose_rhs), dtype, transpose_rhs)

  def loss(fn):
    return lambda x, w: jnp.sum(
        fn(x, w, sizes, transpose_rhs=transpose_rhs).astype(jnp.float32) * ct)

  ours = lambda x, w, s, **kw: gmm(x, w, s, tuning=TUNES[schedule],  # noqa: E731
                                   interpret=True, **kw)
  out = ours(x, w, sizes, transpose_rhs=transpose_rhs)
  ref = gmm_reference(x, w, sizes, transpose_rhs=transpose_rhs)
  chex.assert_shape(out, (M, N))
  assert out.dtype == dtype
  assert _rel(out, ref) < tol
  # Rows in no group are exactly zero (they are written, not left stale).
  np.testing.assert_array_equal(np.asarray(out[sum(SIZES):], np.float32), 0)
  g = jax.grad(loss(ours), (0, 1))(x, w)
  g_ref = jax.grad(loss(gmm_reference), (0, 1))(x, w)
  for name, a, b in zip(("dx", "dw"), g, g_ref):
    assert _rel(a, b) < tol, name


def test_tgmm_matches_reference():
  x, _, ct, sizes = _operands(3, jnp.float32)
  out = tgmm(x, ct, sizes, tuning=TUNE, interpret=True)
  chex.assert_shape(out, (len(SIZES), K, N))
  assert _rel(out, tgmm_reference(x, ct, sizes)) < 1e-5
  # Empty groups get an exact zero gradient.
  np.testing.assert_array_equal(np.asarray(out[0]), 0)


def test_visits_cover_every_row_once():
  sizes = jnp.asarray(SIZES, jnp.int32)
  tile, group, lo, hi = (np.asarray(a) for a in visits(sizes, 80, 16))
  assert len(tile) == 80 // 16 + len(SIZES)
  covered = np.zeros(80, int)
  ends = np.cumsum(SIZES)
  for t, g, a, b in zip(tile, group, lo, hi):
    assert t * 16 <= a <= b <= (t + 1) * 16
    covered[a:b] += 1
    if b > a and g < len(SIZES):   # rows [a, b) all in group g
      assert ends[g] - SIZES[g] <= a and b <= ends[g]
  np.testing.assert_array_equal(covered, 1)


@pytest.mark.parametrize("bad,match", [
    (dict(x=jnp.zeros((8, 24)), w=jnp.zeros((7, 24, 48))),
     "K a multiple of 16"),
    (dict(x=jnp.zeros((8, 32), jnp.int32)), "float32 or bfloat16"),
    (dict(w=jnp.zeros((7, 16, 48))), "K and E must agree"),
    (dict(sizes=jnp.zeros((7,), jnp.float32)), "integer group_sizes"),
])
def test_bad_operands_are_named(bad, match):
  args = dict(x=jnp.zeros((8, 32)), w=jnp.zeros((7, 32, 48)),
              sizes=jnp.zeros((7,), jnp.int32))
  args.update(bad)
  with pytest.raises(ValueError, match=match):
    gmm(args["x"], args["w"], args["sizes"], interpret=True)


def test_tuning_rejects_non_power_of_two_blocks():
  with pytest.raises(ValueError, match="Tuning.block_n"):
    Tuning(block_n=48)
