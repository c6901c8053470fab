"""Answer accuracy of image-text examples, per question type.

An answer counts as right when the teacher-forced argmax of the model equals
the target at every loss-masked position of the row (the answer bytes and
the closing EOS): the exact match a greedy decode of the answer would give.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.data.stdlib_corpus import EOS, PAD
from moe_jax.data.vision import (QUESTION_TYPES, chance_accuracy, collate,
                                  prompt_ids)
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


def greedy_answers(model: nn.Module, params, router_state, examples,
                   seq_len: int, patches: int, max_len: int = 48,
                   blank_images: bool = False) -> list[str]:
  """The model's greedy answers to examples (text up to its EOS).

  Re-runs the full forward for every new token (one compile for the
  [n, seq_len] shape): simple, and enough for a few examples.
  """
  n = len(examples)
  tokens = np.full((n, seq_len), PAD, np.int32)
  length = np.zeros(n, np.int64)
  for i, e in enumerate(examples):
    ids = prompt_ids(e, patches)
    tokens[i, :len(ids)] = ids
    length[i] = len(ids)
  images = np.stack([e.images for e in examples])
  if blank_images:
    images = np.zeros_like(images)
  forward = jax.jit(lambda t, im: model.apply(
      {"params": params, "router_state": router_state}, t, images=im))
  done = np.zeros(n, bool)
  answers = [[] for _ in range(n)]
  for _ in range(max_len):
    logits = np.asarray(forward(tokens, images))
    for i in range(n):
      if done[i] or length[i] >= seq_len:
        done[i] = True
        continue
      nxt = int(np.argmax(logits[i, length[i] - 1]))
      if nxt == EOS:
        done[i] = True
        continue
      tokens[i, length[i]] = nxt
      answers[i].append(nxt)
      length[i] += 1
    if done.all():
      break
  return [bytes(t for t in a if t < 256).decode("utf-8", "replace")
          for a in answers]


def candidate_log_likelihoods(logits_fn: Callable, examples, candidates,
                              seq_len: int, patches: int, image_size: int,
                              batch_size: int = 64,
                              blank_images: bool = False) -> np.ndarray:
  """float64 [len(examples), len(candidates)]: log p(candidate answer + EOS
  | image, prompt) of every example, each candidate teacher-forced in turn.

  logits_fn(batch) -> logits [batch_size, seq_len, V] of a collated batch
  (every call has batch_size rows: the last one is padded). Ranks whole
  answers, so it does not depend on how the names split into bytes (one
  name a prefix of another, or the first byte deciding).
  """
  rows = [dataclasses.replace(e, answer=c) for e in examples
          for c in candidates]
  out = np.zeros(len(rows))
  for lo in range(0, len(rows), batch_size):
    chunk = rows[lo:lo + batch_size]
    pad = batch_size - len(chunk)
    batch = collate(chunk + chunk[:1] * pad, seq_len, patches, image_size,
                    blank_images)
    del batch["qtype"]
    logp = np.asarray(jax.nn.log_softmax(
        jnp.asarray(logits_fn(batch), jnp.float32), -1))
    picked = np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    out[lo:lo + len(chunk)] = (picked * batch["loss_mask"]).sum(1)[:len(chunk)]
  return out.reshape(len(examples), len(candidates))


def confusion_matrix(truth, predicted, labels) -> np.ndarray:
  """int64 [L, L]: counts of (true label row, predicted label column)."""
  index = {label: i for i, label in enumerate(labels)}
  out = np.zeros((len(labels), len(labels)), np.int64)
  for t, p in zip(truth, predicted):
    out[index[t], index[p]] += 1
  return out
