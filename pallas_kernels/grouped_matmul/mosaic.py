"""Grouped matmul over group-sorted rows on Mosaic GPU (TMA + wgmma, sm_90).

The same products as gmm.py (`gmm`: out[r] = x[r] @ w[g(r)]; `tgmm`:
out[g] = x[rows g]^T @ dy[rows g]), as Hopper kernels: operands reach shared
memory by TMA, pipelined over the contraction, and are multiplied by
warpgroup MMAs (wgmma) into an fp32 register accumulator.

gmm_mosaic walks layout.py's visits (row tile of block_m rows, group, rows
[lo, hi) of the tile in the group; the tail group E holds the rows past
sum(sizes), which are stored as zeros), times the N / block_n column
blocks. The kernel is persistent: one program per SM
(`plgpu.nd_loop(..., collective_axes="sm")`), each looping over the
(visit, column block) work items i = sm, sm + #SMs, ... . One item:
  1. the K loop: `plgpu.emit_pipeline` fetches x[tile, k block] and
     w[g][k block, column block] by TMA, `max_concurrent_steps` blocks
     ahead, and wgmma accumulates [block_m, block_n] in fp32;
  2. the bf16 result goes to shared memory and leaves by TMA stores of only
     rows [lo, hi) of the tile: TMA boxes have static sizes, so the rows
     are stored as a ladder of power-of-two boxes (block_m, block_m / 2,
     ..., 1 rows; the one of 2^b rows runs iff bit b of hi - lo is set), a
     full tile being the single block_m box. The visits of one tile hold
     disjoint rows, so no two items write one element.
The work is at most M / block_m + E visits (an empty group in the middle of
a tile costs a no-op item) times N / block_n.

tgmm_mosaic is persistent the same way over (group, K block, N block)
items, each an output block [tgmm_block_k, tgmm_block_n] accumulated over
the row tiles of its group (a pipeline of block_m rows per step; an empty
group stores zeros). wgmma reads the x block [block_m, K block]
transposed (layout "rows"; jax 0.10's GPU interpreter cannot, so there x^T
[K, M] is made by XLA first and read plainly: layout "cols"). In the first
and last tile of a group the rows of x of other groups are zeroed in
shared memory before the product.

Limits (`check_mosaic`): bf16 x (wgmma on fp32 is TF32; fp32 callers
keep the Triton kernels), K and N multiples of 64 (the 128-byte swizzle of
a 64-wide bf16 block), block_m, block_n, tgmm_block_k, tgmm_block_n in
{64, 128, 256} with each accumulator ([block_m, block_n] and [tgmm_block_k,
tgmm_block_n]) at most 128 x 128 (one warpgroup holds it: 128 fp32
registers per thread). Rows M are padded to a multiple of block_m so that
every TMA read is in bounds.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - every supported jax has it
  plgpu = None

from pallas_kernels.device import gpu_compute_major
from pallas_kernels.grouped_matmul.layout import (Tuning, block_divisor,
                                                  group_bounds, pad_rows,
                                                  visits)
from pallas_kernels.linear_attention.common.mosaic import (
    LAYOUTS, SMEM_LIMIT, _interpret_params, _load, default_layout,
    interpreter_transposes)

_F32 = jnp.float32
_BF16 = jnp.bfloat16
_MIN_DIM = 64         # K, N: multiples of one 128-byte swizzled bf16 block
_BLOCK_K = 64         # the contraction step: 64 bf16 = one 128-byte row
_WGMMA_BLOCKS = (64, 128, 256)
_MAX_ACC = 128 * 128  # accumulator elements: 128 fp32 registers per thread
_INTERPRET_SMS = 4    # persistent programs in the interpreter (no card)


def _transforms():
  """Tiling (8 rows x 64) and 128-byte swizzle of a bf16 wgmma operand
  block in shared memory (every block here is a multiple of 64 wide)."""
  return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def mosaic_gpu_available() -> bool:
  """Whether the default device runs these kernels: a GPU of compute
  capability 9.0 or later (wgmma, TMA) and a jax with Mosaic GPU."""
  return plgpu is not None and gpu_compute_major() >= 9


def num_programs(interpret) -> int:
  """Persistent programs: the card's SM count, or a few when interpreting."""
  if interpret:
    return _INTERPRET_SMS
  return int(getattr(jax.devices()[0], "core_count", 132) or 132)


def check_mosaic(dtype, k: int, n: int, tune: Tuning, what: str = "gmm"):
  """ValueError naming the operand or field unless the Mosaic kernels fit a
  product with x of `dtype`, contraction K and output width N (the same
  limits hold for its gradients: dx swaps K and N, dw takes both)."""
  me = f"{what} with Tuning(kernel='mosaic')"
  if plgpu is None:
    raise ValueError(f"{me} needs jax.experimental.pallas.mosaic_gpu, absent "
                     "from this jax")
  if jnp.dtype(dtype) != _BF16:
    raise ValueError(f"{me} takes x in bfloat16 only (wgmma on float32 is "
                     f"TF32), got {jnp.dtype(dtype).name}; use "
                     "Tuning(kernel='triton')")
  for name, d in (("K", k), ("N", n)):
    if d % _MIN_DIM:
      raise ValueError(f"{me} needs {name} a multiple of {_MIN_DIM}, got "
                       f"{name}={d}; use Tuning(kernel='triton')")
  for name in ("block_m", "block_n", "tgmm_block_k", "tgmm_block_n"):
    if getattr(tune, name) not in _WGMMA_BLOCKS:
      raise ValueError(f"{me} needs Tuning.{name} in {_WGMMA_BLOCKS}, got "
                       f"{getattr(tune, name)}")
  for a, b in (("block_m", "block_n"), ("tgmm_block_k", "tgmm_block_n")):
    if getattr(tune, a) * getattr(tune, b) > _MAX_ACC:
      raise ValueError(
          f"{me} needs Tuning.{a} x Tuning.{b} <= {_MAX_ACC} (the fp32 "
          f"accumulator of one warpgroup), got {getattr(tune, a)} x "
          f"{getattr(tune, b)}")


def _steps(tune: Tuning, per_step: int, fixed: int, what: str) -> int:
  """TMA blocks in flight: tune.mosaic_steps, lowered so that the pipeline
  (per_step bytes each) and the `fixed` bytes fit in shared memory; at
  least 2 (one computing, one arriving)."""
  steps = min(tune.mosaic_steps, (SMEM_LIMIT - fixed) // per_step)
  if steps < 2:
    raise ValueError(
        f"{what} with Tuning(kernel='mosaic') needs {fixed + 2 * per_step} "
        f"bytes of shared memory at these blocks (limit {SMEM_LIMIT}); use "
        "smaller blocks")
  return steps


def _store_rows(o_smem, o_gmem, row0, start, size, bm):
  """TMA stores of rows [start, start + size) of o_smem to rows row0 + start
  ... of o_gmem: one box per set bit of size (static box sizes bm .. 1)."""
  rung = bm
  while rung >= 1:
    @pl.when(size & rung != 0)
    def _():
      plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(start, rung)],
                              o_gmem.at[pl.ds(row0 + start, rung)])
    start = start + (size & rung)
    rung //= 2


def _gmm_kernel(tile_g, group_g, lo_g, hi_g, x_g, w_g, o_g, o_smem, *, bm, bn,
                n_blocks, num_groups, steps):
  n_items = tile_g.shape[0] * n_blocks
  k_steps = x_g.shape[1] // _BLOCK_K

  @plgpu.nd_loop((n_items,), collective_axes="sm")
  def _item(info):
    (i,) = info.index
    v, j = jax.lax.div(i, n_blocks), jax.lax.rem(i, n_blocks)
    t, g, lo, hi = tile_g[v], group_g[v], lo_g[v], hi_g[v]

    @pl.when(hi > lo)
    def _visit():
      def product(acc):
        @pl.when(g < num_groups)   # the tail group: acc stays zero
        def _():
          def mma(_, x_smem, w_smem):
            plgpu.wgmma(acc, x_smem, w_smem)
            plgpu.wgmma_wait(1)    # the slot of step k - 1 may be refilled
          plgpu.emit_pipeline(
              mma, grid=(k_steps,),
              in_specs=[
                  plgpu.BlockSpec((bm, _BLOCK_K), lambda k: (t, k),
                                  transforms=_transforms(), delay_release=1),
                  plgpu.BlockSpec((_BLOCK_K, bn), lambda k: (k, j),
                                  transforms=_transforms(), delay_release=1)],
              max_concurrent_steps=steps)(x_g, w_g.at[g])
        return acc[...]

      acc = pl.run_scoped(product, plgpu.ACC((bm, bn), _F32))
      # The previous item's stores have finished reading o_smem.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      o_smem[...] = acc.astype(o_smem.dtype)
      plgpu.commit_smem()
      _store_rows(o_smem, o_g.at[:, pl.ds(j * bn, bn)], t * bm, lo - t * bm,
                  hi - lo, bm)

  plgpu.wait_smem_to_gmem(0)


def _as_wgmma(value, interpret):
  """value in the wgmma accumulator's register layout (a layout hint the
  lowering needs). jax 0.10's GPU interpreter runs no layout_cast and models
  no layouts: there, value as is."""
  if interpret and not interpreter_transposes():
    return value
  return plgpu.layout_cast(value, plgpu.Layout.WGMMA)


def _tgmm_kernel(start_g, end_g, x_g, dy_g, o_g, o_smem, *, bm, bk, bn,
                 k_blocks, n_blocks, steps, layout, interpret):
  n_groups = start_g.shape[0]
  n_items = n_groups * k_blocks * n_blocks
  rows_axis = 0 if layout == "rows" else 1   # x's rows in its block
  x_block = (bm, bk) if layout == "rows" else (bk, bm)

  @plgpu.nd_loop((n_items,), collective_axes="sm")
  def _item(info):
    (item,) = info.index
    g = jax.lax.div(item, k_blocks * n_blocks)
    i = jax.lax.div(jax.lax.rem(item, k_blocks * n_blocks), n_blocks)
    j = jax.lax.rem(item, n_blocks)
    lo, hi = start_g[g], end_g[g]
    t0 = jax.lax.div(lo, bm)
    n_tiles = jax.lax.div(hi + bm - 1, bm) - t0

    def product(acc):
      def mma(idx, x_smem, dy_smem):
        t = t0 + idx[0]

        # A tile shared with another group: zero the rows of x of other
        # groups before the product.
        @pl.when((t * bm < lo) | ((t + 1) * bm > hi))
        def _():
          rows = t * bm + _as_wgmma(jax.lax.broadcasted_iota(
              jnp.int32, x_block, rows_axis), interpret)
          xv = _load(x_smem, plgpu.Layout.WGMMA, interpret)
          x_smem[...] = jnp.where((rows >= lo) & (rows < hi), xv,
                                  jnp.zeros_like(xv))
          plgpu.commit_smem()

        lhs = x_smem.transpose((1, 0)) if layout == "rows" else x_smem
        plgpu.wgmma(acc, lhs, dy_smem)
        plgpu.wgmma_wait(1)        # the slot of step r - 1 may be refilled

      def x_index(r):
        return (t0 + r, i) if layout == "rows" else (i, t0 + r)

      @pl.when(hi > lo)            # an empty group: acc stays zero
      def _():
        plgpu.emit_pipeline(
            mma, grid=(n_tiles,),
            in_specs=[
                plgpu.BlockSpec(x_block, x_index, transforms=_transforms(),
                                delay_release=1),
                plgpu.BlockSpec((bm, bn), lambda r: (t0 + r, j),
                                transforms=_transforms(), delay_release=1)],
            max_concurrent_steps=steps)(x_g, dy_g)
      return acc[...]

    acc = pl.run_scoped(product, plgpu.ACC((bk, bn), _F32))
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    o_smem[...] = acc.astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(
        o_smem, o_g.at[g, pl.ds(i * bk, bk), pl.ds(j * bn, bn)])

  plgpu.wait_smem_to_gmem(0)


def gmm_mosaic(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
               tuning: Tuning | None = None,
               interpret=False) -> jax.Array:
  """out[r] = x[r] @ w[g(r)] over group-sorted rows, on Mosaic GPU.

  Args:
    x: [M, K] bf16, rows sorted by group; K a multiple of 64.
    w: [E, K, N], cast to bf16 (callers wanting w^T transpose it first);
      N a multiple of 64.
    group_sizes: int [E], sum <= M; rows past the sum give zeros.
    tuning: block_m, block_n (each 64, 128 or 256; block_n is lowered to
      the largest power of two dividing N) and mosaic_steps (K blocks in
      flight) of layout.Tuning.
    interpret: True or gpu_interpreter(...) to run in the GPU interpreter.

  Returns:
    [M, N] bf16 (fp32 accumulation).
  """
  tune = tuning or Tuning()
  m, k = x.shape
  n = w.shape[2]
  check_mosaic(x.dtype, k, n, tune)
  bm, bn = tune.block_m, block_divisor(n, tune.block_n)
  m_pad = pl.cdiv(m, bm) * bm
  meta = visits(group_sizes.astype(jnp.int32), m_pad, bm)
  kernel = functools.partial(
      _gmm_kernel, bm=bm, bn=bn, n_blocks=n // bn, num_groups=w.shape[0],
      steps=_steps(tune, (bm + bn) * _BLOCK_K * 2, bm * bn * 2, "gmm"))
  call = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((m_pad, n), x.dtype),
      scratch_types=[plgpu.SMEM((bm, bn), x.dtype)],
      grid=(num_programs(interpret),), grid_names=("sm",),
      kernel_name="gmm_mosaic", interpret=_interpret_params(interpret))
  out = call(*meta, pad_rows(x, m_pad), w.astype(x.dtype))
  return out[:m]


def tgmm_mosaic(x: jax.Array, dy: jax.Array, group_sizes: jax.Array, *,
                out_dtype=_F32, tuning: Tuning | None = None,
                layout: str | None = None, interpret=False) -> jax.Array:
  """out[g] = x[rows g]^T @ dy[rows g] (the weight gradient), on Mosaic GPU.

  Args:
    x: [M, K] bf16, dy: [M, N] (cast to bf16), rows sorted by group; K and
      N multiples of 64.
    group_sizes: int [E], sum <= M (rows past the sum are in no group).
    out_dtype: the result's dtype (fp32 accumulation either way).
    tuning: block_m (rows per step, 64, 128 or 256), tgmm_block_k and
      tgmm_block_n (the [K, N] output block; lowered to the largest power
      of two dividing the dim) and mosaic_steps of layout.Tuning.
    layout: how wgmma gets x^T: "rows" (x as is, read transposed by the
      hardware) or "cols" (x^T [K, M] made by XLA first, an extra pass over
      x; the only one jax 0.10's GPU interpreter runs). None: "rows", but
      "cols" in that interpreter.
    interpret: True or gpu_interpreter(...) to run in the GPU interpreter.

  Returns:
    [E, K, N] in out_dtype; zeros for empty groups.
  """
  tune = tuning or Tuning()
  m, k = x.shape
  n = dy.shape[1]
  check_mosaic(x.dtype, k, n, tune, what="tgmm")
  layout = default_layout(interpret) if layout is None else layout
  if layout not in LAYOUTS:
    raise ValueError(f"tgmm_mosaic layout must be one of {LAYOUTS}, got "
                     f"{layout!r}")
  bm = tune.block_m
  bk = block_divisor(k, tune.tgmm_block_k)
  bn = block_divisor(n, tune.tgmm_block_n)
  m_pad = pl.cdiv(m, bm) * bm
  start, end = group_bounds(group_sizes.astype(jnp.int32))
  e = group_sizes.shape[0]
  kernel = functools.partial(
      _tgmm_kernel, bm=bm, bk=bk, bn=bn, k_blocks=k // bk, n_blocks=n // bn,
      steps=_steps(tune, (bk + bn) * bm * 2,
                   bk * bn * jnp.dtype(out_dtype).itemsize, "tgmm"),
      layout=layout, interpret=bool(interpret))
  call = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((e, k, n), out_dtype),
      scratch_types=[plgpu.SMEM((bk, bn), out_dtype)],
      grid=(num_programs(interpret),), grid_names=("sm",),
      kernel_name="tgmm_mosaic", interpret=_interpret_params(interpret))
  xp = pad_rows(x, m_pad)
  return call(start, end, xp if layout == "rows" else xp.T,
              pad_rows(dy, m_pad).astype(x.dtype))
