"""The vision front end: images -> one d_model embedding per patch.

patchify cuts each image into p x p patches in raster order (row of patches
by row, left to right); the encoder embeds them (`linear`: one projection
plus a learned position per patch; `vit`: the same, then pre-norm
bidirectional transformer blocks over the patches of one image); a
two-layer projector maps them into the language model's d_model.

`place_image_tokens` puts the result into the token sequence: the k-th
IMAGE placeholder of a row (moe_jax.data.vision.IMAGE_TOKEN) takes the k-th
patch of that row's images, images in order. The rest of the model sees one
token per patch, between BOI and EOI, and runs the same KDA/MLA/MoE stack.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_jax.layers.norms import RMSNorm
from moe_jax.layers.param_axes import DEFAULT_KERNEL_INIT, with_axes

ENCODERS = ("none", "linear", "vit")


def patchify(images: jax.Array, patch: int) -> jax.Array:
  """[..., H, W, C] -> [..., (H/p) * (W/p), p * p * C], patches in raster
  order, each flattened (row, column, channel)."""
  *lead, h, w, c = images.shape
  x = images.reshape(*lead, h // patch, patch, w // patch, patch, c)
  n = len(lead)
  x = jnp.moveaxis(x, n + 2, n + 1)  # [..., H/p, W/p, p, p, C]
  return x.reshape(*lead, (h // patch) * (w // patch), patch * patch * c)


def unpatchify(patches: jax.Array, patch: int, height: int, width: int
               ) -> jax.Array:
  """Inverse of patchify: [..., N, p * p * C] -> [..., H, W, C]."""
  *lead, _, d = patches.shape
  c = d // (patch * patch)
  x = patches.reshape(*lead, height // patch, width // patch, patch, patch, c)
  n = len(lead)
  x = jnp.moveaxis(x, n + 1, n + 2)  # [..., H/p, p, W/p, p, C]
  return x.reshape(*lead, height, width, c)


def _dense(features: int, in_axis, out_axis, dtype, param_dtype, name: str,
           scale: float = 1.0) -> nn.Dense:
  init = (DEFAULT_KERNEL_INIT if scale == 1.0 else
          nn.initializers.variance_scaling(scale, "fan_in", "truncated_normal"))
  return nn.Dense(features, use_bias=False, dtype=dtype,
                  param_dtype=param_dtype,
                  kernel_init=with_axes(init, in_axis, out_axis), name=name)


class ViTBlock(nn.Module):
  """Pre-norm bidirectional self-attention + GELU MLP over [B, N, D]."""
  num_heads: int
  mlp_dim: int
  norm_eps: float = 1e-6
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    b, n, d = x.shape
    h = self.num_heads
    dense = lambda f, i, o, name: _dense(f, i, o, self.dtype, self.param_dtype,
                                         name)
    y = RMSNorm(self.norm_eps, dtype=self.dtype, name="attn_norm")(x)
    qkv = dense(3 * d, "embed", "heads", "qkv")(y).reshape(b, n, 3, h, d // h)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
    probs = jax.nn.softmax(logits / jnp.sqrt(d // h), axis=-1)
    att = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v)
    x = x + dense(d, "heads", "embed", "out")(att.reshape(b, n, d))
    y = RMSNorm(self.norm_eps, dtype=self.dtype, name="mlp_norm")(x)
    y = nn.gelu(dense(self.mlp_dim, "embed", "mlp", "mlp_in")(y))
    return x + dense(d, "mlp", "embed", "mlp_out")(y)


class VisionEncoder(nn.Module):
  """Images [B, N, H, W, C] -> patch embeddings [B, N * P, d_model].

  images: uint8 in [0, 255] or float in [0, 1]. P = (H / patch)^2.

  Attributes:
    d_model: the language model's width (the projector's output).
    encoder: 'linear' | 'vit'.
    patch_size: p; divides the image's height and width.
    width: the encoder's width (patch embedding dim).
    num_layers, num_heads, mlp_dim: the ViT blocks (encoder='vit').
  """
  d_model: int
  encoder: str = "linear"
  patch_size: int = 8
  width: int = 64
  num_layers: int = 2
  num_heads: int = 2
  mlp_dim: int = 128
  norm_eps: float = 1e-6
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, images: jax.Array) -> jax.Array:
    if self.encoder not in ENCODERS[1:]:
      raise ValueError(f"model.vision.encoder must be one of "
                       f"{list(ENCODERS[1:])} to embed images, got "
                       f"{self.encoder!r}")
    b, n, h, w, _ = images.shape
    if jnp.issubdtype(images.dtype, jnp.integer):
      images = images.astype(jnp.float32) / 255.0
    x = patchify(images.astype(self.dtype) * 2.0 - 1.0, self.patch_size)
    x = x.reshape(b * n, *x.shape[2:])  # one image per row: [B*N, P, p*p*C]
    x = _dense(self.width, None, "embed", self.dtype, self.param_dtype,
               "patch_embed")(x)
    pos = self.param("pos_embed", with_axes(nn.initializers.normal(0.02),
                                            None, "embed"),
                     x.shape[1:], self.param_dtype)
    x = x + pos.astype(self.dtype)
    if self.encoder == "vit":
      for i in range(self.num_layers):
        x = ViTBlock(self.num_heads, self.mlp_dim, self.norm_eps, self.dtype,
                     self.param_dtype, name=f"vit_{i}")(x)
      x = RMSNorm(self.norm_eps, dtype=self.dtype, name="vit_norm")(x)
    # Projector into the language model's embedding space.
    x = nn.gelu(_dense(self.d_model, "embed", "mlp", self.dtype,
                       self.param_dtype, "proj_in")(x))
    x = _dense(self.d_model, "mlp", "embed", self.dtype, self.param_dtype,
               "proj_out")(x)
    return x.reshape(b, n * x.shape[1], self.d_model)


def place_image_tokens(x: jax.Array, tokens: jax.Array, patches: jax.Array,
                       image_token: int) -> jax.Array:
  """x with the rows at image placeholders replaced by the patches.

  x: [B, T, D] token embeddings; tokens: int [B, T]; patches: [B, M, D].
  The k-th position of row b with tokens == image_token takes patches[b, k];
  a row with more than M placeholders reuses its last patch (the data never
  makes one).
  """
  is_image = tokens == image_token
  k = jnp.clip(jnp.cumsum(is_image, axis=1) - 1, 0, patches.shape[1] - 1)
  taken = jnp.take_along_axis(patches, k[..., None], axis=1)
  return jnp.where(is_image[..., None], taken.astype(x.dtype), x)
