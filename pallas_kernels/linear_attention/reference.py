"""Pure-JAX oracles for chunked linear attention with per-channel log decay.

docs/design.md §4. Shapes follow the common convention:
  q, k:  [B, T, H, K]
  v:     [B, T, H, V]
  g:     [B, T, H, K]  log decay per step, g <= 0 (fp32)
  beta:  [B, T, H]     delta-rule step size (KDA only)
  state: [B, H, K, V]  fp32

Recurrences (scale defaults to K**-0.5):
  GLA: S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T,                   o_t = scale S_t^T q_t
  KDA: S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1}
             + beta_t k_t v_t^T,                                    o_t = scale S_t^T q_t

Three families live here:
  * naive_recurrent_*: a per-token jax.lax.scan, the ground truth of every test;
  * chunk_*_ref: the chunked algorithm in plain JAX (the "xla" backend of
    ops.py and the oracle the Pallas kernels are checked against);
  * recurrent_step_*: one token, for decoding.

Everything is computed in fp32 at HIGHEST matmul precision (these are
oracles: TF32/bf16 passes would hide kernel errors). Outputs o are returned in
v.dtype, states always in fp32.

The chunked versions are numerically safe for ANY g <= 0, bounded or not: the
intra-chunk decays are formed on position pairs, exp(b_i - b_j) with the
causal mask applied before the exp, so every exponent is <= 0; the cross-chunk
factors exp(b_i) and exp(b_C - b_j) are <= 1 as well. The price is an
intermediate of size [B, H, T/C, C, C, K] (O(B*H*T*C*K) memory), fine for an
oracle and small models; the fast dense-dot tiling is the kernels' job.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

_PREC = jax.lax.Precision.HIGHEST
_F32 = jnp.float32


def _default_scale(scale: Optional[float], k_dim: int) -> float:
  return float(k_dim) ** -0.5 if scale is None else scale


def _init_state(initial_state, b, h, k_dim, v_dim):
  if initial_state is None:
    return jnp.zeros((b, h, k_dim, v_dim), _F32)
  return initial_state.astype(_F32)


# ---------------------------------------------------------------------------
# One-token steps (decoding) and the naive per-token recurrences.
# ---------------------------------------------------------------------------


def _step_gla_f32(q, k, v, g, state, scale):
  """fp32 GLA step; q, k, g [B, H, K], v [B, H, V], state [B, H, K, V]."""
  s = jnp.exp(g)[..., None] * state + k[..., None] * v[..., None, :]
  o = scale * jnp.einsum("bhk,bhkv->bhv", q, s, precision=_PREC)
  return o, s


def _step_kda_f32(q, k, v, g, beta, state, scale):
  """fp32 KDA step: decay first, then the delta rule on the decayed state."""
  s = jnp.exp(g)[..., None] * state
  pred = jnp.einsum("bhk,bhkv->bhv", k, s, precision=_PREC)  # S'^T k
  s = s + (beta[..., None, None] * k[..., None]) * (v - pred)[..., None, :]
  o = scale * jnp.einsum("bhk,bhkv->bhv", q, s, precision=_PREC)
  return o, s


def recurrent_step_gla(q, k, v, g, state, *, scale=None):
  """One GLA token (decoding).

  Args:
    q, k, g: [B, H, K] (g log decay <= 0).
    v: [B, H, V].
    state: [B, H, K, V] state after the previous token.
    scale: query scale, default K**-0.5.
  Returns:
    o [B, H, V] in v.dtype, new state [B, H, K, V] fp32.
  """
  scale = _default_scale(scale, q.shape[-1])
  o, s = _step_gla_f32(q.astype(_F32), k.astype(_F32), v.astype(_F32),
                       g.astype(_F32), state.astype(_F32), scale)
  return o.astype(v.dtype), s


def recurrent_step_kda(q, k, v, g, beta, state, *, scale=None):
  """One KDA token (decoding).

  Args:
    q, k, g: [B, H, K] (g log decay <= 0).
    v: [B, H, V].
    beta: [B, H].
    state: [B, H, K, V] state after the previous token.
    scale: query scale, default K**-0.5.
  Returns:
    o [B, H, V] in v.dtype, new state [B, H, K, V] fp32.
  """
  scale = _default_scale(scale, q.shape[-1])
  o, s = _step_kda_f32(q.astype(_F32), k.astype(_F32), v.astype(_F32),
                       g.astype(_F32), beta.astype(_F32), state.astype(_F32),
                       scale)
  return o.astype(v.dtype), s


def _time_major(x):
  """[B, T, ...] fp32 -> [T, B, ...] so lax.scan walks over tokens."""
  return jnp.moveaxis(x.astype(_F32), 1, 0)


def naive_recurrent_gla(q, k, v, g, *, scale=None, initial_state=None):
  """Per-token GLA recurrence (ground truth).

  Args:
    q, k, g: [B, T, H, K]; v: [B, T, H, V]; initial_state: [B, H, K, V] or None.
  Returns:
    o [B, T, H, V] in v.dtype, final state [B, H, K, V] fp32.
  """
  b, _, h, dk = q.shape
  scale = _default_scale(scale, dk)
  s0 = _init_state(initial_state, b, h, dk, v.shape[-1])

  def body(s, xs):
    o, s = _step_gla_f32(*xs, s, scale)
    return s, o

  s, o = jax.lax.scan(body, s0, tuple(map(_time_major, (q, k, v, g))))
  return jnp.moveaxis(o, 0, 1).astype(v.dtype), s


def naive_recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None):
  """Per-token KDA (gated delta rule) recurrence (ground truth).

  Args:
    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H];
    initial_state: [B, H, K, V] or None.
  Returns:
    o [B, T, H, V] in v.dtype, final state [B, H, K, V] fp32.
  """
  b, _, h, dk = q.shape
  scale = _default_scale(scale, dk)
  s0 = _init_state(initial_state, b, h, dk, v.shape[-1])

  def body(s, xs):
    o, s = _step_kda_f32(*xs, s, scale)
    return s, o

  s, o = jax.lax.scan(body, s0, tuple(map(_time_major, (q, k, v, g, beta))))
  return jnp.moveaxis(o, 0, 1).astype(v.dtype), s


# ---------------------------------------------------------------------------
# Chunked algorithm.
# ---------------------------------------------------------------------------


def _to_chunks(x, chunk_size):
  """[B, T, H, ...] -> fp32 [B, H, N, C, ...], zero-padding T up to N*C.

  Zero padding is neutral for the state: g=0 keeps it (exp(0)=1) and k=0,
  v=0, beta=0 add nothing, so the final state of the padded sequence is the
  final state of the real one.
  """
  b, t, h = x.shape[:3]
  n = -(-t // chunk_size)
  pad = n * chunk_size - t
  x = x.astype(_F32)
  if pad:
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  x = x.reshape((b, n, chunk_size, h) + x.shape[3:])
  return jnp.moveaxis(x, 3, 1)


def _from_chunks(o, t, dtype):
  """[B, H, N, C, V] -> [B, T, H, V] (dropping the padding)."""
  b, h, n, c, dv = o.shape
  o = jnp.moveaxis(o, 1, 3).reshape(b, n * c, h, dv)
  return o[:, :t].astype(dtype)


def _pair_decays(b_cum):
  """exp(b_i - b_j) on position pairs j <= i, zero above the diagonal.

  b_cum: [..., C, K] within-chunk cumulative log decay (non-increasing).
  Returns [..., C, C, K]. The mask is applied to the exponent (-inf above the
  diagonal) BEFORE the exp: for j > i, b_i - b_j >= 0 can be arbitrarily
  large under unbounded decay and exp would overflow (and poison gradients
  with inf * 0). Masked entries give exp(-inf) = 0 with zero gradient.
  """
  c = b_cum.shape[-2]
  causal = jnp.tril(jnp.ones((c, c), bool))[:, :, None]
  diff = b_cum[..., :, None, :] - b_cum[..., None, :, :]
  return jnp.exp(jnp.where(causal, diff, -jnp.inf))


def _pair_scores(a, c, decay):
  """sum_d a_id c_jd decay_ijd: [..., C, K] x [..., C, K] x [..., C, C, K] -> [..., C, C].

  An elementwise product and a reduction (exact fp32, fuses into one loop)
  rather than a three-operand einsum.
  """
  return jnp.sum(a[..., :, None, :] * c[..., None, :, :] * decay, axis=-1)


def _chunk_decays(g_c):
  """Per-chunk decay factors, all <= 1.

  Returns b (within-chunk cumsum) [..., C, K], exp(b) [..., C, K],
  exp(b_C) [..., K] (whole-chunk decay) and exp(b_C - b) [..., C, K].
  """
  b_cum = jnp.cumsum(g_c, axis=-2)
  b_last = b_cum[..., -1:, :]
  return (b_cum, jnp.exp(b_cum), jnp.exp(b_last[..., 0, :]),
          jnp.exp(b_last - b_cum))


def _scan_chunks(step, s0, xs):
  """lax.scan over the chunk axis (axis 2 of [B, H, N, ...] inputs)."""
  xs = tuple(jnp.moveaxis(x, 2, 0) for x in xs)
  s, ys = jax.lax.scan(step, s0, xs)
  return s, jax.tree_util.tree_map(lambda y: jnp.moveaxis(y, 0, 2), ys)


def _check_chunk_size(chunk_size):
  if not isinstance(chunk_size, int) or chunk_size <= 0:
    raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def chunk_gla_ref(q, k, v, g, *, scale=None, initial_state=None,
                  chunk_size=64):
  """Chunked GLA in pure JAX (docs/design.md §4), safe for any g <= 0.

  Per chunk with start state S and within-chunk decay cumsum b:
    O = scale * ((q exp(b)) S + Aqk v),  Aqk_ij = sum_d q_id k_jd exp(b_id - b_jd), j <= i
    S <- diag(exp(b_C)) S + (k exp(b_C - b))^T v
  The intra-chunk parts are computed for all chunks at once; only the state
  passing is sequential (lax.scan over chunks).

  Args:
    q, k, g: [B, T, H, K]; v: [B, T, H, V]; any T (padded internally).
    scale: default K**-0.5.
    initial_state: [B, H, K, V] or None (zeros).
    chunk_size: chunk length C.
  Returns:
    o [B, T, H, V] in v.dtype, final state [B, H, K, V] fp32.
  """
  _check_chunk_size(chunk_size)
  bsz, t, h, dk = q.shape
  scale = _default_scale(scale, dk)
  s0 = _init_state(initial_state, bsz, h, dk, v.shape[-1])
  qc, kc, vc, gc = (_to_chunks(x, chunk_size) for x in (q, k, v, g))

  b_cum, eb, eb_last, eb_rest = _chunk_decays(gc)
  # Intra-chunk scores on position pairs (inclusive diagonal: S_t holds k_t v_t^T).
  # The decays go in through an optimization barrier, so XLA stores them
  # rather than fusing the exp into the score reduce: fused, XLA's GPU
  # compile of that one reduce runs for minutes; stored, the forward and
  # gradient jits compile in seconds (results/kernels.md, 2026-12-05).
  # KDA's reference (two score reduces over the same decays) compiles in
  # seconds as it is.
  aqk = _pair_scores(qc, kc,
                     jax.lax.optimization_barrier(_pair_decays(b_cum)))
  k_to_end = kc * eb_rest  # k_j decayed to the chunk's last row

  def step(s, xs):
    kd, v_n, e_last = xs
    s_next = e_last[..., None] * s + jnp.einsum(
        "bhck,bhcv->bhkv", kd, v_n, precision=_PREC)
    return s_next, s  # emit the state entering this chunk

  s_final, s_in = _scan_chunks(step, s0, (k_to_end, vc, eb_last))
  o = scale * (jnp.einsum("bhnck,bhnkv->bhncv", qc * eb, s_in, precision=_PREC)
               + jnp.einsum("bhnij,bhnjv->bhniv", aqk, vc, precision=_PREC))
  return _from_chunks(o, t, v.dtype), s_final


def unit_lower_triangular_inverse(n: jax.Array) -> jax.Array:
  """(I + N)^-1 for strictly lower-triangular N [..., C, C], fp32.

  Forward substitution, one row at a time: M_i = e_i - sum_{j<i} N_ij M_j.
  Two shortcuts were tried and rejected, and tests pin why:
  - the dense-dot product (I - N)(I + N^2)(I + N^4)... is exact in exact
    arithmetic but its powers N^(2^p) reach ~C^(2^p)/(2^p)! when N is near
    the all-ones lower matrix (similar keys, beta ~ 1, slow decay): in fp32
    at C = 64 they overflow and training produced NaN (gpu_small, step 54);
  - jax.scipy.linalg.solve_triangular: jaxlib 0.10.2's batched CPU LAPACK
    kernel can deadlock its thread pool when two solves run at once.
  """
  c = n.shape[-1]
  eye = jnp.eye(c, dtype=n.dtype)

  def row(i, m):
    n_i = jax.lax.dynamic_index_in_dim(n, i, axis=-2, keepdims=False)
    m_i = eye[i] - jnp.einsum("...j,...jk->...k", n_i, m, precision=_PREC)
    return jax.lax.dynamic_update_index_in_dim(m, m_i, i, axis=-2)

  # eye + zeros_like(n), not broadcast_to: the carry must carry n's
  # varying-manual-axes type when this runs inside shard_map (context
  # parallelism), or fori_loop rejects the carry.
  return jax.lax.fori_loop(1, c, row, eye + jnp.zeros_like(n))


def chunk_kda_ref(q, k, v, g, beta, *, scale=None, initial_state=None,
                  chunk_size=64):
  """Chunked KDA (gated delta rule) in pure JAX (docs/design.md §4), safe for any g <= 0.

  Per chunk with start state S and within-chunk decay cumsum b:
    L_ij = beta_i sum_d k_id k_jd exp(b_id - b_jd)   (j < i),  M = (I + L)^-1
    W = M (beta k exp(b)),  U = M (beta v)            (state-independent)
    V' = U - W S                                      (the delta-rule "new values")
    O = scale * ((q exp(b)) S + Aqk V')
    S <- diag(exp(b_C)) S + (k exp(b_C - b))^T V'
  (I + L) is unit lower triangular; `unit_lower_triangular_inverse` inverts
  it by forward substitution (see there for why not a LAPACK solve).

  Args:
    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; any T.
    scale: default K**-0.5.
    initial_state: [B, H, K, V] or None (zeros).
    chunk_size: chunk length C.
  Returns:
    o [B, T, H, V] in v.dtype, final state [B, H, K, V] fp32.
  """
  _check_chunk_size(chunk_size)
  bsz, t, h, dk = q.shape
  dv = v.shape[-1]
  scale = _default_scale(scale, dk)
  s0 = _init_state(initial_state, bsz, h, dk, dv)
  qc, kc, vc, gc = (_to_chunks(x, chunk_size) for x in (q, k, v, g))
  betac = _to_chunks(beta, chunk_size)[..., None]  # [B, H, N, C, 1]

  b_cum, eb, eb_last, eb_rest = _chunk_decays(gc)
  decay = _pair_decays(b_cum)  # [B, H, N, C, C, K], zero above the diagonal
  aqk = _pair_scores(qc, kc, decay)
  strict = jnp.tril(jnp.ones((chunk_size, chunk_size), bool), -1)
  lmat = jnp.where(strict, betac * _pair_scores(kc, kc, decay), 0.0)

  # [W | U] = (I + L)^-1 [beta k exp(b) | beta v], both at once.
  rhs = jnp.concatenate([betac * kc * eb, betac * vc], axis=-1)
  wu = jnp.einsum("bhnij,bhnjd->bhnid", unit_lower_triangular_inverse(lmat),
                  rhs, precision=_PREC)
  w, u = wu[..., :dk], wu[..., dk:]
  k_to_end = kc * eb_rest

  def step(s, xs):
    w_n, u_n, kd, e_last = xs
    v_new = u_n - jnp.einsum("bhck,bhkv->bhcv", w_n, s, precision=_PREC)
    s_next = e_last[..., None] * s + jnp.einsum(
        "bhck,bhcv->bhkv", kd, v_new, precision=_PREC)
    return s_next, (s, v_new)

  s_final, (s_in, v_new) = _scan_chunks(step, s0, (w, u, k_to_end, eb_last))
  o = scale * (jnp.einsum("bhnck,bhnkv->bhncv", qc * eb, s_in, precision=_PREC)
               + jnp.einsum("bhnij,bhnjv->bhniv", aqk, v_new, precision=_PREC))
  return _from_chunks(o, t, v.dtype), s_final


__all__ = [
    "naive_recurrent_gla", "naive_recurrent_kda", "chunk_gla_ref",
    "chunk_kda_ref", "recurrent_step_gla", "recurrent_step_kda",
    "unit_lower_triangular_inverse",
]
