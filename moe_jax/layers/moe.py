"""Sparse MoE: shared SwiGLU + dropless routed SwiGLU experts (DESIGN 3.5).

Routed dispatch "ragged" sorts (token, slot) pairs by expert and runs grouped
matmuls with `jax.lax.ragged_dot`; "loop" runs every expert on every token and
masks, the obviously-correct reference used by tests. Both give the same values
and gradients. Router state/stats live in the `router_state` / `router_stats`
collections of the `router` submodule (see router.py).
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_jax.layers.router import Router

DISPATCH_METHODS = ("ragged", "loop")

_default_init = nn.initializers.variance_scaling(1.0, "fan_in",
                                                 "truncated_normal")


def _expert_init(base: Callable) -> Callable:
  """Init for stacked [E, fan_in, fan_out] weights: each expert as a matrix."""

  def init(key, shape, dtype=jnp.float32):
    keys = jax.random.split(key, shape[0])
    return jax.vmap(lambda k: base(k, shape[1:], dtype))(keys)

  return init


class SwiGLU(nn.Module):
  """Dense SwiGLU FFN without biases: down(silu(x W_gate) * (x W_up)).

  Attributes:
    d_ff: hidden width F.
    dtype: compute dtype.
    param_dtype: parameter dtype.
    kernel_init: init of the three kernels.
  """
  d_ff: int
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  kernel_init: Callable = _default_init

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """x: [..., D] -> [..., D]."""
    dense = lambda n, name: nn.Dense(
        n, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=self.kernel_init, name=name)
    h = nn.silu(dense(self.d_ff, "gate")(x)) * dense(self.d_ff, "up")(x)
    return dense(x.shape[-1], "down")(h)


class MoE(nn.Module):
  """Shared expert(s) + top-k routed SwiGLU experts, dropless.

  Attributes:
    d_model: D (must equal x.shape[-1]).
    num_experts: E routed experts.
    top_k: experts per token.
    d_expert: F, hidden width of each routed expert.
    num_shared: number of shared experts (0 = none); implemented as one SwiGLU
      of width num_shared * d_shared applied to every token.
    d_shared: hidden width per shared expert (defaults to d_expert).
    balancing: router balancing, "qb" | "sign" | "aux" | "none".
    route_scale: scale of the routed combine weights.
    aux_loss_coef: Switch aux loss coefficient (balancing == "aux").
    expert_latent_dim: 0 = experts act on d_model; L > 0 = latent experts:
      tokens are projected D -> L (`latent_down`) before the routed experts
      and L -> D (`latent_up`) after; the router and shared expert see x.
    qb_estimator, qb_bins, qb_range: Quantile-Balancing estimator settings,
      passed to the Router (see router.py).
    dispatch: "ragged" (sort + ragged_dot) | "loop" (reference).
    dtype: compute dtype (the router always computes in fp32).
    param_dtype: dtype of the expert / shared params.
    kernel_init: init of one expert's [fan_in, fan_out] matrix.
  """
  d_model: int
  num_experts: int
  top_k: int
  d_expert: int
  num_shared: int = 0
  d_shared: int | None = None
  balancing: str = "qb"
  route_scale: float = 1.0
  aux_loss_coef: float = 0.0
  qb_estimator: str = "exact"
  qb_bins: int = 256
  qb_range: float = 4.0
  expert_latent_dim: int = 0
  dispatch: str = "ragged"
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  kernel_init: Callable = _default_init

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """x: [B, T, D] -> [B, T, D] (dtype of the compute dtype)."""
    if self.dispatch not in DISPATCH_METHODS:
      raise ValueError(
          f"dispatch must be one of {DISPATCH_METHODS}, got {self.dispatch!r}")
    if x.shape[-1] != self.d_model:
      raise ValueError(
          f"expected last dim d_model={self.d_model}, got {x.shape}")
    e, d, f = self.num_experts, self.d_model, self.d_expert
    lead = x.shape[:-1]
    xf = x.reshape(-1, d)                                        # [N, D]

    idx, w = Router(
        num_experts=e, top_k=self.top_k, balancing=self.balancing,
        route_scale=self.route_scale, aux_loss_coef=self.aux_loss_coef,
        qb_estimator=self.qb_estimator, qb_bins=self.qb_bins,
        qb_range=self.qb_range, name="router")(xf)               # [N, k] x2

    # Latent experts: route on x, but run the routed experts in a smaller
    # space (fewer expert params, a smaller all-to-all payload when sharded).
    latent = self.expert_latent_dim
    dense = lambda n, name: nn.Dense(  # noqa: E731
        n, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=self.kernel_init, name=name)
    xc = xf.astype(self.dtype)
    x_experts = dense(latent, "latent_down")(xc) if latent else xc
    d_in = latent or d

    init = _expert_init(self.kernel_init)
    w_gate = self.param("w_gate", init, (e, d_in, f), self.param_dtype)
    w_up = self.param("w_up", init, (e, d_in, f), self.param_dtype)
    w_down = self.param("w_down", init, (e, f, d_in), self.param_dtype)
    w_gate, w_up, w_down = (
        p.astype(self.dtype) for p in (w_gate, w_up, w_down))

    if self.dispatch == "ragged":
      y = _ragged_experts(x_experts, idx, w, w_gate, w_up, w_down)
    else:
      y = _loop_experts(x_experts, idx, w, w_gate, w_up, w_down)
    y = y.astype(self.dtype)
    if latent:
      y = dense(d, "latent_up")(y)

    if self.num_shared > 0:
      d_shared = self.d_shared if self.d_shared is not None else self.d_expert
      y = y + SwiGLU(self.num_shared * d_shared, dtype=self.dtype,
                     param_dtype=self.param_dtype,
                     kernel_init=self.kernel_init, name="shared")(xc)
    return y.reshape(*lead, d)


def _ragged_experts(x, idx, w, w_gate, w_up, w_down):
  """Dropless grouped-matmul dispatch.

  Args:
    x: [N, D] tokens (compute dtype).
    idx: [N, k] int32 expert ids.
    w: [N, k] fp32 combine weights.
    w_gate, w_up: [E, D, F]; w_down: [E, F, D].

  Returns:
    [N, D] fp32 routed output.
  """
  n, k = idx.shape
  e = w_gate.shape[0]
  flat_e = idx.reshape(-1)                                       # [N*k]
  # Stable sort keeps token order inside each expert group (determinism).
  order = jnp.argsort(flat_e, stable=True)                       # [N*k]
  xs = jnp.take(x, order // k, axis=0)                           # [N*k, D]
  group_sizes = jnp.bincount(flat_e, length=e).astype(jnp.int32)  # [E]
  h = (nn.silu(jax.lax.ragged_dot(xs, w_gate, group_sizes))
       * jax.lax.ragged_dot(xs, w_up, group_sizes))              # [N*k, F]
  ys = jax.lax.ragged_dot(h, w_down, group_sizes)                # [N*k, D]
  ys = ys.astype(jnp.float32) * jnp.take(w.reshape(-1), order)[:, None]
  # Inverse permutation (a scatter of indices) back to (token, slot) order.
  inv = jnp.zeros_like(order).at[order].set(
      jnp.arange(order.shape[0], dtype=order.dtype))
  return jnp.take(ys, inv, axis=0).reshape(n, k, -1).sum(axis=1)


def _loop_experts(x, idx, w, w_gate, w_up, w_down):
  """Reference: every expert on every token, masked by the combine weight.

  Same args/returns as `_ragged_experts`. O(E) times the compute; tests only.
  """
  e = w_gate.shape[0]
  y = jnp.zeros((x.shape[0], w_down.shape[-1]), jnp.float32)
  for j in range(e):
    c = jnp.sum(jnp.where(idx == j, w, 0.0), axis=-1)            # [N]
    h = nn.silu(x @ w_gate[j]) * (x @ w_up[j])
    y = y + c[:, None] * (h @ w_down[j]).astype(jnp.float32)
  return y
