"""GLA's intra-chunk kernel: b, the decayed operands and the causal score
matrix A (see gla/chunk.py for the algorithm)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention.common.documents import (
    document_spec, with_documents)
from pallas_kernels.linear_attention.common.tiles import (
    N_TILES, TILE, F32, chunk_spec, k_slice, row_slice_operands,
    row_slice_scores, shape_of, square_spec, store_row, tile_iota)


def _intra_kernel(q_ref, k_ref, g_ref, aqk_ref, qg_ref, kg_ref, ec_ref,
                  *b_refs, bk, bounded, mm, g_min, docs=None):
  # q_ref, k_ref, g_ref [C, Kp]; aqk_ref [C, C] (matmul dtype); qg_ref
  # (q exp(b)), kg_ref (k exp(b_C - b)) [C, Kp] matmul dtype; ec_ref
  # (exp(b_C)) [Kp] fp32; b_refs: (b_ref [C, Kp] fp32,) for the backward,
  # else (). g_min: the bounded path's clamp (applied as g is loaded) or None.
  # docs: packed documents (common.documents.ChunkDocuments) or None.
  #
  # Row tile by row tile: row i of A summed over the K slices in a
  # fori_loop (b of tiles 0..i recomputed per slice: the same bits), so only
  # one row's i + 1 score tiles are live.
  row, col = tile_iota()
  causal = row >= col
  n_k = k_ref.shape[-1] // bk
  b_ref = b_refs[0] if b_refs else None
  for i in range(N_TILES):

    def row_body(kk, acc, i=i):
      cols = k_slice(kk, bk)
      b, c, k_t, q_i = row_slice_operands(i, cols, q_ref, k_ref, g_ref,
                                          g_min, b_ref, qg_ref, kg_ref,
                                          ec_ref, docs)
      [scores] = row_slice_scores(i, [q_i], k_t, b, c, causal, bounded, mm)
      return tuple(a + p for a, p in zip(acc, scores))

    zeros = tuple(jnp.zeros((TILE, TILE), F32) for _ in range(i + 1))
    aqk = list(jax.lax.fori_loop(0, n_k, row_body, zeros))
    aqk[i] = jnp.where(causal, aqk[i], 0.0)   # where: masked overflow stays out
    if docs is not None:   # and pairs of different documents
      aqk = [jnp.where(docs.same(i, j), a, 0.0) for j, a in enumerate(aqk)]
    store_row(aqk_ref, i, aqk)


def intra_call(qp, kp_, gp, lay, bounded, g_min, tune, interpret,
               for_backward, docs=None):
  """Kernel 1: [Aqk, qg, kg, ec] (+ [b] with for_backward): Aqk [B, H, Tp,
  C], qg = q exp(b), kg = k exp(b_C - b) [B, Tp, H, Kp] in the matmul dtype;
  ec = exp(b_C) [B, H, N, Kp] and b [B, Tp, H, Kp] fp32. docs: None, or the
  [B, Tp] int32 document index of packed documents (common/documents.py):
  the outputs then carry its masks."""
  kp, mm = lay["kp"], lay["mm"]
  seq_k_mm = shape_of(lay, "bsz", "tp", "h", "kp", dtype=mm)
  out_specs = [square_spec(), chunk_spec(kp), chunk_spec(kp),
               pl.BlockSpec((None, None, None, kp),
                            lambda b, h, n: (b, h, n, 0))]
  out_shape = [shape_of(lay, "bsz", "h", "tp", "chunk", dtype=mm),
               seq_k_mm, seq_k_mm, shape_of(lay, "bsz", "h", "n_chunks", "kp")]
  if for_backward:
    out_specs.append(chunk_spec(kp))
    out_shape.append(shape_of(lay, "bsz", "tp", "h", "kp"))
  kernel, doc_in, doc_specs = _intra_kernel, [], []
  if docs is not None:   # one more input, after the usual ones
    kernel = with_documents(_intra_kernel, 3)
    doc_in, doc_specs = [docs], [document_spec()]
  return pl.pallas_call(
      functools.partial(kernel, bk=lay["bk"], bounded=bounded, mm=mm,
                        g_min=g_min),
      grid=(lay["bsz"], lay["h"], lay["n_chunks"]),
      in_specs=[chunk_spec(kp)] * 3 + doc_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=tune.params("intra"),
      interpret=interpret,
      name="gla_chunk_intra",
  )(qp, kp_, gp, *doc_in)
