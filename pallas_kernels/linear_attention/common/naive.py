"""Helpers shared by the pure-JAX references of GLA and KDA (gla/naive.py,
kda/naive.py): scale and state defaults, the chunk reshapes, the
position-pair decays, the scan over chunks and the packed-document masks.
fp32, HIGHEST precision."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp


PREC = jax.lax.Precision.HIGHEST


F32 = jnp.float32


def default_scale(scale: Optional[float], k_dim: int) -> float:
  return float(k_dim) ** -0.5 if scale is None else scale


def init_state(initial_state, b, h, k_dim, v_dim):
  if initial_state is None:
    return jnp.zeros((b, h, k_dim, v_dim), F32)
  return initial_state.astype(F32)


def time_major(x):
  """[B, T, ...] fp32 -> [T, B, ...] so lax.scan walks over tokens."""
  return jnp.moveaxis(x.astype(F32), 1, 0)


def to_chunks(x, chunk_size):
  """[B, T, H, ...] -> fp32 [B, H, N, C, ...], zero-padding T up to N*C.

  Zero padding is neutral for the state: g=0 keeps it (exp(0)=1) and k=0,
  v=0, beta=0 add nothing, so the final state of the padded sequence is the
  final state of the real one.
  """
  b, t, h = x.shape[:3]
  n = -(-t // chunk_size)
  pad = n * chunk_size - t
  x = x.astype(F32)
  if pad:
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  x = x.reshape((b, n, chunk_size, h) + x.shape[3:])
  return jnp.moveaxis(x, 3, 1)


def from_chunks(o, t, dtype):
  """[B, H, N, C, V] -> [B, T, H, V] (dropping the padding)."""
  b, h, n, c, dv = o.shape
  o = jnp.moveaxis(o, 1, 3).reshape(b, n * c, h, dv)
  return o[:, :t].astype(dtype)


def pair_decays(b_cum, same_doc=None):
  """exp(b_i - b_j) on position pairs j <= i, zero above the diagonal.

  b_cum: [..., C, K] within-chunk cumulative log decay (non-increasing).
  same_doc: optional bool [..., C, C] broadcastable to b_cum's batch dims;
    pairs of different documents are zeroed too (packed documents).
  Returns [..., C, C, K]. The mask is applied to the exponent (-inf above the
  diagonal) BEFORE the exp: for j > i, b_i - b_j >= 0 can be arbitrarily
  large under unbounded decay and exp would overflow (and poison gradients
  with inf * 0). Masked entries give exp(-inf) = 0 with zero gradient.
  """
  c = b_cum.shape[-2]
  causal = jnp.tril(jnp.ones((c, c), bool))[:, :, None]
  if same_doc is not None:
    causal = causal & same_doc[..., None]
  diff = b_cum[..., :, None, :] - b_cum[..., None, :, :]
  return jnp.exp(jnp.where(causal, diff, -jnp.inf))


def pair_scores(a, c, decay):
  """sum_d a_id c_jd decay_ijd: [..., C, K] x [..., C, K] x [..., C, C, K] -> [..., C, C].

  An elementwise product and a reduction (exact fp32, fuses into one loop)
  rather than a three-operand einsum.
  """
  return jnp.sum(a[..., :, None, :] * c[..., None, :, :] * decay, axis=-1)


def chunk_decays(g_c):
  """Per-chunk decay factors, all <= 1.

  Returns b (within-chunk cumsum) [..., C, K], exp(b) [..., C, K],
  exp(b_C) [..., K] (whole-chunk decay) and exp(b_C - b) [..., C, K].
  """
  b_cum = jnp.cumsum(g_c, axis=-2)
  b_last = b_cum[..., -1:, :]
  return (b_cum, jnp.exp(b_cum), jnp.exp(b_last[..., 0, :]),
          jnp.exp(b_last - b_cum))


def scan_chunks(step, s0, xs):
  """lax.scan over the chunk axis (axis 2 of [B, H, N, ...] inputs)."""
  xs = tuple(jnp.moveaxis(x, 2, 0) for x in xs)
  s, ys = jax.lax.scan(step, s0, xs)
  return s, jax.tree_util.tree_map(lambda y: jnp.moveaxis(y, 0, 2), ys)


def check_chunk_size(chunk_size):
  if not isinstance(chunk_size, int) or chunk_size <= 0:
    raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def document_starts(segment_ids):
  """[B, T] segment ids -> bool [B, T], True where a new document starts
  inside the row (never at position 0: the row's first document takes the
  initial state)."""
  prev = jnp.concatenate([segment_ids[:, :1], segment_ids[:, :-1]], axis=1)
  return segment_ids != prev


def chunk_document_masks(segment_ids, chunk_size):
  """Per-chunk document masks of the chunked references (fp32 0/1 except
  same_doc; kda/naive.py `chunk_kda_ref` says how they enter).

  Args:
    segment_ids: [B, T] int; padded up to N*C with the last id (the zero
      padding of `to_chunks` then joins the row's last document, neutral).
  Returns:
    same_doc bool [B, 1, N, C, C] (pair (i, j) in one document),
    reads_state [B, 1, N, C, 1] (token in the document of the token before
      the chunk), in_last [B, 1, N, C, 1] (token in the chunk's last
      document), keeps_state [B, 1, N, 1] (the chunk has no document start).
  """
  b, t = segment_ids.shape
  n = -(-t // chunk_size)
  seg = jnp.pad(segment_ids, [(0, 0), (0, n * chunk_size - t)], mode="edge")
  seg = seg.reshape(b, 1, n, chunk_size)
  # Document of the token before each chunk; the first chunk's is its own
  # first token's (the initial state belongs to the row's first document).
  before = jnp.concatenate([seg[:, :, :1, 0], seg[:, :, :-1, -1]], axis=2)
  last = seg[..., -1]
  same_doc = seg[..., :, None] == seg[..., None, :]
  reads_state = (seg == before[..., None]).astype(F32)[..., None]
  in_last = (seg == last[..., None]).astype(F32)[..., None]
  keeps_state = (last == before).astype(F32)[..., None]
  return same_doc, reads_state, in_last, keeps_state
