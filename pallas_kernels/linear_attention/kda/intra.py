"""KDA's intra-chunk kernels: the decayed scores Lk, Aqk, the triangular
inverse M = (I + L)^-1, W and U (see kda/chunk.py for the algorithm)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention.common.tiles import (
    CHUNK, N_TILES, TILE, F32, NN, chunk_spec, cumsum_tiles, k_slice, mm_dot,
    row_slice_operands, row_slice_scores, shape_of, square_spec, square_tile,
    store_row, store_row_decays, tile_iota, tile_rows)
from pallas_kernels.linear_attention.kda import tuning
from pallas_kernels.linear_attention.kda.tuning import kernel_params


def _f32_dot(inverse_dot):
  """The fp32 [16, 16] dot of the triangular inverse: IEEE (`mm_dot`, fp32
  operands, Precision.HIGHEST) or a tensor-core form (INVERSE_DOTS: the
  DotAlgorithmPreset of `tuning.INVERSE_ALGORITHMS`, e.g. TF32_TF32_F32_X3 for
  Triton's tf32x3 input precision)."""
  if inverse_dot == "ieee":
    return mm_dot
  algorithm = tuning.INVERSE_ALGORITHMS[inverse_dot]

  def dot(a, b, dims=NN):
    return jax.lax.dot_general(a, b, (dims, ((), ())), precision=algorithm,
                               preferred_element_type=F32)
  return dot


def _inv_unit_lower_tile(n, row, col, dot=mm_dot):
  """(I + N)^-1 for one strictly lower [16, 16] fp32 tile, recursive doubling.

  X_1 = I; X_2s = X_s - X_s N_s X_s with N_s the part of N in the lower-left
  s x s block of each 2s x 2s diagonal block (see the module docstring).
  dot: the fp32 dot (`_f32_dot`).
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


def _inverse_row(i, lt_row, mt, row, col, dot=mm_dot):
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


def _solve_row(i, lk_row, beta_t, mt, row, col, dot, m_ref=None):
  """Row tile i of M from row tile i of Lk (lk_row, tiles j <= i) and the
  rows above (`_inverse_row` on L = diag(beta) Lk); stores it to m_ref
  (the backward's residual) when given. Returns mt with the row added."""
  mt = _inverse_row(i, [beta_t[i] * l for l in lk_row], mt, row, col, dot)
  if m_ref is not None:
    store_row(m_ref, i, [mt[i, j] for j in range(i + 1)])
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


def _intra_scores_by_slice(q_ref, k_ref, g_ref, b_ref, qg_ref, kg_ref,
                           ec_ref, bk, n_k, bounded, mm, g_min, causal,
                           rows=tuple(range(N_TILES))):
  """The intra kernel's score tiles with the K slices OUTSIDE the rows
  (INTRA_ORDER "slices"): one fori_loop over the slices, each computing b
  once for all 4 tiles and adding its part to all 10 tile pairs of Lk and
  Aqk (20 [16, 16] fp32 accumulators carried), where the "rows" order runs
  one loop over the slices per row tile and recomputes b of tiles 0..i
  (10 tile cumsums per slice instead of 4). Same products summed in the
  same slice order, same stores (`store_row_decays`): bit-identical.
  rows: the row tiles to compute (tuning.SCORE_GROUPS; b of tiles 0..max(rows)).
  Returns (lk, aqk): per row tile in `rows`, the i + 1 tiles j <= i
  (unmasked)."""
  n_b = max(rows) + 1

  def body(kk, acc):
    cols = k_slice(kk, bk)
    b, c, b_end = cumsum_tiles(g_ref, cols, n_b, g_min)
    k_t = [k_ref[tile_rows(t), cols].astype(F32) for t in range(n_b)]
    lk_acc, aqk_acc = acc
    new_lk, new_aqk = [], []
    for r, i in enumerate(rows):
      q_i = q_ref[tile_rows(i), cols].astype(F32)
      store_row_decays(i, cols, b, b_end, k_t, q_i, b_ref, qg_ref, kg_ref,
                        ec_ref)
      lk_s, aqk_s = row_slice_scores(i, [k_t[i], q_i], k_t, b, c, causal,
                                      bounded, mm)
      new_lk.append(tuple(a + p for a, p in zip(lk_acc[r], lk_s)))
      new_aqk.append(tuple(a + p for a, p in zip(aqk_acc[r], aqk_s)))
    return tuple(new_lk), tuple(new_aqk)

  zeros = tuple(tuple(jnp.zeros((TILE, TILE), F32) for _ in range(i + 1))
                for i in rows)
  return jax.lax.fori_loop(0, n_k, body, (zeros, zeros))


def _score_rows(q_ref, k_ref, g_ref, b_ref, qg_ref, kg_ref, ec_ref, *, bk,
                bounded, mm, g_min, order, rows=tuple(range(N_TILES))):
  """Row tiles i in `rows` (default 0..3) of Lk and Aqk, in order: yields
  (i, lk, aqk), each a list of the i + 1 [16, 16] fp32 tiles j <= i,
  masked (Lk strictly lower, Aqk inclusive). On the way it stores the
  decayed operands of those rows (b when b_ref is given, q exp(b); with row
  3, k exp(b_C - b) and exp(b_C); `store_row_decays`).

  order "rows": per row tile, a fori_loop over the K slices (not unrolled:
  unrolling the slices and the 10 tile pairs gave ~11k lines of TTIR and a
  2-6 min ptxas compile); only one row's 2 (i + 1) score tiles are live in
  the loop. "slices": `_intra_scores_by_slice`, all rows inside one loop.
  """
  row, col = tile_iota()
  causal, strict = row >= col, row > col
  n_k = k_ref.shape[-1] // bk
  if order == "slices":
    scores = _intra_scores_by_slice(q_ref, k_ref, g_ref, b_ref, qg_ref,
                                    kg_ref, ec_ref, bk, n_k, bounded, mm,
                                    g_min, causal, rows)
  for r, i in enumerate(rows):
    if order == "slices":
      lk, aqk = scores[0][r], scores[1][r]
    else:

      def row_body(kk, acc, i=i):
        cols = k_slice(kk, bk)
        # b, and the decayed operands of the state passes and the output
        # (q exp(b) here; k exp(b_C - b), exp(b_C) on the last row) stored.
        b, c, k_t, q_i = row_slice_operands(i, cols, q_ref, k_ref, g_ref,
                                             g_min, b_ref, qg_ref, kg_ref,
                                             ec_ref)
        lk_s, aqk_s = row_slice_scores(i, [k_t[i], q_i], k_t, b, c,
                                        causal, bounded, mm)
        return (tuple(a + p for a, p in zip(acc[0], lk_s)),
                tuple(a + p for a, p in zip(acc[1], aqk_s)))

      zeros = tuple(jnp.zeros((TILE, TILE), F32) for _ in range(i + 1))
      lk, aqk = jax.lax.fori_loop(0, n_k, row_body, (zeros, zeros))
    lk, aqk = list(lk), list(aqk)
    # where, not a product: masked overflow cannot leak.
    lk[i] = jnp.where(strict, lk[i], 0.0)
    aqk[i] = jnp.where(causal, aqk[i], 0.0)
    yield i, lk, aqk


def _store_w_u(mt, beta_t, k_ref, g_ref, v_ref, w_ref, u_ref, *, bk, bv, mm,
               g_min):
  """W = M (beta k exp(b)), slice by slice of K (b recomputed from g: the
  same bits as the stored b), and U = M (beta v) in blocks of bv columns
  (power-of-two loads), from the lower-triangular tiles mt of M."""

  def w_body(kk, carry):
    cols = k_slice(kk, bk)
    b, _, _ = cumsum_tiles(g_ref, cols, g_min=g_min)
    _store_lower_product(w_ref, cols, mt, [
        beta_t[j] * k_ref[tile_rows(j), cols].astype(F32) * jnp.exp(b[j])
        for j in range(N_TILES)], mm)
    return carry

  jax.lax.fori_loop(0, k_ref.shape[-1] // bk, w_body, 0)
  for cv in range(0, v_ref.shape[-1], bv):
    cols = pl.ds(cv, bv)
    _store_lower_product(u_ref, cols, mt, [
        beta_t[j] * v_ref[tile_rows(j), cols].astype(F32)
        for j in range(N_TILES)], mm)


def _intra_kernel(q_ref, k_ref, g_ref, beta_ref, v_ref, w_ref, u_ref,
                  aqk_ref, qg_ref, kg_ref, ec_ref, *grad_refs, bk, bv,
                  bounded, mm, g_min, inverse_dot="ieee", order="rows"):
  # q_ref, k_ref, g_ref, w_ref, qg_ref, kg_ref [C, Kp]; beta_ref [C];
  # v_ref, u_ref [C, V]; aqk_ref [C, C] (matmul dtype); ec_ref [Kp];
  # grad_refs: (b_ref [C, Kp] fp32, m_ref [C, C] matmul dtype, lk_ref
  # [C, C] fp32) when the backward needs them, else (). g_min: the bounded
  # path's clamp (g is clamped as it is loaded, cumsum_tiles) or None.
  # inverse_dot: the triangular inverse's fp32 dots (INVERSE_DOT); order:
  # the score loops' order (INTRA_ORDER).
  #
  # Row tile by row tile (`_score_rows`): row i of Lk and Aqk, then row i of
  # M by block forward substitution from the rows above; then W and U.
  row, col = tile_iota()
  beta_t = beta_tiles(beta_ref)
  b_ref, m_ref, lk_ref = grad_refs if grad_refs else (None, None, None)
  mt = {}
  for i, lk, aqk in _score_rows(q_ref, k_ref, g_ref, b_ref, qg_ref, kg_ref,
                                ec_ref, bk=bk, bounded=bounded, mm=mm,
                                g_min=g_min, order=order):
    store_row(aqk_ref, i, aqk)
    mt = _solve_row(i, lk, beta_t, mt, row, col, _f32_dot(inverse_dot),
                    m_ref)
    if lk_ref is not None:
      store_row(lk_ref, i, lk)
  _store_w_u(mt, beta_t, k_ref, g_ref, v_ref, w_ref, u_ref, bk=bk, bv=bv,
             mm=mm, g_min=g_min)


def _scores_kernel(q_ref, k_ref, g_ref, aqk_ref, qg_ref, kg_ref, ec_ref,
                   lk_ref, *b_refs, bk, bounded, mm, g_min, order="rows",
                   groups=(tuple(range(N_TILES)),)):
  # SOLVE_APART's first kernel: the intra kernel's scores and decay stores,
  # no inverse. q_ref, k_ref, g_ref, qg_ref, kg_ref [C, Kp]; aqk_ref [C, C]
  # (matmul dtype); lk_ref [C, C] fp32; ec_ref [Kp]; b_refs: (b_ref [C, Kp]
  # fp32,) when the backward needs it. groups (tuning.SCORE_GROUPS): the row tiles
  # of each program along the grid's 4th axis (one group: no such axis).
  b_ref = b_refs[0] if b_refs else None

  def run(rows):
    for i, lk, aqk in _score_rows(q_ref, k_ref, g_ref, b_ref, qg_ref, kg_ref,
                                  ec_ref, bk=bk, bounded=bounded, mm=mm,
                                  g_min=g_min, order=order, rows=rows):
      store_row(aqk_ref, i, aqk)
      store_row(lk_ref, i, lk)

  if len(groups) == 1:
    run(groups[0])
    return
  program = pl.program_id(3)
  for p, rows in enumerate(groups):
    pl.when(program == p)(functools.partial(run, rows))


def _solve_kernel(lk_ref, k_ref, g_ref, beta_ref, v_ref, w_ref, u_ref,
                  *m_refs, bk, bv, mm, g_min, inverse_dot="ieee"):
  # SOLVE_APART's second kernel: M = (I + diag(beta) Lk)^-1 from the stored
  # Lk, then W and U. lk_ref [C, C] fp32; k_ref, g_ref, w_ref [C, Kp];
  # beta_ref [C]; v_ref, u_ref [C, V]; m_refs: (m_ref [C, C] matmul dtype,)
  # when the backward needs it.
  row, col = tile_iota()
  beta_t = beta_tiles(beta_ref)
  mt = {}
  for i in range(N_TILES):
    mt = _solve_row(i, [square_tile(lk_ref, i, j) for j in range(i + 1)], beta_t,
                    mt, row, col, _f32_dot(inverse_dot),
                    m_refs[0] if m_refs else None)
  _store_w_u(mt, beta_t, k_ref, g_ref, v_ref, w_ref, u_ref, bk=bk, bv=bv,
             mm=mm, g_min=g_min)


def beta_spec():
  """Chunk n of beta [B, H, Tp]; grid (B, H, N[, j])."""
  return pl.BlockSpec((None, None, CHUNK), lambda b, h, n, *_: (b, h, n))


def intra_call(qp, kp_, gp, betap, vp, lay, bounded, interpret,
                for_backward=False, g_min=None, inverse_dot="ieee",
                intra_order="rows", solve_apart=False):
  """Kernel 1 (or 1a and 1b, SOLVE_APART). Returns [W, U, Aqk, qg, kg, ec]
  (+ [b, M, Lk] with for_backward): W, qg = q exp(b), kg = k exp(b_C - b)
  [B, Tp, H, Kp] and U [B, Tp, H, V] in the matmul dtype; b [B, Tp, H, Kp]
  fp32 (the within-chunk cumsum of g); ec = exp(b_C) [B, H, N, Kp] fp32;
  Aqk, M [B, H, Tp, C] in the matmul dtype and Lk [B, H, Tp, C] fp32 (lower
  triangular [C, C] per chunk). With g_min, g is clamped to it inside the
  kernel. inverse_dot (INVERSE_DOT) applies to bf16 inputs on the GPU; fp32
  inputs and interpret mode use IEEE. solve_apart (SOLVE_APART): the
  inverse, W and U in a second kernel that reads the first one's Lk."""
  kp, dv, mm = lay["kp"], lay["dv"], lay["mm"]
  inverse_dot = "ieee" if interpret or mm == F32 else inverse_dot
  grid = (lay["bsz"], lay["h"], lay["n_chunks"])
  square = shape_of(lay, "bsz", "h", "tp", "chunk", dtype=mm)
  lk_shape = shape_of(lay, "bsz", "h", "tp", "chunk")
  seq_k_mm = shape_of(lay, "bsz", "tp", "h", "kp", dtype=mm)
  seq_k = shape_of(lay, "bsz", "tp", "h", "kp")
  seq_v_mm = shape_of(lay, "bsz", "tp", "h", "dv", dtype=mm)
  ec_spec = pl.BlockSpec((None, None, None, kp),
                         lambda b, h, n, *_: (b, h, n, 0))
  ec_shape = shape_of(lay, "bsz", "h", "n_chunks", "kp")
  if not solve_apart:
    out_specs = [chunk_spec(kp), chunk_spec(dv), square_spec(),
                 chunk_spec(kp), chunk_spec(kp), ec_spec]
    out_shape = [seq_k_mm, seq_v_mm, square, seq_k_mm, seq_k_mm, ec_shape]
    if for_backward:
      out_specs += [chunk_spec(kp), square_spec(), square_spec()]
      out_shape += [seq_k, square, lk_shape]
    return pl.pallas_call(
        functools.partial(_intra_kernel, bk=lay["bk"], bv=lay["bv"],
                          bounded=bounded, mm=mm, g_min=g_min,
                          inverse_dot=inverse_dot, order=intra_order),
        grid=grid,
        in_specs=[chunk_spec(kp), chunk_spec(kp), chunk_spec(kp),
                  beta_spec(), chunk_spec(dv)],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=kernel_params("intra"),
        interpret=interpret,
        name="kda_chunk_intra",
    )(qp, kp_, gp, betap, vp)
  # Kernel 1a: Aqk, qg, kg, ec, Lk (+ b).
  out_specs = [square_spec(), chunk_spec(kp), chunk_spec(kp), ec_spec,
               square_spec()]
  out_shape = [square, seq_k_mm, seq_k_mm, ec_shape, lk_shape]
  if for_backward:
    out_specs.append(chunk_spec(kp))
    out_shape.append(seq_k)
  groups = tuning.SCORE_GROUPS
  scores = pl.pallas_call(
      functools.partial(_scores_kernel, bk=lay["bk"], bounded=bounded,
                        mm=mm, g_min=g_min, order=intra_order,
                        groups=groups),
      grid=grid + ((len(groups),) if len(groups) > 1 else ()),
      in_specs=[chunk_spec(kp)] * 3,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=kernel_params("intra"),
      interpret=interpret,
      name="kda_chunk_scores",
  )(qp, kp_, gp)
  aqk, qg, kg, ec, lk = scores[:5]
  # Kernel 1b: M (+ stored), W, U.
  out_specs = [chunk_spec(kp), chunk_spec(dv)]
  out_shape = [seq_k_mm, seq_v_mm]
  if for_backward:
    out_specs.append(square_spec())
    out_shape.append(square)
  solved = pl.pallas_call(
      functools.partial(_solve_kernel, bk=lay["bk"], bv=lay["bv"], mm=mm,
                        g_min=g_min, inverse_dot=inverse_dot),
      grid=grid,
      in_specs=[square_spec(), chunk_spec(kp), chunk_spec(kp),
                beta_spec(), chunk_spec(dv)],
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=kernel_params("solve"),
      interpret=interpret,
      name="kda_chunk_solve",
  )(lk, kp_, gp, betap, vp)
  out = [solved[0], solved[1], aqk, qg, kg, ec]
  if for_backward:
    out += [scores[5], solved[2], lk]
  return out
