"""Gated Multi-head Latent Attention (MLA), NoPE by default.

docs/design.md §5. Keys and values come from a small latent
  c_kv = rmsnorm(W_dkv x)                          [B, T, kv_lora_rank]
  k_h = W_uk_h c_kv,  v_h = W_uv_h c_kv            per head
  q_h = W_q_h x  (or W_uq_h rmsnorm(W_dq x) with q_lora_rank > 0)
and an optional decoupled rotary part shared by all heads' keys
(qk_rope_head_dim; 0 = pure NoPE, the default). The output is gated
elementwise by sigmoid(W_gate x) before W_o.

Which attention runs where (model.mla.attention_impl):
- one sequence per row (no segment_ids): on a GPU, "auto" runs cuDNN's flash
  attention (bf16/fp16, padded head width a multiple of 8 and at most 128,
  256 on Hopper), so memory stays O(T); XLA otherwise (fp32 models, wider
  heads, CPU). JAX's own default for jax.nn.dot_product_attention is XLA,
  whose [B, H, T, T] scores do not fit long sequences, so "auto" names
  cuDNN rather than leave the choice to JAX;
- packed documents (segment_ids): the mask is causal AND same document. On a
  GPU, "auto" runs a Pallas flash kernel that reads the ids per tile
  (pallas_kernels/flash_attention.py), so memory stays O(T); cuDNN is not
  used here because its masked path is not verified for this mask. On CPU
  "auto" (and "xla" / "cudnn" everywhere) runs XLA with a dense
  [B, 1, T, T] mask, O(T^2) but simple;
- "pallas" forces the flash kernel, packed or not ("interpret": the same
  kernel in the Pallas interpreter, for CPU tests);
- context parallel (T split over the mesh's context axis): always
  dot_product_attention with a mask (context_attention.py); "pallas" and
  "interpret" run there as "auto".

Decoding (`decode=True`) caches only c_kv [B, T_max, r] (+ the rotary key
[B, T_max, R]) and attends in the absorbed form: W_uk is folded into the
query (q~_h = W_uk_h^T q_h, size r) and W_uv into the output
(o_h = W_uv_h sum_s p_s c_s), so the cache is never expanded per head.
Beside the latent, the segment id of every cached position [B, T_max] int32:
a token attends to cached positions of its own document only, as the packed
forward does. RoPE positions are the row's (0 at the start of the sequence,
not of each document), in the forward and in decoding alike.

logn_scale_len = L > 0 multiplies the queries at row position p by
max(1, log(p + 1) / log(L)) in every path (training, context parallel,
prefill, decoding): nothing changes up to L, and beyond it the logits grow
with the log of the number of visible keys (length extrapolation of NoPE
attention; a model trained at L without it can be evaluated with it).
"""
from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_jax.layers import mesh_utils
from moe_jax.layers.context_attention import context_parallel_latent_attention
from moe_jax.layers.norms import RMSNorm
from moe_jax.layers.param_axes import DEFAULT_KERNEL_INIT, with_axes
from pallas_kernels.device import gpu_compute_major
from pallas_kernels.flash_attention import (MAX_HEAD_WIDTH, flash_attention,
                                            supports_head_dims)

# model.mla.attention_impl: "pallas" / "interpret" (the Pallas interpreter,
# CPU tests) run the flash kernel; the others name (or, "auto", leave to JAX)
# the implementation of jax.nn.dot_product_attention.
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "pallas", "interpret")


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding on the last axis (pairs (2i, 2i+1) rotate together).

  x: [B, T, N, R] with R even; positions: [T] or [B, T] integer positions.
  """
  r = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, r, 2, dtype=jnp.float32) / r))
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [.., T, R/2]
  if angles.ndim == 2:
    angles = angles[None]
  sin, cos = jnp.sin(angles)[:, :, None], jnp.cos(angles)[:, :, None]
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., 0::2], x32[..., 1::2]
  out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
  return out.reshape(x.shape).astype(x.dtype)


def logn_scale(positions: jax.Array, train_len: int) -> jax.Array:
  """Query scale per position: max(1, log(p + 1) / log(train_len)).

  positions: [T] or [B, T] 0-based positions in the row; p + 1 keys are
  visible to a causal query there. 1 up to train_len, so training at that
  length is unchanged; beyond it the logits grow with log(p + 1), keeping
  the attention's entropy near what training saw as the keys multiply.
  """
  p = positions.astype(jnp.float32) + 1.0
  return jnp.maximum(1.0, jnp.log(p) / jnp.log(float(train_len)))


class GatedMLA(nn.Module):
  """Causal gated MLA over [B, T, D].

  Attributes mirror config.model.mla; d_model is the model width;
  mesh_axes are the mesh axes from the run's rules (mesh_utils.mesh_axes).
  """
  d_model: int
  num_heads: int
  kv_lora_rank: int
  qk_nope_head_dim: int
  v_head_dim: int
  q_lora_rank: int = 0
  qk_rope_head_dim: int = 0
  rope_theta: float = 10000.0
  logn_scale_len: int = 0
  attention_impl: str = "auto"
  norm_eps: float = 1e-6
  out_init_scale: float = 1.0
  mesh_axes: mesh_utils.MeshAxes = mesh_utils.MeshAxes()
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, decode: bool = False,
               new_sequence: bool = False,
               segment_ids: jax.Array | None = None) -> jax.Array:
    """x: [B, T, D] -> [B, T, D].

    segment_ids: optional [B, T] int >= 0, packed documents: a token attends
      only to earlier tokens of its own document (causal AND same id), also
      under context parallelism and with decode; see the module docstring
      for which attention runs it.

    decode: attend over the `cache` collection (make it mutable) after
      appending this call's T latents at its `index`; created with zeros and
      T_max = T when absent (moe_jax/decode.py builds it for a given T_max).
      With segment_ids, the tokens attend to cached positions of their own
      id; None: they continue the document of the last cached position.
    new_sequence (with decode): the tokens start a new sequence at position
      0 of the cache, whatever it held.
    When the ambient mesh (jax.set_mesh) has the context axis of size > 1
    dividing T, the attention runs context-parallel (context_attention.py):
    each device gathers the latent c_kv of the whole sequence. Otherwise
    (no mesh, size 1) the plain path below, unchanged.
    """
    b, t, _ = x.shape
    h, dn, dr, dv = (self.num_heads, self.qk_nope_head_dim,
                     self.qk_rope_head_dim, self.v_head_dim)
    dqk = dn + dr
    def dense(n, name, axes, init=DEFAULT_KERNEL_INIT):
      return nn.Dense(n, use_bias=False, dtype=self.dtype,
                      param_dtype=self.param_dtype,
                      kernel_init=with_axes(init, *axes), name=name)
    x = x.astype(self.dtype)

    # Queries.
    if self.q_lora_rank > 0:
      c_q = RMSNorm(self.norm_eps, name="q_norm")(
          dense(self.q_lora_rank, "q_down", ("embed", None))(x))
      q = dense(h * dqk, "q_up", (None, "heads"))(c_q)
    else:
      q = dense(h * dqk, "q_proj", ("embed", "heads"))(x)
    q = q.reshape(b, t, h, dqk)

    # Latent keys/values: only c_kv (and the rotary key) would be cached.
    c_kv = RMSNorm(self.norm_eps, name="kv_norm")(
        dense(self.kv_lora_rank, "kv_down", ("embed", None))(x))
    n_ctx = mesh_utils.axis_size(self.mesh_axes.context)
    if decode:
      o = self._cached_attention(x, q, c_kv, dense, new_sequence, segment_ids)
    elif n_ctx > 1 and t % n_ctx == 0:
      # Context parallel: gather the small latent, not the keys and values.
      o = self._context_attention(x, q, c_kv, dense, segment_ids)
    else:
      o = self._attention(x, q, c_kv, dense, segment_ids=segment_ids)

    gate = jax.nn.sigmoid(dense(h * dv, "gate_proj", ("embed", "heads"))(x))
    return dense(self.d_model, "o_proj", ("heads", "embed"),
                 nn.initializers.variance_scaling(
                     self.out_init_scale, "fan_in", "truncated_normal"))(
                         o * gate)

  def _context_attention(self, x, q, c_kv, dense, segment_ids=None):
    """Attention with T split over the context axis; o [B, T, H * Dv].

    segment_ids: [B, T] or None; with ids the XLA implementation, as in
    `_attention`.
    """
    b, t, _ = x.shape
    h, dn, dr, dv = (self.num_heads, self.qk_nope_head_dim,
                     self.qk_rope_head_dim, self.v_head_dim)
    # The up-projections run inside shard_map on the gathered latent, so
    # their kernels are taken as arrays; same param path and init as Dense.
    w_uk = _DenseKernel(self.kv_lora_rank, h * dn, self.param_dtype,
                        name="k_up")().reshape(self.kv_lora_rank, h, dn)
    w_uv = _DenseKernel(self.kv_lora_rank, h * dv, self.param_dtype,
                        name="v_up")().reshape(self.kv_lora_rank, h, dv)
    k_rope = None
    if dr > 0:
      positions = jnp.arange(t)  # global positions (global view)
      k_rope = apply_rope(dense(dr, "k_rope", ("embed", None))(x)[:, :, None],
                          positions, self.rope_theta)[:, :, 0]
      q_rope = apply_rope(q[..., dn:], positions, self.rope_theta)
      q = jnp.concatenate([q[..., :dn], q_rope], axis=-1)
    q = self._scale_queries(q, jnp.arange(t))
    # The flash kernel is not context-parallel: its values run as "auto".
    impl = (None if self.attention_impl in ("auto", "pallas", "interpret")
            else self.attention_impl)
    if segment_ids is not None:
      impl = "xla"
    b_axes, h_axes = self.mesh_axes.split_axes(mesh_utils.resolve_mesh(), b,
                                               h)
    o = context_parallel_latent_attention(
        q, c_kv, w_uk, w_uv, k_rope, scale=(dn + dr) ** -0.5,
        axis=self.mesh_axes.context, dtype=self.dtype, implementation=impl,
        batch_axes=b_axes, head_axes=h_axes, segment_ids=segment_ids)
    return o.reshape(b, t, h * dv)

  def _cached_attention(self, x, q, c_kv, dense, new_sequence,
                        segment_ids=None):
    """Attention over the latent cache; o [B, T, H * Dv].

    The T new tokens are written at positions index .. index + T - 1 (0 ..
    T - 1 for a new sequence) with their segment ids (segment_ids [B, T];
    None: the id at index - 1, or 0 for a new sequence), and token t
    attends to slots <= index + t of its own id, in the absorbed form. A new
    sequence attends over its own tokens only, with the training path
    (flash on GPU; no T x T_max scores).
    """
    b, t, _ = x.shape
    h, dn, dr, dv = (self.num_heads, self.qk_nope_head_dim,
                     self.qk_rope_head_dim, self.v_head_dim)
    r = self.kv_lora_rank
    cache = self.variable("cache", "c_kv", jnp.zeros, (b, t, r), c_kv.dtype)
    index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
    t_max = cache.value.shape[1]
    if t > t_max:
      raise ValueError(f"MLA decode: {t} tokens do not fit the latent cache "
                       f"of T_max={t_max} positions")
    ids = self.variable("cache", "segment_ids", jnp.zeros, (b, t), jnp.int32)
    i = jnp.zeros((), jnp.int32) if new_sequence else index.value
    cache.value = jax.lax.dynamic_update_slice(
        cache.value, c_kv.astype(cache.value.dtype), (0, i, 0))
    index.value = i + t
    if segment_ids is None:
      # The tokens continue the last cached document.
      last = (jnp.zeros((b, 1), jnp.int32) if new_sequence else
              jax.lax.dynamic_slice_in_dim(ids.value, jnp.maximum(i - 1, 0),
                                           1, axis=1))
      new_ids = jnp.broadcast_to(last, (b, t))
    else:
      new_ids = segment_ids.astype(jnp.int32)
    ids.value = jax.lax.dynamic_update_slice(ids.value, new_ids, (0, i))
    positions = i + jnp.arange(t)
    k_rope = None
    if dr > 0:
      k_rope = apply_rope(dense(dr, "k_rope", ("embed", None))(x)[:, :, None],
                          positions, self.rope_theta)          # [B, T, 1, R]
      rope_cache = self.variable("cache", "rope_key", jnp.zeros, (b, t, dr),
                                 k_rope.dtype)
      rope_cache.value = jax.lax.dynamic_update_slice(
          rope_cache.value, k_rope[:, :, 0].astype(rope_cache.value.dtype),
          (0, i, 0))
    if new_sequence:
      return self._attention(x, q, c_kv, dense, k_rope, segment_ids)
    q = self._scale_queries(q, positions)

    # Same params as the Dense up-projections of _attention, as matrices.
    w_uk = _DenseKernel(r, h * dn, self.param_dtype, name="k_up")().reshape(
        r, h, dn).astype(self.dtype)
    w_uv = _DenseKernel(r, h * dv, self.param_dtype, name="v_up")().reshape(
        r, h, dv).astype(self.dtype)
    q_lat = jnp.einsum("bthd,rhd->bthr", q[..., :dn], w_uk)       # [B,T,H,r]
    c_all = cache.value                                            # [B,S,r]
    scores = jnp.einsum("bthr,bsr->bhts", q_lat, c_all,
                        preferred_element_type=jnp.float32)
    if dr > 0:
      q_rope = apply_rope(q[..., dn:], positions, self.rope_theta)
      scores = scores + jnp.einsum("bthd,bsd->bhts", q_rope, rope_cache.value,
                                   preferred_element_type=jnp.float32)
    scores = scores * (dn + dr) ** -0.5
    visible = ((jnp.arange(t_max)[None, None, :] <= positions[None, :, None])
               & (ids.value[:, None, :] == new_ids[:, :, None]))  # [B,T,S]
    scores = jnp.where(visible[:, None], scores, -jnp.inf)
    p = jax.nn.softmax(scores, axis=-1).astype(self.dtype)        # [B,H,T,S]
    ctx = jnp.einsum("bhts,bsr->bthr", p, c_all)                   # [B,T,H,r]
    o = jnp.einsum("bthr,rhv->bthv", ctx, w_uv)
    return o.reshape(b, t, h * dv).astype(self.dtype)

  def _attention(self, x, q, c_kv, dense, k_rope=None, segment_ids=None):
    """Single-device (or compiler-partitioned) attention; o [B, T, H * Dv].

    k_rope: the rotated rotary key [B, T, 1, R] when already computed.
    segment_ids: [B, T] or None; with ids, a same-document mask on top of
      the causal one: the flash kernel (per-tile ids) or XLA with a dense
      [B, 1, T, T] mask, as `_resolved_impl` picks.
    """
    b, t, _ = x.shape
    h, dn, dr, dv = (self.num_heads, self.qk_nope_head_dim,
                     self.qk_rope_head_dim, self.v_head_dim)
    dqk = dn + dr
    k = dense(h * dn, "k_up", (None, "heads"))(c_kv).reshape(b, t, h, dn)
    v = dense(h * dv, "v_up", (None, "heads"))(c_kv).reshape(b, t, h, dv)
    if dr > 0:
      positions = jnp.arange(t)
      if k_rope is None:
        k_rope = apply_rope(
            dense(dr, "k_rope", ("embed", None))(x)[:, :, None], positions,
            self.rope_theta)
      q_rope = apply_rope(q[..., dn:], positions, self.rope_theta)
      q = jnp.concatenate([q[..., :dn], q_rope], axis=-1)
      k = jnp.concatenate([k, jnp.broadcast_to(k_rope, (b, t, h, dr))], -1)

    q = self._scale_queries(q, jnp.arange(t))
    impl = self._resolved_impl(segment_ids is not None, q.dtype)
    if impl in ("pallas", "interpret"):
      o = flash_attention(q, k, v, segment_ids, scale=dqk ** -0.5,
                          interpret=impl == "interpret")
      return o.reshape(b, t, h * dv)

    # dot_product_attention wants one head dim for q, k and v: zero-pad to
    # the larger one (zeros add nothing to q.k and are sliced off the output).
    width = max(dqk, dv)
    pad = lambda a: jnp.pad(  # noqa: E731
        a, ((0, 0), (0, 0), (0, 0), (0, width - a.shape[-1])))
    q, k, vp = pad(q), pad(k), pad(v)
    mask = None
    if segment_ids is not None:
      mask = (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    o = jax.nn.dot_product_attention(
        q, k, vp, mask=mask, is_causal=True, scale=dqk ** -0.5,
        implementation=impl)
    return o[..., :dv].reshape(b, t, h * dv)

  def _scale_queries(self, q: jax.Array, positions: jax.Array) -> jax.Array:
    """q [B, T, H, Dqk] times logn_scale at positions [T] (a no-op when
    logn_scale_len is 0)."""
    if not self.logn_scale_len:
      return q
    scale = logn_scale(positions, self.logn_scale_len)[None, :, None, None]
    return (q * scale).astype(q.dtype)

  def _resolved_impl(self, packed: bool, dtype) -> str:
    """The attention that `_attention` runs: "pallas" | "interpret" (the
    flash kernel), else the `implementation` of jax.nn.dot_product_attention
    ("cudnn" | "xla").

    "auto" on a GPU: cuDNN for one sequence per row where it takes the
    dtype and head width; the flash kernel for packed documents where it
    fits the head width (cuDNN's masked path is not verified for the
    same-document mask). Everywhere else XLA ([B, H, T, T] scores; a dense
    mask when packed): fp32 models, too-wide heads, CPU.
    """
    impl = self.attention_impl
    if impl not in ATTENTION_IMPLS:
      raise ValueError(f"model.mla.attention_impl must be one of "
                       f"{list(ATTENTION_IMPLS)}, got {impl!r}")
    dqk, dv = self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim
    fits = supports_head_dims(dqk, dv)
    if impl in ("pallas", "interpret"):
      if not fits:
        raise ValueError(
            f"model.mla.attention_impl={impl!r}: the flash kernel takes head "
            f"widths up to {MAX_HEAD_WIDTH}, got q/k {dqk} and v {dv} "
            "(padded to a power of two); use 'auto', 'xla' or 'cudnn'")
      return impl
    if packed and impl in ("xla", "cudnn"):
      return "xla"
    if impl != "auto":
      return impl
    if jax.default_backend() != "gpu":
      return "xla"
    if packed:
      return "pallas" if fits else "xla"
    return "cudnn" if cudnn_takes(dtype, max(dqk, dv)) else "xla"


def cudnn_takes(dtype, width: int) -> bool:
  """Whether cuDNN's flash attention takes this dtype and (padded) head
  width on this GPU: bf16 or fp16, a multiple of 8, at most 128 (256 from
  compute capability 9.0, Hopper)."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return False
  return width % 8 == 0 and width <= (256 if gpu_compute_major() >= 9
                                      else 128)


class _DenseKernel(nn.Module):
  """The kernel of an up-projection nn.Dense (same path, shape, init and
  logical axes (None, heads)), as an array.

  For code that must apply the matrix inside shard_map, where Linen modules
  cannot be called.
  """
  in_features: int
  features: int
  param_dtype: jnp.dtype = jnp.float32
  kernel_init: Callable = nn.linear.default_kernel_init

  @nn.compact
  def __call__(self) -> jax.Array:
    return self.param("kernel", with_axes(self.kernel_init, None, "heads"),
                      (self.in_features, self.features), self.param_dtype)
