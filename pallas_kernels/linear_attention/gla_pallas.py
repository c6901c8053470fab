"""Chunked GLA as Pallas kernels (Triton lowering): forward and backward.

DESIGN 3.1 / 3.2 / 4. Registered as the "pallas" (GPU) and "interpret" (the
same kernels interpreted on CPU) backends of `ops.gla`.

Notation, per chunk of C = 64 rows (4 tiles of 16): b = within-chunk
inclusive cumsum of g, b_C = its last row, S_n the state entering chunk n.
  o_i     = scale * ((q_i exp(b_i)) S_n + sum_{j<=i} A_ij v_j),
  A_ij    = sum_d q_id k_jd exp(b_id - b_jd),
  S_{n+1} = diag(exp(b_C)) S_n + (k exp(b_C - b))^T v.

Two intra-chunk paths (static flag `bounded`):
  * bounded (g >= g_min, g_min in [-5.5, 0)): every 16x16 tile of A, the
    diagonal included, is ONE dense dot anchored at c = b at the first row of
    the query tile:  A_tile = (q_i exp(b_i - c)) @ (k_j exp(c - b_j))^T.
    The query factor is in [exp(-82.5), 1]; the key factor is <= 1 off the
    diagonal and <= exp((16-1)*5.5) = exp(82.5) on it, inside the fp32/bf16
    range (~88.7). The causal mask is applied after the dot with `where`.
  * unbounded (any g <= 0): off-diagonal tiles as above (both factors <= 1
    for any g), diagonal tiles on position pairs, exp(b_i - b_j) with the
    mask in the exponent (-inf above the diagonal) before the exp, as a
    [16, 16, bk] product and reduction over K slices of width bk. This is
    the measured baseline.
The anchor is never later than any valid query row of its tile, so outputs
are strictly causal even in a partly filled last tile.

g below g_min: the op clamps g to g_min (documented policy, tested); the
clamped entries get zero gradient.

Kernels (inputs stay in the caller's [B, T, H, D] layout: no transposes):
  forward
    1. `_state_kernel`, grid (B, H, K/BK, V/BV): sequential fori_loop over
       chunks; stores the state entering each chunk [B, H, N, K, V] fp32 and
       the final state. Rows of S (K) are independent under a diagonal decay,
       so K is blocked too: more programs for the one sequential pass.
    2. `_output_kernel`, grid (B, H, N, V/BV), parallel over chunks.
  backward (recomputes the states; nothing O(T*K*V) is kept from forward)
    3. `_dstate_kernel`, grid (B, H, K/BK, V/BV): reverse pass over chunks,
       dH_n = grad wrt the state LEAVING chunk n:
       dH_{n-1} = diag(exp(b_C)) dH_n + scale (q exp(b))^T do.
    4. `_grad_kernel`, grid (B, H, N, V/BV), parallel over chunks: dv for the
       V block and this V block's partial dq, dk (summed over V blocks after):
         dq_i = scale ((do_i S_n^T) exp(b_i) + sum_{j<=i} D_ij (k_j exp(b_i-b_j)))
         dk_j = scale sum_{i>=j} D_ij (q_i exp(b_i-b_j)) + (v_j dH^T) exp(b_C-b_j)
         dv_j = scale sum_{i>=j} A_ij^T do_i + (k_j exp(b_C - b_j)) dH
       with D_ij = do_i . v_j, tiles anchored exactly like the forward.
    Then dg, chunk-locally (XLA, memory bound): with S_n and dH_{n+1} fixed
    the chunk's loss depends on g only through b, via q exp(b), k exp(-b)
    and exp(b_C) on S_{n+1}, so dL/db_t = q_t dq_t - k_t dk_t, plus
    sum_v dH_{n+1} * S_{n+1} at the chunk's last row, and dg is the reverse
    cumsum of dL/db within the chunk (64 terms, not T: rounding does not
    accumulate over the sequence).
The wrapper pads T to a multiple of 64 (q=k=v=0, g=0: inert) and K to a
power of two (zero channels are inert) only when needed, and slices back.
Dots accumulate in fp32; with bf16 inputs their operands are bf16.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # Triton compiler params (jax 0.10 - 0.12); absent -> default params.
  from jax.experimental.pallas import triton as plgpu_triton
except ImportError:  # pragma: no cover
  plgpu_triton = None

CHUNK = 64
TILE = 16
N_TILES = CHUNK // TILE
G_MIN_LOWEST = -5.5  # (TILE - 1) * 5.5 = 82.5 nats < ~88.7 (fp32/bf16 max exp)
MAX_DIM = 256
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Tuning:
  """Block sizes and launch parameters (benchmarked on an H200, see results/)."""
  state_bk: int = 64        # K block of the state passes (forward and dH)
  state_bv: int = 64        # V block of the state passes
  out_bv: int = 64          # V block of the output kernel
  grad_bv: int = 64         # V block of the gradient kernel
  bk_bounded: int = 128     # K slice width inside the chunk kernels (bounded)
  bk_unbounded: int = 32    # K slice width, unbounded (position-pair tiles)
  state_warps: int = 4
  chunk_warps: int = 8
  num_stages: int = 2


DEFAULT_TUNING = Tuning()


def _compiler_params(num_warps, num_stages):
  if plgpu_triton is None:
    return None
  return plgpu_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _next_pow2(n):
  return 1 << (n - 1).bit_length()


def _block(d, cap):
  """Largest power of two dividing d, at most cap (d is a multiple of 16)."""
  b = cap
  while d % b:
    b //= 2
  return b


def _dot_general(a, b, dims, mm):
  # fp32 operands: full-precision dots (the GPU default would be TF32).
  prec = jax.lax.Precision.HIGHEST if mm == _F32 else None
  return jax.lax.dot_general(a.astype(mm), b.astype(mm), (dims, ((), ())),
                             precision=prec, preferred_element_type=_F32)


def _dot(a, b, mm):
  return _dot_general(a, b, ((1,), (0,)), mm)


def _dot_nt(a, b, mm):
  """a @ b^T, contracting the last dims."""
  return _dot_general(a, b, ((1,), (1,)), mm)


def _dot_tn(a, b, mm):
  """a^T @ b, contracting the first dims."""
  return _dot_general(a, b, ((0,), (0,)), mm)


def _split_hi_lo(x, mm):
  """x (fp32) = hi + lo, both in mm: two dots with them carry x to ~2^-16.

  For the diagonal tiles of the backward: a pair (s, t) of one tile enters
  dL/db_t (via q_t dq_t) and dL/db_s (via k_s dk_s) with opposite signs and
  cancels in dg's within-chunk cumsum; with the decayed operand rounded to
  bf16 once per side it would not cancel (dg error 2.4e-2 -> 4e-3, bf16).
  """
  if mm == _F32:
    return (x,)
  hi = x.astype(mm)
  return hi, (x - hi.astype(_F32)).astype(mm)


def _rows(t):
  return pl.ds(t * TILE, TILE)


def _tile_decays(g_ref, cols):
  """Within-chunk decays of one chunk, tile by tile, for the columns `cols`.

  Returns (b, c, b_C): b[t] [16, w] the inclusive cumsum of g over the chunk
  at tile t's rows, c[t] [1, w] = b at tile t's first row (its anchor), and
  b_C [w] the whole-chunk sum. Built from per-tile cumsums plus a running
  offset (the Triton lowering cannot slice values).
  """
  b, c = [], []
  offset = None
  for t in range(N_TILES):
    g_t = g_ref[_rows(t), cols].astype(_F32)
    b_t = jnp.cumsum(g_t, axis=0)
    first = g_ref[pl.ds(t * TILE, 1), cols].astype(_F32)
    if offset is not None:
      b_t = b_t + offset[None, :]
      first = first + offset[None, :]
    b.append(b_t)
    c.append(first)
    tile_sum = jnp.sum(g_t, axis=0)
    offset = tile_sum if offset is None else offset + tile_sum
  return b, c, offset


def _causal():
  row = jax.lax.broadcasted_iota(jnp.int32, (TILE, TILE), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (TILE, TILE), 1)
  return row >= col


def _pair_decay(b_i, b_j, causal):
  """exp(b_i - b_j) on position pairs [16, 16, w]; 0 above the diagonal.

  The mask goes into the exponent (-inf) before the exp: above the diagonal
  b_i - b_j >= 0 is unbounded and exp would overflow.
  """
  diff = b_i[:, None, :] - b_j[None, :, :]
  return jnp.exp(jnp.where(causal[:, :, None], diff, -jnp.inf))


# ---------------------------------------------------------------------------
# Forward kernels.
# ---------------------------------------------------------------------------


def _state_kernel(k_ref, v_ref, g_ref, s0_ref, states_ref, sfin_ref, *,
                  n_chunks, mm):
  # k_ref, g_ref [Tp, BK]; v_ref [Tp, BV]; s0_ref, sfin_ref [BK, BV];
  # states_ref [N, BK, BV] (the state entering each chunk).
  def body(n, s):
    states_ref[n] = s.astype(states_ref.dtype)
    rows = pl.ds(n * CHUNK, CHUNK)
    g = g_ref[rows, :].astype(_F32)
    b = jnp.cumsum(g, axis=0)                       # [C, BK]
    b_last = jnp.sum(g, axis=0)                     # [BK] (= last row of b)
    k_dec = k_ref[rows, :].astype(_F32) * jnp.exp(b_last[None, :] - b)
    return jnp.exp(b_last)[:, None] * s + _dot_tn(k_dec, v_ref[rows, :], mm)

  sfin_ref[...] = jax.lax.fori_loop(0, n_chunks, body,
                                    s0_ref[...].astype(_F32))


def _output_kernel(q_ref, k_ref, v_ref, g_ref, s_ref, o_ref, *, scale, mm,
                   bounded, bk):
  # q_ref, k_ref, g_ref [C, Kp]; v_ref, o_ref [C, BV]; s_ref [Kp, BV].
  causal = _causal()
  acc = [None] * N_TILES                    # [16, BV] per query tile
  a = {}                                    # (i, j) -> A_ij [16, 16]
  for kk in range(q_ref.shape[-1] // bk):   # K slices: bounded registers
    cols = pl.ds(kk * bk, bk)
    b, c, _ = _tile_decays(g_ref, cols)
    s = s_ref[cols, :]
    ks = [k_ref[_rows(j), cols].astype(_F32) for j in range(N_TILES)]
    for i in range(N_TILES):
      q_i = q_ref[_rows(i), cols].astype(_F32)
      inter = _dot(q_i * jnp.exp(b[i]), s, mm)      # (q exp(b)) S_n
      acc[i] = inter if acc[i] is None else acc[i] + inter
      q_dec = q_i * jnp.exp(b[i] - c[i])            # <= 1
      for j in range(i + 1):
        if j == i and not bounded:
          a_ij = jnp.sum(q_i[:, None, :] * ks[i][None, :, :]
                         * _pair_decay(b[i], b[i], causal), axis=-1)
        else:
          a_ij = _dot_nt(q_dec, ks[j] * jnp.exp(c[i] - b[j]), mm)
        a[i, j] = a_ij if (i, j) not in a else a[i, j] + a_ij
  for i in range(N_TILES):
    out = acc[i]
    for j in range(i + 1):
      a_ij = jnp.where(causal, a[i, j], 0.0) if j == i else a[i, j]
      out = out + _dot(a_ij, v_ref[_rows(j), :], mm)
    o_ref[_rows(i), :] = (scale * out).astype(o_ref.dtype)


# ---------------------------------------------------------------------------
# Backward kernels.
# ---------------------------------------------------------------------------


def _dstate_kernel(q_ref, do_ref, g_ref, dsfin_ref, dstates_ref, ds0_ref, *,
                   n_chunks, scale, mm):
  # q_ref, g_ref [Tp, BK]; do_ref [Tp, BV]; dsfin_ref, ds0_ref [BK, BV];
  # dstates_ref [N, BK, BV] (grad wrt the state LEAVING each chunk).
  def body(r, dh):
    n = n_chunks - 1 - r
    dstates_ref[n] = dh.astype(dstates_ref.dtype)
    rows = pl.ds(n * CHUNK, CHUNK)
    g = g_ref[rows, :].astype(_F32)
    b = jnp.cumsum(g, axis=0)
    b_last = jnp.sum(g, axis=0)
    q_dec = q_ref[rows, :].astype(_F32) * jnp.exp(b)
    return (jnp.exp(b_last)[:, None] * dh
            + scale * _dot_tn(q_dec, do_ref[rows, :], mm))

  ds0_ref[...] = jax.lax.fori_loop(0, n_chunks, body,
                                   dsfin_ref[...].astype(_F32))


def _grad_kernel(q_ref, k_ref, v_ref, g_ref, do_ref, s_ref, dh_ref, dq_ref,
                 dk_ref, dv_ref, *, scale, mm, bounded, bk):
  # q_ref, k_ref, g_ref [C, Kp]; v_ref, do_ref, dv_ref [C, BV];
  # s_ref (state entering), dh_ref (grad of the state leaving) [Kp, BV];
  # dq_ref, dk_ref [C, Kp] fp32: this V block's partial sums.
  causal = _causal()
  dos = [do_ref[_rows(i), :] for i in range(N_TILES)]
  vs = [v_ref[_rows(j), :] for j in range(N_TILES)]
  d = {}                                    # D_ij = do_i . v_j, j <= i
  for i in range(N_TILES):
    for j in range(i + 1):
      d_ij = _dot_nt(dos[i], vs[j], mm)
      d[i, j] = jnp.where(causal, d_ij, 0.0) if j == i else d_ij
  a = {}
  dv = [None] * N_TILES
  for kk in range(q_ref.shape[-1] // bk):
    cols = pl.ds(kk * bk, bk)
    b, c, b_last = _tile_decays(g_ref, cols)
    s, dh = s_ref[cols, :], dh_ref[cols, :]
    qs = [q_ref[_rows(i), cols].astype(_F32) for i in range(N_TILES)]
    ks = [k_ref[_rows(j), cols].astype(_F32) for j in range(N_TILES)]
    q_dec = [qs[i] * jnp.exp(b[i] - c[i]) for i in range(N_TILES)]
    # dq rows: query tile i.
    for i in range(N_TILES):
      dq_i = _dot_nt(dos[i], s, mm) * jnp.exp(b[i])
      intra = None
      for j in range(i + 1):
        if j == i and not bounded:
          dq_i = dq_i + jnp.sum(d[i, i][:, :, None] * ks[i][None, :, :]
                                * _pair_decay(b[i], b[i], causal), axis=1)
          continue
        k_dec = ks[j] * jnp.exp(c[i] - b[j])
        parts = _split_hi_lo(k_dec, mm) if j == i else (k_dec,)
        for part in parts:
          t = _dot(d[i, j], part, mm)
          intra = t if intra is None else intra + t
      if intra is not None:
        dq_i = dq_i + intra * jnp.exp(b[i] - c[i])
      dq_ref[_rows(i), cols] = scale * dq_i
    # dk and the dH part of dv rows: key tile j.
    for j in range(N_TILES):
      k_end = jnp.exp(b_last[None, :] - b[j])       # exp(b_C - b_j) <= 1
      dk_j = _dot_nt(vs[j], dh, mm) * k_end
      for i in range(j, N_TILES):
        if i == j and not bounded:
          dk_j = dk_j + scale * jnp.sum(
              d[j, j][:, :, None] * qs[j][:, None, :]
              * _pair_decay(b[j], b[j], causal), axis=0)
          continue
        parts = _split_hi_lo(q_dec[i], mm) if i == j else (q_dec[i],)
        t = sum(_dot_tn(d[i, j], part, mm) for part in parts)  # [16, bk]
        dk_j = dk_j + scale * t * jnp.exp(c[i] - b[j])
      dk_ref[_rows(j), cols] = dk_j
      dv_h = _dot(ks[j] * k_end, dh, mm)
      dv[j] = dv_h if dv[j] is None else dv[j] + dv_h
    # A_ij accumulated over K slices (for dv).
    for i in range(N_TILES):
      for j in range(i + 1):
        if j == i and not bounded:
          a_ij = jnp.sum(qs[i][:, None, :] * ks[i][None, :, :]
                         * _pair_decay(b[i], b[i], causal), axis=-1)
        else:
          a_ij = _dot_nt(q_dec[i], ks[j] * jnp.exp(c[i] - b[j]), mm)
        a[i, j] = a_ij if (i, j) not in a else a[i, j] + a_ij
  for j in range(N_TILES):
    out = dv[j]
    for i in range(j, N_TILES):
      a_ij = jnp.where(causal, a[i, j], 0.0) if i == j else a[i, j]
      out = out + scale * _dot_tn(a_ij, dos[i], mm)
    dv_ref[_rows(j), :] = out.astype(dv_ref.dtype)


# ---------------------------------------------------------------------------
# Wrappers.
# ---------------------------------------------------------------------------


def _pad(x, tp, d_pad):
  """[B, T, H, D] -> [B, Tp, H, D_pad], zero padded (a no-op when aligned)."""
  t, d = x.shape[1], x.shape[3]
  if tp == t and d_pad == d:
    return x
  return jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, d_pad - d)))


def _layout(q, v):
  bsz, t, h, dk = q.shape
  dv = v.shape[-1]
  tp = -(-t // CHUNK) * CHUNK
  return bsz, t, h, dk, dv, tp, tp // CHUNK, _next_pow2(dk)


def _mm_dtype(v):
  return jnp.bfloat16 if v.dtype == jnp.bfloat16 else _F32


def _pass_call(kernel, x_k, x_v, y_k, state, *, n_chunks, tune, interpret,
               name):
  """A sequential pass over chunks (the state pass and its reverse), grid
  (B, H, K blocks, V blocks): x_k, y_k [B, Tp, H, Kp] and x_v [B, Tp, H, V]
  whole in T, state [B, H, Kp, V]. Returns the per-chunk states
  [B, H, N, Kp, V] fp32 and the state left at the end [B, H, Kp, V] fp32."""
  bsz, tp, h, kp = x_k.shape
  dv = x_v.shape[-1]
  bk, bv = _block(kp, tune.state_bk), _block(dv, tune.state_bv)
  seq_k = pl.BlockSpec((None, tp, None, bk), lambda b, hh, i, j: (b, 0, hh, i))
  seq_v = pl.BlockSpec((None, tp, None, bv), lambda b, hh, i, j: (b, 0, hh, j))
  blk = pl.BlockSpec((None, None, bk, bv), lambda b, hh, i, j: (b, hh, i, j))
  return pl.pallas_call(
      kernel,
      grid=(bsz, h, kp // bk, dv // bv),
      in_specs=[seq_k, seq_v, seq_k, blk],
      out_specs=[pl.BlockSpec((None, None, n_chunks, bk, bv),
                              lambda b, hh, i, j: (b, hh, 0, i, j)), blk],
      out_shape=[
          jax.ShapeDtypeStruct((bsz, h, n_chunks, kp, dv), _F32),
          jax.ShapeDtypeStruct((bsz, h, kp, dv), _F32),
      ],
      compiler_params=_compiler_params(tune.state_warps, tune.num_stages),
      interpret=interpret,
      name=name,
  )(x_k, x_v, y_k, state)


def _state_pass(kp_, vp_, gp_, s0p, *, n_chunks, tune, interpret):
  """States entering each chunk [B, H, N, Kp, V] fp32 and the final state."""
  return _pass_call(
      functools.partial(_state_kernel, n_chunks=n_chunks, mm=_mm_dtype(vp_)),
      kp_, vp_, gp_, s0p, n_chunks=n_chunks, tune=tune, interpret=interpret,
      name="gla_state_pass")


def _chunk_spec(d):
  return pl.BlockSpec((None, CHUNK, None, d), lambda b, h, n, j: (b, n, h, 0))


def _chunk_spec_v(bv):
  return pl.BlockSpec((None, CHUNK, None, bv), lambda b, h, n, j: (b, n, h, j))


def _state_spec(kp, bv):
  return pl.BlockSpec((None, None, None, kp, bv),
                      lambda b, h, n, j: (b, h, n, 0, j))


@functools.partial(jax.jit, static_argnames=("scale", "bounded", "tune",
                                             "interpret"))
def _gla_fwd(q, k, v, g, s0, *, scale, bounded, tune, interpret):
  """q, k, g [B, T, H, K]; v [B, T, H, V]; s0 [B, H, K, V] fp32."""
  bsz, t, h, dk, dv, tp, n_chunks, kp = _layout(q, v)
  qp, kp_, gp = (_pad(x, tp, kp) for x in (q, k, g))
  vp = _pad(v, tp, dv)
  s0p = jnp.pad(s0, ((0, 0), (0, 0), (0, kp - dk), (0, 0)))
  states, s_final = _state_pass(kp_, vp, gp, s0p, n_chunks=n_chunks,
                                tune=tune, interpret=interpret)
  bv = _block(dv, tune.out_bv)
  bk = min(kp, tune.bk_bounded if bounded else tune.bk_unbounded)
  o = pl.pallas_call(
      functools.partial(_output_kernel, scale=scale, mm=_mm_dtype(v),
                        bounded=bounded, bk=bk),
      grid=(bsz, h, n_chunks, dv // bv),
      in_specs=[_chunk_spec(kp), _chunk_spec(kp), _chunk_spec_v(bv),
                _chunk_spec(kp), _state_spec(kp, bv)],
      out_specs=_chunk_spec_v(bv),
      out_shape=jax.ShapeDtypeStruct((bsz, tp, h, dv), v.dtype),
      compiler_params=_compiler_params(tune.chunk_warps, tune.num_stages),
      interpret=interpret,
      name="gla_chunk_output",
  )(qp, kp_, vp, gp, states)
  return o[:, :t], s_final[:, :, :dk]


@functools.partial(jax.jit, static_argnames=("scale", "bounded", "tune",
                                             "interpret"))
def _gla_bwd(q, k, v, g, s0, do, ds_final, *, scale, bounded, tune,
             interpret):
  """Gradients (dq, dk, dv, dg, ds0) given do [B,T,H,V], ds_final [B,H,K,V]."""
  bsz, t, h, dk, dv, tp, n_chunks, kp = _layout(q, v)
  mm = _mm_dtype(v)
  qp, kp_, gp = (_pad(x, tp, kp) for x in (q, k, g))
  vp = _pad(v, tp, dv)
  dop = _pad(do.astype(v.dtype), tp, dv)
  s0p = jnp.pad(s0, ((0, 0), (0, 0), (0, kp - dk), (0, 0)))
  dsfp = jnp.pad(ds_final.astype(_F32), ((0, 0), (0, 0), (0, kp - dk), (0, 0)))
  states, s_final = _state_pass(kp_, vp, gp, s0p, n_chunks=n_chunks,
                                tune=tune, interpret=interpret)

  dstates, ds0 = _pass_call(
      functools.partial(_dstate_kernel, n_chunks=n_chunks, scale=scale, mm=mm),
      qp, dop, gp, dsfp, n_chunks=n_chunks, tune=tune, interpret=interpret,
      name="gla_dstate_pass")

  bv = _block(dv, tune.grad_bv)
  nv = dv // bv
  bk = min(kp, tune.bk_bounded if bounded else tune.bk_unbounded)
  part = pl.BlockSpec((None, None, CHUNK, None, kp),
                      lambda b, hh, n, j: (j, b, n, hh, 0))
  dq_p, dk_p, dvp = pl.pallas_call(
      functools.partial(_grad_kernel, scale=scale, mm=mm, bounded=bounded,
                        bk=bk),
      grid=(bsz, h, n_chunks, nv),
      in_specs=[_chunk_spec(kp), _chunk_spec(kp), _chunk_spec_v(bv),
                _chunk_spec(kp), _chunk_spec_v(bv), _state_spec(kp, bv),
                _state_spec(kp, bv)],
      out_specs=[part, part, _chunk_spec_v(bv)],
      out_shape=[
          jax.ShapeDtypeStruct((nv, bsz, tp, h, kp), _F32),
          jax.ShapeDtypeStruct((nv, bsz, tp, h, kp), _F32),
          jax.ShapeDtypeStruct((bsz, tp, h, dv), v.dtype),
      ],
      compiler_params=_compiler_params(tune.chunk_warps, tune.num_stages),
      interpret=interpret,
      name="gla_chunk_grad",
  )(qp, kp_, vp, gp, dop, states, dstates)

  dq = jnp.sum(dq_p, axis=0)
  dk_ = jnp.sum(dk_p, axis=0)
  # dg, chunk-locally: per chunk, with S_n and dH_{n+1} held fixed, the loss
  # depends on g only through b, via q exp(b), k exp(-b) and exp(b_C) on
  # S_{n+1}: dL/db_t = q_t dq_t - k_t dk_t, plus sum_v dH_{n+1} * S_{n+1} at
  # the chunk's last row; dg = reverse cumsum of dL/db within the chunk.
  # (A reverse cumsum over all of T would sum the rounding of every later
  # position into each dg: its error would grow like sqrt(T).)
  d_b = qp.astype(_F32) * dq - kp_.astype(_F32) * dk_        # [B, Tp, H, Kp]
  s_next = jnp.concatenate([states[:, :, 1:], s_final[:, :, None]], axis=2)
  d_end = jnp.sum(dstates * s_next, axis=-1)                # [B, H, N, Kp]
  d_b = d_b.reshape(bsz, n_chunks, CHUNK, h, kp)
  d_b = d_b.at[:, :, CHUNK - 1].add(jnp.transpose(d_end, (0, 2, 1, 3)))
  dg = jax.lax.cumsum(d_b, axis=2, reverse=True).reshape(bsz, tp, h, kp)
  dq, dk_, dg = (x[:, :t, :, :dk] for x in (dq, dk_, dg))
  return (dq.astype(q.dtype), dk_.astype(k.dtype), dvp[:, :t],
          dg.astype(g.dtype), ds0[:, :, :dk])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _gla_pallas_vjp(q, k, v, g, s0, scale, bounded, tune, interpret):
  return _gla_fwd(q, k, v, g, s0, scale=scale, bounded=bounded, tune=tune,
                  interpret=interpret)


def _vjp_fwd(q, k, v, g, s0, scale, bounded, tune, interpret):
  out = _gla_fwd(q, k, v, g, s0, scale=scale, bounded=bounded, tune=tune,
                 interpret=interpret)
  return out, (q, k, v, g, s0)


def _vjp_bwd(scale, bounded, tune, interpret, res, cts):
  q, k, v, g, s0 = res
  do, ds_final = cts
  return _gla_bwd(q, k, v, g, s0, do, ds_final, scale=scale, bounded=bounded,
                  tune=tune, interpret=interpret)


_gla_pallas_vjp.defvjp(_vjp_fwd, _vjp_bwd)


class GMinError(ValueError):
  """g_min unusable by the bounded kernel (use g_min=None: unbounded path)."""


def check_g_min(g_min):
  """Raises GMinError (a ValueError) unless g_min is a float in [-5.5, 0)."""
  if g_min is None or isinstance(g_min, bool) or not (
      G_MIN_LOWEST <= float(g_min) < 0):
    raise GMinError(
        f"the bounded Pallas path needs g_min in [{G_MIN_LOWEST}, 0) (dense "
        f"16-row diagonal tiles span (16-1)*|g_min| nats), got "
        f"g_min={g_min!r}; pass g_min=None for the unbounded (position-pair) "
        "path")


def check_dims(q, v, chunk_size, what="GLA"):
  """Kernel limits on K, V, chunk size and dtypes (ValueError names them)."""
  if chunk_size != CHUNK:
    raise ValueError(f"the Pallas {what} kernel supports chunk_size={CHUNK} "
                     f"only, got chunk_size={chunk_size!r}")
  for name, d in (("K", q.shape[-1]), ("V", v.shape[-1])):
    if d % TILE or not 0 < d <= MAX_DIM:
      raise ValueError(f"the Pallas {what} kernel needs {name} a multiple of "
                       f"{TILE} in [16, {MAX_DIM}], got {name}={d}")
  for name, x in (("q", q), ("v", v)):
    if x.dtype not in (jnp.float32, jnp.bfloat16):
      raise ValueError(f"the Pallas {what} kernel takes {name} in float32 or "
                       f"bfloat16, got {x.dtype}")


def gla_pallas(q, k, v, g, *, scale, initial_state, chunk_size, g_min,
               interpret=False, bounded=None, tune=DEFAULT_TUNING):
  """Chunked GLA, forward and backward as Pallas kernels (jax.custom_vjp).

  Args:
    q, k, g: [B, T, H, K]; v: [B, T, H, V] (fp32 or bf16; g fp32 log decay).
    scale: query scale or None (K**-0.5).
    initial_state: [B, H, K, V] or None (zeros).
    chunk_size: must be 64.
    g_min: None (unbounded path) or a python float in [-5.5, 0), the caller's
      promise g >= g_min (bounded path). g below g_min is clamped to g_min.
    interpret: run the kernels in Pallas interpret mode (CPU).
    bounded: force the path (default: bounded iff g_min is given).
    tune: block sizes and launch parameters.
  Returns:
    o [B, T, H, V] in v.dtype, final state [B, H, K, V] fp32.
  """
  check_dims(q, v, chunk_size)
  if bounded is None:
    bounded = g_min is not None
  if bounded:
    check_g_min(g_min)
    # The clamp policy: compute with max(g, g_min); zero gradient below g_min
    # (where, not maximum: maximum would halve the gradient at g == g_min).
    g = jnp.where(g < g_min, float(g_min), g)
  bsz, _, h, dk = q.shape
  dv = v.shape[-1]
  scale = float(dk) ** -0.5 if scale is None else float(scale)
  if initial_state is None:
    initial_state = jnp.zeros((bsz, h, dk, dv), _F32)
  return _gla_pallas_vjp(q, k, v, g.astype(_F32),
                         initial_state.astype(_F32), scale, bool(bounded),
                         tune, bool(interpret))


def register():
  from pallas_kernels.linear_attention import ops
  ops.register_backend("pallas", gla=gla_pallas)
  ops.register_backend("interpret",
                       gla=functools.partial(gla_pallas, interpret=True))
