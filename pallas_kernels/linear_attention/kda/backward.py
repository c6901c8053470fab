"""KDA's chunk-parallel backward kernels (the reverse state pass is in
passes.py), in the order the backward runs them:

  4. `_dvintra_kernel`, grid (B, H, N, V/bv): scale Aqk^T dO [C, bv], the
     state-independent part of dV', one dense dot;
  6. `_grad_v_kernel`, grid (B, H, N), walking all of V in blocks: dU' =
     M^T dV', dv = beta dU', dL = -strict_lower(dU' V'^T) and dAqk = scale
     causal(dO V'^T) (complete sums over V, stored [B, H, T, C] with dLk =
     beta dL) and the V-side terms of dbeta;
  7. `_grad_k_kernel`, grid (B, H, N, K/grad_k_bk): one K slice of dq, dk,
     dg and that slice's dbeta term, from the stored dAqk, dLk, dU', V', S
     and dH (the contractions over V done inside), each slice computed once.
     The row tiles run last first in a fori_loop, each pulling its own "+b"
     and "-b" terms and storing at once (common/key_side.py); dg is the
     within-chunk reverse cumsum of dL/db (64 terms: no rounding growth
     over T), zero below g_min on the bounded path.
dU', dAqk and dLk are stored in the matmul dtype on the bounded path
(grad_k uses them only as dot operands, cast to that dtype anyway: the same
bits at half the traffic), in fp32 on the unbounded path, whose
position-pair products need them so.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention.common.documents import (
    document_spec, with_documents)
from pallas_kernels.linear_attention.common.key_side import (
    pull_key_side_grads, state_side_inputs, state_side_terms)
from pallas_kernels.linear_attention.common.tiles import (
    CHUNK, TILE, F32, NT, TN, block_v, chunk_spec, mm_dot, shape_of,
    square_spec, tile_rows)
from pallas_kernels.linear_attention.kda.intra import beta_spec


def _dvintra_kernel(aqk_ref, do_ref, out_ref, *, scale, mm):
  # aqk_ref [C, C]; do_ref, out_ref [C, BV]: scale Aqk^T dO, one dense dot.
  out_ref[...] = scale * mm_dot(aqk_ref[...], do_ref[...], TN, mm)


def _grad_v_kernel(m_ref, lk_ref, beta_ref, v_ref, do_ref, vn_ref, dvn_ref,
                   dv_ref, du_ref, da_ref, dlk_ref, dbeta_ref, *, scale, bv,
                   mm, docs=None):
  # m_ref [C, C] (M, matmul dtype); lk_ref [C, C] fp32; beta_ref [C];
  # v_ref, do_ref, vn_ref (V'), dvn_ref (dV'), dv_ref [C, V]; du_ref (dU')
  # [C, V] matmul dtype; da_ref, dlk_ref [C, C] (matmul dtype bounded, fp32
  # unbounded); dbeta_ref [C] fp32 (the V-side part). docs: packed
  # documents (common.documents.ChunkDocuments) or None.
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
  # dL = -strict(dU' V'^T), dLk = beta dL; dAqk = scale causal(dO V'^T);
  # packed: on the pairs of one document only (those L and Aqk hold).
  same = None if docs is None else docs.same_chunk()
  pairs = lambda mask: mask if same is None else mask & same  # noqa: E731
  dl = -jnp.where(pairs(row > col), dl, 0.0)
  dbeta_ref[...] = dbeta + jnp.sum(dl * lk_ref[...], axis=1)
  dlk_ref[...] = (beta * dl).astype(dlk_ref.dtype)
  da_ref[...] = (scale * jnp.where(pairs(row >= col), da, 0.0)).astype(
      da_ref.dtype)


def _grad_k_kernel(q_ref, k_ref, b_ref, g_ref, beta_ref, da_ref, dlk_ref,
                   do_ref, du_ref, vn_ref, s_ref, dh_ref, dq_ref, dk_ref,
                   dg_ref, dbeta_ref, *, scale, bv, bounded, mm, g_min,
                   docs=None):
  # One K slice of one chunk:
  #   q_ref, k_ref, b_ref, g_ref (the caller's g, read only with g_min: the
  #   clamp's zero-gradient mask) [C, w]; beta_ref [C]; da_ref (dAqk),
  #   dlk_ref (dLk) [C, C] (matmul dtype bounded, fp32 unbounded); do_ref,
  #   du_ref (dU', matmul dtype), vn_ref (V') [C, V]; s_ref (state entering),
  #   dh_ref (grad of the state leaving) [w, V] in the matmul dtype;
  #   dq_ref, dk_ref [C, w] in q's and k's dtype (cast here, not by an XLA
  #   pass); dg_ref [C, w] fp32; dbeta_ref [C] fp32 (this slice's part).
  #   docs: packed documents (common.documents.ChunkDocuments) or None.
  do_s, du_s, x_dh, dh_s = state_side_terms(
      (do_ref, du_ref, vn_ref, s_ref, dh_ref), bv, mm, delta=True)
  if docs is not None:
    # The forward's masks on q exp(b) and W's rows (reads state), k exp(b_C
    # - b) (in last) and exp(b_C) (keeps state), on their gradient terms.
    do_s, du_s, x_dh = (
        (lambda t, f=f, m=m: jnp.where(m(t), f(t), 0.0))
        for f, m in ((do_s, docs.reads_state), (du_s, docs.reads_state),
                     (x_dh, docs.in_last)))
    dh_s = jnp.where(docs.keeps_state(), dh_s, 0.0)

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


def dvintra_call(aqk, dop, lay, scale, tune, interpret):
  """scale Aqk^T dO [B, Tp, H, V] fp32: the state-independent part of dV'."""
  bv = lay["bv"]
  return pl.pallas_call(
      functools.partial(_dvintra_kernel, scale=scale, mm=lay["mm"]),
      grid=(lay["bsz"], lay["h"], lay["n_chunks"], lay["nv"]),
      in_specs=[square_spec(), chunk_spec(bv, True)],
      out_specs=chunk_spec(bv, True),
      out_shape=shape_of(lay, "bsz", "tp", "h", "dv"),
      compiler_params=tune.params("dv_intra"),
      interpret=interpret,
      name="kda_chunk_dv_intra",
  )(aqk, dop)


def grad_v_call(m, lk, betap, vp, dop, v_new, dv_new, lay, scale, dtype,
                bounded, tune, interpret, docs=None):
  """Per chunk, all of V: dv [B, Tp, H, V] in dtype; dU' [B, Tp, H, V] and,
  on the bounded path, dAqk, dLk [B, H, Tp, C] in the matmul dtype (fp32 on
  the unbounded path); the V-side part of dbeta [B, H, Tp] fp32. docs: None
  or the [B, Tp] document index of packed documents (common/documents.py).
  """
  dv, mm = lay["dv"], lay["mm"]
  square_dtype = mm if bounded else F32
  kernel, doc_in, doc_specs = _grad_v_kernel, [], []
  if docs is not None:
    kernel = with_documents(_grad_v_kernel, 7)
    doc_in, doc_specs = [docs], [document_spec()]
  return pl.pallas_call(
      functools.partial(kernel, scale=scale, bv=lay["bv"], mm=mm),
      grid=(lay["bsz"], lay["h"], lay["n_chunks"]),
      in_specs=[square_spec(), square_spec(), beta_spec()]
      + [chunk_spec(dv)] * 4 + doc_specs,
      out_specs=[chunk_spec(dv), chunk_spec(dv), square_spec(),
                 square_spec(), beta_spec()],
      out_shape=[
          shape_of(lay, "bsz", "tp", "h", "dv", dtype=dtype),
          shape_of(lay, "bsz", "tp", "h", "dv", dtype=mm),
          shape_of(lay, "bsz", "h", "tp", "chunk", dtype=square_dtype),
          shape_of(lay, "bsz", "h", "tp", "chunk", dtype=square_dtype),
          shape_of(lay, "bsz", "h", "tp"),
      ],
      compiler_params=tune.params("grad_v"),
      interpret=interpret,
      name="kda_chunk_grad_v",
  )(m, lk, betap, vp, dop, v_new, dv_new, *doc_in)


def grad_k_call(qp, kp_, bp, betap, dop, v_new, du, da, dlk, states,
                dstates, lay, scale, bounded, tune, interpret, gp=None,
                g_min=None, block_k=None, docs=None):
  """Per chunk and K slice: dq, dk [B, Tp, H, Kp] in q's and k's dtype, dg
  [B, Tp, H, Kp] fp32 and the slice's part of dbeta [K slices, B, H, Tp]
  fp32. With g_min, dg is zero where gp (the caller's g, padded) < g_min.
  block_k: grad_k's K slice width (None: lay["bk"]). docs: None or the
  [B, Tp] document index of packed documents (common/documents.py)."""
  if g_min is None:
    gp = bp   # a placeholder: the kernel reads g only with g_min
  if block_k is not None:
    lay = dict(lay, bk=min(lay["kp"], block_k))
  bk, dv, nk = lay["bk"], lay["dv"], lay["kp"] // lay["bk"]
  k_block = chunk_spec(bk, True)
  side, side_specs = state_side_inputs([dop, du, v_new], states, dstates,
                                       lay)
  kernel = _grad_k_kernel
  if docs is not None:
    kernel = with_documents(_grad_k_kernel, 7 + len(side))
    side, side_specs = side + [docs], side_specs + [document_spec()]
  return pl.pallas_call(
      functools.partial(kernel, scale=scale,
                        bv=block_v(dv, cap=tune.grad_bv), bounded=bounded,
                        mm=lay["mm"], g_min=g_min),
      grid=(lay["bsz"], lay["h"], lay["n_chunks"], nk),
      in_specs=[k_block] * 4 + [beta_spec(), square_spec(), square_spec()]
      + side_specs,
      out_specs=[k_block, k_block, k_block,
                 pl.BlockSpec((None, None, None, CHUNK),
                              lambda b, h, n, j: (j, b, h, n))],
      out_shape=[shape_of(lay, "bsz", "tp", "h", "kp", dtype=qp.dtype),
                 shape_of(lay, "bsz", "tp", "h", "kp", dtype=kp_.dtype),
                 shape_of(lay, "bsz", "tp", "h", "kp"),
                 jax.ShapeDtypeStruct((nk, lay["bsz"], lay["h"], lay["tp"]),
                                      F32)],
      compiler_params=tune.params("grad_k"),
      interpret=interpret,
      name="kda_chunk_grad_k",
  )(qp, kp_, bp, gp, betap, da, dlk, *side)
