"""Sparse MoE: shared + dropless routed SwiGLU experts (docs/design.md §5).

Routed dispatch "ragged" sorts (token, slot) pairs by expert and runs grouped
matmuls (expert_parallel.ragged_experts): `jax.lax.ragged_dot`, or on a GPU
the Pallas grouped matmul of pallas_kernels.grouped_matmul; split over the
"expert" mesh axis with an all-to-all when the ambient mesh has one. With
no more (token, slot) pairs than experts (a decode step) it gathers the
routed experts' weights instead (expert_parallel.gathered_experts). "loop"
runs every expert on every token and masks, the obviously-correct reference
used by tests. Both give the same values and gradients. Router state/stats
live in the `router_state` / `router_stats` collections of the `router`
submodule (see router.py).
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_jax.balancing import QB_HIST_SCALE
from moe_jax.layers import mesh_utils
from moe_jax.layers.expert_parallel import (
    expert_parallel_experts, gathered_experts,
    ragged_experts as _ragged_experts, token_axes)
from moe_jax.layers.param_axes import with_axes
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
    dense = lambda n, name, *axes: nn.Dense(  # noqa: E731
        n, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=with_axes(self.kernel_init, *axes), name=name)
    h = (nn.silu(dense(self.d_ff, "gate", "embed", "mlp")(x))
         * dense(self.d_ff, "up", "embed", "mlp")(x))
    return dense(x.shape[-1], "down", "mlp", "embed")(h)


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
    qb_estimator, qb_bins, qb_range, qb_scale: Quantile-Balancing estimator
      settings, passed to the Router (see router.py).
    dispatch: "ragged" (sort + grouped matmul; weight gathers when N * top_k
      <= num_experts) | "loop" (reference).
    grouped_matmul: the ragged dispatch's grouped products, one of
      expert_parallel.GROUPED_MATMULS ("auto": the Pallas kernels on a GPU,
      jax.lax.ragged_dot elsewhere).
    mesh_axes: the mesh axes from the run's rules (mesh_utils.mesh_axes).
      When the ambient mesh (jax.set_mesh) has its expert axis with size > 1
      dividing num_experts and the tokens (and dispatch == "ragged"), the
      routed experts run split over it with an all-to-all token dispatch
      (expert_parallel.py), tokens split over its batch and context axes.
      Otherwise, and without a mesh, the single-device dispatch.
    ep_capacity_factor: None = dropless expert-parallel dispatch (default);
      c > 0 caps the rows per destination device at ceil(c n k / P) and
      drops the rest (an option, never the default).
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
  qb_scale: float = QB_HIST_SCALE
  expert_latent_dim: int = 0
  dispatch: str = "ragged"
  grouped_matmul: str = "auto"
  mesh_axes: mesh_utils.MeshAxes = mesh_utils.MeshAxes()
  ep_capacity_factor: float | None = None
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
        qb_range=self.qb_range, qb_scale=self.qb_scale,
        name="router")(xf)               # [N, k] x2

    # Latent experts: route on x, but run the routed experts in a smaller
    # space (fewer expert params, a smaller all-to-all payload when sharded).
    latent = self.expert_latent_dim
    dense = lambda n, name, *axes: nn.Dense(  # noqa: E731
        n, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=with_axes(self.kernel_init, *axes), name=name)
    xc = xf.astype(self.dtype)
    x_experts = (dense(latent, "latent_down", "embed", None)(xc) if latent
                 else xc)
    d_in = latent or d

    init = _expert_init(self.kernel_init)
    in_axes = with_axes(init, "expert", "embed", "mlp")
    w_gate = self.param("w_gate", in_axes, (e, d_in, f), self.param_dtype)
    w_up = self.param("w_up", in_axes, (e, d_in, f), self.param_dtype)
    w_down = self.param("w_down", with_axes(init, "expert", "mlp", "embed"),
                        (e, f, d_in), self.param_dtype)
    w_gate, w_up, w_down = (
        p.astype(self.dtype) for p in (w_gate, w_up, w_down))

    ax = self.mesh_axes
    n_ep = mesh_utils.axis_size(ax.expert)
    if (self.dispatch == "ragged" and n_ep > 1 and e % n_ep == 0
        and token_axes(mesh_utils.resolve_mesh(), lead, ax.expert, ax.batch,
                       ax.context) is not None):
      # Expert parallel: experts split over the axis, tokens all-to-all'd
      # to them (expert_parallel.py); routing above is unchanged (global).
      y = expert_parallel_experts(
          x_experts.reshape(*lead, d_in), idx.reshape(*lead, -1),
          w.reshape(*lead, -1), w_gate, w_up, w_down,
          expert_axis=ax.expert, batch_axes=ax.batch,
          context_axis=ax.context, capacity_factor=self.ep_capacity_factor,
          matmul=self.grouped_matmul).reshape(-1, d_in)
    elif self.dispatch == "ragged" and xf.shape[0] * self.top_k <= e:
      # A decode step's few tokens: gather their experts' weights rather
      # than stream all E through the grouped matmul.
      y = gathered_experts(x_experts, idx, w, w_gate, w_up, w_down)
    elif self.dispatch == "ragged":
      y = _ragged_experts(x_experts, idx, w, w_gate, w_up, w_down,
                          self.grouped_matmul)
    else:
      y = _loop_experts(x_experts, idx, w, w_gate, w_up, w_down)
    y = y.astype(self.dtype)
    if latent:
      y = dense(d, "latent_up", None, "embed")(y)

    if self.num_shared > 0:
      d_shared = self.d_shared if self.d_shared is not None else self.d_expert
      y = y + SwiGLU(self.num_shared * d_shared, dtype=self.dtype,
                     param_dtype=self.param_dtype,
                     kernel_init=self.kernel_init, name="shared")(xc)
    return y.reshape(*lead, d)


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
