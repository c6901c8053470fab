"""Pure-JAX oracles for chunked GLA with per-channel log decay.

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

Packed documents: with `segment_ids` [B, T] (a document is a contiguous run
of equal ids) the GLA recurrence and its chunked form restart from a zero
state at each document start inside a row, as kda/naive.py's do.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.linear_attention.common.naive import (
    F32, PREC, check_chunk_size, chunk_decays, chunk_document_masks,
    default_scale, document_starts, from_chunks, init_state, pair_decays,
    pair_scores, scan_chunks, time_major, to_chunks)


def _step_gla_f32(q, k, v, g, state, scale):
  """fp32 GLA step; q, k, g [B, H, K], v [B, H, V], state [B, H, K, V]."""
  s = jnp.exp(g)[..., None] * state + k[..., None] * v[..., None, :]
  o = scale * jnp.einsum("bhk,bhkv->bhv", q, s, precision=PREC)
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
  scale = default_scale(scale, q.shape[-1])
  o, s = _step_gla_f32(q.astype(F32), k.astype(F32), v.astype(F32),
                       g.astype(F32), state.astype(F32), scale)
  return o.astype(v.dtype), s


def naive_recurrent_gla(q, k, v, g, *, scale=None, initial_state=None,
                        segment_ids=None):
  """Per-token GLA recurrence (ground truth).

  Args:
    q, k, g: [B, T, H, K]; v: [B, T, H, V]; initial_state: [B, H, K, V] or None.
    segment_ids: [B, T] int or None; the state is zeroed before the first
      token of each new document.
  Returns:
    o [B, T, H, V] in v.dtype, final state [B, H, K, V] fp32 (of the row's
    last document).
  """
  b, t, h, dk = q.shape
  scale = default_scale(scale, dk)
  s0 = init_state(initial_state, b, h, dk, v.shape[-1])
  starts = (jnp.zeros((b, t), bool) if segment_ids is None
            else document_starts(segment_ids))

  def body(s, xs):
    *xs, start = xs
    s = jnp.where(start[:, None, None, None], 0.0, s)
    o, s = _step_gla_f32(*xs, s, scale)
    return s, o

  s, o = jax.lax.scan(body, s0, tuple(map(time_major, (q, k, v, g)))
                      + (jnp.moveaxis(starts, 1, 0),))
  return jnp.moveaxis(o, 0, 1).astype(v.dtype), s


def chunk_gla_ref(q, k, v, g, *, scale=None, initial_state=None,
                  chunk_size=64, segment_ids=None):
  """Chunked GLA in pure JAX (docs/design.md §4), safe for any g <= 0.

  Per chunk with start state S and within-chunk decay cumsum b:
    O = scale * ((q exp(b)) S + Aqk v),  Aqk_ij = sum_d q_id k_jd exp(b_id - b_jd), j <= i
    S <- diag(exp(b_C)) S + (k exp(b_C - b))^T v
  The intra-chunk parts are computed for all chunks at once; only the state
  passing is sequential (lax.scan over chunks).

  Packed documents (segment_ids): as chunk_kda_ref, pairs of different
  documents are masked out of Aqk, only tokens of the document of the token
  before the chunk read S (rows of q exp(b)), only tokens of the chunk's
  last document enter the carried state (rows of k exp(b_C - b)), and
  diag(exp(b_C)) S is kept only by a chunk without a document start.

  Args:
    q, k, g: [B, T, H, K]; v: [B, T, H, V]; any T (padded internally).
    scale: default K**-0.5.
    initial_state: [B, H, K, V] or None (zeros).
    chunk_size: chunk length C.
    segment_ids: [B, T] int or None (one document per row).
  Returns:
    o [B, T, H, V] in v.dtype, final state [B, H, K, V] fp32 (of the row's
    last document).
  """
  check_chunk_size(chunk_size)
  bsz, t, h, dk = q.shape
  scale = default_scale(scale, dk)
  s0 = init_state(initial_state, bsz, h, dk, v.shape[-1])
  qc, kc, vc, gc = (to_chunks(x, chunk_size) for x in (q, k, v, g))

  b_cum, eb, eb_last, eb_rest = chunk_decays(gc)
  same_doc = None
  if segment_ids is not None:
    same_doc, reads_state, in_last, keeps_state = chunk_document_masks(
        segment_ids, chunk_size)
    eb, eb_rest = eb * reads_state, eb_rest * in_last
    eb_last = eb_last * keeps_state
  # Intra-chunk scores on position pairs (inclusive diagonal: S_t holds k_t v_t^T).
  # The decays go in through an optimization barrier, so XLA stores them
  # rather than fusing the exp into the score reduce: fused, XLA's GPU
  # compile of that one reduce runs for minutes; stored, the forward and
  # gradient jits compile in seconds (results/kernels.md, 2026-12-05).
  # KDA's reference (two score reduces over the same decays) compiles in
  # seconds as it is.
  aqk = pair_scores(qc, kc,
                    jax.lax.optimization_barrier(pair_decays(b_cum,
                                                             same_doc)))
  k_to_end = kc * eb_rest  # k_j decayed to the chunk's last row

  def step(s, xs):
    kd, v_n, e_last = xs
    s_next = e_last[..., None] * s + jnp.einsum(
        "bhck,bhcv->bhkv", kd, v_n, precision=PREC)
    return s_next, s  # emit the state entering this chunk

  s_final, s_in = scan_chunks(step, s0, (k_to_end, vc, eb_last))
  o = scale * (jnp.einsum("bhnck,bhnkv->bhncv", qc * eb, s_in, precision=PREC)
               + jnp.einsum("bhnij,bhnjv->bhniv", aqk, vc, precision=PREC))
  return from_chunks(o, t, v.dtype), s_final
