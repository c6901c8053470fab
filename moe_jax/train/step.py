"""Train state, the jitted train step and the eval step.

The order inside one step is the contract of Quantile Balancing (DESIGN §3.6):
route with the old router bias, take the gradient and the optimizer step,
then apply the router-bias update from the statistics the forward emitted.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from moe_jax.layers.router import (collect_loads, max_violation,
                                   update_router_state)

PyTree = Any
LN2 = math.log(2.0)


@flax.struct.dataclass
class TrainState:
  """Everything a step reads and writes; all of it is checkpointed."""
  step: jax.Array
  params: PyTree
  opt_state: PyTree
  router_state: PyTree


def init_train_state(model: nn.Module, tx: optax.GradientTransformation,
                     rng: jax.Array, seq_len: int) -> TrainState:
  """Initialises params, router_state and the optimizer state."""
  # Jitted: eager init would dispatch every op of the model one by one.
  variables = jax.jit(model.init)(rng, jnp.zeros((1, seq_len), jnp.int32))
  params = variables["params"]
  router_state = variables.get("router_state", {})
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=tx.init(params), router_state=router_state)


def global_norm(tree: PyTree) -> jax.Array:
  """sqrt(sum of squares) over all leaves, in fp32."""
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
                      for x in jax.tree.leaves(tree)))


def sum_aux_losses(router_stats: PyTree) -> jax.Array:
  """Sum of every 'aux_loss' leaf (already scaled by its coefficient)."""
  total = jnp.zeros((), jnp.float32)
  for path, leaf in jax.tree_util.tree_leaves_with_path(router_stats):
    if getattr(path[-1], "key", None) == "aux_loss":
      total = total + leaf
  return total


def layer_label(path: str) -> str:
  """'layer_3_moe/router' -> 'layer_3' for metric names."""
  return path.split("/")[0].removesuffix("_moe")


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean token cross-entropy in nats. logits [B,T,V] fp32, targets [B,T]."""
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, targets).mean()


def make_train_step(model: nn.Module, tx: optax.GradientTransformation,
                    moe_cfg, schedule: optax.Schedule | None = None
                    ) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
  """Returns train_step(state, batch) -> (state, metrics); jit it outside."""

  def loss_fn(params, router_state, batch):
    logits, mutated = model.apply(
        {"params": params, "router_state": router_state}, batch["inputs"],
        mutable=["router_stats"])
    stats = mutated.get("router_stats", {})
    ce = cross_entropy(logits, batch["targets"])
    aux = sum_aux_losses(stats)
    return ce + aux, (ce, aux, stats)

  def train_step(state: TrainState, batch: dict):
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, (ce, aux, stats)), grads = grad_fn(state.params,
                                              state.router_state, batch)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # After the optimizer step, outside the gradient: the router bias update.
    router_state = update_router_state(
        state.router_state, stats, method=moe_cfg.balancing,
        ema=moe_cfg.qb_ema, sign_rate=moe_cfg.sign_rate,
        qb_range=moe_cfg.qb_range, top_k=moe_cfg.top_k)
    metrics = {"loss": loss, "ce": ce, "bpb": ce / LN2, "aux_loss": aux,
               "grad_norm": global_norm(grads),
               "param_norm": global_norm(params)}
    if schedule is not None:
      metrics["lr"] = schedule(state.step)
    for path, load in collect_loads(stats).items():
      metrics[f"maxvio/{layer_label(path)}"] = max_violation(load)
    new_state = state.replace(step=state.step + 1, params=params,
                              opt_state=opt_state, router_state=router_state)
    return new_state, metrics

  return train_step


def make_eval_step(model: nn.Module):
  """eval_step(params, router_state, batch) -> (sum of CE nats, count, loads)."""

  def eval_step(params, router_state, batch):
    logits, mutated = model.apply(
        {"params": params, "router_state": router_state}, batch["inputs"],
        mutable=["router_stats"])
    ce = optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["targets"])
    return ce.sum(), ce.size, collect_loads(mutated.get("router_stats", {}))

  return eval_step
