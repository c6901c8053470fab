"""Picking entries along the last axis with a scatter-free gradient.

`jnp.take_along_axis(x, idx, axis=-1)` is a gather whose gradient is a
scatter-add into zeros of x's shape; XLA runs that scatter on a GPU as
atomics, one fusion per call (in the training step: every router's top-k
weights and the loss's target logits). `pick` computes the same values as a
one-hot masked sum over the last axis, so its gradient is a broadcast and
a select that fuse with their neighbours. The values are exact: each sum
adds one entry of x to zeros.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def pick(x: jax.Array, idx: jax.Array) -> jax.Array:
  """x[..., idx]: x [..., V], idx [..., k] integer in [0, V) -> [..., k].

  Costs [..., k, V] elementwise work (fused); meant for small k x V (top-k
  of a router's experts, one target of a vocabulary).
  """
  if idx.shape[:-1] != x.shape[:-1]:
    raise ValueError(f"pick: idx {idx.shape} and x {x.shape} must agree on "
                     "every axis but the last")
  hit = idx[..., :, None] == jnp.arange(x.shape[-1], dtype=idx.dtype)
  return jnp.sum(jnp.where(hit, x[..., None, :], jnp.zeros((), x.dtype)),
                 axis=-1)
