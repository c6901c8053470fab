"""One-token GLA step (decoding) as a Pallas kernel: common/step.py."""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.linear_attention.common.step import (
    F32, check_step, run_step, step_scale)


def gla_step_pallas(q, k, v, g, state, *, scale=None, interpret=False):
  """One GLA token. q, k, g [B, H, K]; v [B, H, V]; state [B, H, K, V].

  Returns o [B, H, V] in v.dtype and the new state [B, H, K, V] fp32.
  """
  _, _, dk, _ = check_step(q, k, v, g, None, state, "GLA")
  return run_step(q, k, v, g, jnp.zeros(q.shape, F32), state,
                  scale=step_scale(scale, dk), delta=False,
                  interpret=bool(interpret))
