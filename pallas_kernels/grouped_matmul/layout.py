"""Tunings and the row layout shared by the grouped-matmul kernels.

Rows are sorted by group (expert): group g owns rows [start_g, end_g), rows
past sum(sizes) belong to no group. Both kernel families (gmm.py's Triton
kernels and mosaic.py's Mosaic GPU kernels) pad the rows to a multiple of
the row tile and walk the same *visits*: pairs (row tile of block_m rows,
group) with the tile holding rows of the group.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# gmm's program layouts: "visits" (one program per (row tile, group) pair,
# masked stores) or "tiles" (one program per row tile, looping over the
# groups in it with masked loads, one plain store).
SCHEDULES = ("visits", "tiles")
# Who runs the products: the Triton kernels here (any float dtype) or the
# Mosaic GPU kernels of mosaic.py (bf16, K and N multiples of 64).
KERNELS = ("triton", "mosaic")


@dataclasses.dataclass(frozen=True)
class Tuning:
  """Block sizes and launch parameters of the two kernels.

  block_m: rows per tile (gmm's visits, tgmm's inner loop step).
  block_n, block_k: output columns per program and the contraction step of
    gmm; each is lowered to the largest power of two that divides its dim.
  tgmm_block_k, tgmm_block_n: the [K, N] output block of one tgmm program.
  schedule: gmm's program layout, "visits" (the default, measured at both
    the gpu_small and the gpu_1b shapes) or "tiles" (see the module
    docstring; faster at the gpu_small shape on an H100, results/train_step.md).
  kernel: "triton" (the kernels of this module) or "mosaic" (mosaic.py:
    wgmma + TMA; bf16 only). With "mosaic", block_m x block_n and
    tgmm_block_k x tgmm_block_n are the accumulator tiles (each 64, 128 or
    256, at most 128 x 128 elements), block_m also tgmm's rows per step,
    mosaic_steps the pipeline's blocks in flight; block_k, the warps,
    stages and schedule are unused.
  mosaic_steps: TMA blocks in flight in the Mosaic kernels (lowered to fit
    shared memory; at least 2).
  """
  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  num_warps: int = 8
  num_stages: int = 3
  tgmm_block_k: int = 128
  tgmm_block_n: int = 128
  tgmm_num_warps: int = 8
  tgmm_num_stages: int = 3
  schedule: str = "visits"
  kernel: str = "triton"
  mosaic_steps: int = 4

  def __post_init__(self):
    if self.schedule not in SCHEDULES:
      raise ValueError(f"Tuning.schedule must be one of {SCHEDULES}, got "
                       f"{self.schedule!r}")
    if self.kernel not in KERNELS:
      raise ValueError(f"Tuning.kernel must be one of {KERNELS}, got "
                       f"{self.kernel!r}")
    for f in dataclasses.fields(self):
      if f.name in ("schedule", "kernel"):
        continue
      v = getattr(self, f.name)
      if not isinstance(v, int) or v < 1 or (
          f.name.startswith(("block", "tgmm_block")) and (v & (v - 1) or
                                                          v < 16)):
        raise ValueError(
            f"Tuning.{f.name} must be a positive int (block sizes: a power "
            f"of two >= 16), got {v!r}")


def _searchsorted(sorted_arr, v, side):
  """jnp.searchsorted by comparing every (entry, query) pair: one fused op
  (here a few thousand queries against at most a few thousand entries). The
  default binary search is a while loop, and on the GPU each of its
  iterations waits for the host to read the loop's predicate."""
  return jnp.searchsorted(sorted_arr, v, side=side, method="compare_all")


def block_divisor(dim: int, cap: int) -> int:
  """Largest power of two <= cap dividing dim (dim is a multiple of 16)."""
  b = cap
  while dim % b:
    b //= 2
  return b


def group_bounds(group_sizes: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(start, end) row of each group. int32 [E] each."""
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  return ends - group_sizes.astype(jnp.int32), ends


def visits(group_sizes: jax.Array, m_pad: int, block_m: int) -> tuple:
  """The (tile, group, lo, hi) of every gmm program row; each int32 [V].

  Groups are the E real ones plus a tail group E over [sum(sizes), m_pad),
  whose rows gmm zero-fills. V = m_pad / block_m + E bounds the visits;
  unused trailing entries get lo = hi (nothing to do).
  """
  e = group_sizes.shape[0]
  start, end = group_bounds(group_sizes)
  end_x = jnp.concatenate([end, jnp.full((1,), m_pad, jnp.int32)])
  start_x = jnp.concatenate([start, end[-1:]])
  n_tiles = m_pad // block_m
  first_row = jnp.arange(n_tiles, dtype=jnp.int32) * block_m
  # The group holding row r is the first whose end exceeds r (empty groups
  # never hold a row; ones between g_first and g_last cost a no-op visit).
  g_first = _searchsorted(end_x, first_row, side="right")
  g_last = _searchsorted(end_x, first_row + block_m - 1, side="right")
  per_tile = (g_last - g_first + 1).astype(jnp.int32)
  offsets = jnp.cumsum(per_tile)
  n_visits = n_tiles + e
  v = jnp.arange(n_visits, dtype=jnp.int32)
  tile = jnp.minimum(_searchsorted(offsets, v, side="right"),
                     n_tiles - 1).astype(jnp.int32)
  group = (g_first[tile] + v - (offsets[tile] - per_tile[tile])).astype(
      jnp.int32)
  valid = v < offsets[-1]
  group = jnp.where(valid, jnp.minimum(group, e), e)
  lo = jnp.maximum(start_x[group], tile * block_m)
  hi = jnp.minimum(end_x[group], (tile + 1) * block_m)
  hi = jnp.where(valid, jnp.maximum(hi, lo), lo)
  return tile, group, lo, hi


def tile_groups(group_sizes: jax.Array, m_pad: int, block_m: int) -> tuple:
  """(first, last) real group holding rows of each row tile; int32 [M/bm].

  A tile wholly past sum(sizes) gets first = E > last (no group).
  """
  e = group_sizes.shape[0]
  _, end = group_bounds(group_sizes)
  first_row = jnp.arange(m_pad // block_m, dtype=jnp.int32) * block_m
  first = _searchsorted(end, first_row, side="right").astype(jnp.int32)
  last = jnp.minimum(_searchsorted(end, first_row + block_m - 1,
                                      side="right"), e - 1).astype(jnp.int32)
  return first, last


def pad_rows(a, m_pad):
  return a if a.shape[0] == m_pad else jnp.pad(
      a, ((0, m_pad - a.shape[0]), (0, 0)))
