"""The KDA kernels' block sizes, launch parameters and stage choices.

One frozen (hashable, static) dataclass: `kda_pallas(..., tune=Tuning(...))`.
The defaults are the measured choices on an H100 / H200 (B1 T32768 and
B8 T8192, H16 D128 bf16; results/kernels.md has the sweeps and the dates).
"""
from __future__ import annotations

import dataclasses

from pallas_kernels.linear_attention.common.mosaic import (
    STAGE_KERNELS, STATE_PASS_CHOICES)
from pallas_kernels.linear_attention.common.tiles import TILE, compiler_params

GRAD_K_BK_BOUNDED = 64   # Tuning.grad_k_bk=None on the bounded path


@dataclasses.dataclass(frozen=True)
class Tuning:
  """Block sizes, warps per kernel and the stage kernels of one KDA call."""
  # K slice width of the intra (scores, solve) kernels, both paths: narrow
  # slices bound the live [16, bk] fp32 tiles (128 spilled).
  block_k: int = 32
  # grad_k's K slice width; None: GRAD_K_BK_BOUNDED (64) on the bounded path,
  # block_k on the unbounded one (its [16, 16, w] pair tensors grow with w).
  # Wider slices mean fewer programs re-reading each chunk's blocks.
  grad_k_bk: int | None = None
  pass_bv: int = 16         # V block of the sequential passes (more programs)
  bv: int = 64              # V block of the output, dv_intra and grad_v loops
  grad_bv: int = 128        # V block of grad_k's contractions over V
  scores_warps: int = 4
  solve_warps: int = 4
  state_warps: int = 8
  output_warps: int = 4
  dv_intra_warps: int = 2
  dstate_warps: int = 8
  grad_v_warps: int = 4
  grad_k_warps: int = 4
  num_stages: int = 2
  # The state and dstate passes on Triton or Mosaic GPU (wgmma + TMA,
  # common/mosaic.py; bf16, K >= 64); "auto": Mosaic on a GPU where it
  # applies, where it is faster (H200, B1 T32768 and B8 T8192).
  state_pass: str = "auto"
  # The output kernel likewise; Mosaic is within noise of Triton on an H200
  # (faster at B8 T8192, slower at B1 T32768): "triton".
  output_kernel: str = "triton"

  def params(self, kernel):
    """Triton compiler params of `kernel` (a *_warps field's prefix)."""
    return compiler_params(getattr(self, f"{kernel}_warps"), self.num_stages)


DEFAULT_TUNING = Tuning()
_SIZES = ("block_k", "grad_k_bk", "pass_bv", "bv", "grad_bv")


def check_tuning(tune):
  """ValueError naming the field unless tune is a valid Tuning: block sizes
  powers of two >= 16 (grad_k_bk may be None), warp and stage counts >= 1,
  the stage kernels among their choices."""
  if not isinstance(tune, Tuning):
    raise ValueError(f"tune must be a kda.tuning.Tuning, got {tune!r}")
  for f in dataclasses.fields(tune):
    value = getattr(tune, f.name)
    if f.name in _SIZES:
      if value is None and f.name == "grad_k_bk":
        continue
      if (isinstance(value, bool) or not isinstance(value, int)
          or value < TILE or value & (value - 1)):
        raise ValueError(f"tune.{f.name} must be a power of two >= {TILE}, "
                         f"got {value!r}")
    elif f.name.endswith("_warps") or f.name == "num_stages":
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"tune.{f.name} must be an int >= 1, got {value!r}")
  for name, allowed in (("state_pass", STATE_PASS_CHOICES),
                        ("output_kernel", STAGE_KERNELS)):
    if getattr(tune, name) not in allowed:
      raise ValueError(f"tune.{name} must be one of {allowed}, got "
                       f"{getattr(tune, name)!r}")


def grad_k_block(tune, bounded):
  """grad_k's K slice width for this call (see Tuning.grad_k_bk)."""
  if tune.grad_k_bk is not None:
    return tune.grad_k_bk
  return GRAD_K_BK_BOUNDED if bounded else tune.block_k
