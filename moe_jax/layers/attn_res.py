"""Block Attention Residuals (docs/design.md §7).

Instead of x_{l+1} = x_l + f_l(x_l), each sublayer reads a softmax mixture of
a few *sources*: the embedding, the sums of completed blocks of sublayers, and
the running partial sum of the current block:

  h_l = sum_i softmax_i(w_l . rmsnorm(v_i)) v_i

with a learned pseudo-query w_l per sublayer, zero-initialised so training
starts from the uniform average. One sublayer per block is full AttnRes (every
earlier output is a source); memory and traffic scale with blocks, not layers.

The sublayers of one block share their completed sources, and the queries
are parameters, not functions of the input. So the mixture runs in two
phases (`BlockAttnResState.mix`):
  1. at a block's start, `attn_res_mix_many` mixes the completed sources for
     all of the block's sublayers at once: each source is read once for L
     queries instead of once per sublayer, and its backward writes one
     cotangent per source for the block instead of one per sublayer;
  2. each later sublayer of the block merges that mixture with the block's
     partial sum (`attn_res_merge`): with the completed sources' log-sum-exp
     `lse`, the partial's weight is sigmoid(logit_p - lse).
Both have hand-written backwards that keep only [L, S, B, T] statistics (and
the merge its phase-1 mixture) and read the sources again, which the model
holds for later mixes anyway. `attn_res_mix_reference` is the plain autodiff
form of one mixture that the tests compare with.

Applied with mutable=["intermediates"], each sublayer's mix sows its softmax
weights averaged over batch and tokens ('weights', [S]): the learned depth
attention that notebook 03 plots.
"""
from __future__ import annotations

import functools
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_jax.layers.norms import rms_normalize
from moe_jax.layers.param_axes import with_axes


def attn_res_mix_reference(sources: Sequence[jax.Array], query: jax.Array,
                           eps: float = 1e-6) -> jax.Array:
  """sources: S arrays [B, T, D]; query [D] -> [B, T, D] in the sources'
  dtype; fp32 inside. Autodiff saves the stacked fp32 sources and keys."""
  v = jnp.stack(sources, axis=0).astype(jnp.float32)             # [S,B,T,D]
  logits = jnp.einsum("sbtd,d->sbt", rms_normalize(v, eps),
                      query.astype(jnp.float32))
  weights = jax.nn.softmax(logits, axis=0)
  return jnp.einsum("sbt,sbtd->btd", weights, v).astype(sources[0].dtype)


# The products with the query are written as multiply-and-reduce, not as
# dots: a dot would be a matrix-vector call on a materialised fp32 copy of
# the source; a reduction reads the source once in its own dtype. The query
# gradients are sums over every token: token-contracting matrix products in
# the sources' dtype with fp32 accumulation (a GEMM, rather than a column
# reduction over B x T rows).


# Sources of at most this many elements (a decode step's [B, 1, D]) are
# stacked: one fused pass over [S, B, T, D] replaces S per-source passes,
# and a step's launches are what its time is made of. Training-size sources
# stay separate, so no stacked fp32 copy is written.
_STACK_MAX_ELEMENTS = 1 << 16


def _stacked(sources):
  """[S, B, T, D] fp32 if the sources are small enough to stack, else None."""
  if sources[0].size > _STACK_MAX_ELEMENTS:
    return None
  return jnp.stack(sources).astype(jnp.float32)


def _stats(sources, queries, eps):
  """Inverse RMS r [S, B, T] and products v . w [L, S, B, T] (fp32) of
  sources (S arrays [B, T, D]) with queries [L, D]."""
  w = queries.astype(jnp.float32)
  v = _stacked(sources)
  if v is not None:
    inv_rms = jax.lax.rsqrt(jnp.mean(v * v, axis=-1) + eps)
    return inv_rms, jnp.sum(v[None] * w[:, None, None, None], axis=-1)
  inv_rms, vw = [], []
  for v in sources:
    v = v.astype(jnp.float32)
    inv_rms.append(jax.lax.rsqrt(jnp.mean(v * v, axis=-1) + eps))
    vw.append(jnp.stack([jnp.sum(v * w_l, axis=-1) for w_l in w]))
  return jnp.stack(inv_rms), jnp.stack(vw, axis=1)


def _mix(sources, weights):
  """sum_i weights[l, i] v_i for each l: weights [L, S, B, T] -> L arrays
  [B, T, D] in the sources' dtype."""
  dtype = sources[0].dtype
  v = _stacked(sources)
  if v is not None:
    out = jnp.sum(weights[..., None] * v[None], axis=1)          # [L,B,T,D]
    return tuple(o.astype(dtype) for o in out)
  return tuple(sum(a[..., None] * v.astype(jnp.float32)
                   for a, v in zip(w_l, sources)).astype(dtype)
               for w_l in weights)


def _key_grad(scale, w, vw, inv_rms, v):
  """sum_l scale_l dlogit_l/dv for logit_l = (v . w_l) r, r = (mean(v^2) +
  eps)^-1/2: sum_l scale_l r (w_l - (v . w_l) r^2 v / D), with scale [L, B,
  T] already multiplied by r; w [L, D], vw [L, B, T], inv_rms [B, T], v
  [B, T, D] fp32. Returns [B, T, D] fp32."""
  d = w.shape[-1]
  return (sum(s_l[..., None] * w_l for s_l, w_l in zip(scale, w))
          - (jnp.sum(scale * vw, axis=0) * inv_rms * inv_rms / d)[..., None]
          * v)


def _token_dot(coef, v):
  """sum over tokens of coef[l, b, t] v[b, t, :]: [L, D] fp32."""
  return jax.lax.dot_general(coef.astype(v.dtype), v,
                             (((1, 2), (0, 1)), ((), ())),
                             preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def attn_res_mix_many(sources: Sequence[jax.Array], queries: jax.Array,
                      eps: float = 1e-6
                      ) -> tuple[tuple[jax.Array, ...], jax.Array]:
  """L mixtures of the same sources, one per query, reading each source once.

  sources: tuple of S arrays [B, T, D] (one dtype); queries: [L, D].
  Returns (L arrays [B, T, D] in the sources' dtype: mixture l is
  attn_res_mix_reference(sources, queries[l]); lse [L, B, T] fp32: the
  log-sum-exp of each mixture's logits, for `attn_res_merge`).
  """
  return _mix_many_fwd(sources, queries, eps)[0]


def _mix_many_fwd(sources, queries, eps):
  inv_rms, vw = _stats(sources, queries, eps)
  logits = vw * inv_rms[None]                                    # [L,S,B,T]
  lse = jax.nn.logsumexp(logits, axis=1)                         # [L,B,T]
  weights = jnp.exp(logits - lse[:, None])
  outs = _mix(sources, weights)
  return (outs, lse), (sources, queries, weights, inv_rms, vw)


def _mix_many_bwd(eps, res, cotangents):
  # logit_li = (v_i . w_l) r_i (`_key_grad`), and dlse_l/dlogit_li = a_li.
  del eps
  sources, queries, weights, inv_rms, vw = res
  g_outs, g_lse = cotangents
  w = queries.astype(jnp.float32)
  gs = [g.astype(jnp.float32) for g in g_outs]
  vs = [v.astype(jnp.float32) for v in sources]
  gv = jnp.stack([jnp.stack([jnp.sum(g * v, axis=-1) for v in vs])
                  for g in gs])                                  # [L,S,B,T]
  d_logits = weights * (gv - jnp.sum(weights * gv, axis=1, keepdims=True)
                        + g_lse[:, None])
  scale = d_logits * inv_rms[None]                               # [L,S,B,T]
  d_sources, d_queries = [], jnp.zeros_like(w)
  for i, (v, src) in enumerate(zip(vs, sources)):
    a, s = weights[:, i], scale[:, i]
    dv = (sum(a_l[..., None] * g for a_l, g in zip(a, gs))
          + _key_grad(s, w, vw[:, i], inv_rms[i], v))
    d_sources.append(dv.astype(src.dtype))
    d_queries = d_queries + _token_dot(s, src)
  return tuple(d_sources), d_queries.astype(queries.dtype)


attn_res_mix_many.defvjp(_mix_many_fwd, _mix_many_bwd)


def attn_res_mix(sources: Sequence[jax.Array], query: jax.Array,
                 eps: float = 1e-6) -> jax.Array:
  """attn_res_mix_reference's value, with the backward of
  `attn_res_mix_many` (one query).

  sources: tuple of S arrays [B, T, D] (one dtype); query: [D].
  Returns [B, T, D] in the sources' dtype (fp32 accumulation).
  """
  return attn_res_mix_many(tuple(sources), query[None], eps)[0][0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def attn_res_merge(mixed: jax.Array, lse: jax.Array, partial: jax.Array,
                   query: jax.Array, eps: float = 1e-6) -> jax.Array:
  """One more source merged into a mixture: the mixture over sources + [p].

  mixed: [B, T, D], the mixture of the other sources under `query`, with
  lse [B, T] the log-sum-exp of their logits (attn_res_mix_many's outputs);
  partial: the new source p [B, T, D]; query: [D]. p's weight is
  alpha = sigmoid(logit_p - lse), and the result
  mixed + alpha (p - mixed) [B, T, D] in p's dtype.
  """
  return _merge_fwd(mixed, lse, partial, query, eps)[0]


def _merge_fwd(mixed, lse, partial, query, eps):
  p = partial.astype(jnp.float32)
  o = mixed.astype(jnp.float32)
  inv_rms, pw = _stats((partial,), query[None], eps)
  inv_rms, pw = inv_rms[0], pw[0, 0]
  alpha = jax.nn.sigmoid(pw * inv_rms - lse)
  out = (o + alpha[..., None] * (p - o)).astype(partial.dtype)
  return out, (mixed, partial, query, alpha, inv_rms, pw)


def _merge_bwd(eps, res, g):
  del eps
  mixed, partial, query, alpha, inv_rms, pw = res
  w = query.astype(jnp.float32)
  p = partial.astype(jnp.float32)
  g = g.astype(jnp.float32)
  d_alpha = jnp.sum(g * (p - mixed.astype(jnp.float32)), axis=-1)
  d_logit = d_alpha * alpha * (1 - alpha)
  s = d_logit * inv_rms
  d_mixed = ((1 - alpha)[..., None] * g).astype(mixed.dtype)
  d_partial = (alpha[..., None] * g
               + _key_grad(s[None], w[None], pw[None], inv_rms, p))
  d_query = _token_dot(s[None], partial)[0]
  return (d_mixed, -d_logit, d_partial.astype(partial.dtype),
          d_query.astype(query.dtype))


attn_res_merge.defvjp(_merge_fwd, _merge_bwd)


class AttnResMix(nn.Module):
  """One sublayer's pseudo-query and its softmax mixture of sources.

  Attributes:
    d_model: width D of the sources (the query is [D], zero-initialised).
    eps: RMSNorm epsilon for the keys.
  """
  d_model: int
  eps: float = 1e-6
  param_dtype: jnp.dtype = jnp.float32

  def setup(self):
    # Declared in setup so that BlockAttnResState can read the queries of a
    # whole block before any of its sublayers runs.
    self.query = self.param("query", with_axes(nn.initializers.zeros, None),
                            (self.d_model,), self.param_dtype)

  def __call__(self, sources: Sequence[jax.Array]) -> jax.Array:
    """sources: S arrays [B, T, D] -> [B, T, D]."""
    self.sow_weights(sources)
    return attn_res_mix(tuple(sources), self.query, self.eps)

  def sow_weights(self, sources: Sequence[jax.Array]) -> None:
    """With 'intermediates' mutable: sows the softmax weights over `sources`
    averaged over batch and tokens ('weights', [S]); else nothing."""
    if self.is_mutable_collection("intermediates"):
      inv_rms, vw = _stats(tuple(sources),
                           jax.lax.stop_gradient(self.query)[None], self.eps)
      weights = jax.nn.softmax(vw[0] * inv_rms, axis=0)
      self.sow("intermediates", "weights",
               jax.lax.stop_gradient(weights.mean(axis=(1, 2))))   # [S]


class BlockAttnResState:
  """Sources across sublayers (plain Python, trace-time only), and the
  two-phase mixture over them.

  `sources()` lists the embedding, completed block sums and (if non-empty)
  the current partial sum; `add(out)` adds a sublayer output to the partial
  sum and closes the block every `layers_per_block` sublayers; `mix(mixers,
  j)` is sublayer j's input.
  """

  def __init__(self, embedding: jax.Array, layers_per_block: int,
               eps: float = 1e-6):
    self.blocks = [embedding]
    self.partial = None
    self.in_block = 0
    self.layers_per_block = layers_per_block
    self.eps = eps
    self._mixed = self._lse = None

  def sources(self) -> list[jax.Array]:
    return self.blocks + ([self.partial] if self.partial is not None else [])

  def add(self, out: jax.Array) -> None:
    self.partial = out if self.partial is None else self.partial + out
    self.in_block += 1
    if self.in_block == self.layers_per_block:
      self.blocks.append(self.partial)
      self.partial, self.in_block = None, 0

  def mix(self, mixers: Sequence[AttnResMix], j: int) -> jax.Array:
    """The mixture of sources() under mixers[j]'s query: [B, T, D].

    mixers: one AttnResMix per sublayer and a last one for the final norm; j
    counts sublayers (len(mixers) - 1 for the final mix). At a block's start
    the completed sources are mixed for mixers[j : j + layers_per_block] at
    once; later sublayers of the block merge that with the partial sum.
    """
    k = self.in_block
    if k == 0:
      queries = jnp.stack(
          [m.query for m in mixers[j:j + self.layers_per_block]])
      self._mixed, self._lse = attn_res_mix_many(tuple(self.blocks), queries,
                                                 self.eps)
    mixers[j].sow_weights(self.sources())
    if self.partial is None:
      return self._mixed[k]
    return attn_res_merge(self._mixed[k], self._lse[k], self.partial,
                          mixers[j].query, self.eps)
