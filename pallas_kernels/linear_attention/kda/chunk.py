"""Chunked KDA as Pallas kernels (Triton lowering): the op and its custom_vjp.

docs/design.md §3-4. Registered as the "pallas" (GPU) and "interpret" (the
same kernels interpreted on CPU) backends of `ops.kda`.

KDA (gated delta rule with per-channel decay), per token:
    S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,
    o_t = scale * S_t^T q_t.
Chunked form (chunk C = 64 = 4 tiles of 16, b = within-chunk cumsum of g,
b_C its last row, S = S_n the state entering chunk n):
    Lk_ij = sum_d k_id k_jd exp(b_id - b_jd)  (j < i),  L = diag(beta) Lk,
    M = (I + L)^-1,
    W = M (beta k exp(b)),  U = M (beta v)             (state-independent)
    V' = U - W S                                       (delta-rule new values)
    O = scale * ((q exp(b)) S + Aqk V'),
        Aqk_ij = sum_d q_id k_jd exp(b_id - b_jd)  (j <= i)
    S_{n+1} = diag(exp(b_C)) S + (k exp(b_C - b))^T V'.

Two intra-chunk paths (static flag `bounded`, default: bounded iff g_min is
given):
  * bounded (g >= g_min, g_min in [G_MIN_LOWEST, 0) = [-5.5, 0)): every 16x16
    tile of Lk and Aqk, the diagonal tile included, is ONE dense dot
        (x_i * exp(b_i - c)) @ (k_j * exp(c - b_j))^T
    anchored at c = b at the FIRST row of the query tile: the query factor is
    in [exp(-82.5), 1], the key factor <= exp(82.5) on the diagonal tile and
    <= 1 off it, inside the fp32/bf16 range (~88.7). The triangular mask is
    applied after the dot with `where`. g below g_min is CLAMPED to g_min
    (as the intra kernels load g): the op is KDA on the clamped decay and
    the gradient w.r.t. a clamped entry of g is zero (grad_k masks dg).
  * unbounded (g_min=None; any g <= 0, no clamp): off-diagonal tiles as above
    (both factors <= 1 for any g <= 0), diagonal tiles on position pairs,
    exp(b_i - b_j) with the mask in the exponent (-inf above the diagonal)
    before the exp, as a [16, 16, bk] product reduced over K slices.
The anchor is never later than a valid query row of its tile, so outputs are
strictly causal even in a partly filled last tile.

b is computed ONCE, by the scores kernel, which also stores what the other
kernels need of it: b itself (fp32, for grad_k), q exp(b) and k exp(b_C - b)
in the matmul dtype (the dtype the dots cast them to anyway: the same bits
as computing them in place) and exp(b_C). Every kernel thus sees the same
rounded b, so exponent differences such as b_C - b_j are consistent across
kernels (recomputing b_C next to cumsum(g) cost ~5e-6 relative error on the
states), and the sequential passes do no exp on their critical path.

Kernels, in order (the caller's [B, T, H, D] layout, T padded to a multiple
of 64; beta moved to [B, H, T]):
  forward: 1a scores, 1b solve (intra.py); 2 the state pass (passes.py);
    3 the output O = scale ((q exp(b)) S_n + Aqk V') (common/output.py).
  backward (the forward keeps 1a/1b's outputs, O(T (4 K + V + 3 C)), so they
    never run twice; the state pass is re-run rather than keeping its
    O(T K V / C) states, and in one jit XLA merges it with the forward's):
    4 dv_intra (backward.py); 5 the reverse pass (passes.py); 6 grad_v,
    7 grad_k (backward.py); XLA sums the dbeta parts.
With dO the output cotangent and dH_n the gradient w.r.t. the state LEAVING
chunk n, per chunk (S = S_n, dH = dH_n):
    dV'     = scale Aqk^T dO + (k exp(b_C - b)) dH
    dH_{n-1} = diag(exp(b_C)) dH + scale (q exp(b))^T dO - W^T dV'
    dU'     = M^T dV'                           (= dR_v, R_v = beta v)
    dL      = -strict_lower(dU' V'^T)           (d(I+L)^-1 = -M dL M, and
              dM = dV' ((I+L) V')^T since R_v - R_k S = (I+L) V')
    dR_k    = -dU' S^T                          (R_k = beta k exp(b))
    dv      = beta dU'
    dbeta   = rowsum(dL * Lk) + rowsum(dU' * v) + rowsum(dR_k * k exp(b))
    dAqk    = scale causal(dO V'^T),  dLk = beta dL
    dq      = scale (dO S^T) exp(b) + [dAqk through Aqk's query side]
    dk      = [dLk through Lk's row side] + beta dR_k exp(b)     ("+b" terms)
            + [dAqk, dLk through the key sides] + (V' dH^T) exp(b_C - b)
                                                                 ("-b" terms)
    dL/db   = q dq + k (dk_+b - dk_-b),  plus sum_v dH * S_{n+1} at the
              chunk's last row,
    dg      = within-chunk reverse cumsum of dL/db (64 terms, not T).
Bounded path caveat: the query-side dots of a diagonal tile, dAqk_ii @
(k exp(c - b)), have terms up to |dAqk| |k| exp(15 |g_min|) before the
exp(b - c) <= 1 rescale: fp32/bf16 overflow needs row sums |dAqk . k| >
~3e38 / exp(15 |g_min|) (~5e2 at g_min = -5.5, ~1e6 at -5).

Packed documents (segment_ids): one more input, the [B, Tp] int32
document index of each token within its chunk (common/documents.py). The
scores kernel masks Lk and Aqk to same-document pairs and stores q exp(b)
on the rows that read the entering state, k exp(b_C - b) on the rows of the
chunk's last document and exp(b_C) only for a chunk without a document
start; the solve kernel masks W's rows like q exp(b). The state pass, its
reverse and the output kernel run unchanged on these operands; grad_v masks
dL and dAqk to same-document pairs and grad_k masks the terms through S,
through k exp(b_C - b) and through exp(b_C) as the forward did. Without
segment_ids no kernel takes the index and the kernels are the unpacked ones.

The wrapper pads T with q=k=v=0, g=0, beta=0 (inert: L rows/columns vanish,
V' = 0, dV' = 0, the state is unchanged) and K to a power of two with zero
channels, only when needed, and slices back. Dots accumulate in fp32; with
bf16 inputs the operands of the big dots are bf16, while the inverse works
on fp32 tiles. Block sizes, warps and the stage kernels: tuning.Tuning.
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
    G_MIN_LOWEST, F32, GMinError, block_v, check_dims, check_g_min,
    chunk_layout, next_pow2, pad_to)
from pallas_kernels.linear_attention.kda.backward import (
    dvintra_call, grad_k_call, grad_v_call)
from pallas_kernels.linear_attention.kda.intra import intra_call
from pallas_kernels.linear_attention.kda.passes import (
    run_dstate_pass, run_state_pass)
from pallas_kernels.linear_attention.kda.tuning import (
    DEFAULT_TUNING, Tuning, check_tuning, grad_k_block)

__all__ = ["kda_pallas", "register", "Tuning", "DEFAULT_TUNING", "GMinError",
           "G_MIN_LOWEST"]


def call_layout(q, v, tune):
  """The static sizes of one call (common/tiles.chunk_layout)."""
  return chunk_layout(q, v, block_k=tune.block_k, bv_pass=tune.pass_bv,
                      bv=tune.bv)


def prepare_inputs(q, k, v, beta, s0, lay):
  """Padded q, k [B, Tp, H, Kp], v [B, Tp, H, V], beta [B, H, Tp] fp32 and
  s0 [B, H, Kp, V] fp32."""
  tp, kp, dk = lay["tp"], lay["kp"], lay["dk"]
  qp, kp_ = pad_to(q, tp, kp), pad_to(k, tp, kp)
  vp = pad_to(v, tp, lay["dv"])
  betap = jnp.pad(jnp.transpose(beta.astype(F32), (0, 2, 1)),
                  ((0, 0), (0, 0), (0, tp - lay["t"])))       # [B, H, Tp]
  s0p = jnp.pad(s0.astype(F32), ((0, 0), (0, 0), (0, kp - dk), (0, 0)))
  return qp, kp_, vp, betap, s0p


def prepare(q, k, v, g, beta, s0, lay):
  """prepare_inputs plus g padded to [B, Tp, H, Kp] fp32 (zeros: inert)."""
  qp, kp_, vp, betap, s0p = prepare_inputs(q, k, v, beta, s0, lay)
  return qp, kp_, vp, pad_to(g.astype(F32), lay["tp"], lay["kp"]), betap, s0p


_STATIC = ("scale", "bounded", "interpret", "g_min", "tune")


@functools.partial(jax.jit, static_argnames=_STATIC + ("for_backward",))
def _kda_fwd(q, k, v, g, beta, s0, docs, *, scale, bounded, interpret, g_min,
             tune, for_backward=False):
  """q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; s0 [B, H, K, V];
  docs None or the [B, Tp] document index of packed documents
  (common/documents.py).

  With for_backward, also returns the residuals: the intra kernels' outputs
  W, U, Aqk, qg, kg, ec, b, M, Lk (about twice the size of the inputs). With
  g_min (a float), g is clamped to it inside the intra kernels; None: no
  clamp.
  """
  lay = call_layout(q, v, tune)
  qp, kp_, vp, gp, betap, s0p = prepare(q, k, v, g, beta, s0, lay)
  intra = intra_call(qp, kp_, gp, betap, vp, lay, bounded, interpret, tune,
                     for_backward, g_min, docs)
  w, u, aqk, qg, kg, ec = intra[:6]
  states, v_new, s_final = run_state_pass(w, u, kg, ec, s0p, lay, tune,
                                          interpret)
  o = output_call(qg, aqk, v_new, states, lay, scale, v.dtype, interpret,
                  tune.output_warps, "kda_chunk_output", tune.output_kernel)
  out = o[:, :lay["t"]], s_final[:, :, :lay["dk"]]
  if not for_backward:
    return out
  return out, intra


@functools.partial(jax.jit, static_argnames=_STATIC)
def _kda_bwd(q, k, v, beta, s0, docs, intra, g, do, ds_final, *, scale,
             bounded, interpret, g_min, tune):
  """(dq, dk, dv, dg, dbeta, ds0) given do [B,T,H,V], ds_final [B,H,K,V] and
  the forward's residuals (the intra kernels' outputs, and g [B,T,H,K] when
  g_min clamps it: dg is zero where g < g_min; else g is None)."""
  lay = call_layout(q, v, tune)
  t, tp, dk, kp, dv = (lay[n] for n in ("t", "tp", "dk", "kp", "dv"))
  qp, kp_, vp, betap, s0p = prepare_inputs(q, k, v, beta, s0, lay)
  dop = pad_to(do.astype(v.dtype), tp, dv)
  dsfp = jnp.pad(ds_final.astype(F32),
                 ((0, 0), (0, 0), (0, kp - dk), (0, 0)))
  w, u, aqk, qg, kg, ec, bp, m, lk = intra
  # The state pass is re-run, not kept (O(T K V / C)): when the forward and
  # backward share one jit, XLA merges this call with the forward's.
  states, v_new, _ = run_state_pass(w, u, kg, ec, s0p, lay, tune, interpret)
  dv_intra = dvintra_call(aqk, dop, lay, scale, tune, interpret)
  dstates, dv_new, ds0 = run_dstate_pass(qg, kg, ec, w, dop, dv_intra, dsfp,
                                         lay, scale, tune, interpret)
  dvp, du, da, dlk, dbeta_v = grad_v_call(m, lk, betap, vp, dop, v_new,
                                          dv_new, lay, scale, v.dtype,
                                          bounded, tune, interpret, docs)
  gp = None if g_min is None else pad_to(g.astype(F32), tp, kp)
  dq, dk_, dg, dbeta_k = grad_k_call(qp, kp_, bp, betap, dop, v_new, du, da,
                                     dlk, states, dstates, lay, scale,
                                     bounded, tune, interpret, gp, g_min,
                                     grad_k_block(tune, bounded), docs)
  dbeta = jnp.transpose(dbeta_v + jnp.sum(dbeta_k, axis=0), (0, 2, 1))[:, :t]
  # dq, dk come in q's and k's dtype from grad_k (no XLA convert pass).
  dq, dk_, dg = (x[:, :t, :, :dk] for x in (dq, dk_, dg))
  return (dq, dk_, dvp[:, :t], dg, dbeta.astype(beta.dtype), ds0[:, :, :dk])


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11))
def _kda_pallas_vjp(q, k, v, g, beta, s0, docs, scale, bounded, interpret,
                    g_min, tune):
  return _kda_fwd(q, k, v, g, beta, s0, docs, scale=scale, bounded=bounded,
                  interpret=interpret, g_min=g_min, tune=tune)


def _vjp_fwd(q, k, v, g, beta, s0, docs, scale, bounded, interpret, g_min,
             tune):
  # The forward keeps what its intra kernels built (b, W, U, Aqk, M, Lk, qg,
  # kg, ec): the backward does not re-run them. g itself only when the
  # clamp needs its mask.
  out, intra = _kda_fwd(q, k, v, g, beta, s0, docs, scale=scale,
                        bounded=bounded, interpret=interpret, g_min=g_min,
                        tune=tune, for_backward=True)
  return out, (q, k, v, beta, s0, docs, intra, None if g_min is None else g)


def _vjp_bwd(scale, bounded, interpret, g_min, tune, res, cts):
  q, k, v, beta, s0, docs, intra, g = res
  do, ds_final = cts
  grads = _kda_bwd(q, k, v, beta, s0, docs, intra, g, do, ds_final,
                   scale=scale, bounded=bounded, interpret=interpret,
                   g_min=g_min, tune=tune)
  return grads + (None,)   # the document index is not differentiable


_kda_pallas_vjp.defvjp(_vjp_fwd, _vjp_bwd)


def kda_pallas(q, k, v, g, beta, *, scale, initial_state, chunk_size, g_min,
               segment_ids=None, interpret=False, bounded=None,
               tune=DEFAULT_TUNING):
  """Chunked KDA, forward and backward as Pallas kernels (jax.custom_vjp).

  Args:
    q, k, g: [B, T, H, K]; v: [B, T, H, V] (fp32 or bf16; g fp32 log decay
      <= 0); beta: [B, T, H]. K, V multiples of 16 in [16, 256]; any T.
    scale: query scale or None (K**-0.5).
    initial_state: [B, H, K, V] or None (zeros).
    chunk_size: must be 64.
    segment_ids: [B, T] int or None: packed documents (a document is a
      contiguous run of equal ids); the state restarts from zero at each
      document start inside a row (common/documents.py), the initial state
      belongs to the row's first document and the final state is the row's
      last document's. None runs the kernels without document masks.
    g_min: None (unbounded path: any g <= 0, no clamp) or a python float in
      [-5.5, 0), the caller's promise g >= g_min (bounded path). On the
      bounded path g below g_min is clamped to g_min (zero gradient there).
    interpret: run the kernels in Pallas interpret mode (CPU).
    bounded: force the path (default: bounded iff g_min is given).
    tune: block sizes, warps and stage kernels (a kda.tuning.Tuning).
  Returns:
    o [B, T, H, V] in v.dtype, final state [B, H, K, V] fp32.
  """
  if bounded is None:
    bounded = g_min is not None
  if bounded:
    check_g_min(g_min)  # GMinError (a ValueError) names g_min=None
  bsz, h, dk, dv = ops.check_shapes(q, k, v, g, beta, initial_state,
                                    need_beta=True)
  check_dims(q, v, chunk_size, what="KDA")  # chunk 64, K/V, dtypes
  check_tuning(tune)
  scale = float(dk) ** -0.5 if scale is None else float(scale)
  if initial_state is None:
    initial_state = jnp.zeros((bsz, h, dk, dv), F32)
  # The clamp policy of the bounded path: the op is KDA on where(g < g_min,
  # g_min, g), with zero gradient below g_min (at g == g_min the gradient
  # passes). The intra kernels clamp as they load g and grad_k masks dg: no
  # XLA passes over [B, T, H, K] fp32.
  clamp = float(g_min) if bounded else None
  kp = next_pow2(dk)
  tune = dataclasses.replace(tune, state_pass=mosaic.resolve_state_pass(
      tune.state_pass, kp, dv, v.dtype, kp, block_v(dv, tune.pass_bv),
      interpret, kda=True))
  if tune.state_pass == "mosaic":
    mosaic.check_state_pass(kp, dv, v.dtype, kp, tune.pass_bv,
                            mosaic.default_layout(interpret), whole_k=True)
  if tune.output_kernel == "mosaic":
    mosaic.check_state_pass(kp, dv, v.dtype, kp, block_v(dv, tune.bv),
                            "rows", whole_k=True, what="output_kernel")
  docs = checked_document_index(segment_ids, q.shape[:2],
                                call_layout(q, v, tune)["tp"])
  return _kda_pallas_vjp(q, k, v, g.astype(F32), beta,
                         initial_state.astype(F32), docs, scale,
                         bool(bounded), bool(interpret), clamp, tune)


def register():
  ops.register_backend("pallas", kda=kda_pallas)
  ops.register_backend("interpret",
                       kda=functools.partial(kda_pallas, interpret=True))
  ops.set_bounded_only("kda", False)  # both paths exist: "auto" may pick
                                      # the unbounded one for g_min=None
