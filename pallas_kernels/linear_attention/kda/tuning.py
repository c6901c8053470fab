"""KDA kernels' block sizes, launch parameters and options."""
from __future__ import annotations

import jax

from pallas_kernels.linear_attention.common.tiles import (
    N_TILES, compiler_params)


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
# mosaic.py: bf16 and K >= 64 only); "auto": Mosaic on a GPU where it
# applies, else Triton (mosaic.resolve_state_pass). H200, same
# process (session 17, ab_kernels, fwd+bwd): Triton 10.88 / Mosaic 9.69 ms
# at B1 T32768 H16 D128, 19.57 / 19.15 at B8 T8192 (o and gradients within
# 3e-5 of each other).
STATE_PASS = "auto"


# The output kernel O = scale ((q exp(b)) S + Aqk V') likewise: "triton" or
# "mosaic" (mosaic.output: both products into one wgmma accumulator,
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


INVERSE_ALGORITHMS = dict(
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


def kernel_params(kernel):
  return compiler_params(NUM_WARPS[kernel], NUM_STAGES)
