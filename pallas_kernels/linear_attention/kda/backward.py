"""KDA's chunk-parallel backward kernels: dv_intra, grad_v and grad_k."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention.common.tiles import (
    CHUNK, N_TILES, TILE, F32, NN, NT, TN, block_v, chunk_spec, decay_tiles,
    mm_dot, pair_decay, shape_of, square_spec, square_tile, tile_iota, tile_rows)
from pallas_kernels.linear_attention.common.key_side import (
    end_terms, pull_key_side_grads, state_side_inputs, state_side_terms,
    store_key_side_grads, store_key_side_tile)
from pallas_kernels.linear_attention.kda import tuning
from pallas_kernels.linear_attention.kda.tuning import kernel_params
from pallas_kernels.linear_attention.kda.intra import beta_spec, beta_tiles


def _dvintra_kernel(aqk_ref, do_ref, out_ref, *, scale, mm):
  # aqk_ref [C, C]; do_ref, out_ref [C, BV]: scale Aqk^T dO, one dense dot.
  out_ref[...] = scale * mm_dot(aqk_ref[...], do_ref[...], TN, mm)


def _grad_v_kernel(m_ref, lk_ref, beta_ref, v_ref, do_ref, vn_ref, dvn_ref,
                   dv_ref, du_ref, da_ref, dlk_ref, dbeta_ref, *, scale, bv,
                   mm):
  # m_ref [C, C] (M, matmul dtype); lk_ref [C, C] fp32; beta_ref [C];
  # v_ref, do_ref, vn_ref (V'), dvn_ref (dV'), dv_ref [C, V]; du_ref (dU')
  # [C, V] matmul dtype; da_ref, dlk_ref [C, C] (matmul dtype bounded, fp32
  # unbounded); dbeta_ref [C] fp32 (the V-side part).
  # All of V is walked here in bv-column blocks, so dAqk and dL (sums over
  # V) are complete and the K-side kernel runs once per K slice.
  c = CHUNK
  row = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
  beta = jax.lax.broadcast_in_dim(beta_ref[...].astype(F32), (c, 1), (0,))
  m = m_ref[...]
  dl = da = dbeta = None
  for cv in range(0, v_ref.shape[-1], bv):
    cols = pl.ds(cv, bv)
    du = mm_dot(m, dvn_ref[:, cols], TN, mm)          # dU' = M^T dV'
    du_ref[:, cols] = du.astype(du_ref.dtype)
    dv_ref[:, cols] = (beta * du).astype(dv_ref.dtype)
    vn = vn_ref[:, cols]
    part_b = jnp.sum(du * v_ref[:, cols].astype(F32), axis=1)
    part_l = mm_dot(du, vn, NT, mm)
    part_a = mm_dot(do_ref[:, cols], vn, NT, mm)
    if dl is None:
      dbeta, dl, da = part_b, part_l, part_a
    else:
      dbeta, dl, da = dbeta + part_b, dl + part_l, da + part_a
  # dL = -strict(dU' V'^T), dLk = beta dL; dAqk = scale causal(dO V'^T).
  dl = -jnp.where(row > col, dl, 0.0)
  dbeta_ref[...] = dbeta + jnp.sum(dl * lk_ref[...], axis=1)
  dlk_ref[...] = (beta * dl).astype(dlk_ref.dtype)
  da_ref[...] = (scale * jnp.where(row >= col, da, 0.0)).astype(da_ref.dtype)


class _TileLoads:
  """Row tiles of a [C, w] ref, loaded where they are used (t -> [16, w]
  fp32): the streamed grad_k keeps no list of them live across the kernel."""

  def __init__(self, ref):
    self._ref = ref

  def __getitem__(self, t):
    return self._ref[tile_rows(t), :].astype(F32)


def _grad_k_kernel(*refs, scale, bv, bounded, mm, g_min, split, stream):
  # One K slice of one chunk. refs = (q, k, b, g, beta, dAqk, dLk, *side,
  # dq, dk, dg, dbeta):
  #   q_ref, k_ref, b_ref, g_ref (the caller's g, read only with g_min: the
  #   clamp's zero-gradient mask) [C, w]; beta_ref [C]; da_ref (dAqk),
  #   dlk_ref (dLk) [C, C] (matmul dtype bounded, fp32 unbounded);
  #   side: split=False: do_ref, du_ref (dU', matmul dtype), vn_ref (V')
  #   [C, V] and s_ref (state entering), dh_ref (grad of the state leaving)
  #   [w, V] in the matmul dtype; split=True: their contractions over V,
  #   dO S^T, dU' S^T, V' dH^T [C, w] and sum_v dH * S [w] (fp32, from
  #   `_state_side_kernel`);
  #   dq_ref, dk_ref [C, w] in q's and k's dtype (cast here, not by an XLA
  #   pass); dg_ref [C, w] fp32; dbeta_ref [C] fp32 (this slice's part).
  # stream=False: row tiles in order, q, k, b loaded once up front, every
  # tile's dq, dk, dL/db held until the end (4 x [16, w] fp32 each: with
  # the "-b" lists ~10 such lists live, 255 registers and spills at w=32).
  # stream=True: row tiles last first. Row tile i is the last to add to
  # the "-b" terms of tile i (they come from rows >= i), so after it tile
  # i is complete: its dq, dk, dg are stored at once (dg's reverse cumsum
  # runs last tile first anyway) and q, k, b are re-read per use from the
  # block (L1) instead of held. Same products; only the order in which the
  # "-b" terms are summed differs (fp32 rounding).
  (q_ref, k_ref, b_ref, g_ref, beta_ref, da_ref, dlk_ref), side = (
      refs[:7], refs[7:-4])
  dq_ref, dk_ref, dg_ref, dbeta_ref = refs[-4:]
  do_s, du_s, x_dh, dh_s = state_side_terms(side, split, bv, mm, delta=True)
  row, col = tile_iota()
  causal = row >= col
  beta_t = beta_tiles(beta_ref)
  w = q_ref.shape[-1]
  b, c, b_last = decay_tiles(b_ref, pl.ds(0, w))
  if stream:   # b's tile list is then used for b_last alone (dead loads)
    q_t, k_t, b = _TileLoads(q_ref), _TileLoads(k_ref), _TileLoads(b_ref)
  else:
    q_t = [q_ref[tile_rows(t), :].astype(F32) for t in range(N_TILES)]
    k_t = [k_ref[tile_rows(t), :].astype(F32) for t in range(N_TILES)]

  # dL/db = q dq + k (dk_+b - dk_-b), formed term by term: a tile pair's
  # contribution to the query side and to the key side is multiplied by the
  # SAME rounded dot operands (x_dec, y_dec in the matmul dtype), so that the
  # two sides cancel in the within-chunk reverse cumsum as exactly as they do
  # in exact arithmetic (q dq and k dk computed separately leave bf16-rounding
  # residues: bounded path, bf16, T=130, K=V=32: dg relative error 1.7e-2
  # instead of 4.0e-3).
  dq, dk_pos = [None] * N_TILES, [None] * N_TILES   # "+b" factors
  db_pos = [None] * N_TILES
  # "-b" factors, starting with the chunk-end terms (S_{n+1} through V').
  dk_neg, db_neg, d_end = end_terms(x_dh, dh_s, k_t, b, b_last)
  later = None   # streamed: the reverse cumsum of the tiles stored so far
  for i in (reversed(range(N_TILES)) if stream else range(N_TILES)):
    b_i, q_i, k_i = b[i], q_t[i], k_t[i]
    eb = jnp.exp(b_i)
    dq_i = scale * do_s(i) * eb                               # (q exp(b)) S
    d_rk = -du_s(i)                                           # dR_k rows
    k_eb = k_i * eb
    dbeta_ref[tile_rows(i)] = jnp.sum(d_rk * k_eb, axis=1)
    dk_i = beta_t[i] * d_rk * eb
    db_i = q_i * dq_i + beta_t[i] * d_rk * k_eb
    x_scale = jnp.exp(b_i - c[i])                             # <= 1
    q_dec = (q_i * x_scale).astype(mm)
    k_dec = (k_i * x_scale).astype(mm)
    acc_q = acc_k = None
    for j in range(i + 1):
      da, dlk = square_tile(da_ref, i, j), square_tile(dlk_ref, i, j)
      if j == i and not bounded:
        pd = pair_decay(b_i, causal)                         # [16, 16, w]
        pk = pd * k_i[None, :, :]
        p_q = jnp.sum(da[:, :, None] * pk, axis=1)
        p_k = jnp.sum(dlk[:, :, None] * pk, axis=1)
        p_n = jnp.sum(pd * (da[:, :, None] * q_i[:, None, :]
                            + dlk[:, :, None] * k_i[:, None, :]), axis=0)
        dq_i, dk_i = dq_i + p_q, dk_i + p_k
        db_i = db_i + q_i * p_q + k_i * p_k
        dk_neg[i] = dk_neg[i] + p_n
        db_neg[i] = db_neg[i] + k_i * p_n
        continue
      b_j, k_j = (b_i, k_i) if j == i else (b[j], k_t[j])
      y_scale = jnp.exp(c[i] - b_j)             # <= 1 off the diagonal
      y_dec = (k_j * y_scale).astype(mm)
      t_q = mm_dot(da, y_dec, NN, mm)
      t_k = mm_dot(dlk, y_dec, NN, mm)
      acc_q = t_q if acc_q is None else acc_q + t_q
      acc_k = t_k if acc_k is None else acc_k + t_k
      t_n = mm_dot(da, q_dec, TN, mm) + mm_dot(dlk, k_dec, TN, mm)
      dk_neg[j] = dk_neg[j] + t_n * y_scale
      db_neg[j] = db_neg[j] + t_n * y_dec.astype(F32)
    if acc_q is not None:
      dq_i = dq_i + acc_q * x_scale
      dk_i = dk_i + acc_k * x_scale
      db_i = db_i + acc_q * q_dec.astype(F32) + acc_k * k_dec.astype(F32)
    if stream:   # tile i is complete: store it and drop it
      later = store_key_side_tile(
          i, dq_i, dk_i + dk_neg[i], db_i - db_neg[i], d_end, later,
          dq_ref, dk_ref, dg_ref, g_ref, g_min)
      dk_neg[i] = db_neg[i] = None
    else:
      dq[i], dk_pos[i], db_pos[i] = dq_i, dk_i, db_i
  if not stream:
    store_key_side_grads(
        dq, [p + n for p, n in zip(dk_pos, dk_neg)],
        [p - n for p, n in zip(db_pos, db_neg)], d_end, dq_ref, dk_ref,
        dg_ref, g_ref, g_min)


def _grad_k_pull_kernel(*refs, scale, bv, bounded, mm, g_min, split):
  # grad_k in the "pull" order (`chunk_common._pull_key_side_grads`: the
  # row tiles last first in a fori_loop, each forming all of its own
  # gradients): same refs and outputs as `_grad_k_kernel`.
  (q_ref, k_ref, b_ref, g_ref, beta_ref, da_ref, dlk_ref), side = (
      refs[:7], refs[7:-4])
  dq_ref, dk_ref, dg_ref, dbeta_ref = refs[-4:]
  do_s, du_s, x_dh, dh_s = state_side_terms(side, split, bv, mm, delta=True)

  def row_terms(i, q_i, k_i, b_i):   # through S and the delta-rule rows
    beta_i = jax.lax.broadcast_in_dim(
        beta_ref[tile_rows(i)].astype(F32), (TILE, 1), (0,))
    eb = jnp.exp(b_i)
    dq_i = scale * do_s(i) * eb                               # (q exp(b)) S
    d_rk = -du_s(i)                                           # dR_k rows
    k_eb = k_i * eb
    dbeta_ref[tile_rows(i)] = jnp.sum(d_rk * k_eb, axis=1)
    return (dq_i, beta_i * d_rk * eb,
            q_i * dq_i + beta_i * d_rk * k_eb)

  pull_key_side_grads(row_terms, [(da_ref, False), (dlk_ref, True)], q_ref,
                       k_ref, b_ref, g_ref, x_dh, dh_s, dq_ref, dk_ref,
                       dg_ref, bounded=bounded, mm=mm, g_min=g_min)


def dvintra_call(aqk, dop, lay, scale, interpret):
  """scale Aqk^T dO [B, Tp, H, V] fp32: the state-independent part of dV'."""
  bv = lay["bv"]
  return pl.pallas_call(
      functools.partial(_dvintra_kernel, scale=scale, mm=lay["mm"]),
      grid=(lay["bsz"], lay["h"], lay["n_chunks"], lay["nv"]),
      in_specs=[square_spec(), chunk_spec(bv, True)],
      out_specs=chunk_spec(bv, True),
      out_shape=shape_of(lay, "bsz", "tp", "h", "dv"),
      compiler_params=kernel_params("dv_intra"),
      interpret=interpret,
      name="kda_chunk_dv_intra",
  )(aqk, dop)


def grad_v_call(m, lk, betap, vp, dop, v_new, dv_new, lay, scale, dtype,
                 bounded, interpret):
  """Per chunk, all of V: dv [B, Tp, H, V] in dtype; dU' [B, Tp, H, V] and,
  on the bounded path, dAqk, dLk [B, H, Tp, C] in the matmul dtype (fp32 on
  the unbounded path); the V-side part of dbeta [B, H, Tp] fp32.

  dU', dAqk and dLk are read only by grad_k, once per K slice. Its bounded
  path uses them only as dot operands, which mm_dot casts to the matmul dtype,
  so storing them in that dtype changes no bit and halves their traffic
  with bf16 inputs; the unbounded path's position-pair products need dAqk
  and dLk in fp32."""
  dv, mm = lay["dv"], lay["mm"]
  square_dtype = mm if bounded else F32
  return pl.pallas_call(
      functools.partial(_grad_v_kernel, scale=scale, bv=lay["bv"], mm=mm),
      grid=(lay["bsz"], lay["h"], lay["n_chunks"]),
      in_specs=[square_spec(), square_spec(), beta_spec()]
      + [chunk_spec(dv)] * 4,
      out_specs=[chunk_spec(dv), chunk_spec(dv), square_spec(),
                 square_spec(), beta_spec()],
      out_shape=[
          shape_of(lay, "bsz", "tp", "h", "dv", dtype=dtype),
          shape_of(lay, "bsz", "tp", "h", "dv", dtype=mm),
          shape_of(lay, "bsz", "h", "tp", "chunk", dtype=square_dtype),
          shape_of(lay, "bsz", "h", "tp", "chunk", dtype=square_dtype),
          shape_of(lay, "bsz", "h", "tp"),
      ],
      compiler_params=kernel_params("grad_v"),
      interpret=interpret,
      name="kda_chunk_grad_v",
  )(m, lk, betap, vp, dop, v_new, dv_new)


def grad_k_call(qp, kp_, bp, betap, dop, v_new, du, da, dlk, states,
                 dstates, lay, scale, bounded, interpret, gp=None, g_min=None,
                 split=False, order="held", block_k=None):
  """Per chunk and K slice: dq, dk [B, Tp, H, Kp] in q's and k's dtype, dg
  [B, Tp, H, Kp] fp32 and the slice's part of dbeta [K slices, B, H, Tp]
  fp32. With g_min, dg is zero where gp (the caller's g, padded) < g_min.
  split: the contractions over V (dO S^T, dU' S^T, V' dH^T, sum_v dH * S)
  run first in a kernel of their own (`_state_side_kernel`, dense dots),
  and grad_k reads them instead of redoing them per K slice. order: see
  GRAD_K_ORDER. block_k: grad_k's K slice width (None: lay["bk"])."""
  if g_min is None:
    gp = bp   # a placeholder: the kernel reads g only with g_min
  if block_k is not None:
    lay = dict(lay, bk=min(lay["kp"], block_k))
  bk, dv, nk = lay["bk"], lay["dv"], lay["kp"] // lay["bk"]
  kernel = (_grad_k_pull_kernel if order == "pull" else functools.partial(
      _grad_k_kernel, stream=order == "stream"))
  k_slice = chunk_spec(bk, True)
  side, side_specs = state_side_inputs(
      [dop, du, v_new], (False, False, True), states, dstates, lay, split,
      tuning.BLOCK_K_STATE_SIDE, tuning.NUM_WARPS["state_side"], interpret,
      "kda_chunk_state_side")
  return pl.pallas_call(
      functools.partial(kernel, scale=scale, bv=block_v(dv, cap=128),
                        bounded=bounded, mm=lay["mm"], g_min=g_min,
                        split=split),
      grid=(lay["bsz"], lay["h"], lay["n_chunks"], nk),
      in_specs=[k_slice] * 4 + [beta_spec(), square_spec(), square_spec()]
      + side_specs,
      out_specs=[k_slice, k_slice, k_slice,
                 pl.BlockSpec((None, None, None, CHUNK),
                              lambda b, h, n, j: (j, b, h, n))],
      out_shape=[shape_of(lay, "bsz", "tp", "h", "kp", dtype=qp.dtype),
                 shape_of(lay, "bsz", "tp", "h", "kp", dtype=kp_.dtype),
                 shape_of(lay, "bsz", "tp", "h", "kp"),
                 jax.ShapeDtypeStruct((nk, lay["bsz"], lay["h"], lay["tp"]),
                                      F32)],
      compiler_params=kernel_params("grad_k"),
      interpret=interpret,
      name="kda_chunk_grad_k",
  )(qp, kp_, bp, gp, betap, da, dlk, *side)
