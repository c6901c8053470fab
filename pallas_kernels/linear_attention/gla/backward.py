"""GLA's chunk-parallel backward kernels: dv (and dA) and grad_k."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention.common.tiles import (
    CHUNK, N_TILES, F32, NN, NT, TN, block_v, chunk_spec, decay_tiles, mm_dot,
    pair_decay, shape_of, square_spec, square_tile, tile_iota, tile_rows)
from pallas_kernels.linear_attention.common.key_side import (
    end_terms, pull_key_side_grads, state_side_inputs, state_side_terms,
    store_key_side_grads)
from pallas_kernels.linear_attention.gla.tuning import GRAD_K_BK_BOUNDED


def _dv_kernel(aqk_ref, kg_ref, v_ref, do_ref, dh_ref, dv_ref, da_ref, *,
               scale, bv, mm):
  # aqk_ref [C, C]; kg_ref (k exp(b_C - b)) [C, Kp]; v_ref, do_ref, dv_ref
  # [C, V]; dh_ref (grad of the state leaving) [Kp, V]; da_ref [C, C]
  # (matmul dtype bounded, fp32 unbounded). All of V is walked here, so dA
  # (a sum over V) is complete and grad_k runs once per K slice.
  c = CHUNK
  row = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
  a, kg = aqk_ref[...], kg_ref[...]
  da = None
  for cv in range(0, v_ref.shape[-1], bv):
    cols = pl.ds(cv, bv)
    do = do_ref[:, cols]
    dv = scale * mm_dot(a, do, TN, mm) + mm_dot(kg, dh_ref[:, cols], NN, mm)
    dv_ref[:, cols] = dv.astype(dv_ref.dtype)
    part = mm_dot(do, v_ref[:, cols], NT, mm)
    da = part if da is None else da + part
  da_ref[...] = (scale * jnp.where(row >= col, da, 0.0)).astype(da_ref.dtype)


def _grad_k_kernel(*refs, scale, bv, bounded, mm, g_min, split):
  # One K slice of one chunk. refs = (q, k, b, g, dA, *side, dq, dk, dg):
  #   q_ref, k_ref, b_ref, g_ref (the caller's g, read only with g_min: the
  #   clamp's mask) [C, w]; da_ref (dA, scale included) [C, C];
  #   side: split=False: do_ref, v_ref [C, V] and s_ref (state entering),
  #   dh_ref (grad of the state leaving) [w, V] in the matmul dtype;
  #   split=True: dO S^T, v dH^T [C, w] and sum_v dH * S [w] (fp32, from
  #   chunk_common's `_state_side_kernel`);
  #   dq_ref, dk_ref [C, w] in q's and k's dtype; dg_ref [C, w] fp32.
  (q_ref, k_ref, b_ref, g_ref, da_ref), side = refs[:5], refs[5:-3]
  dq_ref, dk_ref, dg_ref = refs[-3:]
  do_s, _, x_dh, dh_s = state_side_terms(side, split, bv, mm, delta=False)
  row, col = tile_iota()
  causal = row >= col
  w = q_ref.shape[-1]
  b, c, b_last = decay_tiles(b_ref, pl.ds(0, w))
  q_t = [q_ref[tile_rows(t), :].astype(F32) for t in range(N_TILES)]
  k_t = [k_ref[tile_rows(t), :].astype(F32) for t in range(N_TILES)]
  # "-b" factors (the key side, k exp(-b)), starting with the chunk-end
  # terms through S_{n+1}; then "+b" factors (the query side) row by row.
  dk, db_neg, d_end = end_terms(x_dh, dh_s, k_t, b, b_last)
  dq, db_pos = [None] * N_TILES, [None] * N_TILES
  for i in range(N_TILES):
    dq_i = scale * do_s(i) * jnp.exp(b[i])
    db_i = q_t[i] * dq_i
    x_scale = jnp.exp(b[i] - c[i])                            # <= 1
    q_dec = (q_t[i] * x_scale).astype(mm)
    acc = None
    for j in range(i + 1):
      da = square_tile(da_ref, i, j)
      if j == i and not bounded:
        pd = pair_decay(b[i], causal)                        # [16, 16, w]
        p_q = jnp.sum(da[:, :, None] * (pd * k_t[i][None, :, :]), axis=1)
        p_k = jnp.sum(pd * (da[:, :, None] * q_t[i][:, None, :]), axis=0)
        dq_i = dq_i + p_q
        db_i = db_i + q_t[i] * p_q
        dk[i] = dk[i] + p_k
        db_neg[i] = db_neg[i] + k_t[i] * p_k
        continue
      y_scale = jnp.exp(c[i] - b[j])            # <= 1 off the diagonal
      y_dec = (k_t[j] * y_scale).astype(mm)
      t_q = mm_dot(da, y_dec, NN, mm)
      acc = t_q if acc is None else acc + t_q
      t_k = mm_dot(da, q_dec, TN, mm)
      dk[j] = dk[j] + t_k * y_scale
      db_neg[j] = db_neg[j] + t_k * y_dec.astype(F32)
    if acc is not None:
      dq_i = dq_i + acc * x_scale
      db_i = db_i + acc * q_dec.astype(F32)
    dq[i], db_pos[i] = dq_i, db_i
  store_key_side_grads(dq, dk, [p - n for p, n in zip(db_pos, db_neg)],
                        d_end, dq_ref, dk_ref, dg_ref, g_ref, g_min)


def _grad_k_pull_kernel(*refs, scale, bv, bounded, mm, g_min, split):
  # grad_k in the "pull" order (`chunk_common._pull_key_side_grads`): same
  # refs and outputs as `_grad_k_kernel`.
  (q_ref, k_ref, b_ref, g_ref, da_ref), side = refs[:5], refs[5:-3]
  dq_ref, dk_ref, dg_ref = refs[-3:]
  do_s, _, x_dh, dh_s = state_side_terms(side, split, bv, mm, delta=False)

  def row_terms(i, q_i, k_i, b_i):   # through S: (q exp(b)) S
    del k_i
    dq_i = scale * do_s(i) * jnp.exp(b_i)
    return dq_i, jnp.zeros_like(dq_i), q_i * dq_i

  pull_key_side_grads(row_terms, [(da_ref, False)], q_ref, k_ref, b_ref,
                       g_ref, x_dh, dh_s, dq_ref, dk_ref, dg_ref,
                       bounded=bounded, mm=mm, g_min=g_min)


def dv_call(aqk, kg, vp, dop, dstates, lay, scale, dtype, bounded, tune,
             interpret):
  """Kernel 5: dv [B, Tp, H, V] in dtype and dA [B, H, Tp, C] (matmul dtype
  on the bounded path, where grad_k uses it only as a dot operand; fp32 on
  the unbounded path's position pairs)."""
  kp, dv, mm = lay["kp"], lay["dv"], lay["mm"]
  return pl.pallas_call(
      functools.partial(_dv_kernel, scale=scale, bv=lay["bv"], mm=mm),
      grid=(lay["bsz"], lay["h"], lay["n_chunks"]),
      in_specs=[square_spec(), chunk_spec(kp), chunk_spec(dv),
                chunk_spec(dv),
                pl.BlockSpec((None, None, None, kp, dv),
                             lambda b, h, n: (b, h, n, 0, 0))],
      out_specs=[chunk_spec(dv), square_spec()],
      out_shape=[shape_of(lay, "bsz", "tp", "h", "dv", dtype=dtype),
                 shape_of(lay, "bsz", "h", "tp", "chunk",
                           dtype=mm if bounded else F32)],
      compiler_params=tune.params("dv"),
      interpret=interpret,
      name="gla_chunk_dv",
  )(aqk, kg, vp, dop, dstates)


def grad_k_call(qp, kp_, bp, gp, dop, vp, da, states, dstates, lay, scale,
                 bounded, g_min, tune, interpret):
  """Kernel 6: dq, dk [B, Tp, H, Kp] in q's and k's dtype, dg fp32. With
  g_min, dg is zero where gp (the caller's g, padded) < g_min; without it gp
  may be None (it is not read). With tune.split_grad_k the contractions
  over V run first in chunk_common's state-side kernel."""
  if g_min is None:
    gp = bp   # a placeholder: the kernel reads g only with g_min
  grad_bk = tune.grad_k_bk
  if grad_bk is None and bounded:
    grad_bk = GRAD_K_BK_BOUNDED
  if grad_bk is not None:
    lay = dict(lay, bk=min(lay["kp"], grad_bk))
  bk, dv = lay["bk"], lay["dv"]
  kernel = (_grad_k_pull_kernel if tune.grad_k_order == "pull" else
            _grad_k_kernel)
  k_slice = chunk_spec(bk, True)
  side, side_specs = state_side_inputs(
      [dop, vp], (False, True), states, dstates, lay, tune.split_grad_k,
      tune.state_side_bk, tune.state_side_warps, interpret,
      "gla_chunk_state_side")
  return pl.pallas_call(
      functools.partial(kernel, scale=scale,
                        bv=block_v(dv, tune.grad_bv), bounded=bounded,
                        mm=lay["mm"], g_min=g_min, split=tune.split_grad_k),
      grid=(lay["bsz"], lay["h"], lay["n_chunks"], lay["kp"] // bk),
      in_specs=[k_slice] * 4 + [square_spec()] + side_specs,
      out_specs=[k_slice] * 3,
      out_shape=[shape_of(lay, "bsz", "tp", "h", "kp", dtype=qp.dtype),
                 shape_of(lay, "bsz", "tp", "h", "kp", dtype=kp_.dtype),
                 shape_of(lay, "bsz", "tp", "h", "kp")],
      compiler_params=tune.params("grad_k"),
      interpret=interpret,
      name="gla_chunk_grad_k",
  )(qp, kp_, bp, gp, da, *side)
