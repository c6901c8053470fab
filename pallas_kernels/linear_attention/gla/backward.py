"""GLA's chunk-parallel backward kernels (the reverse state pass is in
passes.py):

  5. `_dv_kernel`, grid (B, H, N), walking V in blocks:
       dv = scale A^T dO + (k exp(b_C - b)) dH_n,
       dA = scale causal(dO v^T)  (complete over V, stored [B, H, T, C]);
  6. `_grad_k_kernel`, grid (B, H, N, K/bk), parallel, one K slice:
       dq = scale (dO S^T) exp(b) + [dA through A's query side],
       dk = [dA through A's key side] + (v dH^T) exp(b_C - b),
       dL/db = q dq - k dk (term by term, "+b" minus "-b" factors) plus
       sum_v dH * S_{n+1} at the chunk's last row,
       dg = within-chunk reverse cumsum of dL/db (64 terms, not T);
     the row tiles last first, each pulling its own terms
     (common/key_side.py); dq, dk stored in q's and k's dtype.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention.common.documents import (
    document_spec, with_documents)
from pallas_kernels.linear_attention.common.tiles import (
    CHUNK, F32, NN, NT, TN, block_v, chunk_spec, mm_dot, shape_of, square_spec)
from pallas_kernels.linear_attention.common.key_side import (
    pull_key_side_grads, state_side_inputs, state_side_terms)
from pallas_kernels.linear_attention.gla.tuning import GRAD_K_BK_BOUNDED


def _dv_kernel(aqk_ref, kg_ref, v_ref, do_ref, dh_ref, dv_ref, da_ref, *,
               scale, bv, mm, docs=None):
  # aqk_ref [C, C]; kg_ref (k exp(b_C - b)) [C, Kp]; v_ref, do_ref, dv_ref
  # [C, V]; dh_ref (grad of the state leaving) [Kp, V]; da_ref [C, C]
  # (matmul dtype bounded, fp32 unbounded). All of V is walked here, so dA
  # (a sum over V) is complete and grad_k runs once per K slice. docs:
  # packed documents (common.documents.ChunkDocuments) or None.
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
  causal = row >= col
  if docs is not None:   # dA on the pairs of one document only (A's)
    causal = causal & docs.same_chunk()
  da_ref[...] = (scale * jnp.where(causal, da, 0.0)).astype(da_ref.dtype)


def _grad_k_kernel(q_ref, k_ref, b_ref, g_ref, da_ref, do_ref, v_ref, s_ref,
                   dh_ref, dq_ref, dk_ref, dg_ref, *, scale, bv, bounded, mm,
                   g_min, docs=None):
  # One K slice of one chunk: q_ref, k_ref, b_ref, g_ref (the caller's g,
  # read only with g_min: the clamp's mask) [C, w]; da_ref (dA, scale
  # included) [C, C]; do_ref, v_ref [C, V]; s_ref (state entering), dh_ref
  # (grad of the state leaving) [w, V] in the matmul dtype; dq_ref, dk_ref
  # [C, w] in q's and k's dtype; dg_ref [C, w] fp32. docs: packed
  # documents (common.documents.ChunkDocuments) or None.
  do_s, _, x_dh, dh_s = state_side_terms((do_ref, v_ref, s_ref, dh_ref), bv,
                                         mm, delta=False)
  if docs is not None:
    # The forward's masks on q exp(b) (reads state), k exp(b_C - b) (in
    # last) and exp(b_C) (keeps state), on their gradient terms.
    do_s, x_dh = ((lambda t, f=f, m=m: jnp.where(m(t), f(t), 0.0))
                  for f, m in ((do_s, docs.reads_state),
                               (x_dh, docs.in_last)))
    dh_s = jnp.where(docs.keeps_state(), dh_s, 0.0)

  def row_terms(i, q_i, k_i, b_i):   # through S: (q exp(b)) S
    del k_i
    dq_i = scale * do_s(i) * jnp.exp(b_i)
    return dq_i, jnp.zeros_like(dq_i), q_i * dq_i

  pull_key_side_grads(row_terms, [(da_ref, False)], q_ref, k_ref, b_ref,
                      g_ref, x_dh, dh_s, dq_ref, dk_ref, dg_ref,
                      bounded=bounded, mm=mm, g_min=g_min)


def dv_call(aqk, kg, vp, dop, dstates, lay, scale, dtype, bounded, tune,
            interpret, docs=None):
  """Kernel 5: dv [B, Tp, H, V] in dtype and dA [B, H, Tp, C] (matmul dtype
  on the bounded path, where grad_k uses it only as a dot operand; fp32 on
  the unbounded path's position pairs). docs: None or the [B, Tp] document
  index of packed documents (common/documents.py)."""
  kp, dv, mm = lay["kp"], lay["dv"], lay["mm"]
  kernel, doc_in, doc_specs = _dv_kernel, [], []
  if docs is not None:
    kernel = with_documents(_dv_kernel, 5)
    doc_in, doc_specs = [docs], [document_spec()]
  return pl.pallas_call(
      functools.partial(kernel, scale=scale, bv=lay["bv"], mm=mm),
      grid=(lay["bsz"], lay["h"], lay["n_chunks"]),
      in_specs=[square_spec(), chunk_spec(kp), chunk_spec(dv),
                chunk_spec(dv),
                pl.BlockSpec((None, None, None, kp, dv),
                             lambda b, h, n: (b, h, n, 0, 0))] + doc_specs,
      out_specs=[chunk_spec(dv), square_spec()],
      out_shape=[shape_of(lay, "bsz", "tp", "h", "dv", dtype=dtype),
                 shape_of(lay, "bsz", "h", "tp", "chunk",
                          dtype=mm if bounded else F32)],
      compiler_params=tune.params("dv"),
      interpret=interpret,
      name="gla_chunk_dv",
  )(aqk, kg, vp, dop, dstates, *doc_in)


def grad_k_call(qp, kp_, bp, gp, dop, vp, da, states, dstates, lay, scale,
                bounded, g_min, tune, interpret, docs=None):
  """Kernel 6: dq, dk [B, Tp, H, Kp] in q's and k's dtype, dg fp32. With
  g_min, dg is zero where gp (the caller's g, padded) < g_min; without it gp
  may be None (it is not read). docs: None or the [B, Tp] document index of
  packed documents (common/documents.py)."""
  if g_min is None:
    gp = bp   # a placeholder: the kernel reads g only with g_min
  grad_bk = tune.grad_k_bk
  if grad_bk is None and bounded:
    grad_bk = GRAD_K_BK_BOUNDED
  if grad_bk is not None:
    lay = dict(lay, bk=min(lay["kp"], grad_bk))
  bk, dv = lay["bk"], lay["dv"]
  k_block = chunk_spec(bk, True)
  side, side_specs = state_side_inputs([dop, vp], states, dstates, lay)
  kernel = _grad_k_kernel
  if docs is not None:
    kernel = with_documents(_grad_k_kernel, 5 + len(side))
    side, side_specs = side + [docs], side_specs + [document_spec()]
  return pl.pallas_call(
      functools.partial(kernel, scale=scale,
                        bv=block_v(dv, tune.grad_bv), bounded=bounded,
                        mm=lay["mm"], g_min=g_min),
      grid=(lay["bsz"], lay["h"], lay["n_chunks"], lay["kp"] // bk),
      in_specs=[k_block] * 4 + [square_spec()] + side_specs,
      out_specs=[k_block] * 3,
      out_shape=[shape_of(lay, "bsz", "tp", "h", "kp", dtype=qp.dtype),
                 shape_of(lay, "bsz", "tp", "h", "kp", dtype=kp_.dtype),
                 shape_of(lay, "bsz", "tp", "h", "kp")],
      compiler_params=tune.params("grad_k"),
      interpret=interpret,
      name="gla_chunk_grad_k",
  )(qp, kp_, bp, gp, da, *side)
