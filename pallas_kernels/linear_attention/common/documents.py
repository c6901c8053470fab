"""Packed documents in the chunked Pallas kernels: the per-chunk document
index and the masks the kernels derive from it.

A packed row holds several documents (runs of equal segment ids, as fla's
cu_seqlens marks them); the recurrence restarts from a zero state at each
document start inside the row. The kernels see one int32 per token, its
document index WITHIN ITS CHUNK: the number of document starts in the chunk
up to and including the token. Index 0 is the document the state entering
the chunk belongs to (the row's first document for the first chunk: the
initial state is its), and the chunk's last document has the chunk's
largest index. From it (kda/naive.py `chunk_kda_ref` is the same math):
  * same document: the pair (i, j) of one chunk is kept in the intra-chunk
    scores only when index_i == index_j (dense tiles, masked after the dot
    with `where`, as the causal mask is);
  * reads state: only tokens of index 0 read the state entering the chunk;
  * in last: only tokens of the chunk's last document feed the state
    leaving it;
  * keeps state: the entering state decays into the leaving one only when
    the chunk has no document start (its last index is 0).
The row's padding (T up to a multiple of the chunk) joins the row's last
document, where its inert tokens (q = k = v = beta = 0, g = 0) change
nothing.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention.common.tiles import CHUNK, TILE, tile_rows


def chunk_document_index(segment_ids, tp):
  """[B, T] int segment ids -> [B, Tp] int32, the document index of each
  token within its chunk (module docstring); T is padded to tp, a multiple
  of the chunk, with no document start. A document is a contiguous run of
  equal ids (an id that comes back later starts a new document)."""
  bsz, t = segment_ids.shape
  starts = jnp.concatenate(
      [jnp.zeros((bsz, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]],
      axis=1)
  starts = jnp.pad(starts, ((0, 0), (0, tp - t))).astype(jnp.int32)
  return jnp.cumsum(starts.reshape(bsz, tp // CHUNK, CHUNK),
                    axis=-1).reshape(bsz, tp)


def checked_document_index(segment_ids, batch_time, tp):
  """chunk_document_index of segment_ids after checking it is [B, T] (the
  op's batch_time); None stays None (unpacked rows)."""
  if segment_ids is None:
    return None
  if tuple(segment_ids.shape) != tuple(batch_time):
    raise ValueError(f"segment_ids must have shape [B, T]="
                     f"{tuple(batch_time)}, got {tuple(segment_ids.shape)}")
  return chunk_document_index(segment_ids, tp)


def document_spec():
  """Chunk n of the [B, Tp] document index; grid (B, H, N[, j])."""
  return pl.BlockSpec((None, CHUNK), lambda b, h, n, *_: (b, n))


class ChunkDocuments:
  """The masks of one chunk inside a kernel, from its document index ref
  [C] int32. Tile arguments t may be traced."""

  def __init__(self, index_ref):
    self._ref = index_ref
    self.last = jnp.max(index_ref[...])   # the chunk's last document

  def _column(self, t):   # [16, 1]
    return jax.lax.broadcast_in_dim(self._ref[tile_rows(t)], (TILE, 1), (0,))

  def _row(self, t):   # [1, 16]
    return jax.lax.broadcast_in_dim(self._ref[tile_rows(t)], (1, TILE), (1,))

  def same(self, i, j):
    """bool [16, 16]: the pair (row of tile i, row of tile j) in one
    document."""
    return self._column(i) == self._row(j)

  def same_chunk(self):
    """bool [C, C]: same document, for the whole chunk."""
    idx = self._ref[...]
    return (jax.lax.broadcast_in_dim(idx, (CHUNK, 1), (0,))
            == jax.lax.broadcast_in_dim(idx, (1, CHUNK), (1,)))

  def reads_state(self, t):
    """bool [16, 1]: the rows of tile t that read the entering state."""
    return self._column(t) == 0

  def in_last(self, t):
    """bool [16, 1]: the rows of tile t in the chunk's last document."""
    return self._column(t) == self.last

  def keeps_state(self):
    """bool scalar: the chunk has no document start."""
    return self.last == 0


def with_documents(kernel, n_inputs):
  """A Pallas kernel taking the document index as its input number
  n_inputs (after its n_inputs usual inputs, before its outputs), calling
  `kernel(*refs, docs=ChunkDocuments(index_ref), **options)`."""

  def packed_kernel(*refs, **options):
    docs = ChunkDocuments(refs[n_inputs])
    return kernel(*refs[:n_inputs], *refs[n_inputs + 1:], docs=docs,
                  **options)

  return packed_kernel
