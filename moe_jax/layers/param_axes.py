"""Logical axis names of parameters, declared where each one is created.

Layers create every parameter through `with_axes` (flax's
nn.with_logical_partitioning): model.init returns it boxed with one logical
name (or None) per dim, `moe_jax.sharding.param_logical_axes` reads the
names, and the rules table (config.mesh.rules, default
config_base.DEFAULT_RULES) alone maps them to mesh axes. The train state
stores the plain arrays (nn.meta.unbox), so checkpoints and optimizer
states do not see the boxes.

Names: vocab, embed (d_model), heads (fused H * head_dim), mlp (FFN hidden
width), expert (routed-expert stacks); None for a dim that is never split
(low ranks, conv taps, norm scales).
"""
from __future__ import annotations

from typing import Callable

import flax.linen as nn

DEFAULT_KERNEL_INIT = nn.linear.default_kernel_init  # nn.Dense's default


def with_axes(init: Callable, *names: str | None) -> Callable:
  """init, boxed with the logical axis names of the param it creates.

  Args:
    init: a flax initializer (key, shape, dtype) -> array.
    *names: one logical name (or None) per dim of the param.
  """
  return nn.with_logical_partitioning(init, names)
