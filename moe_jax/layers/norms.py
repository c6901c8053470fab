"""Normalisation helpers: RMSNorm (learned scale) and parameter-free norms."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_jax.layers.param_axes import with_axes


def rms_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x / rms(x) over the last axis, computed in fp32, returned in x.dtype."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return y.astype(x.dtype)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x / ||x|| over the last axis (KDA's q and k), in fp32."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)
  return y.astype(x.dtype)


class RMSNorm(nn.Module):
  """RMSNorm over the last axis with a learned per-channel scale (init 1).

  Attributes:
    eps: added to the mean square.
    dtype: output dtype (None keeps the input dtype).
  """
  eps: float = 1e-6
  dtype: jnp.dtype | None = None
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param("scale", with_axes(nn.initializers.ones, None),
                       (x.shape[-1],),
                       self.param_dtype)
    y = rms_normalize(x.astype(jnp.float32), self.eps) * scale.astype(
        jnp.float32)
    return y.astype(self.dtype or x.dtype)
