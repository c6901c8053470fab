"""Grouped matmul over group-sorted rows as Pallas (Triton) GPU kernels.

The routed experts of a dropless MoE multiply each token row by its
expert's matrix: rows are sorted by expert, group g owns rows
[start_g, end_g), and

  gmm(x, w, sizes)[r]  = x[r] @ w[g(r)]          x [M, K], w [E, K, N]
  tgmm(x, dy, sizes)[g] = x[rows g]^T @ dy[rows g]   (the weight gradient)

Rows past sum(sizes) belong to no group and give zeros, as in
`jax.lax.ragged_dot` (the expert-parallel dispatch marks rows for other
devices that way).

gmm walks "visits": pairs (row tile of `block_m` rows, group) with the tile
holding rows of the group. A tile inside one group is one visit; a tile that
straddles a group boundary is visited once per group, each visit storing
only its own rows (disjoint row sets: no two programs write one element).
There are at most M / block_m + E visits, so the wasted work is at most E
tiles; a dense fallback (every row against every expert) wastes E / top_k.
Tuning.schedule="tiles" is the other layout: one program per (row tile,
column block), looping over the groups its rows hold with the rows of other
groups masked to zero at load time, then one unmasked store of the whole
tile (the same work; no two programs ever touch one tile).
tgmm runs one program per (group, K block, N block) and loops over the row
tiles of its group, so its cost follows the group's size.

`gmm` is differentiable in x and w: dx = gmm(dy, w^T), dw = tgmm(x, dy).
The reference is naive.gmm_reference / tgmm_reference.

Tuning(kernel="mosaic") runs all three products as the Mosaic GPU (TMA +
wgmma) kernels of mosaic.py instead (bf16, K and N multiples of 64).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # Triton compiler params (jax 0.10 - 0.12); absent -> default params.
  from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
  plgpu = None

from pallas_kernels.grouped_matmul import mosaic
from pallas_kernels.grouped_matmul.layout import (Tuning, block_divisor,
                                                  group_bounds, pad_rows,
                                                  tile_groups, visits)

_F32 = jnp.float32
_MIN_DIM = 16


def _params(num_warps, num_stages):
  if plgpu is None:
    return None
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _group_product(x_ref, w_ref, g, row0, j, acc, *, bm, bn, bk,
                   transpose_rhs, precision, row_mask=None):
  """acc + x[row0:row0+bm] @ w[g][:, cols j] over the whole K, fp32.

  row_mask [bm, bk] (optional) zeroes the rows of other groups at load.
  """
  def body(kk, acc):
    a = x_ref[pl.ds(row0, bm), pl.ds(kk * bk, bk)]
    if row_mask is not None:
      a = jnp.where(row_mask, a, jnp.zeros_like(a))
    if transpose_rhs:    # w [E, N, K]: a @ w[g][cols]^T
      b = w_ref[g, pl.ds(j * bn, bn), pl.ds(kk * bk, bk)]
      dims = ((1,), (1,))
    else:                # w [E, K, N]
      b = w_ref[g, pl.ds(kk * bk, bk), pl.ds(j * bn, bn)]
      dims = ((1,), (0,))
    return acc + jax.lax.dot_general(a, b, (dims, ((), ())),
                                     precision=precision,
                                     preferred_element_type=_F32)
  return jax.lax.fori_loop(0, x_ref.shape[1] // bk, body, acc)


def _gmm_kernel(tile_ref, group_ref, lo_ref, hi_ref, x_ref, w_ref, o_ref, *,
                bm, bn, bk, num_groups, transpose_rhs, precision):
  v, j = pl.program_id(0), pl.program_id(1)
  g, lo, hi = group_ref[v], lo_ref[v], hi_ref[v]
  row0 = tile_ref[v] * bm
  rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (bm, bn), 0)
  mask = (rows >= lo) & (rows < hi)
  out = o_ref.at[pl.ds(row0, bm), pl.ds(j * bn, bn)]

  @pl.when((hi > lo) & (g < num_groups))
  def _():
    acc = _group_product(x_ref, w_ref, g, row0, j, jnp.zeros((bm, bn), _F32),
                         bm=bm, bn=bn, bk=bk, transpose_rhs=transpose_rhs,
                         precision=precision)
    plgpu.store(out, acc.astype(o_ref.dtype), mask=mask)

  @pl.when((hi > lo) & (g >= num_groups))
  def _():   # rows in no group
    plgpu.store(out, jnp.zeros((bm, bn), o_ref.dtype), mask=mask)


def _tgmm_kernel(start_ref, end_ref, x_ref, dy_ref, o_ref, *, bm, bk, bn,
                 precision):
  g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  lo, hi = start_ref[g], end_ref[g]
  t_end = jnp.where(hi > lo, (hi + bm - 1) // bm, lo // bm)

  def body(t, acc):
    rows = t * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, bk), 0)
    a = x_ref[pl.ds(t * bm, bm), pl.ds(i * bk, bk)]
    a = jnp.where((rows >= lo) & (rows < hi), a, jnp.zeros_like(a))
    b = dy_ref[pl.ds(t * bm, bm), pl.ds(j * bn, bn)]
    return acc + jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())),
                                     precision=precision,
                                     preferred_element_type=_F32)
  acc = jax.lax.fori_loop(lo // bm, t_end, body, jnp.zeros((bk, bn), _F32))
  o_ref[...] = acc.astype(o_ref.dtype)


def _gmm_tile_kernel(first_ref, last_ref, start_ref, end_ref, x_ref, w_ref,
                     o_ref, *, bm, bn, bk, transpose_rhs, precision):
  t, j = pl.program_id(0), pl.program_id(1)
  row0 = t * bm
  rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (bm, bk), 0)

  def group(g, acc):
    in_g = (rows >= start_ref[g]) & (rows < end_ref[g])
    return _group_product(x_ref, w_ref, g, row0, j, acc, bm=bm, bn=bn, bk=bk,
                          transpose_rhs=transpose_rhs, precision=precision,
                          row_mask=in_g)

  acc = jax.lax.fori_loop(first_ref[t], last_ref[t] + 1, group,
                          jnp.zeros((bm, bn), _F32))
  o_ref[pl.ds(row0, bm), pl.ds(j * bn, bn)] = acc.astype(o_ref.dtype)


def check_operands(x, w, group_sizes, transpose_rhs=False):
  """ValueError naming the operand unless shapes and dtypes fit the kernels."""
  if x.ndim != 2 or w.ndim != 3 or group_sizes.ndim != 1:
    raise ValueError(
        f"gmm takes x [M, K], w [E, K, N] and group_sizes [E]; got x "
        f"{x.shape}, w {w.shape}, group_sizes {group_sizes.shape}")
  k_w = w.shape[2] if transpose_rhs else w.shape[1]
  if x.shape[1] != k_w or w.shape[0] != group_sizes.shape[0]:
    raise ValueError(
        f"gmm: x [M, K={x.shape[1]}] against w {w.shape} (transpose_rhs="
        f"{transpose_rhs}) and {group_sizes.shape[0]} group sizes: K and E "
        "must agree")
  for name, d in (("K", x.shape[1]), ("N", w.shape[1] + w.shape[2] - k_w)):
    if d % _MIN_DIM:
      raise ValueError(f"gmm needs {name} a multiple of {_MIN_DIM}, got "
                       f"{name}={d}")
  for name, a in (("x", x), ("w", w)):
    if a.dtype not in (jnp.float32, jnp.bfloat16):
      raise ValueError(f"gmm takes {name} in float32 or bfloat16, got "
                       f"{a.dtype}")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"gmm takes integer group_sizes, got "
                     f"{group_sizes.dtype}")


def _precision(dtype):
  # fp32 operands: IEEE fp32 products on the GPU, not TF32.
  return jax.lax.Precision.HIGHEST if dtype == _F32 else None


# Jitted so that a model's call sites of one product (its layers, forward
# and rematerialised forward) share one lowered kernel: the step's module
# then carries each distinct kernel once, not once per call.
@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _gmm_call(x, w, group_sizes, transpose_rhs, tune, interpret):
  if tune.kernel == "mosaic":
    if transpose_rhs:   # the kernel reads w plainly; w is small
      w = jnp.swapaxes(w, 1, 2)
    return mosaic.gmm_mosaic(x, w, group_sizes, tuning=tune,
                             interpret=interpret)
  m, k = x.shape
  n = w.shape[1] if transpose_rhs else w.shape[2]
  bm = tune.block_m
  m_pad = pl.cdiv(m, bm) * bm
  bn, bk = block_divisor(n, tune.block_n), block_divisor(k, tune.block_k)
  precision = _precision(x.dtype)
  if tune.schedule == "tiles":
    kernel = functools.partial(_gmm_tile_kernel, transpose_rhs=transpose_rhs,
                               precision=precision)
    meta = (*tile_groups(group_sizes, m_pad, bm), *group_bounds(group_sizes))
  else:
    kernel = functools.partial(_gmm_kernel, num_groups=w.shape[0],
                               transpose_rhs=transpose_rhs,
                               precision=precision)
    meta = visits(group_sizes, m_pad, bm)
  out = pl.pallas_call(
      functools.partial(kernel, bm=bm, bn=bn, bk=bk),
      grid=(meta[0].shape[0], n // bn),   # one row per tile / per visit
      out_shape=jax.ShapeDtypeStruct((m_pad, n), x.dtype),
      compiler_params=_params(tune.num_warps, tune.num_stages),
      interpret=interpret,
      name="gmm",
  )(*meta, pad_rows(x, m_pad), w.astype(x.dtype))
  return out[:m]


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _tgmm_call(x, dy, group_sizes, out_dtype, tune, interpret):
  if tune.kernel == "mosaic":
    return mosaic.tgmm_mosaic(x, dy, group_sizes, out_dtype=out_dtype,
                              tuning=tune, interpret=interpret)
  m, k = x.shape
  n = dy.shape[1]
  bm = tune.block_m
  m_pad = pl.cdiv(m, bm) * bm
  bk = block_divisor(k, tune.tgmm_block_k)
  bn = block_divisor(n, tune.tgmm_block_n)
  start, end = group_bounds(group_sizes)
  e = group_sizes.shape[0]
  whole = lambda a: pl.BlockSpec(a.shape, lambda g, i, j: (0,) * a.ndim)  # noqa: E731
  xp, dyp = pad_rows(x, m_pad), pad_rows(dy, m_pad)
  return pl.pallas_call(
      functools.partial(_tgmm_kernel, bm=bm, bk=bk, bn=bn,
                        precision=_precision(x.dtype)),
      grid=(e, k // bk, n // bn),
      in_specs=[whole(start), whole(end), whole(xp), whole(dyp)],
      out_specs=pl.BlockSpec((None, bk, bn), lambda g, i, j: (g, i, j)),
      out_shape=jax.ShapeDtypeStruct((e, k, n), out_dtype),
      compiler_params=_params(tune.tgmm_num_warps, tune.tgmm_num_stages),
      interpret=interpret,
      name="tgmm",
  )(start, end, xp, dyp.astype(x.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gmm(x, w, group_sizes, transpose_rhs, tune, interpret):
  return _gmm_call(x, w, group_sizes, transpose_rhs, tune, interpret)


def _gmm_fwd(x, w, group_sizes, transpose_rhs, tune, interpret):
  out = _gmm_call(x, w, group_sizes, transpose_rhs, tune, interpret)
  return out, (x, w, group_sizes)


def _gmm_bwd(transpose_rhs, tune, interpret, res, dy):
  x, w, group_sizes = res
  dy = dy.astype(x.dtype)
  dx = _gmm_call(dy, w, group_sizes, not transpose_rhs, tune, interpret)
  if transpose_rhs:   # out = x @ w_g^T, w_g [N, K]: dw_g = dy_g^T x_g
    dw = _tgmm_call(dy, x, group_sizes, w.dtype, tune, interpret)
  else:               # out = x @ w_g: dw_g = x_g^T dy_g
    dw = _tgmm_call(x, dy, group_sizes, w.dtype, tune, interpret)
  return dx, dw, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def gmm(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
        transpose_rhs: bool = False, tuning: Tuning | None = None,
        interpret: bool = False) -> jax.Array:
  """Grouped matmul: out[r] = x[r] @ w[g(r)] over group-sorted rows.

  Args:
    x: [M, K] float32 | bfloat16, rows sorted by group.
    w: [E, K, N] (transpose_rhs: [E, N, K]); cast to x.dtype.
    group_sizes: int [E], sum <= M; rows past the sum give zeros.
    transpose_rhs: multiply by each group's matrix transposed.
    tuning: block sizes and launch parameters (default Tuning());
      Tuning(kernel="mosaic") runs the product and both gradients on Mosaic
      GPU (mosaic.py: bf16 x, K and N multiples of 64).
    interpret: run the kernels in the Pallas interpreter (CPU tests; the
      Mosaic kernels in the GPU interpreter).

  Returns:
    [M, N] in x.dtype (fp32 accumulation). Differentiable in x and w.
  """
  check_operands(x, w, group_sizes, transpose_rhs)
  # Tuning(kernel="mosaic"): gmm_mosaic / tgmm_mosaic check their limits.
  return _gmm(x, w, group_sizes.astype(jnp.int32), transpose_rhs,
              tuning or Tuning(), interpret)


def tgmm(x: jax.Array, dy: jax.Array, group_sizes: jax.Array, *,
         tuning: Tuning | None = None, interpret: bool = False) -> jax.Array:
  """Per-group x^T dy: out[g] = x[rows g]^T @ dy[rows g]. [E, K, N] fp32."""
  if x.ndim != 2 or dy.ndim != 2 or x.shape[0] != dy.shape[0]:
    raise ValueError(f"tgmm takes x [M, K] and dy [M, N], got x {x.shape} "
                     f"and dy {dy.shape}")
  return _tgmm_call(x, dy, group_sizes.astype(jnp.int32), _F32,
                    tuning or Tuning(), interpret)
