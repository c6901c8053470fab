"""Chunked GLA as Pallas kernels (Triton lowering): forward and backward.

DESIGN 3.1 / 3.2 / 4. Registered as the "pallas" (GPU) and "interpret" (the
same kernels interpreted on CPU) backends of `ops.gla`.

GLA, per token: S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T, o_t = scale S_t^T q_t.
Chunked form (chunk C = 64 = 4 tiles of 16, b = within-chunk inclusive cumsum
of g, b_C its last row, S = S_n the state entering chunk n):
    A_ij    = sum_d q_id k_jd exp(b_id - b_jd)  (j <= i)
    O       = scale ((q exp(b)) S + A v)
    S_{n+1} = diag(exp(b_C)) S + (k exp(b_C - b))^T v.
The kernels are those of kda_pallas without the delta rule (no Lk, inverse,
W, U or V'), built from the same pieces (chunk_common), so that what was
measured on one carries to the other (results/kernels.md, session 16).

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
    3. the output, O = scale ((q exp(b)) S + A v), chunk_common's kernel
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
       the cumsum as in exact arithmetic (chunk_common, kda_pallas).
       dq, dk are stored in q's and k's dtype.
The wrapper pads T with q=k=v=0, g=0 (inert) and K to a power of two with
zero channels, only when needed, and slices back. Dots accumulate in fp32;
with bf16 inputs their operands are bf16.

Session 16 rebuilt GLA this way (before: the state passes cumsummed g on
their critical path, the output and grad kernels recomputed A per V block,
the grad kernel wrote per-V-block partial dq, dk and XLA formed dg; H200 B1
T32768 H16 D128 bf16: 3.96 ms forward, 13.37 ms forward+backward, against
fla chunk_gla's 1.78 / 6.88; results/kernels.md). The rebuilt kernels are
not yet timed on a card.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention.chunk_common import (
    CHUNK, G_MIN_LOWEST, MAX_DIM, N_TILES, TILE, _F32, _NN, _NT, _TN,
    GMinError, _block_v, _chunk_layout, _chunk_spec, _compiler_params,
    _decay_tiles, _dot, _end_terms, _k_slice, _output_call, _pad,
    _pair_decay, _row_slice_scores, _rows, _shape_of, _square_spec,
    _state_side_inputs, _state_side_terms, _store_key_side_grads, _store_row,
    _row_slice_operands, _tile, _tile_iota, check_dims, check_g_min,
    _next_pow2, _pull_key_side_grads)
from pallas_kernels.linear_attention import state_mosaic
from pallas_kernels.linear_attention.state_mosaic import (
    STAGE_KERNELS, STATE_PASS_CHOICES)

__all__ = ["gla_pallas", "register", "Tuning", "DEFAULT_TUNING", "check_tuning",
           "GMinError", "G_MIN_LOWEST", "CHUNK", "TILE", "MAX_DIM",
           "check_dims", "check_g_min"]


@dataclasses.dataclass(frozen=True)
class Tuning:
  """Block sizes and launch parameters (defaults: KDA's measured choices on
  an H200, results/kernels.md; GLA's own sweep is bench_kernels --tune)."""
  block_k: int = 32         # K slice width of the intra and grad_k kernels
  pass_bk: int = 64         # K block of the sequential passes
  pass_bv: int = 16         # V block of the sequential passes
  bv: int = 64              # V block of the output kernel and the dv loop
  grad_bv: int = 128        # V block of grad_k's contractions over V
  intra_warps: int = 4
  pass_warps: int = 4
  output_warps: int = 4
  dv_warps: int = 4
  grad_k_warps: int = 4
  num_stages: int = 2
  # The contractions over V (dO S^T, v dH^T, sum_v dH S) in a kernel of
  # their own before grad_k (see kda_pallas.SPLIT_GRAD_K); untimed.
  split_grad_k: bool = False
  state_side_bk: int = 64
  state_side_warps: int = 4
  # grad_k's order on its row tiles: "held" (in order, every tile's results
  # held to the end) or "pull" (last first in a fori_loop, each tile forming
  # all of its own gradients: chunk_common._pull_key_side_grads), and its K
  # slice width (None: GRAD_K_BK_BOUNDED on the bounded path and block_k on
  # the unbounded one, whose [16, 16, w] pair tensors grow with w; a value
  # applies to both paths, as kda_pallas's grad_k_block_k). KDA's grad_k,
  # pull at 64 against held at 32, went 21.1 -> 19.2 ms fwd+bwd at B8 T8192
  # and 10.6 -> 9.8 at B1 T32768 (H100, session 19). GLA's, same process
  # (H200, session 20, ab_kernels, fwd+bwd ms at B8 T8192 / B1 T32768):
  # held w=32 12.26 / 6.59, pull w=32 11.76 / 5.92, pull w=64 11.18 / 5.71.
  grad_k_order: str = "pull"
  grad_k_bk: int | None = None
  # The state and dstate passes as Triton ("triton") or Mosaic GPU
  # ("mosaic": wgmma + TMA, state_mosaic.py, blocks pass_bk x pass_bv; bf16,
  # K >= 64) kernels; "auto": Mosaic on a GPU where it applies. H200 B1
  # T32768 H16 D128 fwd+bwd (session 17): Triton 6.73, Mosaic 6.37 ms.
  state_pass: str = "auto"
  # The output kernel likewise ("mosaic": state_mosaic.output, block bv);
  # H200 (session 17): 6.69 vs 6.73 ms, within noise: "triton".
  output_kernel: str = "triton"

  def params(self, kernel):
    return _compiler_params(getattr(self, f"{kernel}_warps"), self.num_stages)


GRAD_K_BK_BOUNDED = 64   # Tuning.grad_k_bk=None on the bounded path
DEFAULT_TUNING = Tuning()
GRAD_K_ORDERS = ("held", "pull")


# ---------------------------------------------------------------------------
# Kernels.
# ---------------------------------------------------------------------------


def _intra_kernel(q_ref, k_ref, g_ref, aqk_ref, qg_ref, kg_ref, ec_ref,
                  *b_refs, bk, bounded, mm, g_min):
  # q_ref, k_ref, g_ref [C, Kp]; aqk_ref [C, C] (matmul dtype); qg_ref
  # (q exp(b)), kg_ref (k exp(b_C - b)) [C, Kp] matmul dtype; ec_ref
  # (exp(b_C)) [Kp] fp32; b_refs: (b_ref [C, Kp] fp32,) for the backward,
  # else (). g_min: the bounded path's clamp (applied as g is loaded) or None.
  #
  # Row tile by row tile: row i of A summed over the K slices in a
  # fori_loop (b of tiles 0..i recomputed per slice: the same bits), so only
  # one row's i + 1 score tiles are live.
  row, col = _tile_iota()
  causal = row >= col
  n_k = k_ref.shape[-1] // bk
  b_ref = b_refs[0] if b_refs else None
  for i in range(N_TILES):

    def row_body(kk, acc, i=i):
      cols = _k_slice(kk, bk)
      b, c, k_t, q_i = _row_slice_operands(i, cols, q_ref, k_ref, g_ref,
                                           g_min, b_ref, qg_ref, kg_ref,
                                           ec_ref)
      [scores] = _row_slice_scores(i, [q_i], k_t, b, c, causal, bounded, mm)
      return tuple(a + p for a, p in zip(acc, scores))

    zeros = tuple(jnp.zeros((TILE, TILE), _F32) for _ in range(i + 1))
    aqk = list(jax.lax.fori_loop(0, n_k, row_body, zeros))
    aqk[i] = jnp.where(causal, aqk[i], 0.0)   # where: masked overflow stays out
    _store_row(aqk_ref, i, aqk)


def _state_kernel(kg_ref, v_ref, ec_ref, s0_ref, states_ref, sfin_ref, *,
                  n_chunks, mm):
  # kg_ref (k exp(b_C - b)) [Tp, BK]; v_ref [Tp, BV]; ec_ref (exp(b_C))
  # [N, BK]; s0_ref, sfin_ref [BK, BV]; states_ref [N, BK, BV] (the state
  # entering each chunk).
  def body(n, s):
    states_ref[n] = s.astype(states_ref.dtype)
    rows = pl.ds(n * CHUNK, CHUNK)
    return ec_ref[n][:, None] * s + _dot(kg_ref[rows, :], v_ref[rows, :],
                                         _TN, mm)

  sfin_ref[...] = jax.lax.fori_loop(0, n_chunks, body,
                                    s0_ref[...].astype(_F32))


def _dstate_kernel(qg_ref, do_ref, ec_ref, dsfin_ref, dstates_ref, ds0_ref,
                   *, n_chunks, scale, mm):
  # qg_ref (q exp(b)) [Tp, BK]; do_ref [Tp, BV]; ec_ref [N, BK]; dsfin_ref,
  # ds0_ref [BK, BV]; dstates_ref [N, BK, BV] (grad wrt the state LEAVING
  # each chunk).
  def body(r, dh):
    n = n_chunks - 1 - r
    dstates_ref[n] = dh.astype(dstates_ref.dtype)
    rows = pl.ds(n * CHUNK, CHUNK)
    return (ec_ref[n][:, None] * dh
            + scale * _dot(qg_ref[rows, :], do_ref[rows, :], _TN, mm))

  ds0_ref[...] = jax.lax.fori_loop(0, n_chunks, body,
                                   dsfin_ref[...].astype(_F32))


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
    dv = scale * _dot(a, do, _TN, mm) + _dot(kg, dh_ref[:, cols], _NN, mm)
    dv_ref[:, cols] = dv.astype(dv_ref.dtype)
    part = _dot(do, v_ref[:, cols], _NT, mm)
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
  do_s, _, x_dh, dh_s = _state_side_terms(side, split, bv, mm, delta=False)
  row, col = _tile_iota()
  causal = row >= col
  w = q_ref.shape[-1]
  b, c, b_last = _decay_tiles(b_ref, pl.ds(0, w))
  q_t = [q_ref[_rows(t), :].astype(_F32) for t in range(N_TILES)]
  k_t = [k_ref[_rows(t), :].astype(_F32) for t in range(N_TILES)]
  # "-b" factors (the key side, k exp(-b)), starting with the chunk-end
  # terms through S_{n+1}; then "+b" factors (the query side) row by row.
  dk, db_neg, d_end = _end_terms(x_dh, dh_s, k_t, b, b_last)
  dq, db_pos = [None] * N_TILES, [None] * N_TILES
  for i in range(N_TILES):
    dq_i = scale * do_s(i) * jnp.exp(b[i])
    db_i = q_t[i] * dq_i
    x_scale = jnp.exp(b[i] - c[i])                            # <= 1
    q_dec = (q_t[i] * x_scale).astype(mm)
    acc = None
    for j in range(i + 1):
      da = _tile(da_ref, i, j)
      if j == i and not bounded:
        pd = _pair_decay(b[i], causal)                        # [16, 16, w]
        p_q = jnp.sum(da[:, :, None] * (pd * k_t[i][None, :, :]), axis=1)
        p_k = jnp.sum(pd * (da[:, :, None] * q_t[i][:, None, :]), axis=0)
        dq_i = dq_i + p_q
        db_i = db_i + q_t[i] * p_q
        dk[i] = dk[i] + p_k
        db_neg[i] = db_neg[i] + k_t[i] * p_k
        continue
      y_scale = jnp.exp(c[i] - b[j])            # <= 1 off the diagonal
      y_dec = (k_t[j] * y_scale).astype(mm)
      t_q = _dot(da, y_dec, _NN, mm)
      acc = t_q if acc is None else acc + t_q
      t_k = _dot(da, q_dec, _TN, mm)
      dk[j] = dk[j] + t_k * y_scale
      db_neg[j] = db_neg[j] + t_k * y_dec.astype(_F32)
    if acc is not None:
      dq_i = dq_i + acc * x_scale
      db_i = db_i + acc * q_dec.astype(_F32)
    dq[i], db_pos[i] = dq_i, db_i
  _store_key_side_grads(dq, dk, [p - n for p, n in zip(db_pos, db_neg)],
                        d_end, dq_ref, dk_ref, dg_ref, g_ref, g_min)


def _grad_k_pull_kernel(*refs, scale, bv, bounded, mm, g_min, split):
  # grad_k in the "pull" order (`chunk_common._pull_key_side_grads`): same
  # refs and outputs as `_grad_k_kernel`.
  (q_ref, k_ref, b_ref, g_ref, da_ref), side = refs[:5], refs[5:-3]
  dq_ref, dk_ref, dg_ref = refs[-3:]
  do_s, _, x_dh, dh_s = _state_side_terms(side, split, bv, mm, delta=False)

  def row_terms(i, q_i, k_i, b_i):   # through S: (q exp(b)) S
    del k_i
    dq_i = scale * do_s(i) * jnp.exp(b_i)
    return dq_i, jnp.zeros_like(dq_i), q_i * dq_i

  _pull_key_side_grads(row_terms, [(da_ref, False)], q_ref, k_ref, b_ref,
                       g_ref, x_dh, dh_s, dq_ref, dk_ref, dg_ref,
                       bounded=bounded, mm=mm, g_min=g_min)


# ---------------------------------------------------------------------------
# Wrappers.
# ---------------------------------------------------------------------------


def _layout(q, v, tune):
  return _chunk_layout(q, v, block_k=tune.block_k, bv_pass=tune.pass_bv,
                       bk_pass=tune.pass_bk, bv=tune.bv)


def _intra_call(qp, kp_, gp, lay, bounded, g_min, tune, interpret,
                for_backward):
  """Kernel 1: [Aqk, qg, kg, ec] (+ [b] with for_backward): Aqk [B, H, Tp,
  C], qg = q exp(b), kg = k exp(b_C - b) [B, Tp, H, Kp] in the matmul dtype;
  ec = exp(b_C) [B, H, N, Kp] and b [B, Tp, H, Kp] fp32."""
  kp, mm = lay["kp"], lay["mm"]
  seq_k_mm = _shape_of(lay, "bsz", "tp", "h", "kp", dtype=mm)
  out_specs = [_square_spec(), _chunk_spec(kp), _chunk_spec(kp),
               pl.BlockSpec((None, None, None, kp),
                            lambda b, h, n: (b, h, n, 0))]
  out_shape = [_shape_of(lay, "bsz", "h", "tp", "chunk", dtype=mm),
               seq_k_mm, seq_k_mm, _shape_of(lay, "bsz", "h", "n_chunks", "kp")]
  if for_backward:
    out_specs.append(_chunk_spec(kp))
    out_shape.append(_shape_of(lay, "bsz", "tp", "h", "kp"))
  return pl.pallas_call(
      functools.partial(_intra_kernel, bk=lay["bk"], bounded=bounded, mm=mm,
                        g_min=g_min),
      grid=(lay["bsz"], lay["h"], lay["n_chunks"]),
      in_specs=[_chunk_spec(kp)] * 3,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=tune.params("intra"),
      interpret=interpret,
      name="gla_chunk_intra",
  )(qp, kp_, gp)


def _pass_call(kernel, x_k, x_v, ec, state, lay, tune, interpret, name):
  """A sequential pass over chunks (the state pass and its reverse), grid
  (B, H, K blocks, V blocks): x_k [B, Tp, H, Kp] and x_v [B, Tp, H, V] whole
  in T, ec [B, H, N, Kp], state [B, H, Kp, V] fp32. Returns the per-chunk
  states [B, H, N, Kp, V] in the matmul dtype and the state left at the
  end [B, H, Kp, V] fp32."""
  tp, n, bk, bv = lay["tp"], lay["n_chunks"], lay["bk_pass"], lay["bv_pass"]
  seq_k = pl.BlockSpec((None, tp, None, bk), lambda b, h, i, j: (b, 0, h, i))
  seq_v = pl.BlockSpec((None, tp, None, bv), lambda b, h, i, j: (b, 0, h, j))
  ec_spec = pl.BlockSpec((None, None, n, bk), lambda b, h, i, j: (b, h, 0, i))
  blk = pl.BlockSpec((None, None, bk, bv), lambda b, h, i, j: (b, h, i, j))
  return pl.pallas_call(
      kernel,
      grid=(lay["bsz"], lay["h"], lay["nk_pass"], lay["nv_pass"]),
      in_specs=[seq_k, seq_v, ec_spec, blk],
      out_specs=[pl.BlockSpec((None, None, n, bk, bv),
                              lambda b, h, i, j: (b, h, 0, i, j)), blk],
      out_shape=[
          _shape_of(lay, "bsz", "h", "n_chunks", "kp", "dv", dtype=lay["mm"]),
          _shape_of(lay, "bsz", "h", "kp", "dv"),
      ],
      compiler_params=tune.params("pass"),
      interpret=interpret,
      name=name,
  )(x_k, x_v, ec, state)


def _state_call(kg, vp, ec, s0p, lay, tune, interpret):
  """Kernel 2: the states entering each chunk and the final state."""
  return _pass_call(
      functools.partial(_state_kernel, n_chunks=lay["n_chunks"], mm=lay["mm"]),
      kg, vp, ec, s0p, lay, tune, interpret, "gla_state_pass")


def _state_pass(kg, vp, ec, s0p, lay, tune, interpret):
  """Kernel 2 as Triton or Mosaic GPU kernels (tune.state_pass)."""
  if tune.state_pass == "mosaic":
    layout = state_mosaic.default_layout(interpret)
    return state_mosaic.state_pass(
        state_mosaic.as_layout(kg, layout), vp, ec, s0p, bk=lay["bk_pass"],
        bv=lay["bv_pass"], layout=layout, interpret=interpret)
  return _state_call(kg, vp, ec, s0p, lay, tune, interpret)


def _dstate_call(qg, dop, ec, dsfp, lay, scale, tune, interpret):
  """Kernel 4: dH_n (grad wrt the state leaving chunk n) and dS_0."""
  return _pass_call(
      functools.partial(_dstate_kernel, n_chunks=lay["n_chunks"], scale=scale,
                        mm=lay["mm"]),
      qg, dop, ec, dsfp, lay, tune, interpret, "gla_dstate_pass")


def _dstate_pass(qg, dop, ec, dsfp, lay, scale, tune, interpret):
  """Kernel 4 as Triton or Mosaic GPU kernels (tune.state_pass)."""
  if tune.state_pass == "mosaic":
    layout = state_mosaic.default_layout(interpret)
    return state_mosaic.gla_dstate_pass(
        state_mosaic.as_layout(qg, layout), dop, ec, dsfp, scale=scale,
        bk=lay["bk_pass"], bv=lay["bv_pass"], layout=layout,
        interpret=interpret)
  return _dstate_call(qg, dop, ec, dsfp, lay, scale, tune, interpret)


def _dv_call(aqk, kg, vp, dop, dstates, lay, scale, dtype, bounded, tune,
             interpret):
  """Kernel 5: dv [B, Tp, H, V] in dtype and dA [B, H, Tp, C] (matmul dtype
  on the bounded path, where grad_k uses it only as a dot operand; fp32 on
  the unbounded path's position pairs)."""
  kp, dv, mm = lay["kp"], lay["dv"], lay["mm"]
  return pl.pallas_call(
      functools.partial(_dv_kernel, scale=scale, bv=lay["bv"], mm=mm),
      grid=(lay["bsz"], lay["h"], lay["n_chunks"]),
      in_specs=[_square_spec(), _chunk_spec(kp), _chunk_spec(dv),
                _chunk_spec(dv),
                pl.BlockSpec((None, None, None, kp, dv),
                             lambda b, h, n: (b, h, n, 0, 0))],
      out_specs=[_chunk_spec(dv), _square_spec()],
      out_shape=[_shape_of(lay, "bsz", "tp", "h", "dv", dtype=dtype),
                 _shape_of(lay, "bsz", "h", "tp", "chunk",
                           dtype=mm if bounded else _F32)],
      compiler_params=tune.params("dv"),
      interpret=interpret,
      name="gla_chunk_dv",
  )(aqk, kg, vp, dop, dstates)


def _grad_k_call(qp, kp_, bp, gp, dop, vp, da, states, dstates, lay, scale,
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
  k_slice = _chunk_spec(bk, True)
  side, side_specs = _state_side_inputs(
      [dop, vp], (False, True), states, dstates, lay, tune.split_grad_k,
      tune.state_side_bk, tune.state_side_warps, interpret,
      "gla_chunk_state_side")
  return pl.pallas_call(
      functools.partial(kernel, scale=scale,
                        bv=_block_v(dv, tune.grad_bv), bounded=bounded,
                        mm=lay["mm"], g_min=g_min, split=tune.split_grad_k),
      grid=(lay["bsz"], lay["h"], lay["n_chunks"], lay["kp"] // bk),
      in_specs=[k_slice] * 4 + [_square_spec()] + side_specs,
      out_specs=[k_slice] * 3,
      out_shape=[_shape_of(lay, "bsz", "tp", "h", "kp", dtype=qp.dtype),
                 _shape_of(lay, "bsz", "tp", "h", "kp", dtype=kp_.dtype),
                 _shape_of(lay, "bsz", "tp", "h", "kp")],
      compiler_params=tune.params("grad_k"),
      interpret=interpret,
      name="gla_chunk_grad_k",
  )(qp, kp_, bp, gp, da, *side)


_STATIC = ("scale", "bounded", "g_min", "tune", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC + ("for_backward",))
def _gla_fwd(q, k, v, g, s0, *, scale, bounded, g_min, tune, interpret,
             for_backward=False):
  """q, k, g [B, T, H, K]; v [B, T, H, V]; s0 [B, H, K, V] fp32. With
  for_backward, also returns the intra kernel's outputs (the residuals)."""
  lay = _layout(q, v, tune)
  tp, kp, dk = lay["tp"], lay["kp"], lay["dk"]
  qp, kp_, gp = _pad(q, tp, kp), _pad(k, tp, kp), _pad(g, tp, kp)
  vp = _pad(v, tp, lay["dv"])
  s0p = jnp.pad(s0, ((0, 0), (0, 0), (0, kp - dk), (0, 0)))
  intra = _intra_call(qp, kp_, gp, lay, bounded, g_min, tune, interpret,
                      for_backward)
  aqk, qg, kg, ec = intra[:4]
  states, s_final = _state_pass(kg, vp, ec, s0p, lay, tune, interpret)
  o = _output_call(qg, aqk, vp, states, lay, scale, v.dtype, interpret,
                   tune.output_warps, "gla_chunk_output", tune.output_kernel)
  out = o[:, :lay["t"]], s_final[:, :, :dk]
  return (out, intra) if for_backward else out


@functools.partial(jax.jit, static_argnames=_STATIC)
def _gla_bwd(q, k, v, g, s0, intra, do, ds_final, *, scale, bounded, g_min,
             tune, interpret):
  """(dq, dk, dv, dg, ds0) given do [B,T,H,V], ds_final [B,H,K,V] and the
  forward's residuals (the intra kernel's outputs; g, the caller's g fp32,
  only with g_min, for the clamp's mask, else None)."""
  lay = _layout(q, v, tune)
  t, tp, dk, kp, dv = (lay[n] for n in ("t", "tp", "dk", "kp", "dv"))
  qp, kp_ = _pad(q, tp, kp), _pad(k, tp, kp)
  vp = _pad(v, tp, dv)
  dop = _pad(do.astype(v.dtype), tp, dv)
  s0p = jnp.pad(s0, ((0, 0), (0, 0), (0, kp - dk), (0, 0)))
  dsfp = jnp.pad(ds_final.astype(_F32), ((0, 0), (0, 0), (0, kp - dk),
                                         (0, 0)))
  aqk, qg, kg, ec, bp = intra
  states, _ = _state_pass(kg, vp, ec, s0p, lay, tune, interpret)
  dstates, ds0 = _dstate_pass(qg, dop, ec, dsfp, lay, scale, tune, interpret)
  dvp, da = _dv_call(aqk, kg, vp, dop, dstates, lay, scale, v.dtype, bounded,
                     tune, interpret)
  gp = None if g_min is None else _pad(g, tp, kp)
  dq, dk_, dg = _grad_k_call(qp, kp_, bp, gp, dop, vp, da, states, dstates,
                             lay, scale, bounded, g_min, tune, interpret)
  dq, dk_, dg = (x[:, :t, :, :dk] for x in (dq, dk_, dg))
  return dq, dk_, dvp[:, :t], dg, ds0[:, :, :dk]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _gla_pallas_vjp(q, k, v, g, s0, scale, bounded, g_min, tune, interpret):
  return _gla_fwd(q, k, v, g, s0, scale=scale, bounded=bounded, g_min=g_min,
                  tune=tune, interpret=interpret)


def _vjp_fwd(q, k, v, g, s0, scale, bounded, g_min, tune, interpret):
  out, intra = _gla_fwd(q, k, v, g, s0, scale=scale, bounded=bounded,
                        g_min=g_min, tune=tune, interpret=interpret,
                        for_backward=True)
  return out, (q, k, v, None if g_min is None else g, s0, intra)


def _vjp_bwd(scale, bounded, g_min, tune, interpret, res, cts):
  q, k, v, g, s0, intra = res
  do, ds_final = cts
  return _gla_bwd(q, k, v, g, s0, intra, do, ds_final, scale=scale,
                  bounded=bounded, g_min=g_min, tune=tune, interpret=interpret)


_gla_pallas_vjp.defvjp(_vjp_fwd, _vjp_bwd)


def check_tuning(tune):
  """ValueError naming the field unless tune is a valid Tuning: block sizes
  powers of two >= 16, warp and stage counts >= 1, split_grad_k a bool."""
  if not isinstance(tune, Tuning):
    raise ValueError(f"tune must be a gla_pallas.Tuning, got {tune!r}")
  for name in ("block_k", "pass_bk", "pass_bv", "bv", "grad_bv",
               "state_side_bk", "grad_k_bk"):
    size = getattr(tune, name)
    if size is None and name == "grad_k_bk":
      continue
    if (isinstance(size, bool) or not isinstance(size, int) or size < TILE
        or size & (size - 1)):
      raise ValueError(f"tune.{name} must be a power of two >= {TILE}, got "
                       f"{size!r}")
  for name in ("intra_warps", "pass_warps", "output_warps", "dv_warps",
               "grad_k_warps", "state_side_warps", "num_stages"):
    if getattr(tune, name) < 1:
      raise ValueError(f"tune.{name} must be >= 1, got "
                       f"{getattr(tune, name)!r}")
  if not isinstance(tune.split_grad_k, bool):
    raise ValueError(f"tune.split_grad_k must be True or False, got "
                     f"{tune.split_grad_k!r}")
  for name, allowed in (("state_pass", STATE_PASS_CHOICES),
                        ("output_kernel", STAGE_KERNELS),
                        ("grad_k_order", GRAD_K_ORDERS)):
    if getattr(tune, name) not in allowed:
      raise ValueError(f"tune.{name} must be one of {allowed}, got "
                       f"{getattr(tune, name)!r}")


def gla_pallas(q, k, v, g, *, scale, initial_state, chunk_size, g_min,
               interpret=False, bounded=None, tune=DEFAULT_TUNING):
  """Chunked GLA, forward and backward as Pallas kernels (jax.custom_vjp).

  Args:
    q, k, g: [B, T, H, K]; v: [B, T, H, V] (fp32 or bf16; g fp32 log decay).
      K, V multiples of 16 in [16, 256]; any T.
    scale: query scale or None (K**-0.5).
    initial_state: [B, H, K, V] or None (zeros).
    chunk_size: must be 64.
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
  kp = _next_pow2(dk)
  tune = dataclasses.replace(tune, state_pass=state_mosaic.resolve_state_pass(
      tune.state_pass, kp, dv, v.dtype, min(kp, tune.pass_bk),
      _block_v(dv, tune.pass_bv), interpret, kda=False))
  if tune.state_pass == "mosaic":
    state_mosaic.check_state_pass(
        kp, dv, v.dtype, min(kp, tune.pass_bk), _block_v(dv, tune.pass_bv),
        state_mosaic.default_layout(interpret), whole_k=False)
  if tune.output_kernel == "mosaic":
    state_mosaic.check_state_pass(kp, dv, v.dtype, kp, _block_v(dv, tune.bv),
                                  "rows", whole_k=True, what="output_kernel")
  scale = float(dk) ** -0.5 if scale is None else float(scale)
  if initial_state is None:
    initial_state = jnp.zeros((bsz, h, dk, dv), _F32)
  # The clamp policy of the bounded path: the op is GLA on where(g < g_min,
  # g_min, g), with zero gradient below g_min (at g == g_min the gradient
  # passes); the intra kernel clamps, grad_k masks dg: no XLA passes.
  clamp = float(g_min) if bounded else None
  return _gla_pallas_vjp(q, k, v, g.astype(_F32), initial_state.astype(_F32),
                         scale, bool(bounded), clamp, tune, bool(interpret))


def register():
  from pallas_kernels.linear_attention import ops
  ops.register_backend("pallas", gla=gla_pallas)
  ops.register_backend("interpret",
                       gla=functools.partial(gla_pallas, interpret=True))
