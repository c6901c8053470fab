"""The eval step and the helpers it shares with the train step.

Layering: moe_jax/train imports these; nothing here imports moe_jax.train.
"""
from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import optax

from moe_jax.balancing import STATS_COLLECTION, collect_loads


def token_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Cross-entropy per token in nats. logits [B,T,V] fp32, targets [B,T]."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean token cross-entropy in nats. logits [B,T,V] fp32, targets [B,T]."""
  return token_cross_entropy(logits, targets).mean()


def layer_label(path: str) -> str:
  """'layer_3_moe/router' -> 'layer_3' for metric names."""
  return path.split("/")[0].removesuffix("_moe")


def make_eval_step(model: nn.Module) -> Callable:
  """eval_step(params, router_state, batch) -> (sum of CE nats, count, loads).

  loads: {module path: load [E]} of every router (`collect_loads`); the
  router bias is read, never updated.
  """

  def eval_step(params, router_state, batch):
    logits, mutated = model.apply(
        {"params": params, "router_state": router_state}, batch["inputs"],
        mutable=[STATS_COLLECTION])
    ce = token_cross_entropy(logits, batch["targets"])
    return ce.sum(), ce.size, collect_loads(mutated.get(STATS_COLLECTION, {}))

  return eval_step
