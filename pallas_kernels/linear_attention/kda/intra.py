"""KDA's intra-chunk kernels, grid (B, H, N), parallel over chunks.

  1a. `_scores_kernel`: b (the within-chunk cumsum of g, clamped to g_min on
      the bounded path), q exp(b), k exp(b_C - b), exp(b_C), and the decayed
      scores Lk (strictly lower) and Aqk (inclusive), the K slices in one
      fori_loop outside the row tiles (b computed once per slice for all 4
      tiles); Aqk (matmul dtype) and Lk (fp32) stored as dense
      lower-triangular [C, C] blocks per chunk, [B, H, T, C].
  1b. `_solve_kernel`: M = (I + diag(beta) Lk)^-1 row tile by row tile
      (stored in the matmul dtype for the backward), then W = M (beta k
      exp(b)) slice by slice of K (b recomputed from g: the same bits) and
      U = M (beta v).
Two kernels rather than one: each half fits its registers without spills,
and the split measured faster on an H100 (results/kernels.md).

Triangular inverse, on fp32 [16, 16] tiles:
  * diagonal tiles by recursive doubling: X_1 = I and, for s = 1, 2, 4, 8,
    X_2s = X_s - X_s N_s X_s, where N_s keeps the entries of the strictly
    lower tile N in the lower-left s x s block of each 2s x 2s diagonal
    block (the block inverse [[A,0],[C,D]]^-1 = [[A^-1,0],[-D^-1 C A^-1,
    D^-1]] for all blocks of one level at once). Its intermediates are true
    sub-inverses, so it is as accurate as forward substitution; the product
    (I - N)(I + N^2)(I + N^4)(I + N^8) is not (N^p grows and cancels);
  * off-diagonal tiles by block forward substitution,
    M_ij = -M_ii sum_{m=j}^{i-1} L_im M_mj.
Its dots are one TF32 MMA each for bf16 inputs on the GPU (error ~1e-3
relative, under the bf16 rounding M gets before its later dots) and IEEE
fp32 for fp32 inputs and in interpret mode (the fp32 path's contract).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention.common.documents import (
    document_spec, with_documents)
from pallas_kernels.linear_attention.common.tiles import (
    CHUNK, N_TILES, TILE, F32, NN, chunk_spec, cumsum_tiles, k_slice, mm_dot,
    row_slice_scores, shape_of, square_spec, square_tile, store_row,
    store_row_decays, tile_iota, tile_rows)


def inverse_dot(mm, interpret):
  """The fp32 [16, 16] dot of the triangular inverse: one TF32 MMA for bf16
  inputs on the GPU (what fla's solve_tril uses), else IEEE fp32 (`mm_dot`:
  fp32 operands at Precision.HIGHEST; the CPU has no TF32)."""
  if interpret or mm == F32:
    return mm_dot

  def dot(a, b, dims=NN):
    return jax.lax.dot_general(
        a, b, (dims, ((), ())),
        precision=jax.lax.DotAlgorithmPreset.TF32_TF32_F32,
        preferred_element_type=F32)
  return dot


def _inv_unit_lower_tile(n, row, col, dot=mm_dot):
  """(I + N)^-1 for one strictly lower [16, 16] fp32 tile, recursive doubling.

  X_1 = I; X_2s = X_s - X_s N_s X_s with N_s the part of N in the lower-left
  s x s block of each 2s x 2s diagonal block (see the module docstring).
  dot: the fp32 dot (`inverse_dot`).
  """
  x = jnp.where(row == col, 1.0, 0.0).astype(F32)
  s, p = 1, 0
  while s < TILE:
    rb, cb = jnp.right_shift(row, p), jnp.right_shift(col, p)  # s-block ids
    off = (jnp.bitwise_and(rb, 1) == 1) & (cb == rb - 1)
    n_s = jnp.where(off, n, 0.0)
    x = x - dot(dot(x, n_s), x)
    s, p = 2 * s, p + 1
  return x


def inverse_row(i, lt_row, mt, row, col, dot=mm_dot):
  """Row tile i of M = (I + L)^-1 (fp32), from row tile i of L (lt_row, the
  i + 1 tiles L_i0 .. L_ii) and the rows above it (mt {(m, j): [16, 16]}):
  M_ii = (I + L_ii)^-1, M_ij = -M_ii sum_{m=j}^{i-1} L_im M_mj (block
  forward substitution). Adds the row to mt. dot: the fp32 dot."""
  mt[i, i] = _inv_unit_lower_tile(lt_row[i], row, col, dot)
  for j in range(i):
    acc = dot(lt_row[j], mt[j, j])
    for m in range(j + 1, i):
      acc = acc + dot(lt_row[m], mt[m, j])
    mt[i, j] = -dot(mt[i, i], acc)
  return mt


def beta_tiles(beta_ref):
  """beta of the chunk as 4 x [16, 1] fp32 columns."""
  return [jax.lax.broadcast_in_dim(beta_ref[tile_rows(t)].astype(F32),
                                   (TILE, 1), (0,)) for t in range(N_TILES)]


def _store_lower_product(out_ref, cols, mt, rhs, mm):
  """out[tile i, cols] = sum_{j <= i} M_ij rhs_j for lower-triangular tiles
  mt {(i, j): [16, 16]} and rhs 4 x [16, w]."""
  for i in range(N_TILES):
    acc = mm_dot(mt[i, 0], rhs[0], mm=mm)
    for j in range(1, i + 1):
      acc = acc + mm_dot(mt[i, j], rhs[j], mm=mm)
    out_ref[tile_rows(i), cols] = acc.astype(out_ref.dtype)


def _score_tiles(q_ref, k_ref, g_ref, b_ref, qg_ref, kg_ref, ec_ref, *, bk,
                 bounded, mm, g_min, causal, docs=None):
  """Lk and Aqk of one chunk, summed over the K slices in one fori_loop:
  each slice computes b once for all 4 tiles and adds its part to all 10
  tile pairs of both (20 [16, 16] fp32 accumulators carried). On the way it
  stores the decayed operands (b when b_ref is given, q exp(b); on row tile
  3, k exp(b_C - b) and exp(b_C); `store_row_decays`). The loop is not
  unrolled: unrolled slices and tile pairs made a kernel ptxas took minutes
  to compile. Returns (lk, aqk): per row tile i, the i + 1 tiles j <= i
  (unmasked). docs: packed documents (`store_row_decays`), or None."""

  def body(kk, acc):
    cols = k_slice(kk, bk)
    b, c, b_end = cumsum_tiles(g_ref, cols, N_TILES, g_min)
    k_t = [k_ref[tile_rows(t), cols].astype(F32) for t in range(N_TILES)]
    lk_acc, aqk_acc = acc
    new_lk, new_aqk = [], []
    for i in range(N_TILES):
      q_i = q_ref[tile_rows(i), cols].astype(F32)
      store_row_decays(i, cols, b, b_end, k_t, q_i, b_ref, qg_ref, kg_ref,
                       ec_ref, docs)
      lk_s, aqk_s = row_slice_scores(i, [k_t[i], q_i], k_t, b, c, causal,
                                     bounded, mm)
      new_lk.append(tuple(a + p for a, p in zip(lk_acc[i], lk_s)))
      new_aqk.append(tuple(a + p for a, p in zip(aqk_acc[i], aqk_s)))
    return tuple(new_lk), tuple(new_aqk)

  zeros = tuple(tuple(jnp.zeros((TILE, TILE), F32) for _ in range(i + 1))
                for i in range(N_TILES))
  return jax.lax.fori_loop(0, k_ref.shape[-1] // bk, body, (zeros, zeros))


def _scores_kernel(q_ref, k_ref, g_ref, aqk_ref, qg_ref, kg_ref, ec_ref,
                   lk_ref, *b_refs, bk, bounded, mm, g_min, docs=None):
  # q_ref, k_ref, g_ref, qg_ref, kg_ref [C, Kp]; aqk_ref [C, C] (matmul
  # dtype); lk_ref [C, C] fp32; ec_ref [Kp]; b_refs: (b_ref [C, Kp] fp32,)
  # when the backward needs it. docs: packed documents
  # (common.documents.ChunkDocuments) or None.
  row, col = tile_iota()
  causal, strict = row >= col, row > col
  lk, aqk = _score_tiles(q_ref, k_ref, g_ref, b_refs[0] if b_refs else None,
                         qg_ref, kg_ref, ec_ref, bk=bk, bounded=bounded,
                         mm=mm, g_min=g_min, causal=causal, docs=docs)
  for i in range(N_TILES):
    lk_i, aqk_i = list(lk[i]), list(aqk[i])
    # where, not a product: masked overflow cannot leak.
    if docs is None:
      lk_i[i] = jnp.where(strict, lk_i[i], 0.0)
      aqk_i[i] = jnp.where(causal, aqk_i[i], 0.0)
    else:   # and pairs of different documents
      for j in range(i + 1):
        same = docs.same(i, j)
        lk_i[j] = jnp.where(same & strict if j == i else same, lk_i[j], 0.0)
        aqk_i[j] = jnp.where(same & causal if j == i else same, aqk_i[j],
                             0.0)
    store_row(aqk_ref, i, aqk_i)
    store_row(lk_ref, i, lk_i)


def _store_w_u(mt, beta_t, k_ref, g_ref, v_ref, w_ref, u_ref, *, bk, bv, mm,
               g_min, docs=None):
  """W = M (beta k exp(b)), slice by slice of K (b recomputed from g: the
  same bits as the stored b), and U = M (beta v) in blocks of bv columns
  (power-of-two loads), from the lower-triangular tiles mt of M. docs
  (packed documents, or None): W's right-hand side kept on the rows that
  read the entering state (M is block diagonal by document, so this masks
  W's rows alike)."""

  def w_body(kk, carry):
    cols = k_slice(kk, bk)
    b, _, _ = cumsum_tiles(g_ref, cols, g_min=g_min)
    rhs = [beta_t[j] * k_ref[tile_rows(j), cols].astype(F32) * jnp.exp(b[j])
           for j in range(N_TILES)]
    if docs is not None:
      rhs = [jnp.where(docs.reads_state(j), r, 0.0)
             for j, r in enumerate(rhs)]
    _store_lower_product(w_ref, cols, mt, rhs, mm)
    return carry

  jax.lax.fori_loop(0, k_ref.shape[-1] // bk, w_body, 0)
  for cv in range(0, v_ref.shape[-1], bv):
    cols = pl.ds(cv, bv)
    _store_lower_product(u_ref, cols, mt, [
        beta_t[j] * v_ref[tile_rows(j), cols].astype(F32)
        for j in range(N_TILES)], mm)


def _solve_kernel(lk_ref, k_ref, g_ref, beta_ref, v_ref, w_ref, u_ref,
                  *m_refs, bk, bv, mm, g_min, dot, docs=None):
  # lk_ref [C, C] fp32 (zero across documents when packed); k_ref, g_ref,
  # w_ref [C, Kp]; beta_ref [C]; v_ref, u_ref [C, V]; m_refs: (m_ref [C, C]
  # matmul dtype,) when the backward needs it. dot: the inverse's fp32 dot
  # (`inverse_dot`). docs: packed documents or None.
  row, col = tile_iota()
  beta_t = beta_tiles(beta_ref)
  mt = {}
  for i in range(N_TILES):
    lk_row = [square_tile(lk_ref, i, j) for j in range(i + 1)]
    mt = inverse_row(i, [beta_t[i] * l for l in lk_row], mt, row, col, dot)
    if m_refs:
      store_row(m_refs[0], i, [mt[i, j] for j in range(i + 1)])
  _store_w_u(mt, beta_t, k_ref, g_ref, v_ref, w_ref, u_ref, bk=bk, bv=bv,
             mm=mm, g_min=g_min, docs=docs)


def beta_spec():
  """Chunk n of beta [B, H, Tp]; grid (B, H, N[, j])."""
  return pl.BlockSpec((None, None, CHUNK), lambda b, h, n, *_: (b, h, n))


def intra_call(qp, kp_, gp, betap, vp, lay, bounded, interpret, tune,
               for_backward=False, g_min=None, docs=None):
  """Kernels 1a and 1b. Returns [W, U, Aqk, qg, kg, ec] (+ [b, M, Lk] with
  for_backward): W, qg = q exp(b), kg = k exp(b_C - b) [B, Tp, H, Kp] and U
  [B, Tp, H, V] in the matmul dtype; b [B, Tp, H, Kp] fp32 (the
  within-chunk cumsum of g); ec = exp(b_C) [B, H, N, Kp] fp32; Aqk, M
  [B, H, Tp, C] in the matmul dtype and Lk [B, H, Tp, C] fp32 (lower
  triangular [C, C] per chunk). With g_min, g is clamped to it inside the
  kernels. docs: None, or the [B, Tp] int32 document index of packed
  documents (common/documents.py): the outputs then carry its masks."""
  kp, dv, mm = lay["kp"], lay["dv"], lay["mm"]
  grid = (lay["bsz"], lay["h"], lay["n_chunks"])
  square = shape_of(lay, "bsz", "h", "tp", "chunk", dtype=mm)
  lk_shape = shape_of(lay, "bsz", "h", "tp", "chunk")
  seq_k_mm = shape_of(lay, "bsz", "tp", "h", "kp", dtype=mm)
  seq_v_mm = shape_of(lay, "bsz", "tp", "h", "dv", dtype=mm)
  ec_spec = pl.BlockSpec((None, None, None, kp),
                         lambda b, h, n, *_: (b, h, n, 0))
  # Kernel 1a: Aqk, qg, kg, ec, Lk (+ b).
  out_specs = [square_spec(), chunk_spec(kp), chunk_spec(kp), ec_spec,
               square_spec()]
  out_shape = [square, seq_k_mm, seq_k_mm,
               shape_of(lay, "bsz", "h", "n_chunks", "kp"), lk_shape]
  if for_backward:
    out_specs.append(chunk_spec(kp))
    out_shape.append(shape_of(lay, "bsz", "tp", "h", "kp"))
  scores_kernel, solve_kernel = _scores_kernel, _solve_kernel
  doc_in, doc_specs = [], []
  if docs is not None:   # one more input, after the usual ones
    scores_kernel = with_documents(_scores_kernel, 3)
    solve_kernel = with_documents(_solve_kernel, 5)
    doc_in, doc_specs = [docs], [document_spec()]
  scores = pl.pallas_call(
      functools.partial(scores_kernel, bk=lay["bk"], bounded=bounded,
                        mm=mm, g_min=g_min),
      grid=grid,
      in_specs=[chunk_spec(kp)] * 3 + doc_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=tune.params("scores"),
      interpret=interpret,
      name="kda_chunk_scores",
  )(qp, kp_, gp, *doc_in)
  aqk, qg, kg, ec, lk = scores[:5]
  # Kernel 1b: M (+ stored), W, U.
  out_specs = [chunk_spec(kp), chunk_spec(dv)]
  out_shape = [seq_k_mm, seq_v_mm]
  if for_backward:
    out_specs.append(square_spec())
    out_shape.append(square)
  solved = pl.pallas_call(
      functools.partial(solve_kernel, bk=lay["bk"], bv=lay["bv"], mm=mm,
                        g_min=g_min, dot=inverse_dot(mm, interpret)),
      grid=grid,
      in_specs=[square_spec(), chunk_spec(kp), chunk_spec(kp), beta_spec(),
                chunk_spec(dv)] + doc_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=tune.params("solve"),
      interpret=interpret,
      name="kda_chunk_solve",
  )(lk, kp_, gp, betap, vp, *doc_in)
  out = [solved[0], solved[1], aqk, qg, kg, ec]
  if for_backward:
    out += [scores[5], solved[2], lk]
  return out
