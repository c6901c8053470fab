"""The GLA kernels' block sizes, launch parameters and stage choices: one
frozen (hashable, static) dataclass, `gla_pallas(..., tune=Tuning(...))`."""
from __future__ import annotations

import dataclasses

from pallas_kernels.linear_attention.common.mosaic import (
    STAGE_KERNELS, STATE_PASS_CHOICES)
from pallas_kernels.linear_attention.common.tiles import TILE, compiler_params


@dataclasses.dataclass(frozen=True)
class Tuning:
  """Block sizes, warps per kernel and the stage kernels of one GLA call
  (defaults: KDA's measured choices, which carry over to GLA's kernels built
  from the same pieces; GLA's own sweep is bench_kernels --tune)."""
  block_k: int = 32         # K slice width of the intra and grad_k kernels
  pass_bk: int = 64         # K block of the sequential passes
  pass_bv: int = 16         # V block of the sequential passes
  bv: int = 64              # V block of the output kernel and the dv loop
  grad_bv: int = 128        # V block of grad_k's contractions over V
  intra_warps: int = 4
  pass_warps: int = 4
  output_warps: int = 4
  dv_warps: int = 4
  grad_k_warps: int = 4
  num_stages: int = 2
  # grad_k's K slice width (None: GRAD_K_BK_BOUNDED on the bounded path and
  # block_k on the unbounded one, whose [16, 16, w] pair tensors grow with
  # w; a value applies to both paths). 64 is faster than 32 on the bounded
  # path (H200, B1 T32768 and B8 T8192).
  grad_k_bk: int | None = None
  # The state and dstate passes on Triton or Mosaic GPU (wgmma + TMA,
  # common/mosaic.py, blocks pass_bk x pass_bv; bf16, K >= 64); "auto":
  # Mosaic on a GPU where it applies, where it is faster (H200, B1 T32768).
  state_pass: str = "auto"
  # The output kernel likewise ("mosaic": mosaic.output, block bv); within
  # noise of Triton on an H200: "triton".
  output_kernel: str = "triton"

  def params(self, kernel):
    return compiler_params(getattr(self, f"{kernel}_warps"), self.num_stages)


GRAD_K_BK_BOUNDED = 64   # Tuning.grad_k_bk=None on the bounded path
DEFAULT_TUNING = Tuning()


def check_tuning(tune):
  """ValueError naming the field unless tune is a valid Tuning: block sizes
  powers of two >= 16 (grad_k_bk may be None), warp and stage counts >= 1,
  the stage kernels among their choices."""
  if not isinstance(tune, Tuning):
    raise ValueError(f"tune must be a gla.tuning.Tuning, got {tune!r}")
  for name in ("block_k", "pass_bk", "pass_bv", "bv", "grad_bv",
               "grad_k_bk"):
    size = getattr(tune, name)
    if size is None and name == "grad_k_bk":
      continue
    if (isinstance(size, bool) or not isinstance(size, int) or size < TILE
        or size & (size - 1)):
      raise ValueError(f"tune.{name} must be a power of two >= {TILE}, got "
                       f"{size!r}")
  for name in ("intra_warps", "pass_warps", "output_warps", "dv_warps",
               "grad_k_warps", "num_stages"):
    if getattr(tune, name) < 1:
      raise ValueError(f"tune.{name} must be >= 1, got "
                       f"{getattr(tune, name)!r}")
  for name, allowed in (("state_pass", STATE_PASS_CHOICES),
                        ("output_kernel", STAGE_KERNELS)):
    if getattr(tune, name) not in allowed:
      raise ValueError(f"tune.{name} must be one of {allowed}, got "
                       f"{getattr(tune, name)!r}")
