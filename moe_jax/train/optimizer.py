"""AdamW with warmup and cosine / WSD / constant schedules (optax).

Weight decay applies to matrices only: biases, norm scales, AttnRes queries
and the decay gate's A_log / dt_bias are excluded. The router bias is not a
param at all, so the optimizer never sees it.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import optax

# Params that are matrices by shape but must not be decayed.
_NO_DECAY_NAMES = frozenset({"dt_bias", "A_log"})


def make_schedule(tcfg, restarts: Sequence[int] = (),
                  restart_warmup: int = 0) -> optax.Schedule:
  """Learning rate per step from config.train.

  restarts: global steps (curriculum stage starts) where the rate ramps
  linearly up again over restart_warmup steps, from 1/restart_warmup of the
  schedule's value to all of it (moe_jax.curriculum.warmup_restarts).
  """
  peak, steps, warmup = tcfg.learning_rate, tcfg.steps, tcfg.warmup_steps
  floor = peak * tcfg.min_lr_ratio
  warm = optax.linear_schedule(0.0, peak, max(warmup, 1))
  rest = max(steps - warmup, 1)
  if tcfg.schedule == "cosine":
    main = optax.cosine_decay_schedule(peak, rest, alpha=tcfg.min_lr_ratio)
  elif tcfg.schedule == "wsd":
    decay = max(int(round(rest * tcfg.decay_fraction)), 1)
    main = optax.join_schedules(
        [optax.constant_schedule(peak),
         optax.linear_schedule(peak, floor, decay)], [rest - decay])
  else:
    main = optax.constant_schedule(peak)
  base = optax.join_schedules([warm, main], [warmup])
  if not restarts or restart_warmup <= 0:
    return base

  def schedule(count):
    lr = base(count)
    for start in restarts:
      ramp = (count >= start) & (count < start + restart_warmup)
      lr = jnp.where(ramp, lr * (count - start + 1) / restart_warmup, lr)
    return lr
  return schedule


def decay_mask(params):
  """True for leaves that get weight decay: >= 2-D and not a gate bias."""
  def keep(path, leaf):
    name = getattr(path[-1], "key", str(path[-1]))
    return leaf.ndim >= 2 and name not in _NO_DECAY_NAMES
  return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(tcfg, schedule: optax.Schedule | None = None
                   ) -> optax.GradientTransformation:
  """Global-norm clipping then AdamW with `schedule` (default: config's)."""
  return optax.chain(
      optax.clip_by_global_norm(tcfg.grad_clip) if tcfg.grad_clip > 0
      else optax.identity(),
      optax.adamw(schedule or make_schedule(tcfg), b1=tcfg.b1, b2=tcfg.b2, eps=tcfg.eps,
                  weight_decay=tcfg.weight_decay, mask=decay_mask),
  )
