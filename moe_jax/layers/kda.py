"""Kimi Delta Attention (KDA) layer with the bounded decay parameterization.

docs/design.md §5 and §3.1:
  q, k = l2norm(silu(shortconv(W_q x))), l2norm(silu(shortconv(W_k x)))
  v    = silu(shortconv(W_v x))
  beta = sigmoid(W_b x)
  g    = g_min * sigmoid(a * (W_up W_down x + dt_bias))     (bounded, default)
       = -a * softplus(W_up W_down x + dt_bias)             (unbounded ablation)
  out  = W_o(rmsnorm_head(kda(q, k, v, g, beta)) * sigmoid(W_gu W_gd x))
with a = exp(A_log) per head. The token mixing itself is the public op of
pallas_kernels.linear_attention, so the Pallas kernels slot in by backend.

Decoding (`decode=True`) keeps a `cache` collection per layer: the recurrent
state [B, H, K, V] fp32, the last conv_size - 1 inputs of each short conv and
the last token's segment id [B] int32 (a token of another id starts a new
document: state and conv inputs restart from zero); its size does not depend
on the context length (moe_jax/decode.py).
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.layers import mesh_utils
from moe_jax.layers.norms import l2_normalize, rms_normalize
from moe_jax.layers.param_axes import DEFAULT_KERNEL_INIT, with_axes
from pallas_kernels.linear_attention import kda as kda_op
from pallas_kernels.linear_attention import kda_step
from pallas_kernels.linear_attention.context_parallel import (
    kda_context_parallel)
from pallas_kernels.linear_attention.kda.tuning import Tuning as KdaTuning


def causal_depthwise_conv(x: jax.Array, kernel: jax.Array,
                          state: jax.Array | None = None,
                          segment_ids: jax.Array | None = None):
  """Depthwise causal conv over time: y_t = sum_j kernel[j] * x_{t-W+1+j}.

  Args:
    x: [B, T, C] inputs.
    kernel: [W, C] taps; kernel[-1] multiplies the current token.
    state: optional [B, W-1, C], the W-1 inputs before x (decoding); zeros
      when None (start of a sequence).
    segment_ids: optional [B, T] int (packed documents): a tap reads only
      inputs of the current token's document (never across a start); the
      `state` inputs count as the first token's document.
  Returns:
    y [B, T, C] and the new state [B, W-1, C]: the last W-1 inputs, with
    segment_ids zeros in place of those before the last token's document
    (a continuation must not read the previous document).
  """
  width = kernel.shape[0]
  b, _, c = x.shape
  if state is None:
    state = jnp.zeros((b, width - 1, c), x.dtype)
  xp = jnp.concatenate([state.astype(x.dtype), x], axis=1)
  t = x.shape[1]
  if segment_ids is None:
    taps = [xp[:, j:j + t] for j in range(width)]
  else:
    # The state positions count as the first document's (decoding resumes it).
    sp = jnp.concatenate([jnp.broadcast_to(segment_ids[:, :1], (b, width - 1)),
                          segment_ids], axis=1)
    taps = [jnp.where((sp[:, j:j + t] == segment_ids)[..., None],
                      xp[:, j:j + t], 0) for j in range(width)]
    # Read as the state of a continuation: inputs of the last document only.
    xp = jnp.where((sp == segment_ids[:, -1:])[..., None], xp, 0)
  y = sum(tap * kernel[j].astype(x.dtype) for j, tap in enumerate(taps))
  return y, xp[:, xp.shape[1] - (width - 1):]


def _decay_bias_init(g_min: float, decay: str, min_timescale: float = 1.0,
                     max_timescale: float = 256.0):
  """dt_bias so that the initial per-channel decay spans many timescales.

  A channel with timescale tau starts at g0 = -1/tau (memory of ~tau tokens);
  tau is log-uniform in [min_timescale, max_timescale]. With a = 1 this gives
  sigmoid(dt_bias) = g0 / g_min (bounded) or softplus(dt_bias) = -g0.
  """
  def init(key, shape, dtype=jnp.float32):
    u = jax.random.uniform(key, shape, jnp.float32)
    tau = jnp.exp(u * (math.log(max_timescale) - math.log(min_timescale)) +
                  math.log(min_timescale))
    g0 = -1.0 / tau
    if decay == "bounded":
      p = jnp.clip(g0 / g_min, 1e-6, 1 - 1e-6)
      bias = jnp.log(p) - jnp.log1p(-p)
    else:
      bias = jnp.log(jnp.expm1(-g0))
    return bias.astype(dtype)
  return init


def kda_log_decay(x_g: jax.Array, dt_bias: jax.Array, a_log: jax.Array, *,
                  decay: str, g_min: float) -> jax.Array:
  """Per-channel log decay g from the low-rank projection x_g.

  Args:
    x_g: [B, T, H, K] fp32 projection.
    dt_bias: [H, K].
    a_log: [H]; a = exp(a_log) scales the pre-activation per head.
    decay: "bounded" gives g in (g_min, 0); "unbounded" gives g in (-inf, 0).
  Returns:
    g [B, T, H, K] fp32.
  """
  a = jnp.exp(a_log.astype(jnp.float32))[:, None]
  z = x_g.astype(jnp.float32) + dt_bias.astype(jnp.float32)
  if decay == "bounded":
    return g_min * jax.nn.sigmoid(a * z)
  return -a * jax.nn.softplus(z)


class KDA(nn.Module):
  """Kimi Delta Attention token mixer.

  Attributes:
    d_model: model width D.
    num_heads: H; head dim K = V = D // H.
    decay: "bounded" | "unbounded".
    g_min: lower bound of the log decay per step (bounded), < 0.
    decay_rank, gate_rank: low-rank widths of the decay and output gate.
    conv_size: short-conv width.
    chunk_size: chunk of the chunked algorithm.
    backend: linear-attention backend ("auto" | "xla" | "pallas" | "interpret").
    pallas_stages: "auto" (the kernel module's defaults) | "triton" |
      "mosaic": the Pallas kernel's state passes and output kernel as Triton
      or Mosaic GPU (wgmma) kernels (kda.tuning.Tuning state_pass and
      output_kernel;
      "mosaic" needs bf16 and a head dim > 32). Used only when the op runs
      the Pallas kernel.
    mesh_axes: the mesh axes from the run's rules (mesh_utils.mesh_axes):
      when the ambient mesh (jax.set_mesh) has its context axis with size > 1
      dividing T, the sequence is split over it for the token mixing
      (context parallelism), B and H over its batch and head axes that
      divide; otherwise the plain single-device op.
  """
  d_model: int
  num_heads: int
  decay: str = "bounded"
  g_min: float = -5.0
  decay_rank: int = 16
  gate_rank: int = 16
  conv_size: int = 4
  chunk_size: int = 64
  backend: str = "auto"
  pallas_stages: str = "auto"
  mesh_axes: mesh_utils.MeshAxes = mesh_utils.MeshAxes()
  norm_eps: float = 1e-6
  out_init_scale: float = 1.0
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, decode: bool = False,
               new_sequence: bool = False,
               segment_ids: jax.Array | None = None) -> jax.Array:
    """x: [B, T, D] -> [B, T, D].

    segment_ids: optional [B, T] int, packed documents (a document is a run
      of equal ids): the short convs do not read across a document start
      and the recurrence restarts from zero at each one (every backend of
      ops.kda, also under context parallelism, and decode).

    decode: continue from the `cache` collection (make it mutable) and
      update it: T > 1 (prefill) runs the chunked op from the cached state,
      T == 1 one recurrent step (ops.kda_step). The cache is created with
      zeros when absent. With segment_ids, a first token whose id differs
      from the cached last token's starts a new document (zero state and
      conv inputs); None: the tokens continue the cached document.
    new_sequence (with decode): start from zeros, whatever the cache held.
    """
    b, t, _ = x.shape
    h = self.num_heads
    dk = self.d_model // h
    n_ctx = mesh_utils.axis_size(self.mesh_axes.context)
    if decode:
      last_id = self.variable("cache", "segment_id", jnp.zeros, (b,),
                              jnp.int32)
      # keep[b]: row b continues the cached document (state and conv tails).
      if new_sequence:
        keep = jnp.zeros((b,), bool)
      elif segment_ids is None:
        keep = jnp.ones((b,), bool)
      else:
        keep = segment_ids[:, 0] == last_id.value
      if segment_ids is not None:
        last_id.value = segment_ids[:, -1].astype(jnp.int32)
      elif new_sequence:
        last_id.value = jnp.zeros((b,), jnp.int32)
    def dense(n, name, axes, init=DEFAULT_KERNEL_INIT):
      return nn.Dense(n, use_bias=False, dtype=self.dtype,
                      param_dtype=self.param_dtype,
                      kernel_init=with_axes(init, *axes), name=name)
    x = x.astype(self.dtype)
    to_heads, from_heads = ("embed", "heads"), (None, "heads")

    def conv_branch(name):
      proj = dense(h * dk, f"{name}_proj", to_heads)(x)
      kernel = self.param(f"{name}_conv", with_axes(nn.initializers.normal(
          1.0 / math.sqrt(self.conv_size)), None, "heads"),
                          (self.conv_size, h * dk), self.param_dtype)
      if decode:
        tail = self.variable("cache", f"{name}_conv_tail", jnp.zeros,
                             (b, self.conv_size - 1, h * dk), proj.dtype)
        y, tail.value = causal_depthwise_conv(
            proj, kernel, jnp.where(keep[:, None, None], tail.value, 0),
            segment_ids=segment_ids)
      else:
        y, _ = causal_depthwise_conv(proj, kernel, segment_ids=segment_ids)
      return jax.nn.silu(y).reshape(b, t, h, dk)

    q = l2_normalize(conv_branch("q"), self.norm_eps)
    k = l2_normalize(conv_branch("k"), self.norm_eps)
    v = conv_branch("v")
    beta = jax.nn.sigmoid(
        dense(h, "beta_proj", to_heads)(x).astype(jnp.float32))

    x_g = dense(h * dk, "decay_up", from_heads)(
        dense(self.decay_rank, "decay_down", ("embed", None))(x))
    dt_bias = self.param("dt_bias", with_axes(
        _decay_bias_init(self.g_min, self.decay), "heads", None), (h, dk),
                         jnp.float32)
    a_log = self.param("A_log", with_axes(nn.initializers.zeros, "heads"),
                       (h,), jnp.float32)
    g = kda_log_decay(x_g.reshape(b, t, h, dk), dt_bias, a_log,
                      decay=self.decay, g_min=self.g_min)

    op_kw = dict(backend=self.backend, chunk_size=self.chunk_size,
                 g_min=self.g_min if self.decay == "bounded" else None,
                 pallas_options=None if self.pallas_stages == "auto" else dict(
                     tune=KdaTuning(state_pass=self.pallas_stages,
                                    output_kernel=self.pallas_stages)))
    if decode:
      state = self.variable("cache", "state", jnp.zeros, (b, h, dk, dk),
                            jnp.float32)
      s0 = (None if new_sequence else
            jnp.where(keep[:, None, None, None], state.value, 0))
      if t == 1 and s0 is not None:
        o, state.value = kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0],
                                  beta[:, 0], s0, backend=self.backend)
        o = o[:, None]
      else:
        # The final state is the row's last document's (ops.kda).
        o, state.value = kda_op(q, k, v, g, beta, initial_state=s0,
                                segment_ids=segment_ids, **op_kw)
    elif n_ctx > 1 and t % n_ctx == 0:
      # Sequence split over the context axis: local chunks + an exchange of
      # per-device [K, K] / [K, V] state transitions (context_parallel.py).
      b_axes, h_axes = self.mesh_axes.split_axes(mesh_utils.resolve_mesh(),
                                                 b, h)
      o, _ = kda_context_parallel(q, k, v, g, beta,
                                  axis=self.mesh_axes.context,
                                  batch_axes=b_axes, head_axes=h_axes,
                                  segment_ids=segment_ids, **op_kw)
    else:
      o, _ = kda_op(q, k, v, g, beta, segment_ids=segment_ids, **op_kw)

    # Per-head RMSNorm with a scale shared across heads, then the output gate.
    o_scale = self.param("o_norm_scale", with_axes(nn.initializers.ones,
                                                   None), (dk,),
                         self.param_dtype)
    o = rms_normalize(o.astype(jnp.float32), self.norm_eps) * o_scale
    gate = dense(h * dk, "gate_up", from_heads)(
        dense(self.gate_rank, "gate_down", ("embed", None))(x))
    o = o.reshape(b, t, h * dk).astype(self.dtype) * jax.nn.sigmoid(gate)
    return dense(self.d_model, "o_proj", ("heads", "embed"),
                 nn.initializers.variance_scaling(
                     self.out_init_scale, "fan_in", "truncated_normal"))(o)


def kda_param_count(d_model: int, num_heads: int, decay_rank: int,
                    gate_rank: int, conv_size: int) -> int:
  """Closed-form parameter count of one KDA layer (for planners and tests)."""
  hk = (d_model // num_heads) * num_heads
  return int(np.sum([
      3 * (d_model * hk + conv_size * hk),       # q, k, v projections + convs
      d_model * num_heads,                        # beta
      d_model * decay_rank + decay_rank * hk,     # decay low rank
      hk + num_heads,                             # dt_bias, A_log
      d_model // num_heads,                       # o_norm_scale
      d_model * gate_rank + gate_rank * hk,       # output gate
      hk * d_model,                               # o_proj
  ]))
