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
inside the intra kernel (tile by tile, `_cumsum_tiles`), which also stores
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
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention import ops
from pallas_kernels.linear_attention import state_mosaic
from pallas_kernels.linear_attention.state_mosaic import (
    STAGE_KERNELS, STATE_PASS_CHOICES)
from pallas_kernels.linear_attention.chunk_common import (
    CHUNK, G_MIN_LOWEST, N_TILES, TILE, _F32, _NN, _NT, _TN, GMinError,
    _block_v, _chunk_spec, _compiler_params, _cumsum_tiles, _decay_tiles,
    _dot, _k_slice, _output_call, _pad, _pair_decay, _rows,
    _row_slice_scores, _shape_of, _square_spec, _store_row,
    _tile_iota, check_dims, check_g_min, _tile, _end_terms,
    _state_side_terms, _state_side_inputs, _row_slice_operands,
    _store_key_side_grads, _store_key_side_tile, _chunk_layout, _next_pow2,
    _pull_key_side_grads, _store_row_decays)
from pallas_kernels.linear_attention.reference import chunk_kda_ref
# K slice width of the bounded path. Narrow slices bound the live [16, bk]
# fp32 tiles: on an H200 (B1 T32768 H16 D128 bf16, experiments/profile_kda.py)
# bk=128 gave dv_intra 30.9 ms, grad 77.5 ms, fwd+bwd 121 ms; bk=32 gave
# 6.3, 37.1 and 56.4 ms (likely register spills at 128; results/kernels.md).
BLOCK_K = 32
BLOCK_K_UNBOUNDED = 32   # K slice width, unbounded path ([16, 16, bk] pairs)
# V block width of the two sequential passes (grid B x H x V/BV programs,
# each walking every chunk). H200, B1 T32768 H16 D128 bf16 bounded: 64 ->
# state 2.77, dstate 5.58 ms; 32 -> 2.34, 4.54 ms (more programs); with the
# decayed q, k precomputed by the intra kernel: 32 -> 1.47, 2.01 ms; 16 ->
# 1.49, 1.77 ms.
BLOCK_V_PASS = 16
# The per-chunk states S_n and dH_n are stored in the matmul dtype (bf16 with
# bf16 inputs; the passes carry them in fp32): the output and grad_k use them
# as dot operands, cast to that dtype anyway; only grad_k's chunk-end term
# sum_v dH * S reads them elementwise. H200 B1 T32768 bf16 bounded: fwd+bwd
# 10.24 -> 9.79 ms; dg error vs float64 1.61e-3 -> 1.62e-3 (T=640, slow
# decay; session 15).
# Triton launch parameters per kernel (read when a kernel is traced;
# experiments/profile_kda.py --warps sweeps them).
# H200, B1 T32768 H16 D128 bf16 bounded, ms at 1 / 2 / 4 / 8 warps:
#   intra 4.23 / 3.61 / 5.65 / 9.18     state 10.0 / 5.08 / 2.66 / 2.36
#   output 1.60 / 0.77 / 0.62 / 0.83    dv_intra 0.40 / 0.30 / 0.31 / 0.56
#   dstate 25.6 / 9.50 / 4.72 / 3.23    grad_v 1.60 / 0.99 / 0.79 / 1.04
#   grad_k 12.5 / 7.37 / 5.00 / 8.69    (results/kernels.md)
# The intra kernel with its K slices in a fori_loop (session 15), alone:
#   bounded 2.92 / 2.35 / 4.31 ms at 2 / 4 / 8 warps; unbounded 5.96 / 6.47
#   at 2 / 4.
# intra: the one intra kernel, or SOLVE_APART's scores kernel; solve: its
# solve kernel (8 warps for either was slower, session 20).
NUM_WARPS = dict(intra=4, solve=4, state=8, output=4, dv_intra=2, dstate=8,
                 grad_v=4, grad_k=4, state_side=8)   # state_side: 129 regs, no
# spill at 8 warps; 255 regs and 40 B of stack at 4 (kernel_resources).
# The backward's contractions over V (dO S^T, dU' S^T, V' dH^T, sum_v dH S)
# inside grad_k, per K slice in [16, V] tiles (False), or first in a kernel
# of their own with dense [C, bv] x [bv, BLOCK_K_STATE_SIDE] dots, read by
# grad_k as fp32 [C, w] slices (True). grad_k is the largest kernel (4.2 ms
# of ~10 at B1 T32768, 255 registers): the split takes its V loops and
# their [16, V] operands out, for ~1.6 GB of fp32 traffic (write + read) at
# that shape. H200, same process (session 17, ab_kernels): fused 10.88 /
# split 11.46 ms fwd+bwd at B1 T32768, 19.57 / 21.16 at B8 T8192: False.
SPLIT_GRAD_K = False
# The order of grad_k's work on its 4 row tiles: "held" (in order, every
# tile's results held to the end; `_grad_k_kernel`), "stream" (last first,
# each tile stored as soon as it is complete, q, k, b re-read per use) or
# "pull" (last first in a fori_loop, each tile forming all of its own
# gradients in inner loops: nothing held across tiles;
# `_grad_k_pull_kernel`). grad_k was 9.0 of 17.7 ms at B8 T8192 on an H200
# (session 18), latency-bound at 255 registers with spills. H100, same
# process (session 19, ab_kernels, fwd+bwd ms at B8 T8192 / B1 T32768):
# held 21.19 / 10.64, stream 22.43 / 11.22, pull 22.52 / 11.09 at w=32;
# pull with w=64 (BLOCK_K_GRAD_K) 19.31 / 9.76, held with w=64 25.14 /
# 12.62. Resource report (sm_90, K=V=128): bounded held 255 registers, 56 B
# stack; pull w=64 255, 80 B; unbounded held 2112 B of stack (975 LDL),
# pull 384 B (96 LDL). "pull" on both paths.
GRAD_K_ORDER = "pull"
GRAD_K_ORDERS = ("held", "stream", "pull")
BLOCK_K_STATE_SIDE = 64
# grad_k's own K slice width on the bounded path (None: the layout's
# BLOCK_K; the unbounded path keeps that, its [16, 16, w] pair tensors grow
# with w). Wider slices mean fewer programs re-reading each chunk's [C, C]
# and [C, V] blocks and longer state-side dots. H100 (session 19), pull
# order, fwd+bwd ms at B8 T8192 / B1 T32768: w=16 32.40 / 15.99, 32 22.52 /
# 11.09, 64 19.18 / 9.83, 128 20.44 / 10.45 (8 warps: w=64 23.87 / 12.36,
# 128 20.10 / 10.32).
BLOCK_K_GRAD_K = 64
# Two variants of the pull kernel measured within noise of it (H100,
# session 19; in 6d31444 as PULL_END_DOT / PULL_PLUS_DENSE): the chunk-end
# total from one [C, V] x [V, w] dot, and a row tile's "+b" terms as one
# [16, C] x [C, w] dot over masked key rows. grad_k at num_stages 1 was
# slower (+8%), at 3 within noise.
# The two sequential passes (state, dstate) as Triton kernels ("triton") or
# as Mosaic GPU kernels with warpgroup MMAs and TMA prefetch ("mosaic",
# state_mosaic.py: bf16 and K >= 64 only); "auto": Mosaic on a GPU where it
# applies, else Triton (state_mosaic.resolve_state_pass). H200, same
# process (session 17, ab_kernels, fwd+bwd): Triton 10.88 / Mosaic 9.69 ms
# at B1 T32768 H16 D128, 19.57 / 19.15 at B8 T8192 (o and gradients within
# 3e-5 of each other).
STATE_PASS = "auto"
# The output kernel O = scale ((q exp(b)) S + Aqk V') likewise: "triton" or
# "mosaic" (state_mosaic.output: both products into one wgmma accumulator,
# TMA-prefetched chunks). H200 (session 17): Mosaic 11.13 vs Triton 10.88
# ms at B1 T32768, 19.44 vs 19.57 at B8 T8192: "triton".
OUTPUT_KERNEL = "triton"
# The intra kernel's triangular inverse (fp32 [16, 16] dots) with bf16
# inputs: "ieee" (exact fp32, on FFMA: Triton has no IEEE fp32 MMA) or
# "tf32x3" (three TF32 tensor-core MMAs per dot, the operands split into a
# high and a low TF32 part: about fp32 accuracy). Resource report (session
# 17, sm_90, K = 128, bounded, with the backward's residuals): ieee 255
# registers, 200 B stack, 85 LDL / 41 STL, FFMA 1968, HMMA 130; tf32x3
# 255, 144 B, 40 / 28, FFMA 488, HMMA 418 (forward only: 488 B -> 96 B of
# stack). fp32 inputs keep IEEE (the fp32 path's contract) and interpret
# mode runs IEEE (the CPU has no TF32). H200, same process (session 17):
# tf32x3 is SLOWER despite the fewer spills, fwd 4.47 vs 3.53 ms and
# fwd+bwd 12.06 vs 10.88 ms at B1 T32768. Session 20 added "tf32" (one TF32
# MMA per dot: what fla's solve_tril uses on the GPU) and "bf16x3" (three
# bf16 MMAs, each operand split into a high and a low bf16 part). Inverse
# error vs float64 on the hard case (near-identical keys, beta ~ 1; tests,
# emulated): ieee 2.8e-7, tf32x3 3.1e-7, bf16x3 1.6e-5, tf32 9.1e-4, all
# under the bf16 rounding (3.9e-3) that M gets before the W, U and backward
# dots. H100, same process, SOLVE_APART, fwd+bwd ms at B8 T8192 / B1 T32768:
# ieee 18.66 / 9.32, bf16x3 18.13 / 9.19, tf32 17.88 / 8.99 (max difference
# of o and the gradients from ieee: 5.9e-5 bf16x3, 5.1e-4 tf32); with
# INTRA_ORDER "slices": bf16x3 17.90 / 9.00, tf32 17.59 / 8.84. T=131072
# bf16 vs a float64 recurrence with tf32: output 4.03e-3, final state
# 2.64e-3, as with ieee in session 18. "tf32" (bf16 inputs on the GPU; fp32
# inputs and interpret mode keep IEEE).
INVERSE_DOT = "tf32"
INVERSE_DOTS = ("ieee", "tf32x3", "tf32", "bf16x3")
_INVERSE_ALGORITHMS = dict(
    tf32x3=jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
    tf32=jax.lax.DotAlgorithmPreset.TF32_TF32_F32,
    bf16x3=jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3)
# The intra kernel's score loops: "rows" (per row tile, a fori_loop over
# the K slices) or "slices" (one fori_loop over the K slices, all rows
# inside: b computed once per slice; `_intra_scores_by_slice`).
# Resource report (sm_90, K=V=128, bf16, bounded, one intra kernel): rows
# 255 registers, 200 B stack, 85 / 41 LDL / STL, 6300 TTIR lines; slices
# 255, 560 B, 184 / 179, 5649 lines (fewer scans, more spills: the 20
# carried accumulators). As SOLVE_APART's scores kernel: rows 214 / 0 B,
# slices 255 / 296 B. Faster anyway (session 20, same process, fwd+bwd ms
# at B8 T8192 / B1 T32768): one kernel, H200: rows 17.41 / 8.71, slices
# 17.13 / 9.07; SOLVE_APART, H100: rows 18.66 / 9.32, slices 18.23 / 9.09;
# and with tf32 inverse dots, H100: rows 18.11 / 9.18, slices 17.59 / 8.84.
INTRA_ORDER = "slices"
INTRA_ORDERS = ("rows", "slices")
# The intra work as one kernel (False), or as two (True): the scores and
# decay stores (`_scores_kernel`, which then stores Lk in the forward too),
# then the inverse, W and U (`_solve_kernel`, reading Lk: 16 KB per chunk
# and head more traffic). fla splits the same work over three kernels (the
# diagonal tiles with their inverses, the rest of the inverse, W and U).
# Without its inverse the one kernel took 5.33 instead of 5.97 ms of the
# forward at B8 T8192 (H200, session 20, a timing-only copy). Resource
# report (sm_90, K=V=128, bf16, bounded, rows, ieee): one kernel 255
# registers, 200 B stack; apart: scores 214 / 0 B, solve 248 / 0 B (tf32:
# 180 / 0 B). H100, same process (session 20), fwd / fwd+bwd ms at B8
# T8192: one kernel 6.39 / 18.97, apart 6.10 / 18.66; B1 T32768: 3.25 / 9.44
# and 3.16 / 9.32. The solve kernel at 8 warps (20.38 at B8) and the scores
# at 8 (21.33) were slower. Bit-identical either way (tests).
SOLVE_APART = True
# The scores kernel's programs per chunk: the row tiles each one computes
# (its grid gains a 4th axis over the groups when there are several; every
# program recomputes b of tiles 0..its last row, and the one with row 3
# stores k exp(b_C - b) and exp(b_C)). One group: all 4 rows (the default,
# timed); ((0, 3), (1, 2)): two programs of 5 tile pairs each, ~half the
# live accumulators; ((0,), (1,), (2,), (3,)): fla's split of its diagonal
# kernel, unbalanced (1 to 4 tile pairs). Resource report (sm_90, K=V=128,
# bf16, bounded, registers / stack): one group, slices 255 / 296 B, rows
# 214 / 0; two groups, slices 233 / 0, rows 185 / 0; four, 176 / 0 either
# order. Untimed (session 20, built after the lease): one group.
SCORE_GROUPS = (tuple(range(N_TILES)),)
SCORE_GROUP_CHOICES = {1: (tuple(range(N_TILES)),), 2: ((0, 3), (1, 2)),
                       4: ((0,), (1,), (2,), (3,))}
NUM_STAGES = 2

__all__ = ["kda_pallas", "register", "GMinError", "G_MIN_LOWEST"]


def _params(kernel):
  return _compiler_params(NUM_WARPS[kernel], NUM_STAGES)


def _f32_dot(inverse_dot):
  """The fp32 [16, 16] dot of the triangular inverse: IEEE (`_dot`, fp32
  operands, Precision.HIGHEST) or a tensor-core form (INVERSE_DOTS: the
  DotAlgorithmPreset of `_INVERSE_ALGORITHMS`, e.g. TF32_TF32_F32_X3 for
  Triton's tf32x3 input precision)."""
  if inverse_dot == "ieee":
    return _dot
  algorithm = _INVERSE_ALGORITHMS[inverse_dot]

  def dot(a, b, dims=_NN):
    return jax.lax.dot_general(a, b, (dims, ((), ())), precision=algorithm,
                               preferred_element_type=_F32)
  return dot


def _inv_unit_lower_tile(n, row, col, dot=_dot):
  """(I + N)^-1 for one strictly lower [16, 16] fp32 tile, recursive doubling.

  X_1 = I; X_2s = X_s - X_s N_s X_s with N_s the part of N in the lower-left
  s x s block of each 2s x 2s diagonal block (see the module docstring).
  dot: the fp32 dot (`_f32_dot`).
  """
  x = jnp.where(row == col, 1.0, 0.0).astype(_F32)
  s, p = 1, 0
  while s < TILE:
    rb, cb = jnp.right_shift(row, p), jnp.right_shift(col, p)  # s-block ids
    off = (jnp.bitwise_and(rb, 1) == 1) & (cb == rb - 1)
    n_s = jnp.where(off, n, 0.0)
    x = x - dot(dot(x, n_s), x)
    s, p = 2 * s, p + 1
  return x


def _inverse_row(i, lt_row, mt, row, col, dot=_dot):
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
    _store_row(m_ref, i, [mt[i, j] for j in range(i + 1)])
  return mt


def _beta_tiles(beta_ref):
  """beta of the chunk as 4 x [16, 1] fp32 columns."""
  return [jax.lax.broadcast_in_dim(beta_ref[_rows(t)].astype(_F32),
                                   (TILE, 1), (0,)) for t in range(N_TILES)]


def _store_lower_product(out_ref, cols, mt, rhs, mm):
  """out[tile i, cols] = sum_{j <= i} M_ij rhs_j for lower-triangular tiles
  mt {(i, j): [16, 16]} and rhs 4 x [16, w]."""
  for i in range(N_TILES):
    acc = _dot(mt[i, 0], rhs[0], mm=mm)
    for j in range(1, i + 1):
      acc = acc + _dot(mt[i, j], rhs[j], mm=mm)
    out_ref[_rows(i), cols] = acc.astype(out_ref.dtype)


# ---------------------------------------------------------------------------
# Kernel 1: the chunk's matrices (Aqk, M, Lk), W and U, parallel over chunks.
# ---------------------------------------------------------------------------


def _intra_scores_by_slice(q_ref, k_ref, g_ref, b_ref, qg_ref, kg_ref,
                           ec_ref, bk, n_k, bounded, mm, g_min, causal,
                           rows=tuple(range(N_TILES))):
  """The intra kernel's score tiles with the K slices OUTSIDE the rows
  (INTRA_ORDER "slices"): one fori_loop over the slices, each computing b
  once for all 4 tiles and adding its part to all 10 tile pairs of Lk and
  Aqk (20 [16, 16] fp32 accumulators carried), where the "rows" order runs
  one loop over the slices per row tile and recomputes b of tiles 0..i
  (10 tile cumsums per slice instead of 4). Same products summed in the
  same slice order, same stores (`_store_row_decays`): bit-identical.
  rows: the row tiles to compute (SCORE_GROUPS; b of tiles 0..max(rows)).
  Returns (lk, aqk): per row tile in `rows`, the i + 1 tiles j <= i
  (unmasked)."""
  n_b = max(rows) + 1

  def body(kk, acc):
    cols = _k_slice(kk, bk)
    b, c, b_end = _cumsum_tiles(g_ref, cols, n_b, g_min)
    k_t = [k_ref[_rows(t), cols].astype(_F32) for t in range(n_b)]
    lk_acc, aqk_acc = acc
    new_lk, new_aqk = [], []
    for r, i in enumerate(rows):
      q_i = q_ref[_rows(i), cols].astype(_F32)
      _store_row_decays(i, cols, b, b_end, k_t, q_i, b_ref, qg_ref, kg_ref,
                        ec_ref)
      lk_s, aqk_s = _row_slice_scores(i, [k_t[i], q_i], k_t, b, c, causal,
                                      bounded, mm)
      new_lk.append(tuple(a + p for a, p in zip(lk_acc[r], lk_s)))
      new_aqk.append(tuple(a + p for a, p in zip(aqk_acc[r], aqk_s)))
    return tuple(new_lk), tuple(new_aqk)

  zeros = tuple(tuple(jnp.zeros((TILE, TILE), _F32) for _ in range(i + 1))
                for i in rows)
  return jax.lax.fori_loop(0, n_k, body, (zeros, zeros))


def _score_rows(q_ref, k_ref, g_ref, b_ref, qg_ref, kg_ref, ec_ref, *, bk,
                bounded, mm, g_min, order, rows=tuple(range(N_TILES))):
  """Row tiles i in `rows` (default 0..3) of Lk and Aqk, in order: yields
  (i, lk, aqk), each a list of the i + 1 [16, 16] fp32 tiles j <= i,
  masked (Lk strictly lower, Aqk inclusive). On the way it stores the
  decayed operands of those rows (b when b_ref is given, q exp(b); with row
  3, k exp(b_C - b) and exp(b_C); `_store_row_decays`).

  order "rows": per row tile, a fori_loop over the K slices (not unrolled:
  unrolling the slices and the 10 tile pairs gave ~11k lines of TTIR and a
  2-6 min ptxas compile); only one row's 2 (i + 1) score tiles are live in
  the loop. "slices": `_intra_scores_by_slice`, all rows inside one loop.
  """
  row, col = _tile_iota()
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
        cols = _k_slice(kk, bk)
        # b, and the decayed operands of the state passes and the output
        # (q exp(b) here; k exp(b_C - b), exp(b_C) on the last row) stored.
        b, c, k_t, q_i = _row_slice_operands(i, cols, q_ref, k_ref, g_ref,
                                             g_min, b_ref, qg_ref, kg_ref,
                                             ec_ref)
        lk_s, aqk_s = _row_slice_scores(i, [k_t[i], q_i], k_t, b, c,
                                        causal, bounded, mm)
        return (tuple(a + p for a, p in zip(acc[0], lk_s)),
                tuple(a + p for a, p in zip(acc[1], aqk_s)))

      zeros = tuple(jnp.zeros((TILE, TILE), _F32) for _ in range(i + 1))
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
    cols = _k_slice(kk, bk)
    b, _, _ = _cumsum_tiles(g_ref, cols, g_min=g_min)
    _store_lower_product(w_ref, cols, mt, [
        beta_t[j] * k_ref[_rows(j), cols].astype(_F32) * jnp.exp(b[j])
        for j in range(N_TILES)], mm)
    return carry

  jax.lax.fori_loop(0, k_ref.shape[-1] // bk, w_body, 0)
  for cv in range(0, v_ref.shape[-1], bv):
    cols = pl.ds(cv, bv)
    _store_lower_product(u_ref, cols, mt, [
        beta_t[j] * v_ref[_rows(j), cols].astype(_F32)
        for j in range(N_TILES)], mm)


def _intra_kernel(q_ref, k_ref, g_ref, beta_ref, v_ref, w_ref, u_ref,
                  aqk_ref, qg_ref, kg_ref, ec_ref, *grad_refs, bk, bv,
                  bounded, mm, g_min, inverse_dot="ieee", order="rows"):
  # q_ref, k_ref, g_ref, w_ref, qg_ref, kg_ref [C, Kp]; beta_ref [C];
  # v_ref, u_ref [C, V]; aqk_ref [C, C] (matmul dtype); ec_ref [Kp];
  # grad_refs: (b_ref [C, Kp] fp32, m_ref [C, C] matmul dtype, lk_ref
  # [C, C] fp32) when the backward needs them, else (). g_min: the bounded
  # path's clamp (g is clamped as it is loaded, _cumsum_tiles) or None.
  # inverse_dot: the triangular inverse's fp32 dots (INVERSE_DOT); order:
  # the score loops' order (INTRA_ORDER).
  #
  # Row tile by row tile (`_score_rows`): row i of Lk and Aqk, then row i of
  # M by block forward substitution from the rows above; then W and U.
  row, col = _tile_iota()
  beta_t = _beta_tiles(beta_ref)
  b_ref, m_ref, lk_ref = grad_refs if grad_refs else (None, None, None)
  mt = {}
  for i, lk, aqk in _score_rows(q_ref, k_ref, g_ref, b_ref, qg_ref, kg_ref,
                                ec_ref, bk=bk, bounded=bounded, mm=mm,
                                g_min=g_min, order=order):
    _store_row(aqk_ref, i, aqk)
    mt = _solve_row(i, lk, beta_t, mt, row, col, _f32_dot(inverse_dot),
                    m_ref)
    if lk_ref is not None:
      _store_row(lk_ref, i, lk)
  _store_w_u(mt, beta_t, k_ref, g_ref, v_ref, w_ref, u_ref, bk=bk, bv=bv,
             mm=mm, g_min=g_min)


def _scores_kernel(q_ref, k_ref, g_ref, aqk_ref, qg_ref, kg_ref, ec_ref,
                   lk_ref, *b_refs, bk, bounded, mm, g_min, order="rows",
                   groups=(tuple(range(N_TILES)),)):
  # SOLVE_APART's first kernel: the intra kernel's scores and decay stores,
  # no inverse. q_ref, k_ref, g_ref, qg_ref, kg_ref [C, Kp]; aqk_ref [C, C]
  # (matmul dtype); lk_ref [C, C] fp32; ec_ref [Kp]; b_refs: (b_ref [C, Kp]
  # fp32,) when the backward needs it. groups (SCORE_GROUPS): the row tiles
  # of each program along the grid's 4th axis (one group: no such axis).
  b_ref = b_refs[0] if b_refs else None

  def run(rows):
    for i, lk, aqk in _score_rows(q_ref, k_ref, g_ref, b_ref, qg_ref, kg_ref,
                                  ec_ref, bk=bk, bounded=bounded, mm=mm,
                                  g_min=g_min, order=order, rows=rows):
      _store_row(aqk_ref, i, aqk)
      _store_row(lk_ref, i, lk)

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
  row, col = _tile_iota()
  beta_t = _beta_tiles(beta_ref)
  mt = {}
  for i in range(N_TILES):
    mt = _solve_row(i, [_tile(lk_ref, i, j) for j in range(i + 1)], beta_t,
                    mt, row, col, _f32_dot(inverse_dot),
                    m_refs[0] if m_refs else None)
  _store_w_u(mt, beta_t, k_ref, g_ref, v_ref, w_ref, u_ref, bk=bk, bv=bv,
             mm=mm, g_min=g_min)


# ---------------------------------------------------------------------------
# Kernel 2: sequential state pass (and the new values V').
# ---------------------------------------------------------------------------


def _state_kernel(w_ref, u_ref, kg_ref, ec_ref, s0_ref, states_ref, vnew_ref,
                  sfin_ref, *, n_chunks, mm):
  # w_ref, kg_ref (k exp(b_C - b)) [Tp, Kp]; ec_ref (exp(b_C)) [N, Kp];
  # u_ref, vnew_ref [Tp, BV]; s0_ref, sfin_ref [Kp, BV]; states_ref
  # [N, Kp, BV].
  def body(n, s):
    states_ref[n] = s.astype(states_ref.dtype)
    rows = pl.ds(n * CHUNK, CHUNK)
    # V' = U - W S needs all of K: the state block is [K, BV].
    v_new = u_ref[rows, :].astype(_F32) - _dot(w_ref[rows, :], s, mm=mm)
    vnew_ref[rows, :] = v_new.astype(vnew_ref.dtype)
    return (ec_ref[n][:, None] * s
            + _dot(kg_ref[rows, :], v_new, _TN, mm))

  s = jax.lax.fori_loop(0, n_chunks, body, s0_ref[...].astype(_F32))
  sfin_ref[...] = s


# Kernel 3, the output O = scale ((q exp(b)) S + Aqk V'), is
# chunk_common._output_kernel (shared with GLA, where V' is v).


# ---------------------------------------------------------------------------
# Backward kernels.
# ---------------------------------------------------------------------------


def _dvintra_kernel(aqk_ref, do_ref, out_ref, *, scale, mm):
  # aqk_ref [C, C]; do_ref, out_ref [C, BV]: scale Aqk^T dO, one dense dot.
  out_ref[...] = scale * _dot(aqk_ref[...], do_ref[...], _TN, mm)


def _dstate_kernel(qg_ref, kg_ref, ec_ref, w_ref, do_ref, dvi_ref, dsfin_ref,
                   dstates_ref, dvnew_ref, ds0_ref, *, n_chunks, scale, mm):
  # qg_ref (q exp(b)), kg_ref (k exp(b_C - b)), w_ref [Tp, Kp]; ec_ref
  # (exp(b_C)) [N, Kp]; do_ref, dvi_ref, dvnew_ref [Tp, BV]; dsfin_ref,
  # ds0_ref [Kp, BV]; dstates_ref [N, Kp, BV] (grad wrt the state LEAVING
  # each chunk).
  def body(r, dh):
    n = n_chunks - 1 - r
    dstates_ref[n] = dh.astype(dstates_ref.dtype)
    rows = pl.ds(n * CHUNK, CHUNK)
    dv_new = dvi_ref[rows, :] + _dot(kg_ref[rows, :], dh, mm=mm)  # dV'
    dvnew_ref[rows, :] = dv_new.astype(dvnew_ref.dtype)
    return (ec_ref[n][:, None] * dh
            + scale * _dot(qg_ref[rows, :], do_ref[rows, :], _TN, mm)
            - _dot(w_ref[rows, :], dv_new, _TN, mm))

  ds0_ref[...] = jax.lax.fori_loop(0, n_chunks, body,
                                   dsfin_ref[...].astype(_F32))


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
  beta = jax.lax.broadcast_in_dim(beta_ref[...].astype(_F32), (c, 1), (0,))
  m = m_ref[...]
  dl = da = dbeta = None
  for cv in range(0, v_ref.shape[-1], bv):
    cols = pl.ds(cv, bv)
    du = _dot(m, dvn_ref[:, cols], _TN, mm)          # dU' = M^T dV'
    du_ref[:, cols] = du.astype(du_ref.dtype)
    dv_ref[:, cols] = (beta * du).astype(dv_ref.dtype)
    vn = vn_ref[:, cols]
    part_b = jnp.sum(du * v_ref[:, cols].astype(_F32), axis=1)
    part_l = _dot(du, vn, _NT, mm)
    part_a = _dot(do_ref[:, cols], vn, _NT, mm)
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
    return self._ref[_rows(t), :].astype(_F32)


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
  do_s, du_s, x_dh, dh_s = _state_side_terms(side, split, bv, mm, delta=True)
  row, col = _tile_iota()
  causal = row >= col
  beta_t = _beta_tiles(beta_ref)
  w = q_ref.shape[-1]
  b, c, b_last = _decay_tiles(b_ref, pl.ds(0, w))
  if stream:   # b's tile list is then used for b_last alone (dead loads)
    q_t, k_t, b = _TileLoads(q_ref), _TileLoads(k_ref), _TileLoads(b_ref)
  else:
    q_t = [q_ref[_rows(t), :].astype(_F32) for t in range(N_TILES)]
    k_t = [k_ref[_rows(t), :].astype(_F32) for t in range(N_TILES)]

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
  dk_neg, db_neg, d_end = _end_terms(x_dh, dh_s, k_t, b, b_last)
  later = None   # streamed: the reverse cumsum of the tiles stored so far
  for i in (reversed(range(N_TILES)) if stream else range(N_TILES)):
    b_i, q_i, k_i = b[i], q_t[i], k_t[i]
    eb = jnp.exp(b_i)
    dq_i = scale * do_s(i) * eb                               # (q exp(b)) S
    d_rk = -du_s(i)                                           # dR_k rows
    k_eb = k_i * eb
    dbeta_ref[_rows(i)] = jnp.sum(d_rk * k_eb, axis=1)
    dk_i = beta_t[i] * d_rk * eb
    db_i = q_i * dq_i + beta_t[i] * d_rk * k_eb
    x_scale = jnp.exp(b_i - c[i])                             # <= 1
    q_dec = (q_i * x_scale).astype(mm)
    k_dec = (k_i * x_scale).astype(mm)
    acc_q = acc_k = None
    for j in range(i + 1):
      da, dlk = _tile(da_ref, i, j), _tile(dlk_ref, i, j)
      if j == i and not bounded:
        pd = _pair_decay(b_i, causal)                         # [16, 16, w]
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
      t_q = _dot(da, y_dec, _NN, mm)
      t_k = _dot(dlk, y_dec, _NN, mm)
      acc_q = t_q if acc_q is None else acc_q + t_q
      acc_k = t_k if acc_k is None else acc_k + t_k
      t_n = _dot(da, q_dec, _TN, mm) + _dot(dlk, k_dec, _TN, mm)
      dk_neg[j] = dk_neg[j] + t_n * y_scale
      db_neg[j] = db_neg[j] + t_n * y_dec.astype(_F32)
    if acc_q is not None:
      dq_i = dq_i + acc_q * x_scale
      dk_i = dk_i + acc_k * x_scale
      db_i = db_i + acc_q * q_dec.astype(_F32) + acc_k * k_dec.astype(_F32)
    if stream:   # tile i is complete: store it and drop it
      later = _store_key_side_tile(
          i, dq_i, dk_i + dk_neg[i], db_i - db_neg[i], d_end, later,
          dq_ref, dk_ref, dg_ref, g_ref, g_min)
      dk_neg[i] = db_neg[i] = None
    else:
      dq[i], dk_pos[i], db_pos[i] = dq_i, dk_i, db_i
  if not stream:
    _store_key_side_grads(
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
  do_s, du_s, x_dh, dh_s = _state_side_terms(side, split, bv, mm, delta=True)

  def row_terms(i, q_i, k_i, b_i):   # through S and the delta-rule rows
    beta_i = jax.lax.broadcast_in_dim(
        beta_ref[_rows(i)].astype(_F32), (TILE, 1), (0,))
    eb = jnp.exp(b_i)
    dq_i = scale * do_s(i) * eb                               # (q exp(b)) S
    d_rk = -du_s(i)                                           # dR_k rows
    k_eb = k_i * eb
    dbeta_ref[_rows(i)] = jnp.sum(d_rk * k_eb, axis=1)
    return (dq_i, beta_i * d_rk * eb,
            q_i * dq_i + beta_i * d_rk * k_eb)

  _pull_key_side_grads(row_terms, [(da_ref, False), (dlk_ref, True)], q_ref,
                       k_ref, b_ref, g_ref, x_dh, dh_s, dq_ref, dk_ref,
                       dg_ref, bounded=bounded, mm=mm, g_min=g_min)


# ---------------------------------------------------------------------------
# Wrappers.
# ---------------------------------------------------------------------------


# Block specs (see also chunk_common). Chunk-parallel grids are (B, H, N) or
# (B, H, N, j) with j a V block or a K slice; the sequential passes have grid
# (B, H, j), j a V block.


def _beta_spec():
  """Chunk n of beta [B, H, Tp]; grid (B, H, N[, j])."""
  return pl.BlockSpec((None, None, CHUNK), lambda b, h, n, *_: (b, h, n))


def _pass_specs(lay):
  """Specs of the sequential passes, grid (B, H, V block j): all of T of a
  [B, Tp, H, Kp] array, all of T of a [B, Tp, H, V] array in block j, one
  [Kp, BV] state of [B, H, Kp, V], and the per-chunk states [B, H, N, Kp, V].
  """
  tp, kp, bv, n = lay["tp"], lay["kp"], lay["bv_pass"], lay["n_chunks"]
  seq_k = pl.BlockSpec((None, tp, None, kp), lambda b, h, j: (b, 0, h, 0))
  seq_v = pl.BlockSpec((None, tp, None, bv), lambda b, h, j: (b, 0, h, j))
  state = pl.BlockSpec((None, None, kp, bv), lambda b, h, j: (b, h, 0, j))
  states = pl.BlockSpec((None, None, n, kp, bv),
                        lambda b, h, j: (b, h, 0, 0, j))
  return seq_k, seq_v, state, states


def _pass_ec_spec(lay):
  """All of exp(b_C) [B, H, N, Kp] of (b, h); grid (B, H, V block j)."""
  return pl.BlockSpec((None, None, lay["n_chunks"], lay["kp"]),
                      lambda b, h, j: (b, h, 0, 0))


def _layout(q, v, block_k):
  return _chunk_layout(q, v, block_k=block_k, bv_pass=BLOCK_V_PASS)


def _prepare_inputs(q, k, v, beta, s0, lay):
  """Padded q, k [B, Tp, H, Kp], v [B, Tp, H, V], beta [B, H, Tp] fp32 and
  s0 [B, H, Kp, V] fp32."""
  tp, kp, dk = lay["tp"], lay["kp"], lay["dk"]
  qp, kp_ = _pad(q, tp, kp), _pad(k, tp, kp)
  vp = _pad(v, tp, lay["dv"])
  betap = jnp.pad(jnp.transpose(beta.astype(_F32), (0, 2, 1)),
                  ((0, 0), (0, 0), (0, tp - lay["t"])))       # [B, H, Tp]
  s0p = jnp.pad(s0.astype(_F32), ((0, 0), (0, 0), (0, kp - dk), (0, 0)))
  return qp, kp_, vp, betap, s0p


def _prepare(q, k, v, g, beta, s0, lay):
  """_prepare_inputs plus g padded to [B, Tp, H, Kp] fp32 (zeros: inert)."""
  qp, kp_, vp, betap, s0p = _prepare_inputs(q, k, v, beta, s0, lay)
  return qp, kp_, vp, _pad(g.astype(_F32), lay["tp"], lay["kp"]), betap, s0p


def _intra_call(qp, kp_, gp, betap, vp, lay, bounded, interpret,
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
  inverse_dot = "ieee" if interpret or mm == _F32 else inverse_dot
  grid = (lay["bsz"], lay["h"], lay["n_chunks"])
  square = _shape_of(lay, "bsz", "h", "tp", "chunk", dtype=mm)
  lk_shape = _shape_of(lay, "bsz", "h", "tp", "chunk")
  seq_k_mm = _shape_of(lay, "bsz", "tp", "h", "kp", dtype=mm)
  seq_k = _shape_of(lay, "bsz", "tp", "h", "kp")
  seq_v_mm = _shape_of(lay, "bsz", "tp", "h", "dv", dtype=mm)
  ec_spec = pl.BlockSpec((None, None, None, kp),
                         lambda b, h, n, *_: (b, h, n, 0))
  ec_shape = _shape_of(lay, "bsz", "h", "n_chunks", "kp")
  if not solve_apart:
    out_specs = [_chunk_spec(kp), _chunk_spec(dv), _square_spec(),
                 _chunk_spec(kp), _chunk_spec(kp), ec_spec]
    out_shape = [seq_k_mm, seq_v_mm, square, seq_k_mm, seq_k_mm, ec_shape]
    if for_backward:
      out_specs += [_chunk_spec(kp), _square_spec(), _square_spec()]
      out_shape += [seq_k, square, lk_shape]
    return pl.pallas_call(
        functools.partial(_intra_kernel, bk=lay["bk"], bv=lay["bv"],
                          bounded=bounded, mm=mm, g_min=g_min,
                          inverse_dot=inverse_dot, order=intra_order),
        grid=grid,
        in_specs=[_chunk_spec(kp), _chunk_spec(kp), _chunk_spec(kp),
                  _beta_spec(), _chunk_spec(dv)],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_params("intra"),
        interpret=interpret,
        name="kda_chunk_intra",
    )(qp, kp_, gp, betap, vp)
  # Kernel 1a: Aqk, qg, kg, ec, Lk (+ b).
  out_specs = [_square_spec(), _chunk_spec(kp), _chunk_spec(kp), ec_spec,
               _square_spec()]
  out_shape = [square, seq_k_mm, seq_k_mm, ec_shape, lk_shape]
  if for_backward:
    out_specs.append(_chunk_spec(kp))
    out_shape.append(seq_k)
  groups = SCORE_GROUPS
  scores = pl.pallas_call(
      functools.partial(_scores_kernel, bk=lay["bk"], bounded=bounded,
                        mm=mm, g_min=g_min, order=intra_order,
                        groups=groups),
      grid=grid + ((len(groups),) if len(groups) > 1 else ()),
      in_specs=[_chunk_spec(kp)] * 3,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=_params("intra"),
      interpret=interpret,
      name="kda_chunk_scores",
  )(qp, kp_, gp)
  aqk, qg, kg, ec, lk = scores[:5]
  # Kernel 1b: M (+ stored), W, U.
  out_specs = [_chunk_spec(kp), _chunk_spec(dv)]
  out_shape = [seq_k_mm, seq_v_mm]
  if for_backward:
    out_specs.append(_square_spec())
    out_shape.append(square)
  solved = pl.pallas_call(
      functools.partial(_solve_kernel, bk=lay["bk"], bv=lay["bv"], mm=mm,
                        g_min=g_min, inverse_dot=inverse_dot),
      grid=grid,
      in_specs=[_square_spec(), _chunk_spec(kp), _chunk_spec(kp),
                _beta_spec(), _chunk_spec(dv)],
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=_params("solve"),
      interpret=interpret,
      name="kda_chunk_solve",
  )(lk, kp_, gp, betap, vp)
  out = [solved[0], solved[1], aqk, qg, kg, ec]
  if for_backward:
    out += [scores[5], solved[2], lk]
  return out


def _state_call(w, u, kg, ec, s0p, lay, interpret):
  """Kernel 2: states entering each chunk, V', the final state."""
  seq_k, seq_v, state, states = _pass_specs(lay)
  return pl.pallas_call(
      functools.partial(_state_kernel, n_chunks=lay["n_chunks"], mm=lay["mm"]),
      grid=(lay["bsz"], lay["h"], lay["nv_pass"]),
      in_specs=[seq_k, seq_v, seq_k, _pass_ec_spec(lay), state],
      out_specs=[states, seq_v, state],
      out_shape=[
          _shape_of(lay, "bsz", "h", "n_chunks", "kp", "dv", dtype=lay["mm"]),
          _shape_of(lay, "bsz", "tp", "h", "dv", dtype=lay["mm"]),
          _shape_of(lay, "bsz", "h", "kp", "dv"),
      ],
      compiler_params=_params("state"),
      interpret=interpret,
      name="kda_state_pass",
  )(w, u, kg, ec, s0p)


def _state_pass(w, u, kg, ec, s0p, lay, interpret, state_pass):
  """Kernel 2 as Triton ("triton") or Mosaic GPU ("mosaic") kernels."""
  if state_pass == "mosaic":
    layout = state_mosaic.default_layout(interpret)
    return state_mosaic.state_pass(
        state_mosaic.as_layout(kg, layout), u, ec, s0p, w=w,
        bv=lay["bv_pass"], layout=layout, interpret=interpret)
  return _state_call(w, u, kg, ec, s0p, lay, interpret)


def _dvintra_call(aqk, dop, lay, scale, interpret):
  """scale Aqk^T dO [B, Tp, H, V] fp32: the state-independent part of dV'."""
  bv = lay["bv"]
  return pl.pallas_call(
      functools.partial(_dvintra_kernel, scale=scale, mm=lay["mm"]),
      grid=(lay["bsz"], lay["h"], lay["n_chunks"], lay["nv"]),
      in_specs=[_square_spec(), _chunk_spec(bv, True)],
      out_specs=_chunk_spec(bv, True),
      out_shape=_shape_of(lay, "bsz", "tp", "h", "dv"),
      compiler_params=_params("dv_intra"),
      interpret=interpret,
      name="kda_chunk_dv_intra",
  )(aqk, dop)


def _dstate_call(qg, kg, ec, w, dop, dv_intra, dsfp, lay, scale, interpret):
  """Reverse pass over chunks: dH_n [B, H, N, Kp, V] and dV' [B, Tp, H, V]
  in the matmul dtype, dS_0 fp32."""
  seq_k, seq_v, state, states = _pass_specs(lay)
  return pl.pallas_call(
      functools.partial(_dstate_kernel, n_chunks=lay["n_chunks"], scale=scale,
                        mm=lay["mm"]),
      grid=(lay["bsz"], lay["h"], lay["nv_pass"]),
      in_specs=[seq_k, seq_k, _pass_ec_spec(lay), seq_k, seq_v, seq_v, state],
      out_specs=[states, seq_v, state],
      out_shape=[
          _shape_of(lay, "bsz", "h", "n_chunks", "kp", "dv", dtype=lay["mm"]),
          _shape_of(lay, "bsz", "tp", "h", "dv", dtype=lay["mm"]),
          _shape_of(lay, "bsz", "h", "kp", "dv"),
      ],
      compiler_params=_params("dstate"),
      interpret=interpret,
      name="kda_dstate_pass",
  )(qg, kg, ec, w, dop, dv_intra, dsfp)


def _dstate_pass(qg, kg, ec, w, dop, dv_intra, dsfp, lay, scale, interpret,
                 state_pass):
  """The reverse pass as Triton ("triton") or Mosaic GPU ("mosaic")
  kernels."""
  if state_pass == "mosaic":
    layout = state_mosaic.default_layout(interpret)
    return state_mosaic.kda_dstate_pass(
        state_mosaic.as_layout(qg, layout), kg,
        state_mosaic.as_layout(w, layout), ec, dop, dv_intra, dsfp,
        scale=scale, bv=lay["bv_pass"], layout=layout, interpret=interpret)
  return _dstate_call(qg, kg, ec, w, dop, dv_intra, dsfp, lay, scale,
                      interpret)


def _grad_v_call(m, lk, betap, vp, dop, v_new, dv_new, lay, scale, dtype,
                 bounded, interpret):
  """Per chunk, all of V: dv [B, Tp, H, V] in dtype; dU' [B, Tp, H, V] and,
  on the bounded path, dAqk, dLk [B, H, Tp, C] in the matmul dtype (fp32 on
  the unbounded path); the V-side part of dbeta [B, H, Tp] fp32.

  dU', dAqk and dLk are read only by grad_k, once per K slice. Its bounded
  path uses them only as dot operands, which _dot casts to the matmul dtype,
  so storing them in that dtype changes no bit and halves their traffic
  with bf16 inputs; the unbounded path's position-pair products need dAqk
  and dLk in fp32."""
  dv, mm = lay["dv"], lay["mm"]
  square_dtype = mm if bounded else _F32
  return pl.pallas_call(
      functools.partial(_grad_v_kernel, scale=scale, bv=lay["bv"], mm=mm),
      grid=(lay["bsz"], lay["h"], lay["n_chunks"]),
      in_specs=[_square_spec(), _square_spec(), _beta_spec()]
      + [_chunk_spec(dv)] * 4,
      out_specs=[_chunk_spec(dv), _chunk_spec(dv), _square_spec(),
                 _square_spec(), _beta_spec()],
      out_shape=[
          _shape_of(lay, "bsz", "tp", "h", "dv", dtype=dtype),
          _shape_of(lay, "bsz", "tp", "h", "dv", dtype=mm),
          _shape_of(lay, "bsz", "h", "tp", "chunk", dtype=square_dtype),
          _shape_of(lay, "bsz", "h", "tp", "chunk", dtype=square_dtype),
          _shape_of(lay, "bsz", "h", "tp"),
      ],
      compiler_params=_params("grad_v"),
      interpret=interpret,
      name="kda_chunk_grad_v",
  )(m, lk, betap, vp, dop, v_new, dv_new)


def _grad_k_call(qp, kp_, bp, betap, dop, v_new, du, da, dlk, states,
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
  k_slice = _chunk_spec(bk, True)
  side, side_specs = _state_side_inputs(
      [dop, du, v_new], (False, False, True), states, dstates, lay, split,
      BLOCK_K_STATE_SIDE, NUM_WARPS["state_side"], interpret,
      "kda_chunk_state_side")
  return pl.pallas_call(
      functools.partial(kernel, scale=scale, bv=_block_v(dv, cap=128),
                        bounded=bounded, mm=lay["mm"], g_min=g_min,
                        split=split),
      grid=(lay["bsz"], lay["h"], lay["n_chunks"], nk),
      in_specs=[k_slice] * 4 + [_beta_spec(), _square_spec(), _square_spec()]
      + side_specs,
      out_specs=[k_slice, k_slice, k_slice,
                 pl.BlockSpec((None, None, None, CHUNK),
                              lambda b, h, n, j: (j, b, h, n))],
      out_shape=[_shape_of(lay, "bsz", "tp", "h", "kp", dtype=qp.dtype),
                 _shape_of(lay, "bsz", "tp", "h", "kp", dtype=kp_.dtype),
                 _shape_of(lay, "bsz", "tp", "h", "kp"),
                 jax.ShapeDtypeStruct((nk, lay["bsz"], lay["h"], lay["tp"]),
                                      _F32)],
      compiler_params=_params("grad_k"),
      interpret=interpret,
      name="kda_chunk_grad_k",
  )(qp, kp_, bp, gp, betap, da, dlk, *side)


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
  lay = _layout(q, v, block_k)
  qp, kp_, vp, gp, betap, s0p = _prepare(q, k, v, g, beta, s0, lay)
  intra = _intra_call(qp, kp_, gp, betap, vp, lay, bounded, interpret,
                      for_backward, g_min, inverse_dot, intra_order,
                      solve_apart)
  w, u, aqk, qg, kg, ec = intra[:6]
  states, v_new, s_final = _state_pass(w, u, kg, ec, s0p, lay, interpret,
                                       state_pass)
  o = _output_call(qg, aqk, v_new, states, lay, scale, v.dtype, interpret,
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
  lay = _layout(q, v, block_k)
  t, tp, dk, kp, dv = (lay[n] for n in ("t", "tp", "dk", "kp", "dv"))
  qp, kp_, vp, betap, s0p = _prepare_inputs(q, k, v, beta, s0, lay)
  dop = _pad(do.astype(v.dtype), tp, dv)
  dsfp = jnp.pad(ds_final.astype(_F32),
                 ((0, 0), (0, 0), (0, kp - dk), (0, 0)))
  w, u, aqk, qg, kg, ec, bp, m, lk = intra
  # The state pass is re-run, not kept (O(T K V / C)): when the forward
  # and backward share one jit, XLA merges this call with the forward's
  # identical one (measured: keeping the states changed nothing, 18.19 ms).
  states, v_new, _ = _state_pass(w, u, kg, ec, s0p, lay, interpret,
                                 state_pass)
  dv_intra = _dvintra_call(aqk, dop, lay, scale, interpret)
  dstates, dv_new, ds0 = _dstate_pass(qg, kg, ec, w, dop, dv_intra, dsfp,
                                      lay, scale, interpret, state_pass)
  dvp, du, da, dlk, dbeta_v = _grad_v_call(m, lk, betap, vp, dop, v_new,
                                           dv_new, lay, scale, v.dtype,
                                           bounded, interpret)
  gp = None if g_min is None else _pad(g.astype(_F32), tp, kp)
  dq, dk_, dg, dbeta_k = _grad_k_call(qp, kp_, bp, betap, dop, v_new, du, da,
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
    initial_state = jnp.zeros((bsz, h, dk, dv), _F32)
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
  kp = _next_pow2(dk)
  passes = state_mosaic.resolve_state_pass(
      passes, kp, dv, v.dtype, kp, _block_v(dv, BLOCK_V_PASS), interpret,
      kda=True)
  if passes == "mosaic":
    state_mosaic.check_state_pass(kp, dv, v.dtype, kp, BLOCK_V_PASS,
                                  state_mosaic.default_layout(interpret),
                                  whole_k=True)
  if out_kernel == "mosaic":
    state_mosaic.check_state_pass(kp, dv, v.dtype, kp, _block_v(dv), "rows",
                                  whole_k=True, what="output_kernel")
  return _kda_pallas_vjp(q, k, v, g.astype(_F32), beta,
                         initial_state.astype(_F32), scale, int(block_k),
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
    q = jax.random.normal(keys[0], (bsz, t, h, dk), _F32)
    q = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
    k = jax.random.normal(keys[1], (bsz, t, h, dk), _F32)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(keys[2], (bsz, t, h, dv), _F32)
    g = G_MIN_RUN * jax.nn.sigmoid(
        2.0 * jax.random.normal(keys[3], (bsz, t, h, dk), _F32) - 2.0)
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (bsz, t, h), _F32))
    do = jax.random.normal(keys[5], (bsz, t, h, dv), _F32)
    bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    return bf(q), bf(k), bf(v), g, beta, bf(do)

  def pallas_fn(g_min):
    return jax.jit(lambda q, k, v, g, beta: kda_pallas(
        q, k, v, g, beta, scale=None, initial_state=None, chunk_size=CHUNK,
        g_min=g_min))

  def grad_fn(fn):
    def loss(q, k, v, g, beta, do):
      o, s = fn(q, k, v, g, beta)
      return (jnp.sum(o.astype(_F32) * do.astype(_F32))
              + 1e-3 * jnp.sum(s * s))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))

  xla_fn = lambda q, k, v, g, beta: chunk_kda_ref(  # noqa: E731
      q, k, v, g, beta, chunk_size=CHUNK)
  up = lambda x: x.astype(_F32)  # noqa: E731
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
