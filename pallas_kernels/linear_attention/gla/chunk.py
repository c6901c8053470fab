"""Chunked GLA as Pallas kernels (Triton lowering): forward and backward.

docs/design.md §3-4. Registered as the "pallas" (GPU) and "interpret" (the
same kernels interpreted on CPU) backends of `ops.gla`.

GLA, per token: S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T, o_t = scale S_t^T q_t.
Chunked form (chunk C = 64 = 4 tiles of 16, b = within-chunk inclusive cumsum
of g, b_C its last row, S = S_n the state entering chunk n):
    A_ij    = sum_d q_id k_jd exp(b_id - b_jd)  (j <= i)
    O       = scale ((q exp(b)) S + A v)
    S_{n+1} = diag(exp(b_C)) S + (k exp(b_C - b))^T v.
The kernels are KDA's without the delta rule (no Lk, inverse, W, U or V'),
built from the same pieces (common/), so that what was measured on one
carries to the other.

Two intra-chunk paths (static flag `bounded`, default: bounded iff g_min is
given):
  * bounded (g >= g_min, g_min in [G_MIN_LOWEST, 0) = [-5.5, 0)): every
    16x16 tile of A, the diagonal included, is ONE dense dot anchored at
    c = b at the first row of the query tile:
        A_tile = (q_i exp(b_i - c)) @ (k_j exp(c - b_j))^T.
    The query factor is in [exp(-82.5), 1]; the key factor is <= 1 off the
    diagonal and <= exp((16-1)*5.5) = exp(82.5) on it, inside the fp32/bf16
    range (~88.7). The causal mask is applied after the dot with `where`.
    g below g_min is CLAMPED to g_min (g' = where(g < g_min, g_min, g), as
    the intra kernel loads g); the gradient w.r.t. a clamped entry is zero
    (grad_k masks dg).
  * unbounded (g_min=None; any g <= 0, no clamp): off-diagonal tiles as
    above (both factors <= 1 for any g), diagonal tiles on position pairs,
    exp(b_i - b_j) with the mask in the exponent (-inf above the diagonal)
    before the exp, as a [16, 16, bk] product reduced over K slices. This
    is the measured baseline.
The anchor is never later than any valid query row of its tile, so outputs
are strictly causal even in a partly filled last tile.

Kernels (inputs stay in the caller's [B, T, H, D] layout: no transposes):
  forward
    1. `_intra_kernel`, grid (B, H, N), parallel: b (computed once, here,
       and stored for the backward, so every kernel sees the same rounded
       b), q exp(b), k exp(b_C - b) in the matmul dtype, exp(b_C), and A
       row tile by row tile (its K slices in a fori_loop), stored as a dense
       lower-triangular [C, C] block per chunk [B, H, T, C] (O(T C), like
       fla's A): the later uses are single dense dots.
    2. `_state_kernel`, grid (B, H, K/bk_pass, V/bv_pass): a sequential
       fori_loop over chunks, S_{n+1} = exp(b_C) S + (k exp(b_C - b))^T v:
       one dot per chunk from the stored operands, no exp on the critical
       path. Rows of S (K) are independent under a diagonal decay, so K is
       blocked as well as V: more programs for the one sequential pass.
       Stores the state entering each chunk [B, H, N, K, V] in the matmul
       dtype (carried in fp32) and the final state.
    3. the output, O = scale ((q exp(b)) S + A v), common/output.py's kernel
       (two dense dots per chunk and V block).
  backward (the forward keeps kernel 1's outputs: b, q exp(b),
  k exp(b_C - b), exp(b_C), A; the state pass is re-run, and in one jit XLA
  merges it with the forward's)
    4. `_dstate_kernel`, grid as kernel 2: reverse pass, dH_n = grad wrt the
       state LEAVING chunk n, dH_{n-1} = exp(b_C) dH_n + scale (q exp(b))^T
       dO; stores dH_n (matmul dtype) and dS_0.
    5. `_dv_kernel`, grid (B, H, N), walking V in blocks:
         dv = scale A^T dO + (k exp(b_C - b)) dH_n,
         dA = scale causal(dO v^T)  (complete over V, stored [B, H, T, C]).
    6. `_grad_k_kernel`, grid (B, H, N, K/bk), parallel, one K slice:
         dq = scale (dO S^T) exp(b) + [dA through A's query side],
         dk = [dA through A's key side] + (v dH^T) exp(b_C - b),
         dL/db = q dq - k dk (term by term, "+b" minus "-b" factors) plus
         sum_v dH * S_{n+1} at the chunk's last row,
         dg = within-chunk reverse cumsum of dL/db (64 terms, not T).
       A tile pair's query-side and key-side contributions to dL/db are
       multiplied by the same rounded dot operands, so that they cancel in
       the cumsum as in exact arithmetic (common/key_side.py).
       dq, dk are stored in q's and k's dtype.
Packed documents (segment_ids): one more input, the [B, Tp] int32 document
index of each token within its chunk (common/documents.py); the intra
kernel masks A to same-document pairs and stores q exp(b), k exp(b_C - b)
and exp(b_C) masked as KDA's scores kernel does, kernel 5 masks dA alike and
grad_k the terms through S, k exp(b_C - b) and exp(b_C). The passes and the
output kernel are unchanged; without segment_ids no kernel takes the index.
The wrapper pads T with q=k=v=0, g=0 (inert) and K to a power of two with
zero channels, only when needed, and slices back. Dots accumulate in fp32;
with bf16 inputs their operands are bf16. Kernels 1 (intra.py), 2 and 4
(passes.py), 3 (common/output.py), 5 and 6 (backward.py); block sizes,
warps and stage kernels: tuning.Tuning.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.linear_attention import ops
from pallas_kernels.linear_attention.common import mosaic
from pallas_kernels.linear_attention.common.documents import (
    checked_document_index)
from pallas_kernels.linear_attention.common.output import output_call
from pallas_kernels.linear_attention.common.tiles import (
    CHUNK, G_MIN_LOWEST, MAX_DIM, TILE, F32, GMinError, block_v, check_dims,
    check_g_min, chunk_layout, next_pow2, pad_to)
from pallas_kernels.linear_attention.gla.backward import dv_call, grad_k_call
from pallas_kernels.linear_attention.gla.intra import intra_call
from pallas_kernels.linear_attention.gla.passes import (
    run_dstate_pass, run_state_pass)
from pallas_kernels.linear_attention.gla.tuning import (
    DEFAULT_TUNING, Tuning, check_tuning)


__all__ = ["gla_pallas", "register", "Tuning", "DEFAULT_TUNING", "check_tuning",
           "GMinError", "G_MIN_LOWEST", "CHUNK", "TILE", "MAX_DIM",
           "check_dims", "check_g_min"]


def call_layout(q, v, tune):
  return chunk_layout(q, v, block_k=tune.block_k, bv_pass=tune.pass_bv,
                      bk_pass=tune.pass_bk, bv=tune.bv)


_STATIC = ("scale", "bounded", "g_min", "tune", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC + ("for_backward",))
def _gla_fwd(q, k, v, g, s0, docs, *, scale, bounded, g_min, tune, interpret,
             for_backward=False):
  """q, k, g [B, T, H, K]; v [B, T, H, V]; s0 [B, H, K, V] fp32; docs None or
  the [B, Tp] document index of packed documents (common/documents.py).
  With for_backward, also returns the intra kernel's outputs (the
  residuals)."""
  lay = call_layout(q, v, tune)
  tp, kp, dk = lay["tp"], lay["kp"], lay["dk"]
  qp, kp_, gp = pad_to(q, tp, kp), pad_to(k, tp, kp), pad_to(g, tp, kp)
  vp = pad_to(v, tp, lay["dv"])
  s0p = jnp.pad(s0, ((0, 0), (0, 0), (0, kp - dk), (0, 0)))
  intra = intra_call(qp, kp_, gp, lay, bounded, g_min, tune, interpret,
                     for_backward, docs)
  aqk, qg, kg, ec = intra[:4]
  states, s_final = run_state_pass(kg, vp, ec, s0p, lay, tune, interpret)
  o = output_call(qg, aqk, vp, states, lay, scale, v.dtype, interpret,
                  tune.output_warps, "gla_chunk_output", tune.output_kernel)
  out = o[:, :lay["t"]], s_final[:, :, :dk]
  return (out, intra) if for_backward else out


@functools.partial(jax.jit, static_argnames=_STATIC)
def _gla_bwd(q, k, v, g, s0, docs, intra, do, ds_final, *, scale, bounded,
             g_min, tune, interpret):
  """(dq, dk, dv, dg, ds0) given do [B,T,H,V], ds_final [B,H,K,V] and the
  forward's residuals (the intra kernel's outputs; g, the caller's g fp32,
  only with g_min, for the clamp's mask, else None)."""
  lay = call_layout(q, v, tune)
  t, tp, dk, kp, dv = (lay[n] for n in ("t", "tp", "dk", "kp", "dv"))
  qp, kp_ = pad_to(q, tp, kp), pad_to(k, tp, kp)
  vp = pad_to(v, tp, dv)
  dop = pad_to(do.astype(v.dtype), tp, dv)
  s0p = jnp.pad(s0, ((0, 0), (0, 0), (0, kp - dk), (0, 0)))
  dsfp = jnp.pad(ds_final.astype(F32), ((0, 0), (0, 0), (0, kp - dk),
                                        (0, 0)))
  aqk, qg, kg, ec, bp = intra
  states, _ = run_state_pass(kg, vp, ec, s0p, lay, tune, interpret)
  dstates, ds0 = run_dstate_pass(qg, dop, ec, dsfp, lay, scale, tune, interpret)
  dvp, da = dv_call(aqk, kg, vp, dop, dstates, lay, scale, v.dtype, bounded,
                    tune, interpret, docs)
  gp = None if g_min is None else pad_to(g, tp, kp)
  dq, dk_, dg = grad_k_call(qp, kp_, bp, gp, dop, vp, da, states, dstates,
                            lay, scale, bounded, g_min, tune, interpret,
                            docs)
  dq, dk_, dg = (x[:, :t, :, :dk] for x in (dq, dk_, dg))
  return dq, dk_, dvp[:, :t], dg, ds0[:, :, :dk]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _gla_pallas_vjp(q, k, v, g, s0, docs, scale, bounded, g_min, tune,
                    interpret):
  return _gla_fwd(q, k, v, g, s0, docs, scale=scale, bounded=bounded,
                  g_min=g_min, tune=tune, interpret=interpret)


def _vjp_fwd(q, k, v, g, s0, docs, scale, bounded, g_min, tune, interpret):
  out, intra = _gla_fwd(q, k, v, g, s0, docs, scale=scale, bounded=bounded,
                        g_min=g_min, tune=tune, interpret=interpret,
                        for_backward=True)
  return out, (q, k, v, None if g_min is None else g, s0, docs, intra)


def _vjp_bwd(scale, bounded, g_min, tune, interpret, res, cts):
  q, k, v, g, s0, docs, intra = res
  do, ds_final = cts
  grads = _gla_bwd(q, k, v, g, s0, docs, intra, do, ds_final, scale=scale,
                   bounded=bounded, g_min=g_min, tune=tune,
                   interpret=interpret)
  return grads + (None,)   # the document index is not differentiable


_gla_pallas_vjp.defvjp(_vjp_fwd, _vjp_bwd)


def gla_pallas(q, k, v, g, *, scale, initial_state, chunk_size, g_min,
               segment_ids=None, interpret=False, bounded=None,
               tune=DEFAULT_TUNING):
  """Chunked GLA, forward and backward as Pallas kernels (jax.custom_vjp).

  Args:
    q, k, g: [B, T, H, K]; v: [B, T, H, V] (fp32 or bf16; g fp32 log decay).
      K, V multiples of 16 in [16, 256]; any T.
    scale: query scale or None (K**-0.5).
    initial_state: [B, H, K, V] or None (zeros).
    chunk_size: must be 64.
    segment_ids: [B, T] int or None: packed documents (a document is a
      contiguous run of equal ids); the state restarts from zero at each
      document start inside a row (common/documents.py), the initial state
      belongs to the row's first document and the final state is the row's
      last document's. None runs the kernels without document masks.
    g_min: None (unbounded path) or a python float in [-5.5, 0), the caller's
      promise g >= g_min (bounded path). g below g_min is clamped to g_min
      (zero gradient there).
    interpret: run the kernels in Pallas interpret mode (CPU).
    bounded: force the path (default: bounded iff g_min is given).
    tune: block sizes and launch parameters (a Tuning).
  Returns:
    o [B, T, H, V] in v.dtype, final state [B, H, K, V] fp32.
  """
  check_dims(q, v, chunk_size)
  if bounded is None:
    bounded = g_min is not None
  if bounded:
    check_g_min(g_min)
  check_tuning(tune)
  bsz, _, h, dk = q.shape
  dv = v.shape[-1]
  kp = next_pow2(dk)
  tune = dataclasses.replace(tune, state_pass=mosaic.resolve_state_pass(
      tune.state_pass, kp, dv, v.dtype, min(kp, tune.pass_bk),
      block_v(dv, tune.pass_bv), interpret, kda=False))
  if tune.state_pass == "mosaic":
    mosaic.check_state_pass(
        kp, dv, v.dtype, min(kp, tune.pass_bk), block_v(dv, tune.pass_bv),
        mosaic.default_layout(interpret), whole_k=False)
  if tune.output_kernel == "mosaic":
    mosaic.check_state_pass(kp, dv, v.dtype, kp, block_v(dv, tune.bv),
                            "rows", whole_k=True, what="output_kernel")
  scale = float(dk) ** -0.5 if scale is None else float(scale)
  if initial_state is None:
    initial_state = jnp.zeros((bsz, h, dk, dv), F32)
  # The clamp policy of the bounded path: the op is GLA on where(g < g_min,
  # g_min, g), with zero gradient below g_min (at g == g_min the gradient
  # passes); the intra kernel clamps, grad_k masks dg: no XLA passes.
  clamp = float(g_min) if bounded else None
  docs = checked_document_index(segment_ids, q.shape[:2],
                                call_layout(q, v, tune)["tp"])
  return _gla_pallas_vjp(q, k, v, g.astype(F32), initial_state.astype(F32),
                         docs, scale, bool(bounded), clamp, tune,
                         bool(interpret))


def register():
  ops.register_backend("pallas", gla=gla_pallas)
  ops.register_backend("interpret",
                       gla=functools.partial(gla_pallas, interpret=True))
