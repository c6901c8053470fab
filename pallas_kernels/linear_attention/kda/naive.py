"""Pure-JAX oracles for KDA: the per-token recurrence, the chunked
algorithm and the one-token step (see gla/naive.py for the conventions).

Packed documents: with `segment_ids` [B, T] (a document is a run of equal
ids) the recurrence restarts from a zero state at each document start inside
a row, so a packed row computes what each document alone would; the state
given as `initial_state` belongs to the row's first document.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.linear_attention.common.naive import (
    F32, PREC, check_chunk_size, chunk_decays, chunk_document_masks,
    default_scale, document_starts, from_chunks, init_state, pair_decays,
    pair_scores, scan_chunks, time_major, to_chunks)


def _step_kda_f32(q, k, v, g, beta, state, scale):
  """fp32 KDA step: decay first, then the delta rule on the decayed state."""
  s = jnp.exp(g)[..., None] * state
  pred = jnp.einsum("bhk,bhkv->bhv", k, s, precision=PREC)  # S'^T k
  s = s + (beta[..., None, None] * k[..., None]) * (v - pred)[..., None, :]
  o = scale * jnp.einsum("bhk,bhkv->bhv", q, s, precision=PREC)
  return o, s


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
  scale = default_scale(scale, q.shape[-1])
  o, s = _step_kda_f32(q.astype(F32), k.astype(F32), v.astype(F32),
                       g.astype(F32), beta.astype(F32), state.astype(F32),
                       scale)
  return o.astype(v.dtype), s


def naive_recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None,
                        segment_ids=None):
  """Per-token KDA (gated delta rule) recurrence (ground truth).

  Args:
    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H];
    initial_state: [B, H, K, V] or None.
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
    o, s = _step_kda_f32(*xs, s, scale)
    return s, o

  s, o = jax.lax.scan(body, s0, tuple(map(time_major, (q, k, v, g, beta)))
                      + (jnp.moveaxis(starts, 1, 0),))
  return jnp.moveaxis(o, 0, 1).astype(v.dtype), s


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
    m_i = eye[i] - jnp.einsum("...j,...jk->...k", n_i, m, precision=PREC)
    return jax.lax.dynamic_update_index_in_dim(m, m_i, i, axis=-2)

  # eye + zeros_like(n), not broadcast_to: the carry must carry n's
  # varying-manual-axes type when this runs inside shard_map (context
  # parallelism), or fori_loop rejects the carry.
  return jax.lax.fori_loop(1, c, row, eye + jnp.zeros_like(n))


def chunk_kda_ref(q, k, v, g, beta, *, scale=None, initial_state=None,
                  chunk_size=64, segment_ids=None):
  """Chunked KDA (gated delta rule) in pure JAX (docs/design.md §4), safe for any g <= 0.

  Per chunk with start state S and within-chunk decay cumsum b:
    L_ij = beta_i sum_d k_id k_jd exp(b_id - b_jd)   (j < i),  M = (I + L)^-1
    W = M (beta k exp(b)),  U = M (beta v)            (state-independent)
    V' = U - W S                                      (the delta-rule "new values")
    O = scale * ((q exp(b)) S + Aqk V')
    S <- diag(exp(b_C)) S + (k exp(b_C - b))^T V'
  (I + L) is unit lower triangular; `unit_lower_triangular_inverse` inverts
  it by forward substitution (see there for why not a LAPACK solve).

  Packed documents (segment_ids): chunks may straddle documents. Let p be
  the document of the token before the chunk (the row's first document for
  the first chunk) and l the document of the chunk's last token. Then
    - position pairs (i, j) of different documents are masked out of L and
      Aqk (M becomes block diagonal by document);
    - only tokens of document p read the carried state S (their rows of
      exp(b) in W and in q exp(b) are kept, the others zeroed);
    - S <- [l == p] diag(exp(b_C)) S + sum over tokens j of document l,
  which is exactly the per-document recurrence restarted from zero.

  Args:
    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; any T.
    scale: default K**-0.5.
    initial_state: [B, H, K, V] or None (zeros).
    chunk_size: chunk length C.
    segment_ids: [B, T] int or None (one document per row); a document is a
      contiguous run of equal ids.
  Returns:
    o [B, T, H, V] in v.dtype, final state [B, H, K, V] fp32 (of the row's
    last document).
  """
  check_chunk_size(chunk_size)
  bsz, t, h, dk = q.shape
  dv = v.shape[-1]
  scale = default_scale(scale, dk)
  s0 = init_state(initial_state, bsz, h, dk, dv)
  qc, kc, vc, gc = (to_chunks(x, chunk_size) for x in (q, k, v, g))
  betac = to_chunks(beta, chunk_size)[..., None]  # [B, H, N, C, 1]

  b_cum, eb, eb_last, eb_rest = chunk_decays(gc)
  same_doc = reads_state = in_last = keeps_state = None
  if segment_ids is not None:
    same_doc, reads_state, in_last, keeps_state = chunk_document_masks(
        segment_ids, chunk_size)
    eb_read = eb * reads_state
    eb_rest = eb_rest * in_last
  else:
    eb_read = eb
  # [B, H, N, C, C, K], zero above the diagonal (and across documents).
  decay = pair_decays(b_cum, same_doc)
  aqk = pair_scores(qc, kc, decay)
  strict = jnp.tril(jnp.ones((chunk_size, chunk_size), bool), -1)
  lmat = jnp.where(strict, betac * pair_scores(kc, kc, decay), 0.0)

  # [W | U] = (I + L)^-1 [beta k exp(b) | beta v], both at once.
  rhs = jnp.concatenate([betac * kc * eb_read, betac * vc], axis=-1)
  wu = jnp.einsum("bhnij,bhnjd->bhnid", unit_lower_triangular_inverse(lmat),
                  rhs, precision=PREC)
  w, u = wu[..., :dk], wu[..., dk:]
  k_to_end = kc * eb_rest
  if keeps_state is not None:
    eb_last = eb_last * keeps_state

  def step(s, xs):
    w_n, u_n, kd, e_last = xs
    v_new = u_n - jnp.einsum("bhck,bhkv->bhcv", w_n, s, precision=PREC)
    s_next = e_last[..., None] * s + jnp.einsum(
        "bhck,bhcv->bhkv", kd, v_new, precision=PREC)
    return s_next, (s, v_new)

  s_final, (s_in, v_new) = scan_chunks(step, s0, (w, u, k_to_end, eb_last))
  o = scale * (jnp.einsum("bhnck,bhnkv->bhncv", qc * eb_read, s_in,
                          precision=PREC)
               + jnp.einsum("bhnij,bhnjv->bhniv", aqk, v_new, precision=PREC))
  return from_chunks(o, t, v.dtype), s_final
