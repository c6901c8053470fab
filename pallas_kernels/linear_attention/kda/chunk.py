"""Chunked KDA as Pallas kernels (Triton lowering): forward and backward.

DESIGN 3.1 / 3.2 / 4. Registered as the "pallas" (GPU) and "interpret" (the
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
given, as in gla_pallas):
  * bounded (g >= g_min, g_min in [G_MIN_LOWEST, 0) = [-5.5, 0)): every 16x16
    tile of Lk and Aqk, the diagonal tile included, is ONE dense dot
        (x_i * exp(b_i - c)) @ (k_j * exp(c - b_j))^T
    anchored at c = b at the FIRST row of the query tile: the query factor is
    in [exp(-82.5), 1], the key factor <= exp(82.5) on the diagonal tile and
    <= 1 off it, inside the fp32/bf16 range (~88.7). The triangular mask is
    applied after the dot with `where`. g below g_min is CLAMPED to g_min
    (g' = where(g < g_min, g_min, g), the policy of gla_pallas): the op is KDA
    on the clamped decay and the gradient w.r.t. a clamped entry of g is zero.
    The intra kernel clamps g as it loads it and grad_k zeroes dg below
    g_min (session 16; before, two XLA passes over [B, T, H, K] fp32).
  * unbounded (g_min=None; any g <= 0, no clamp): off-diagonal tiles as above
    (both factors <= 1 for any g <= 0), diagonal tiles on position pairs,
    exp(b_i - b_j) with the mask in the exponent (-inf above the diagonal,
    strictly lower for Lk, inclusive for Aqk) before the exp, as a
    [16, 16, bk] product reduced over K slices of width bk (default 32).
The anchor is never later than a valid query row of its tile, so outputs are
strictly causal even in a partly filled last tile.

Triangular inverse (all dense 16x16 dots on fp32 tiles; their precision is
INVERSE_DOT: one TF32 MMA per dot for bf16 inputs on the GPU, error ~1e-3
relative, under the bf16 rounding M gets before its later dots; IEEE fp32
for fp32 inputs and in interpret mode):
  * diagonal tiles by recursive doubling: X_1 = I and, for s = 1, 2, 4, 8,
    X_2s = X_s - X_s N_s X_s, where N_s keeps the entries of the strictly lower
    tile N that lie in the lower-left s x s block of each 2s x 2s diagonal
    block. This is the block inverse [[A,0],[C,D]]^-1 = [[A^-1,0],[-D^-1 C A^-1,
    D^-1]] applied to all blocks of one level at once; its intermediates are
    true sub-inverses, so it is as accurate as forward substitution. The
    product (I - N)(I + N^2)(I + N^4)(I + N^8), exact in exact arithmetic, is
    not: N^p grows large and cancels. Measured in fp32 on 64x64 L with near-
    identical keys, beta ~ 1, g ~ 0 (max error / max|M| vs float64): power
    product 1.0e-3, doubling 3.2e-7, row-by-row forward substitution 3.0e-7;
  * off-diagonal tiles of the 64x64 inverse by block forward substitution,
    M_ij = -M_ii sum_{m=j}^{i-1} L_im M_mj.

Decay cumsum: b, the within-chunk inclusive cumsum of g, is computed ONCE,
inside the intra kernel (tile by tile, `cumsum_tiles`), which also stores
what the other kernels need of it: b itself (fp32, for the backward's
grad_k), q exp(b) and k exp(b_C - b) in the matmul dtype (the dtype the dots
cast them to anyway, so the stored operands are bit-identical to computing
them in place) and exp(b_C). Every kernel thus sees the same rounded b and
the exponent differences (b_C - b_j, b_i - b_j) are consistent: recomputing
b_C as sum(g) next to cumsum(g) in the state pass cost ~5e-6 relative error
on the states and ~1e-5 on dg (measured vs a float64 reference); with one b
the kernels match the fp32 XLA reference's own error (~1e-6). Computing b in
XLA (a separate pass over g) and the decays inside the sequential passes
(64 x K exps and an fp32 [C, K] load per chunk on their critical path) cost
more: on an H200 moving them into the intra kernel took the state pass from
3.0 to 1.5 ms and the dstate pass from 4.0 to 2.0 ms (results/kernels.md).

Forward kernels (they read the caller's [B, T, H, D] layout, T padded to a
multiple of 64; beta is moved to [B, H, T]):
  1. The intra work, grid (B, H, N), parallel, as two kernels
     (SOLVE_APART, the default) or one (`_intra_kernel`):
     1a. `_scores_kernel`: b, q exp(b), k exp(b_C - b), exp(b_C), and Lk
         and Aqk, tile pair by tile pair summed over K slices of `bk`
         columns in a fori_loop (the decayed key tiles are shared; the
         slices outside the row tiles, INTRA_ORDER "slices", or inside);
         stores Aqk [C, C] (matmul dtype) and Lk [C, C] (fp32) as dense
         lower-triangular matrices [B, H, T, C];
     1b. `_solve_kernel`: reads Lk, forms M row tile by row tile (stored in
         the matmul dtype for the backward), then W [C, K] (slice by slice,
         b recomputed from g: the same bits) and U [C, V] (matmul dtype).
     `_intra_kernel` does both, each row of M right after that row of the
     scores. Storing the [C, C] matrices costs O(T C) memory, like fla's
     Akk / Aqk, and turns the later uses into single dense dots; nothing is
     recomputed per V block. (In session 14 splitting measured slower on
     the H200, before the K slices became a fori_loop: W, U apart 7.5 + 0.5
     ms against 5.4; M, W, U apart 3.1 + 1.2 against 3.7. In session 20,
     with spill-free halves, apart was faster: SOLVE_APART.)
     The K slices are a fori_loop, not unrolled: unrolled (slices x tile
     pairs) the kernel was ~11.4k lines of TTIR that took ptxas 111 s
     (bounded) and 324 s (unbounded) to compile and ran in 3.7 ms; the
     loop is ~6.2k lines, 16 s / 31 s, and runs in 2.3 ms (session 15).
  2. `_state_kernel`, grid (B, H, V/BV_PASS): a sequential fori_loop over
     chunks storing the state ENTERING each chunk [B, H, N, K, V] (matmul
     dtype; carried in fp32), the new values V' = U - W S [B, T, H, V] and
     the final state; per chunk two dots and loads of W, U, k exp(b_C - b)
     and exp(b_C). Unlike GLA, K is not blocked: W S contracts over all of
     K (V blocks are independent).
  3. `chunk_common._output_kernel`, grid (B, H, N, V/BV), parallel:
     O = scale * ((q exp(b)) S_n + Aqk V'): two dense dots per chunk.

Backward. The forward keeps kernel 1's outputs (W, U, Aqk, M, Lk, b, q exp(b),
k exp(b_C - b), exp(b_C): O(T (4 K + V + 3 C)), about twice the size of the
inputs) as residuals, so kernel 1
never runs twice; kernel 2 (the state pass) is re-run rather than keeping
its O(T K V / C) states (in one jit XLA merges it with the forward's).
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
              chunk's last row (exp(b_C) on S and on the k exp(b_C - b) term),
    dg      = within-chunk reverse cumsum of dL/db (64 terms, not T).
  dL/db is formed term by term inside the kernel: each tile pair's query-
  and key-side contributions are multiplied by the same rounded dot operands,
  so that they cancel in the cumsum as in exact arithmetic (see
  `_grad_k_kernel`). Bounded path caveat (as in gla_pallas): the query-side
  dots of a diagonal tile, dAqk_ii @ (k exp(c - b)), have terms up to
  |dAqk| |k| exp(15 |g_min|) before the exp(b - c) <= 1 rescale: fp32/bf16
  overflow needs row sums |dAqk . k| > ~3e38 / exp(15 |g_min|) (~5e2 at
  g_min = -5.5, ~1e6 at -5).
Kernels:
  4. `_dvintra_kernel`, grid (B, H, N, V/BV), parallel: scale Aqk^T dO [C, BV]
     (the state-independent part of dV'), one dense dot.
  5. `_dstate_kernel`, grid (B, H, V/BV_PASS): reverse fori_loop over chunks
     with the full [K, BV] dH (V blocks are independent, K is not: W^T dV';
     it reads the stored q exp(b), k exp(b_C - b) and exp(b_C)):
     stores dH_n [B, H, N, K, V] (matmul dtype; carried in fp32), dV'
     [B, T, H, V] (matmul dtype: grad_v uses it only as a dot operand) and
     dS_0.
  6. `_grad_v_kernel`, grid (B, H, N), parallel, walking all of V in blocks:
     dU' = M^T dV', dv, dL, dAqk (complete sums over V, stored [B, H, T, C]
     with dLk = beta dL) and the V-side terms of dbeta. dU' is stored in the
     matmul dtype, dAqk and dLk too on the bounded path (fp32 unbounded):
     grad_k reads them once per K slice and only as dot operands (the
     dtype the dots cast them to), so the bits do not change.
  7. `_grad_k_pull_kernel` (default; `_grad_k_kernel` for the "held" and
     "stream" orders, GRAD_K_ORDER), grid (B, H, N, K/bk) with bk =
     BLOCK_K_GRAD_K = 64 on the bounded path, parallel: one K slice of dq,
     dk, dL/db [C, bk] and that slice's dbeta term, from the stored dAqk,
     dLk, dU', V', S and dH (contractions over V done inside). Each slice is
     computed once: no partial sums over V blocks. The row tiles run last
     first in a fori_loop, each pulling its own "+b" (key tiles j <= i) and
     "-b" (query tiles m >= i) terms in inner loops and storing at once.
     It also adds the chunk-end term of dL/db, sum_v dH * S_{n+1}, at the
     chunk's last row, from S_n, dH and its own "-b" end terms (no S_{n+1}
     read; before session 15 an XLA pass over the stored states and dH, ~1 GB
     at B1 T32768 H16 D128).
     Finally dg, the within-chunk reverse cumsum of dL/db (64 terms: no
     rounding growth over T), tile by tile (fp32 dots with the
     upper-triangular ones matrix); before session 15 an XLA pass. On the
     bounded path dg is zeroed where g < g_min (the clamp's gradient), and
     dq, dk are stored in q's and k's dtype (session 16: no XLA passes).
     With split_grad_k (an ablation knob, off until timed), the contractions
     over V (dO S^T, dU' S^T, V' dH^T, sum_v dH * S) run first in
     `chunk_common._state_side_kernel`, dense dots, and grad_k reads them.
  XLA: the sum of the dbeta parts.
  Launch: warps per kernel from NUM_WARPS (swept on an H200), num_stages 2.
  Measured on an H200 (B1 T32768 H16 D128 bf16, bounded, profile_kda,
  e6bb4ca, session 15): intra 2.3, state 1.3, output 0.6 | dv_intra 0.3,
  dstate 1.8, grad_v 0.9, grad_k 4.2 ms; forward 3.6 ms, forward+backward
  9.8 ms (results/kernels.md; dg's cumsum moved into grad_k since, untimed).
The wrapper pads T with q=k=v=0, g=0, beta=0 (inert: L rows/columns vanish,
V' = 0, dV' = 0, the state is unchanged) and K to a power of two with zero
channels, only when needed, and slices back. Dots accumulate in fp32; with
bf16 inputs the operands of the big dots are bf16 (W, U, V' are stored in
bf16), while the inverse itself works on fp32 tiles (INVERSE_DOT).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.linear_attention import ops
from pallas_kernels.linear_attention.common import mosaic
from pallas_kernels.linear_attention.common.mosaic import (
    STAGE_KERNELS, STATE_PASS_CHOICES)
from pallas_kernels.linear_attention.common.output import output_call
from pallas_kernels.linear_attention.common.tiles import (
    CHUNK, G_MIN_LOWEST, TILE, F32, GMinError, block_v, check_dims, check_g_min,
    chunk_layout, next_pow2, pad_to)
from pallas_kernels.linear_attention.kda.backward import (
    dvintra_call, grad_k_call, grad_v_call)
from pallas_kernels.linear_attention.kda.intra import intra_call
from pallas_kernels.linear_attention.kda.naive import chunk_kda_ref
from pallas_kernels.linear_attention.kda.passes import (
    run_dstate_pass, run_state_pass)
from pallas_kernels.linear_attention.kda.tuning import (
    BLOCK_K, BLOCK_K_GRAD_K, BLOCK_K_UNBOUNDED, BLOCK_V_PASS, GRAD_K_ORDER,
    GRAD_K_ORDERS, INTRA_ORDER, INTRA_ORDERS, INVERSE_DOT, INVERSE_DOTS,
    NUM_WARPS, OUTPUT_KERNEL, SOLVE_APART, SPLIT_GRAD_K, STATE_PASS)


__all__ = ["kda_pallas", "register", "GMinError", "G_MIN_LOWEST"]


def call_layout(q, v, block_k):
  return chunk_layout(q, v, block_k=block_k, bv_pass=BLOCK_V_PASS)


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


_STATIC = ("scale", "block_k", "bounded", "interpret", "g_min", "state_pass",
           "output_kernel", "inverse_dot", "intra_order", "solve_apart")


@functools.partial(jax.jit, static_argnames=_STATIC + ("for_backward",))
def _kda_fwd_impl(q, k, v, g, beta, s0, *, scale, block_k, bounded,
                  interpret, g_min, state_pass, output_kernel, inverse_dot,
                  intra_order, solve_apart, for_backward=False):
  """q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; s0 [B, H, K, V].

  The kernels read the caller's [B, T, H, D] layout (no transposes); beta is
  moved to [B, H, Tp] so that a chunk of it is one contiguous row. With
  for_backward, also returns the residuals: the intra kernel's outputs W, U,
  Aqk, qg, kg, ec, b, M, Lk (O(T (4 K + V + 3 C)), about twice the size of
  the inputs). With g_min (a float), g is clamped to it inside the intra
  kernel; None: no clamp. state_pass, output_kernel: "triton" or
  "mosaic" (STATE_PASS, OUTPUT_KERNEL); inverse_dot: INVERSE_DOTS;
  intra_order: INTRA_ORDERS; solve_apart: SOLVE_APART.
  """
  lay = call_layout(q, v, block_k)
  qp, kp_, vp, gp, betap, s0p = prepare(q, k, v, g, beta, s0, lay)
  intra = intra_call(qp, kp_, gp, betap, vp, lay, bounded, interpret,
                      for_backward, g_min, inverse_dot, intra_order,
                      solve_apart)
  w, u, aqk, qg, kg, ec = intra[:6]
  states, v_new, s_final = run_state_pass(w, u, kg, ec, s0p, lay, interpret,
                                       state_pass)
  o = output_call(qg, aqk, v_new, states, lay, scale, v.dtype, interpret,
                   NUM_WARPS["output"], "kda_chunk_output", output_kernel)
  out = o[:, :lay["t"]], s_final[:, :, :lay["dk"]]
  if not for_backward:
    return out
  return out, intra


@functools.partial(jax.jit,
                   static_argnames=_STATIC + ("split", "order", "grad_bk"))
def _kda_bwd_impl(q, k, v, beta, s0, intra, g, do, ds_final, *,
                  scale, block_k, bounded, interpret, g_min, state_pass,
                  output_kernel, inverse_dot, intra_order, solve_apart, split,
                  order, grad_bk):
  """(dq, dk, dv, dg, dbeta, ds0) given do [B,T,H,V], ds_final [B,H,K,V] and
  the forward's residuals (the intra kernel's outputs, and g [B,T,H,K] when
  g_min clamps it: dg is zero where g < g_min; else g is None)."""
  del output_kernel, inverse_dot, intra_order, solve_apart  # forward's
  lay = call_layout(q, v, block_k)
  t, tp, dk, kp, dv = (lay[n] for n in ("t", "tp", "dk", "kp", "dv"))
  qp, kp_, vp, betap, s0p = prepare_inputs(q, k, v, beta, s0, lay)
  dop = pad_to(do.astype(v.dtype), tp, dv)
  dsfp = jnp.pad(ds_final.astype(F32),
                 ((0, 0), (0, 0), (0, kp - dk), (0, 0)))
  w, u, aqk, qg, kg, ec, bp, m, lk = intra
  # The state pass is re-run, not kept (O(T K V / C)): when the forward
  # and backward share one jit, XLA merges this call with the forward's
  # identical one (measured: keeping the states changed nothing, 18.19 ms).
  states, v_new, _ = run_state_pass(w, u, kg, ec, s0p, lay, interpret,
                                 state_pass)
  dv_intra = dvintra_call(aqk, dop, lay, scale, interpret)
  dstates, dv_new, ds0 = run_dstate_pass(qg, kg, ec, w, dop, dv_intra, dsfp,
                                      lay, scale, interpret, state_pass)
  dvp, du, da, dlk, dbeta_v = grad_v_call(m, lk, betap, vp, dop, v_new,
                                           dv_new, lay, scale, v.dtype,
                                           bounded, interpret)
  gp = None if g_min is None else pad_to(g.astype(F32), tp, kp)
  dq, dk_, dg, dbeta_k = grad_k_call(qp, kp_, bp, betap, dop, v_new, du, da,
                                      dlk, states, dstates, lay, scale,
                                      bounded, interpret, gp, g_min, split,
                                      order, grad_bk)
  dbeta = jnp.transpose(dbeta_v + jnp.sum(dbeta_k, axis=0), (0, 2, 1))[:, :t]
  # dq, dk come in q's and k's dtype from grad_k (no XLA convert pass).
  dq, dk_, dg = (x[:, :t, :, :dk] for x in (dq, dk_, dg))
  return (dq, dk_, dvp[:, :t], dg, dbeta.astype(beta.dtype), ds0[:, :, :dk])


@functools.partial(jax.custom_vjp,
                   nondiff_argnums=tuple(range(6, 19)))
def _kda_pallas_vjp(q, k, v, g, beta, s0, scale, block_k, bounded, interpret,
                    g_min, state_pass, output_kernel, inverse_dot,
                    intra_order, solve_apart, split, order, grad_bk):
  del split, order, grad_bk  # the backward's options
  return _kda_fwd_impl(q, k, v, g, beta, s0, scale=scale, block_k=block_k,
                       bounded=bounded, interpret=interpret, g_min=g_min,
                       state_pass=state_pass, output_kernel=output_kernel,
                       inverse_dot=inverse_dot, intra_order=intra_order,
                       solve_apart=solve_apart)


def _vjp_fwd(q, k, v, g, beta, s0, scale, block_k, bounded, interpret, g_min,
             state_pass, output_kernel, inverse_dot, intra_order, solve_apart,
             split, order, grad_bk):
  del split, order, grad_bk  # the backward's options
  # The forward keeps what its intra kernel built (b, W, U, Aqk, M, Lk, qg,
  # kg, ec): the backward does not re-run that kernel (H200, B1 T32768 H16
  # D128: 3.6 ms). g itself only when the clamp needs its mask.
  out, intra = _kda_fwd_impl(
      q, k, v, g, beta, s0, scale=scale, block_k=block_k, bounded=bounded,
      interpret=interpret, g_min=g_min, state_pass=state_pass,
      output_kernel=output_kernel, inverse_dot=inverse_dot,
      intra_order=intra_order, solve_apart=solve_apart, for_backward=True)
  return out, (q, k, v, beta, s0, intra, None if g_min is None else g)


def _vjp_bwd(scale, block_k, bounded, interpret, g_min, state_pass,
             output_kernel, inverse_dot, intra_order, solve_apart, split,
             order, grad_bk, res, cts):
  q, k, v, beta, s0, intra, g = res
  do, ds_final = cts
  return _kda_bwd_impl(q, k, v, beta, s0, intra, g, do, ds_final,
                       scale=scale, block_k=block_k, bounded=bounded,
                       interpret=interpret, g_min=g_min,
                       state_pass=state_pass, output_kernel=output_kernel,
                       inverse_dot=inverse_dot, intra_order=intra_order,
                       solve_apart=solve_apart, split=split, order=order,
                       grad_bk=grad_bk)


_kda_pallas_vjp.defvjp(_vjp_fwd, _vjp_bwd)


def _choice(name, given, default, allowed):
  """given, or default when None; ValueError naming the option unless the
  value is one of `allowed`."""
  value = default if given is None else given
  if value not in allowed:
    raise ValueError(f"{name} must be one of {allowed} or None, got "
                     f"{given!r}")
  return value


def kda_pallas(q, k, v, g, beta, *, scale, initial_state, chunk_size, g_min,
               interpret=False, bounded=None, block_k=None,
               split_grad_k=None, state_pass=None, output_kernel=None,
               inverse_dot=None, grad_k_order=None, grad_k_block_k=None,
               intra_order=None, solve_apart=None):
  """Chunked KDA, forward and backward as Pallas kernels (jax.custom_vjp).

  Args:
    q, k, g: [B, T, H, K]; v: [B, T, H, V] (fp32 or bf16; g fp32 log decay
      <= 0); beta: [B, T, H]. K, V multiples of 16 in [16, 256]; any T.
    scale: query scale or None (K**-0.5).
    initial_state: [B, H, K, V] or None (zeros).
    chunk_size: must be 64.
    g_min: None (unbounded path: any g <= 0, no clamp) or a python float in
      [-5.5, 0), the caller's promise g >= g_min (bounded path). On the
      bounded path g below g_min is clamped to g_min (zero gradient there).
    interpret: run the kernels in Pallas interpret mode (CPU).
    bounded: force the path (default: bounded iff g_min is given).
    block_k: K slice width inside the chunk kernels but grad_k (a power of
      two >= 16; default 32 on both paths).
    grad_k_block_k: grad_k's K slice width (a power of two >= 16; default
      BLOCK_K_GRAD_K = 64 on the bounded path, block_k on the unbounded).
    intra_order: "rows" or "slices": the order of the intra kernel's score
      loops (default INTRA_ORDER; see there).
    solve_apart: the intra kernel's triangular inverse, W and U in a kernel
      of their own after the scores (default SOLVE_APART; see there).
    split_grad_k: run the backward's contractions over V in a kernel of
      their own before grad_k (default SPLIT_GRAD_K; an ablation knob until
      timed on a card, results/kernels.md session 16).
    state_pass: "auto", "triton" or "mosaic": the sequential state and
      dstate passes as Triton or Mosaic GPU (wgmma) kernels (default
      STATE_PASS, "auto": Mosaic on a GPU where it applies, measured
      faster). "mosaic" needs bf16 inputs and K > 32.
    output_kernel: "triton" or "mosaic": the output kernel (default
      OUTPUT_KERNEL; "mosaic" needs bf16 inputs and K > 32).
    inverse_dot: "ieee", "tf32x3", "tf32" or "bf16x3": the intra kernel's
      triangular inverse on FFMA or on tensor-core MMAs (3xTF32, TF32, 3xbf16;
      default INVERSE_DOT; bf16 inputs on the GPU only, else IEEE).
    grad_k_order: "held", "stream" or "pull": the order of grad_k's work on
      its row tiles (default GRAD_K_ORDER; see there).
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
  if block_k is None:
    block_k = BLOCK_K if bounded else BLOCK_K_UNBOUNDED
  grad_bk = grad_k_block_k
  if grad_bk is None:
    grad_bk = BLOCK_K_GRAD_K if bounded and BLOCK_K_GRAD_K else block_k
  for name, value in (("block_k", block_k), ("grad_k_block_k", grad_bk)):
    if (isinstance(value, bool) or not isinstance(value, int)
        or value < TILE or value & (value - 1)):
      raise ValueError(f"{name} must be a power of two >= {TILE}, got "
                       f"{value!r}")
  scale = float(dk) ** -0.5 if scale is None else float(scale)
  if initial_state is None:
    initial_state = jnp.zeros((bsz, h, dk, dv), F32)
  # The clamp policy of the bounded path: the op is KDA on where(g < g_min,
  # g_min, g), with zero gradient below g_min (at g == g_min the gradient
  # passes). The intra kernel clamps as it loads g and grad_k masks dg: no
  # XLA passes over [B, T, H, K] fp32 (net ~1.1 GB less traffic at B1
  # T32768 H16 K128, grad_k's extra read of g counted; session 16, untimed).
  clamp = float(g_min) if bounded else None
  for name, given in (("split_grad_k", split_grad_k),
                      ("solve_apart", solve_apart)):
    if given is not None and not isinstance(given, bool):
      raise ValueError(f"{name} must be None, True or False, got {given!r}")
  split = SPLIT_GRAD_K if split_grad_k is None else split_grad_k
  apart = SOLVE_APART if solve_apart is None else solve_apart
  order, passes, out_kernel, intra, inv = (
      _choice(name, given, default, allowed) for name, given, default, allowed
      in (("grad_k_order", grad_k_order, GRAD_K_ORDER, GRAD_K_ORDERS),
          ("state_pass", state_pass, STATE_PASS, STATE_PASS_CHOICES),
          ("output_kernel", output_kernel, OUTPUT_KERNEL, STAGE_KERNELS),
          ("intra_order", intra_order, INTRA_ORDER, INTRA_ORDERS),
          ("inverse_dot", inverse_dot, INVERSE_DOT, INVERSE_DOTS)))
  kp = next_pow2(dk)
  passes = mosaic.resolve_state_pass(
      passes, kp, dv, v.dtype, kp, block_v(dv, BLOCK_V_PASS), interpret,
      kda=True)
  if passes == "mosaic":
    mosaic.check_state_pass(kp, dv, v.dtype, kp, BLOCK_V_PASS,
                                  mosaic.default_layout(interpret),
                                  whole_k=True)
  if out_kernel == "mosaic":
    mosaic.check_state_pass(kp, dv, v.dtype, kp, block_v(dv), "rows",
                                  whole_k=True, what="output_kernel")
  return _kda_pallas_vjp(q, k, v, g.astype(F32), beta,
                         initial_state.astype(F32), scale, int(block_k),
                         bool(bounded), bool(interpret), clamp, passes,
                         out_kernel, inv, intra, apart, split, order,
                         grad_bk)


def register():
  ops.register_backend("pallas", kda=kda_pallas)
  ops.register_backend("interpret",
                       kda=functools.partial(kda_pallas, interpret=True))
  if hasattr(ops, "set_bounded_only"):  # both paths exist: "auto" may pick
    ops.set_bounded_only("kda", False)  # the unbounded one for g_min=None


if __name__ == "__main__":
  # GPU self-check: B=1, T=32768, H=16, K=V=128 bf16, both paths, forward and
  # forward+backward. Run as:
  #   PYTHONPATH=. python pallas_kernels/linear_attention/kda_pallas.py \
  #       [--xla | --check]
  # The error checks use T=4096 (chunk_kda_ref's [B,H,N,C,C,K] intermediate
  # at T=32768 is ~8.6 GB); pass --xla to time the XLA reference at T=32768.
  import sys
  import time

  import numpy as np

  G_MIN_RUN = -5.0

  def make(t, bsz=1, h=16, dk=128, dv=128):
    keys = jax.random.split(jax.random.PRNGKey(0), 7)
    q = jax.random.normal(keys[0], (bsz, t, h, dk), F32)
    q = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
    k = jax.random.normal(keys[1], (bsz, t, h, dk), F32)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(keys[2], (bsz, t, h, dv), F32)
    g = G_MIN_RUN * jax.nn.sigmoid(
        2.0 * jax.random.normal(keys[3], (bsz, t, h, dk), F32) - 2.0)
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (bsz, t, h), F32))
    do = jax.random.normal(keys[5], (bsz, t, h, dv), F32)
    bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    return bf(q), bf(k), bf(v), g, beta, bf(do)

  def pallas_fn(g_min):
    return jax.jit(lambda q, k, v, g, beta: kda_pallas(
        q, k, v, g, beta, scale=None, initial_state=None, chunk_size=CHUNK,
        g_min=g_min))

  def grad_fn(fn):
    def loss(q, k, v, g, beta, do):
      o, s = fn(q, k, v, g, beta)
      return (jnp.sum(o.astype(F32) * do.astype(F32))
              + 1e-3 * jnp.sum(s * s))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))

  xla_fn = lambda q, k, v, g, beta: chunk_kda_ref(  # noqa: E731
      q, k, v, g, beta, chunk_size=CHUNK)
  up = lambda x: x.astype(F32)  # noqa: E731
  rel = lambda a, b: float(jnp.linalg.norm(up(a) - b) /  # noqa: E731
                           jnp.linalg.norm(b))

  def bench(fn, *args, n=20):
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(n):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))

  print("device:", jax.devices()[0])
  q, k, v, g, beta, do = make(4096)
  o_r, s_r = jax.jit(xla_fn)(up(q), up(k), up(v), g, beta)
  grads_r = grad_fn(xla_fn)(up(q), up(k), up(v), g, beta, do)
  for name, g_min in (("bounded", G_MIN_RUN), ("unbounded", None)):
    o_p, s_p = pallas_fn(g_min)(q, k, v, g, beta)
    print(f"T=4096 {name}: rel err o {rel(o_p, o_r):.3e}  final state "
          f"{rel(s_p, s_r):.3e}")
    grads_p = grad_fn(pallas_fn(g_min))(q, k, v, g, beta, do)
    print("  grads rel err " + "  ".join(
        f"{n} {rel(a, b):.3e}" for n, a, b in zip(
            ("dq", "dk", "dv", "dg", "dbeta"), grads_p, grads_r)))

  q, k, v, g, beta, do = make(32768)
  for name, g_min in (("bounded", G_MIN_RUN), ("unbounded", None)):
    fn = pallas_fn(g_min)
    print(f"T=32768 {name}: finite",
          bool(jnp.all(jnp.isfinite(up(fn(q, k, v, g, beta)[0])))))
    print(f"  pallas fwd: {bench(fn, q, k, v, g, beta):.3f} ms")
    print(f"  pallas fwd+bwd: "
          f"{bench(grad_fn(fn), q, k, v, g, beta, do):.3f} ms")
  if "--xla" in sys.argv:
    print(f"xla    fwd: {bench(jax.jit(xla_fn), q, k, v, g, beta):.3f} ms")
