"""Block Attention Residuals (docs/design.md §7).

Instead of x_{l+1} = x_l + f_l(x_l), each sublayer reads a softmax mixture of
a few *sources*: the embedding, the sums of completed blocks of sublayers, and
the running partial sum of the current block:

  h_l = sum_i softmax_i(w_l . rmsnorm(v_i)) v_i

with a learned pseudo-query w_l per sublayer, zero-initialised so training
starts from the uniform average. One sublayer per block is full AttnRes (every
earlier output is a source); memory and traffic scale with blocks, not layers.

Applied with mutable=["intermediates"], each mix sows its softmax weights
averaged over batch and tokens ('weights', [S]): the learned depth attention
that notebook 03 plots.
"""
from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_jax.layers.norms import rms_normalize
from moe_jax.layers.param_axes import with_axes


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
    v = jnp.stack(sources, axis=0)                                  # [S,B,T,D]
    keys = rms_normalize(v.astype(jnp.float32), self.eps)
    logits = jnp.einsum("sbtd,d->sbt", keys, w.astype(jnp.float32))
    weights = jax.nn.softmax(logits, axis=0)
    if self.is_mutable_collection("intermediates"):
      self.sow("intermediates", "weights", weights.mean(axis=(1, 2)))   # [S]
    return jnp.einsum("sbt,sbtd->btd", weights, v.astype(jnp.float32)).astype(
        sources[0].dtype)


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
