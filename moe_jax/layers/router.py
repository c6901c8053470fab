"""Sigmoid top-k router with load balancing state kept outside the gradient.

docs/design.md §5 / §6. The balancing math is in moe_jax/balancing.py; the
router emits what it needs into two non-param collections:

* `router_state` / `bias` [E] fp32: the balancing bias. It only shifts which
  experts are *selected*; it never enters the combine weights and is never seen
  by the optimizer. The train step updates it with
  `balancing.update_router_state` after the optimizer step, from the
  statistics below.
* `router_stats`: per-batch statistics, written only when the collection is
  mutable (so plain `apply` for eval works without it):
    - `load` [E] fp32: number of (token, slot) assignments per expert.
    - `qb_target` [E] fp32 (balancing == "qb", qb_estimator == "exact"):
      exact Quantile-Balancing target bias computed from this batch.
    - `qb_hist` [E, bins] fp32 + `qb_tokens` [] fp32 (balancing == "qb",
      qb_estimator == "histogram"): per-expert counts of r - b over a window
      centred on the current bias, and the token count m. Counts are global
      under jit with sharded tokens and add up exactly over microbatches.
    - `aux_loss` [] fp32 (balancing == "aux"): aux_loss_coef * Switch loss, with
      gradient; the train step adds every `aux_loss` leaf to the loss.
* `router_qb_thresholds` / `r` [N, E] fp32 (balancing == "qb", exact
  estimator), written only when that collection is mutable (never at init):
  the per-token thresholds r = alpha - s, so that gradient accumulation can
  take the exact order statistic of the whole batch over microbatches.
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_jax.balancing import (BALANCING_METHODS, QB_ESTIMATORS,
                               STATE_COLLECTION, STATS_COLLECTION,
                               QB_HIST_SCALE, THRESHOLDS_COLLECTION,
                               expert_load,
                               qb_exact_target, qb_histogram, qb_thresholds,
                               switch_aux_loss)
from moe_jax.layers.param_axes import with_axes
from moe_jax.layers.pick import pick


def _validate(num_experts: int, top_k: int, balancing: str,
              qb_estimator: str = "exact", qb_bins: int = 256,
              qb_range: float = 4.0, qb_scale: float = QB_HIST_SCALE) -> None:
  if qb_estimator not in QB_ESTIMATORS:
    raise ValueError(
        f"qb_estimator must be one of {QB_ESTIMATORS}, got {qb_estimator!r}")
  if not 8 <= qb_bins <= 65536:
    raise ValueError(f"qb_bins must be in [8, 65536], got {qb_bins}")
  if not qb_range > 0:
    raise ValueError(f"qb_range must be > 0, got {qb_range}")
  if not qb_scale >= 0:
    raise ValueError(f"qb_scale must be >= 0, got {qb_scale}")
  if num_experts < 1:
    raise ValueError(f"num_experts must be >= 1, got {num_experts}")
  if not 1 <= top_k <= num_experts:
    raise ValueError(
        f"top_k must be in [1, num_experts={num_experts}], got top_k={top_k}")
  if balancing not in BALANCING_METHODS:
    raise ValueError(
        f"balancing must be one of {BALANCING_METHODS}, got {balancing!r}")
  if balancing == "qb" and top_k >= num_experts:
    # QB needs the (k+1)-th largest score per token.
    raise ValueError(
        f"balancing='qb' needs top_k < num_experts, got top_k={top_k}, "
        f"num_experts={num_experts}")


class Router(nn.Module):
  """Sigmoid top-k router (docs/design.md §5) with a non-param balancing bias.

  Attributes:
    num_experts: E.
    top_k: experts per token, 1 <= top_k <= E (top_k < E for "qb").
    balancing: "qb" | "sign" | "aux" | "none" (what stats are emitted).
    route_scale: multiplies the normalised combine weights.
    aux_loss_coef: coefficient of the Switch loss (balancing == "aux").
    qb_estimator: "exact" (emit `qb_target`) | "histogram" (emit `qb_hist`
      [E, qb_bins] and `qb_tokens`; see `balancing.qb_histogram`).
    qb_bins: histogram bins, in [8, 65536].
    qb_range: histogram window half-width R > 0: bins cover r in
      [b_j - R, b_j + R] around each expert's current bias.
    qb_scale: c >= 0 of the histogram's asinh bins (finest at the bias);
      0 = uniform bins. The update must use the same (balancing.QB_HIST_SCALE
      on both sides by default).
    dtype: dtype the scores are computed in (fp32 by design).
    kernel_init: init of the `kernel` param [D, E].
  """
  num_experts: int
  top_k: int
  balancing: str = "qb"
  route_scale: float = 1.0
  aux_loss_coef: float = 0.0
  qb_estimator: str = "exact"
  qb_bins: int = 256
  qb_range: float = 4.0
  qb_scale: float = QB_HIST_SCALE
  dtype: Any = jnp.float32
  kernel_init: Callable = nn.initializers.variance_scaling(
      1.0, "fan_in", "truncated_normal")

  @nn.compact
  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Routes tokens.

    Args:
      x: [N, D] tokens (any float dtype).

    Returns:
      expert_index: [N, top_k] int32, descending by biased score.
      combine_weight: [N, top_k] fp32, sum route_scale per token; gradient
        flows into the router kernel through the unbiased scores.
    """
    _validate(self.num_experts, self.top_k, self.balancing,
              self.qb_estimator, self.qb_bins, self.qb_range, self.qb_scale)
    if x.ndim != 2:
      raise ValueError(f"Router expects [N, D], got shape {x.shape}")
    e, k = self.num_experts, self.top_k
    kernel = self.param("kernel", with_axes(self.kernel_init, "embed", None),
                        (x.shape[-1], e), jnp.float32)
    bias = self.variable(STATE_COLLECTION, "bias",
                         lambda: jnp.zeros((e,), jnp.float32))

    logits = jnp.dot(x.astype(self.dtype), kernel.astype(self.dtype))
    s = jax.nn.sigmoid(logits.astype(jnp.float32))                # [N, E]
    b = jax.lax.stop_gradient(bias.value.astype(jnp.float32))
    # Bias only picks experts; weights come from the unbiased scores.
    _, idx = jax.lax.top_k(s + b, k)                              # [N, k]
    s_sel = pick(s, idx)                                          # [N, k]
    w = s_sel / (jnp.sum(s_sel, axis=-1, keepdims=True) + 1e-20)
    w = w * self.route_scale
    idx = idx.astype(jnp.int32)

    if self.is_mutable_collection(STATS_COLLECTION):
      load = expert_load(jax.lax.stop_gradient(idx), e)           # [E]
      self.variable(STATS_COLLECTION, "load",
                    lambda: jnp.zeros((e,), jnp.float32)).value = load
      if self.balancing == "qb" and self.qb_estimator == "histogram":
        hist = qb_histogram(s, b, k, bins=self.qb_bins,
                            qb_range=self.qb_range,
                            qb_scale=self.qb_scale)               # [E, bins]
        self.variable(STATS_COLLECTION, "qb_hist", lambda: jnp.zeros(
            (e, self.qb_bins), jnp.float32)).value = hist
        self.variable(STATS_COLLECTION, "qb_tokens",
                      lambda: jnp.zeros((), jnp.float32)).value = jnp.asarray(
                          x.shape[0], jnp.float32)
      elif self.balancing == "qb":
        target = qb_exact_target(s, b, k)
        self.variable(STATS_COLLECTION, "qb_target",
                      lambda: jnp.zeros((e,), jnp.float32)).value = target
        if (self.is_mutable_collection(THRESHOLDS_COLLECTION)
            and not self.is_initializing()):
          self.variable(THRESHOLDS_COLLECTION, "r", lambda: jnp.zeros(
              (x.shape[0], e), jnp.float32)).value = qb_thresholds(s, b, k)
      elif self.balancing == "aux":
        # Switch loss: f (from the load) has no grad, P (from s) does.
        aux = switch_aux_loss(load, s, self.aux_loss_coef)
        self.variable(STATS_COLLECTION, "aux_loss",
                      lambda: jnp.zeros((), jnp.float32)).value = aux
    return idx, w
