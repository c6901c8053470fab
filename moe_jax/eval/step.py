"""The eval step and the helpers it shares with the train step.

Layering: moe_jax/train imports these; nothing here imports moe_jax.train.
"""
from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from moe_jax.balancing import STATS_COLLECTION, collect_loads
from moe_jax.layers.pick import pick


def token_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Cross-entropy per token in nats. logits [B,T,V] fp32, targets [B,T].

  logsumexp minus the target's logit, picked by a one-hot sum (`pick`): the
  gradient is softmax minus the one-hot, with no scatter-add into [B,T,V].
  """
  picked = pick(logits, targets[..., None])[..., 0]
  return jax.nn.logsumexp(logits, axis=-1) - picked


def cross_entropy(logits: jax.Array, targets: jax.Array,
                  loss_mask: jax.Array | None = None) -> jax.Array:
  """Mean token cross-entropy in nats. logits [B,T,V] fp32, targets [B,T].

  loss_mask [B,T] (1 = counted, 0 = not; e.g. image tokens and prompts):
  the mean over the counted tokens. None counts every token.
  """
  ce = token_cross_entropy(logits, targets)
  if loss_mask is None:
    return ce.mean()
  mask = loss_mask.astype(ce.dtype)
  return (ce * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def apply_model(model: nn.Module, variables, batch: dict, **kwargs):
  """model.apply on batch["inputs"], with batch["images"] and
  batch["segment_ids"] (packed documents) when it has them."""
  if "images" in batch:
    kwargs["images"] = batch["images"]
  if "segment_ids" in batch:
    kwargs["segment_ids"] = batch["segment_ids"]
  return model.apply(variables, batch["inputs"], **kwargs)


def layer_label(path: str) -> str:
  """'layer_3_moe/router' -> 'layer_3' for metric names."""
  return path.split("/")[0].removesuffix("_moe")


def make_eval_step(model: nn.Module) -> Callable:
  """eval_step(params, router_state, batch) -> (sum of CE nats, count, loads).

  With batch["loss_mask"] only the masked-in tokens are summed and counted.

  loads: {module path: load [E]} of every router (`collect_loads`); the
  router bias is read, never updated.
  """

  def eval_step(params, router_state, batch):
    logits, mutated = apply_model(
        model, {"params": params, "router_state": router_state}, batch,
        mutable=[STATS_COLLECTION])
    ce = token_cross_entropy(logits, batch["targets"])
    loads = collect_loads(mutated.get(STATS_COLLECTION, {}))
    if "loss_mask" in batch:
      mask = batch["loss_mask"].astype(ce.dtype)
      return (ce * mask).sum(), mask.sum(), loads
    return ce.sum(), ce.size, loads

  return eval_step
