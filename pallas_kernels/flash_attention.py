"""Causal flash attention over packed documents (Pallas, Triton on a GPU).

    o = flash_attention(q, k, v, segment_ids, scale=..., interpret=False)

q, k [B, T, H, Dqk]; v [B, T, H, Dv]; segment_ids [B, T] int >= 0 or None;
o [B, T, H, Dv] in q.dtype. A token attends to the tokens at or before it
that carry its segment id (with None: to every token at or before it).

The kernel is JAX's maintained one, `jax.experimental.pallas.ops.gpu.
attention.mha` (forward and backward kernels, segment ids read per tile, so
no [T, T] mask is ever built). It wants one head dim for q, k and v, and T a
multiple of its blocks, which must be powers of two (Triton tiles). This
module adapts any shape to it:
  - the head dims are zero-padded to one power-of-two width (>= 16, the
    smallest Triton dot): zeros add nothing to q.k, and the padded output
    columns are sliced off. The kernel pads its tiles to that power of two
    itself, so this costs nothing it would not spend anyway;
  - T is padded at the end to the block multiple. Causality already hides
    the padded tokens from every real one; with segment ids they also get an
    id of their own (-1), so they attend only among themselves. Their
    outputs are sliced off, so their cotangents are zero and they add
    nothing to the gradients.
Widths above MAX_HEAD_WIDTH do not fit the kernel's tiles in shared memory
and raise a ValueError.

`interpret=True` runs the same kernels in the Pallas interpreter (CPU
tests). The module is deprecated in favour of tokamax from JAX 0.11 (same
signature in 0.10 and 0.11); its DeprecationWarning is silenced here.
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

with warnings.catch_warnings():
  warnings.simplefilter("ignore", DeprecationWarning)
  from jax.experimental.pallas.ops.gpu import attention as _mha_lib

# The widest padded head dim. The forward kernel holds a q tile and, two
# pipeline stages deep, k and v tiles in shared memory: 5 tiles of
# _TILE_BYTES = 160 KiB of an H100 SM's 228 KiB. At width 256 that is 64 rows
# in bf16, 32 in fp32; wider, the tiles would drop below 32 rows.
MAX_HEAD_WIDTH = 256
_MIN_HEAD_WIDTH = 16
_TILE_BYTES = 32 * 1024
_MAX_FORWARD_BLOCK = 128
_BACKWARD_BLOCK = 32


def _next_power_of_two(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def head_width(*head_dims: int) -> int:
  """The padded head width the kernel runs for these q/k and v head dims."""
  return max(_MIN_HEAD_WIDTH, _next_power_of_two(max(head_dims)))


def supports_head_dims(*head_dims: int) -> bool:
  """Whether the kernel takes these head dims (padded width <= 256)."""
  return head_width(*head_dims) <= MAX_HEAD_WIDTH


def forward_block(width: int, itemsize: int) -> int:
  """Forward tile rows (q and k alike): 128, or fewer so that one
  [rows, width] tile stays within 32 KiB."""
  return max(32, min(_MAX_FORWARD_BLOCK, _TILE_BYTES // (width * itemsize)))


def _check_block(name: str, block: int) -> None:
  if block < _MIN_HEAD_WIDTH or block & (block - 1):
    raise ValueError(f"flash_attention: {name} must be a power of two >= "
                     f"{_MIN_HEAD_WIDTH}, got {block}")


def padded_length(t: int, block: int, backward_block: int) -> int:
  """T padded for the kernel: a multiple of the larger block, or, when T is
  shorter, the next power of two (>= 16; the blocks then shrink to it)."""
  big = max(block, backward_block)
  if t >= big:
    return -(-t // big) * big
  return max(_MIN_HEAD_WIDTH, _next_power_of_two(t))


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                    segment_ids: jax.Array | None = None, *, scale: float,
                    interpret: bool = False, block: int | None = None,
                    backward_block: int = _BACKWARD_BLOCK) -> jax.Array:
  """Causal attention, within documents when segment_ids is given.

  q, k: [B, T, H, Dqk]; v: [B, T, H, Dv]; segment_ids: [B, T] int >= 0 or
  None. scale multiplies q.k. block: forward tile rows (default
  `forward_block`: 128 up to width 128 in bf16); backward_block: backward
  tile rows; both powers of two. Returns o [B, T, H, Dv] in q.dtype.
  """
  b, t, h, dqk = q.shape
  dv = v.shape[-1]
  if k.shape != q.shape or v.shape[:3] != q.shape[:3]:
    raise ValueError(f"flash_attention: q, k must be [B, T, H, Dqk] and v "
                     f"[B, T, H, Dv] alike, got q {q.shape}, k {k.shape}, "
                     f"v {v.shape}")
  if segment_ids is not None and segment_ids.shape != (b, t):
    raise ValueError(f"flash_attention: segment_ids must be [B, T]={(b, t)}, "
                     f"got {segment_ids.shape}")
  width = head_width(dqk, dv)
  if width > MAX_HEAD_WIDTH:
    raise ValueError(
        f"flash_attention: head dims (q/k {dqk}, v {dv}) pad to width "
        f"{width}, above the kernel's {MAX_HEAD_WIDTH}")
  if block is None:
    block = forward_block(width, jnp.dtype(q.dtype).itemsize)
  _check_block("block", block)
  _check_block("backward_block", backward_block)
  tp = padded_length(t, block, backward_block)

  def pad(a):
    return jnp.pad(a, ((0, 0), (0, tp - t), (0, 0), (0, width - a.shape[-1])))
  ids = segment_ids
  if ids is not None:
    ids = jnp.pad(ids.astype(jnp.int32), ((0, 0), (0, tp - t)),
                  constant_values=-1)
  sizes = _mha_lib.BlockSizes(
      block_q=block, block_k=block, block_q_dkv=backward_block,
      block_kv_dkv=backward_block, block_q_dq=backward_block,
      block_kv_dq=backward_block)
  o = _mha_lib.mha(pad(q), pad(k), pad(v.astype(q.dtype)), ids,
                   sm_scale=float(scale), causal=True, block_sizes=sizes,
                   interpret=interpret)
  return o[:, :t, :, :dv]
