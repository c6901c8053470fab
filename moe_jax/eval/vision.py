"""Answer accuracy of image-text examples, per question type.

An answer counts as right when the teacher-forced argmax of the model equals
the target at every loss-masked position of the row (the answer bytes and
the closing EOS): the exact match a greedy decode of the answer would give.
"""
from __future__ import annotations

from typing import Callable, Iterable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.data.vision import QUESTION_TYPES, chance_accuracy
from moe_jax.eval.step import apply_model


def answers_right(logits: jax.Array, targets: jax.Array,
                  loss_mask: jax.Array) -> jax.Array:
  """bool [B]: argmax matches targets wherever loss_mask > 0 (and the row
  has at least one such position). logits [B,T,V], targets, loss_mask [B,T]."""
  hit = (jnp.argmax(logits, -1) == targets) | (loss_mask <= 0)
  return hit.all(axis=1) & (loss_mask > 0).any(axis=1)


def make_answer_step(model: nn.Module) -> Callable:
  """answer_step(params, router_state, batch) -> (right [Q], total [Q]).

  Counts per question type (index in QUESTION_TYPES, batch["qtype"] [B]).
  """
  num_types = len(QUESTION_TYPES)

  def answer_step(params, router_state, batch):
    logits = apply_model(model, {"params": params,
                                 "router_state": router_state}, batch)
    right = answers_right(logits, batch["targets"], batch["loss_mask"])
    onehot = jax.nn.one_hot(batch["qtype"], num_types, dtype=jnp.int32)
    return (right[:, None] * onehot).sum(0), onehot.sum(0)

  return answer_step


def answer_accuracy(answer_step: Callable, params, router_state,
                    batches: Iterable[dict], prefix: str = "acc"
                    ) -> dict[str, float]:
  """{'acc/<type>': accuracy, 'chance/<type>': 1 / #answers} over batches,
  for every question type present; 'acc/all' over all of them."""
  right = np.zeros(len(QUESTION_TYPES), np.int64)
  total = np.zeros(len(QUESTION_TYPES), np.int64)
  for batch in batches:
    r, t = answer_step(params, router_state, batch)
    right += np.asarray(r)
    total += np.asarray(t)
  out = {}
  for i, name in enumerate(QUESTION_TYPES):
    if total[i]:
      out[f"{prefix}/{name}"] = float(right[i] / total[i])
      out[f"chance/{name}"] = chance_accuracy(name)
  if total.sum():
    out[f"{prefix}/all"] = float(right.sum() / total.sum())
  return out
