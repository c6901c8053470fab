"""The key-side gradient pieces of the GLA and KDA grad_k kernels.

One K slice of one chunk. dL/db is formed term by term, "+b" terms (the
query side, q exp(b)) minus "-b" terms (the key side, k exp(-b)), and dg is
its within-chunk reverse cumsum. Each tile pair's product is formed with the
same rounded operands on its query and key sides, so that the two cancel in
dg's cumsum as in exact arithmetic (q dq and k dk computed apart leave
bf16-rounding residues: dg error 1.7e-2 instead of 4.0e-3 at T=130,
K=V=32). The pieces: the contractions over V (`state_side_terms`), the row
tiles pulling their own terms (`pull_key_side_grads`) and the stores
(`store_key_side_tile`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention.common.tiles import (
    N_TILES, TILE, F32, NN, NT, TN, chunk_spec, mm_dot, pair_decay,
    square_tile, tile_iota, tile_rows)


def _v_dot(x_ref, y_ref, t, *, bv, mm):
  """x[tile t] @ y^T over all of V in bv-column blocks: [16, V] x [w, V] ->
  [16, w] fp32."""
  acc = None
  for cv in range(0, x_ref.shape[-1], bv):
    cols = pl.ds(cv, bv)
    part = mm_dot(x_ref[tile_rows(t), cols], y_ref[:, cols], NT, mm)
    acc = part if acc is None else acc + part
  return acc


def _dh_dot_s(dh_ref, s_ref, bv):
  """sum_v dH * S [w] fp32 for state slices dh_ref, s_ref [w, V]."""
  acc = None
  for cv in range(0, dh_ref.shape[-1], bv):
    cols = pl.ds(cv, bv)
    part = jnp.sum(dh_ref[:, cols].astype(F32) * s_ref[:, cols].astype(F32),
                   axis=1)
    acc = part if acc is None else acc + part
  return acc


def state_side_terms(refs, bv, mm, delta):
  """The state-side inputs of grad_k for one K slice, as functions of the
  row tile: (dO S^T, dU' S^T (KDA only, else None), X dH^T) and
  sum_v dH * S [w], contracted over V here in bv-column blocks.

  refs = (do, [du,] x, s, dh): do, du, x [C, V] (GLA: x = v; KDA: x = V'),
  s (the state entering), dh (the grad of the state leaving) [w, V].
  """
  if delta:
    do_ref, du_ref, x_ref, s_ref, dh_ref = refs
  else:
    (do_ref, x_ref, s_ref, dh_ref), du_ref = refs, None
  v_dot = functools.partial(_v_dot, bv=bv, mm=mm)
  return (lambda t: v_dot(do_ref, s_ref, t),
          (lambda t: v_dot(du_ref, s_ref, t)) if delta else None,
          lambda t: v_dot(x_ref, dh_ref, t),
          _dh_dot_s(dh_ref, s_ref, bv))


def state_side_inputs(xs, states, dstates, lay):
  """grad_k's state-side inputs and their block specs (grid (B, H, N, K
  slice j)), in the order `state_side_terms` unpacks them: xs, the [B, Tp,
  H, V] arrays contracted over V (KDA: dO, dU', V'; GLA: dO, v), then the
  states and dstates [B, H, N, Kp, V], one K slice of each."""
  bk, dv = lay["bk"], lay["dv"]
  state_slice = pl.BlockSpec((None, None, None, bk, dv),
                             lambda b, h, n, j: (b, h, n, j, 0))
  return (list(xs) + [states, dstates],
          [chunk_spec(dv)] * len(xs) + [state_slice] * 2)


def pull_key_side_grads(row_terms, pairs, q_ref, k_ref, b_ref, g_ref,
                        x_dh, dh_s, dq_ref, dk_ref, dg_ref, *, bounded, mm,
                         g_min):
  """dq, dk and dg of one K slice, each row tile PULLING its own terms.

  The key-side grads of GLA and KDA (their `grad_k` kernels). The row
  tiles run last first in a fori_loop; tile i forms its "+b" terms from the
  key tiles j <= i and its "-b" terms from the query tiles m >= i in inner
  fori_loops and stores dq, dk, dg at once: only the reverse cumsum's
  running row is carried across tiles, so the live set is one tile's (which
  keeps grad_k within its registers; holding every tile's results to the
  end spilled).

  row_terms(i, q_i, k_i, b_i) -> (dq_i, dk_i, db_i) [16, w] fp32: row tile
  i's terms through the state (and KDA's delta-rule rows); it may store
  per-row outputs itself.
  pairs: [(mat_ref, is_k)]: the [C, C] gradients of the chunk's score
  matrices, each with the operand on its query side, q (is_k False) or k:
  GLA [(dA, False)], KDA [(dAqk, False), (dLk, True)]. A pair's "+b" term
  goes to that operand's gradient, its "-b" term to dk.
  q_ref, k_ref, b_ref (b: the within-chunk cumsum the intra kernel stored),
  g_ref (the caller's g, read with g_min only) [C, w]; x_dh(t) -> (X dH^T)
  [tile t] and dh_s [w] as `state_side_terms` returns them.
  """
  w = q_ref.shape[-1]
  tile_row = jax.lax.broadcasted_iota(jnp.int32, (TILE, w), 0)
  b_last = jnp.sum(jnp.where(tile_row == TILE - 1,
                             b_ref[tile_rows(N_TILES - 1), :], 0.0), axis=0)
  row, col = tile_iota()
  causal = row >= col

  def load(ref, t):
    return ref[tile_rows(t), :].astype(F32)

  def anchor(t):   # b at the first row of tile t [1, w]
    return b_ref[pl.ds(t * TILE, 1), :].astype(F32)

  def end_term(t):   # (X dH^T) exp(b_C - b) on row tile t [16, w]
    return x_dh(t) * jnp.exp(b_last[None, :] - load(b_ref, t))

  def end_sum(t, acc):
    return acc + jnp.sum(load(k_ref, t) * end_term(t), axis=0)

  # d/db_C, needed before the last tile is stored: sum_v dH * S_{n+1} =
  # exp(b_C) sum_v dH * S_n + sum_c k_c exp(b_C - b_c) (X dH^T)_c, from the
  # chunk-end terms (no S_{n+1} read). They run once here for their column
  # sums and again per tile (same code: same fp32 products).
  d_end = jax.lax.fori_loop(0, N_TILES, end_sum, jnp.zeros((w,), F32))
  d_end = d_end + jnp.exp(b_last) * dh_s

  def decayed(t):   # the query-side operands of tile t: x exp(b - anchor)
    x_scale = jnp.exp(load(b_ref, t) - anchor(t))             # <= 1
    return [(load(k_ref if is_k else q_ref, t) * x_scale).astype(mm)
            for _, is_k in pairs], x_scale

  def row_tile(it, later):
    i = N_TILES - 1 - it
    b_i, q_i, k_i = load(b_ref, i), load(q_ref, i), load(k_ref, i)
    c_i = anchor(i)
    dq_i, dk_i, db_i = row_terms(i, q_i, k_i, b_i)
    t_end = end_term(i)
    dk_neg, db_neg = t_end, k_i * t_end
    x_dec, x_scale = decayed(i)
    n_dense = i + 1 if bounded else i   # unbounded: diagonal pair by pair

    def plus_b(j, accs):   # key tile j <= i: mat_ij (k_j exp(c_i - b_j))
      y_dec = (load(k_ref, j) * jnp.exp(c_i - load(b_ref, j))).astype(mm)
      return tuple(a + mm_dot(square_tile(m, i, j), y_dec, NN, mm)
                   for a, (m, _) in zip(accs, pairs))

    zeros = tuple(jnp.zeros((TILE, w), F32) for _ in pairs)
    accs = jax.lax.fori_loop(0, n_dense, plus_b, zeros)
    for acc, xd, (_, is_k) in zip(accs, x_dec, pairs):
      if is_k:
        dk_i = dk_i + acc * x_scale
      else:
        dq_i = dq_i + acc * x_scale
      db_i = db_i + acc * xd.astype(F32)

    def minus_b(m, acc):   # query tile m >= i: the pair (m, i)'s key side
      dk_n, db_n = acc
      x_dec_m, _ = decayed(m)
      t_n = None
      for xd, (mat, _) in zip(x_dec_m, pairs):
        part = mm_dot(square_tile(mat, m, i), xd, TN, mm)
        t_n = part if t_n is None else t_n + part
      y_scale = jnp.exp(anchor(m) - b_i)        # <= 1 off the diagonal
      y_dec = (k_i * y_scale).astype(mm)
      return dk_n + t_n * y_scale, db_n + t_n * y_dec.astype(F32)

    dk_neg, db_neg = jax.lax.fori_loop(i if bounded else i + 1, N_TILES,
                                       minus_b, (dk_neg, db_neg))
    if not bounded:   # the diagonal pair, position by position
      pd = pair_decay(b_i, causal)                           # [16, 16, w]
      pk = pd * k_i[None, :, :]
      mix = None
      for mat, is_k in pairs:
        m_ii = square_tile(mat, i, i)
        x_i = k_i if is_k else q_i
        p_x = jnp.sum(m_ii[:, :, None] * pk, axis=1)
        if is_k:
          dk_i = dk_i + p_x
        else:
          dq_i = dq_i + p_x
        db_i = db_i + x_i * p_x
        part = m_ii[:, :, None] * x_i[:, None, :]
        mix = part if mix is None else mix + part
      p_n = jnp.sum(pd * mix, axis=0)
      dk_neg, db_neg = dk_neg + p_n, db_neg + k_i * p_n
    # d_end enters at the chunk's last row, so every row's reverse sum
    # holds it: `later` starts at d_end (and the store adds no d_end).
    return store_key_side_tile(i, dq_i, dk_i + dk_neg, db_i - db_neg, None,
                               later, dq_ref, dk_ref, dg_ref, g_ref, g_min)

  jax.lax.fori_loop(0, N_TILES, row_tile, d_end)


def store_key_side_tile(i, dq_i, dk_i, db_i, d_end, later, dq_ref, dk_ref,
                        dg_ref, g_ref, g_min):
  """Stores row tile i of dq, dk (in their refs' dtypes) and dg; tiles go
  last first (i = 3, 2, 1, 0).

  dq_i, dk_i, db_i [16, w] fp32 (db = dL/db without the chunk-end term);
  d_end [w] (added at the chunk's last row; None when `later` already
  holds it, as in the pull order, where i may be traced); later [w]: the
  sum of dL/db over the tiles after i (None for the last tile). Returns it
  for tile i - 1. dg is the within-chunk reverse cumsum of dL/db: inside a
  tile one fp32 dot with the upper-triangular ones (row r sums rows r..15,
  each sum on its own, like XLA's windowed cumsum), plus `later` (row 0 of
  the previous tile's result, taken as a masked sum: exact). With g_min, dg is
  zero where g_ref (the caller's g) < g_min: the clamp's gradient, applied
  after the cumsum, which runs over the clamped g' the op was computed on.
  """
  row, col = tile_iota()
  upper = jnp.where(col >= row, 1.0, 0.0).astype(F32)
  tile_row = jax.lax.broadcasted_iota(jnp.int32, dq_i.shape, 0)
  dq_ref[tile_rows(i), :] = dq_i.astype(dq_ref.dtype)
  dk_ref[tile_rows(i), :] = dk_i.astype(dk_ref.dtype)
  if d_end is not None and i == N_TILES - 1:
    db_i = db_i + jnp.where(tile_row == TILE - 1, d_end[None, :], 0.0)
  dg_i = mm_dot(upper, db_i)
  if later is not None:
    dg_i = dg_i + later[None, :]
  later = jnp.sum(jnp.where(tile_row == 0, dg_i, 0.0), axis=0)
  if g_min is not None:
    dg_i = jnp.where(g_ref[tile_rows(i), :] < g_min, 0.0, dg_i)
  dg_ref[tile_rows(i), :] = dg_i
  return later
