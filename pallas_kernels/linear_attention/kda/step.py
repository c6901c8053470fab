"""One-token KDA step (decoding) as a Pallas kernel: common/step.py."""
from __future__ import annotations

from pallas_kernels.linear_attention.common.step import (
    F32, check_step, run_step, step_scale)


def kda_step_pallas(q, k, v, g, beta, state, *, scale=None, interpret=False):
  """One KDA token. q, k, g [B, H, K]; v [B, H, V]; beta [B, H];
  state [B, H, K, V]. Returns o [B, H, V] in v.dtype, new state fp32."""
  if beta is None:
    raise ValueError("beta must be given for KDA: shape [B, H]")
  _, _, dk, _ = check_step(q, k, v, g, beta, state, "KDA")
  bk = beta.astype(F32)[..., None] * k.astype(F32)
  return run_step(q, k, v, g, bk, state, scale=step_scale(scale, dk),
                  delta=True, interpret=bool(interpret))
