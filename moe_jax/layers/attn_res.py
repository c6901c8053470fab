"""Block Attention Residuals (docs/design.md §7).

Instead of x_{l+1} = x_l + f_l(x_l), each sublayer reads a softmax mixture of
a few *sources*: the embedding, the sums of completed blocks of sublayers, and
the running partial sum of the current block:

  h_l = sum_i softmax_i(w_l . rmsnorm(v_i)) v_i

with a learned pseudo-query w_l per sublayer, zero-initialised so training
starts from the uniform average. One sublayer per block is full AttnRes (every
earlier output is a source); memory and traffic scale with blocks, not layers.

`attn_res_mix` computes the mixture with a hand-written backward: it keeps
only the softmax weights, each source's inverse RMS and its product with the
query ([S, B, T] each) and reads the sources again, which the model holds
anyway, so a mix adds no [S, B, T, D] residual of its own;
`attn_res_mix_reference` is the plain autodiff form the tests compare it
with.

Applied with mutable=["intermediates"], each mix sows its softmax weights
averaged over batch and tokens ('weights', [S]): the learned depth attention
that notebook 03 plots.
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
# the source; a reduction reads the source once in its own dtype.


def _weights(sources, query, eps):
  """Softmax weights, inverse RMS r and products v . w, each [S, B, T]
  (fp32)."""
  w = query.astype(jnp.float32)
  inv_rms, vw = [], []
  for v in sources:
    v = v.astype(jnp.float32)
    inv_rms.append(jax.lax.rsqrt(jnp.mean(v * v, axis=-1) + eps))
    vw.append(jnp.sum(v * w, axis=-1))
  inv_rms, vw = jnp.stack(inv_rms), jnp.stack(vw)
  return jax.nn.softmax(vw * inv_rms, axis=0), inv_rms, vw


def _mix(sources, weights):
  out = sum(a[..., None] * v.astype(jnp.float32)
            for a, v in zip(weights, sources))
  return out.astype(sources[0].dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def attn_res_mix(sources: Sequence[jax.Array], query: jax.Array,
                 eps: float = 1e-6) -> jax.Array:
  """attn_res_mix_reference's value, with a backward that saves [S, B, T]
  arrays only.

  sources: tuple of S arrays [B, T, D] (one dtype); query: [D].
  Returns [B, T, D] in the sources' dtype (fp32 accumulation).
  """
  return _mix(sources, _weights(sources, query, eps)[0])


def _mix_fwd(sources, query, eps):
  weights, inv_rms, vw = _weights(sources, query, eps)
  return _mix(sources, weights), (sources, query, weights, inv_rms, vw)


def _mix_bwd(eps, res, g):
  # logit_i = (v_i . w) r_i with r_i = (mean(v_i^2) + eps)^-1/2, so
  # dlogit_i/dv_i = r_i (w - (v_i . w) r_i^2 v_i / D).
  del eps
  sources, query, weights, inv_rms, vws = res
  w = query.astype(jnp.float32)
  g = g.astype(jnp.float32)
  d = g.shape[-1]
  vs = [v.astype(jnp.float32) for v in sources]
  d_weights = jnp.stack([jnp.sum(g * v, axis=-1) for v in vs])   # [S,B,T]
  d_logits = weights * (d_weights - jnp.sum(weights * d_weights, axis=0))
  scale = d_logits * inv_rms                                     # [S,B,T]
  d_sources, d_query = [], jnp.zeros_like(w)
  for v, src, a, s, r, vw in zip(vs, sources, weights, scale, inv_rms, vws):
    dv = (a[..., None] * g + s[..., None] * w
          - (s * vw * r * r / d)[..., None] * v)
    d_sources.append(dv.astype(src.dtype))
    d_query = d_query + jnp.sum(s[..., None] * v, axis=(0, 1))
  return tuple(d_sources), d_query.astype(query.dtype)


attn_res_mix.defvjp(_mix_fwd, _mix_bwd)


class AttnResMix(nn.Module):
  """Softmax mixture of sources with a zero-initialised pseudo-query.

  Attributes:
    eps: RMSNorm epsilon for the keys.
  """
  eps: float = 1e-6
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, sources: Sequence[jax.Array]) -> jax.Array:
    """sources: S arrays [B, T, D] -> [B, T, D]."""
    d = sources[0].shape[-1]
    w = self.param("query", with_axes(nn.initializers.zeros, None), (d,),
                   self.param_dtype)
    sources = tuple(sources)
    if self.is_mutable_collection("intermediates"):
      weights = _weights(sources, jax.lax.stop_gradient(w), self.eps)[0]
      self.sow("intermediates", "weights",
               jax.lax.stop_gradient(weights.mean(axis=(1, 2))))   # [S]
    return attn_res_mix(sources, w, self.eps)


class BlockAttnResState:
  """Bookkeeping of sources across sublayers (plain Python, trace-time only).

  `sources()` lists the embedding, completed block sums and (if non-empty)
  the current partial sum; `add(out)` adds a sublayer output to the partial
  sum and closes the block every `layers_per_block` sublayers.
  """

  def __init__(self, embedding: jax.Array, layers_per_block: int):
    self.blocks = [embedding]
    self.partial = None
    self.in_block = 0
    self.layers_per_block = layers_per_block

  def sources(self) -> list[jax.Array]:
    return self.blocks + ([self.partial] if self.partial is not None else [])

  def add(self, out: jax.Array) -> None:
    self.partial = out if self.partial is None else self.partial + out
    self.in_block += 1
    if self.in_block == self.layers_per_block:
      self.blocks.append(self.partial)
      self.partial, self.in_block = None, 0
