"""GLA kernels' block sizes, launch parameters and options."""
from __future__ import annotations

import dataclasses

from pallas_kernels.linear_attention.common.mosaic import (
    STAGE_KERNELS, STATE_PASS_CHOICES)
from pallas_kernels.linear_attention.common.tiles import TILE, compiler_params


@dataclasses.dataclass(frozen=True)
class Tuning:
  """Block sizes and launch parameters (defaults: KDA's measured choices on
  an H200, results/kernels.md; GLA's own sweep is bench_kernels --tune)."""
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
  # The contractions over V (dO S^T, v dH^T, sum_v dH S) in a kernel of
  # their own before grad_k (see kda_pallas.SPLIT_GRAD_K); untimed.
  split_grad_k: bool = False
  state_side_bk: int = 64
  state_side_warps: int = 4
  # grad_k's order on its row tiles: "held" (in order, every tile's results
  # held to the end) or "pull" (last first in a fori_loop, each tile forming
  # all of its own gradients: chunk_common._pull_key_side_grads), and its K
  # slice width (None: GRAD_K_BK_BOUNDED on the bounded path and block_k on
  # the unbounded one, whose [16, 16, w] pair tensors grow with w; a value
  # applies to both paths, as kda_pallas's grad_k_block_k). KDA's grad_k,
  # pull at 64 against held at 32, went 21.1 -> 19.2 ms fwd+bwd at B8 T8192
  # and 10.6 -> 9.8 at B1 T32768 (H100, session 19). GLA's, same process
  # (H200, session 20, ab_kernels, fwd+bwd ms at B8 T8192 / B1 T32768):
  # held w=32 12.26 / 6.59, pull w=32 11.76 / 5.92, pull w=64 11.18 / 5.71.
  grad_k_order: str = "pull"
  grad_k_bk: int | None = None
  # The state and dstate passes as Triton ("triton") or Mosaic GPU
  # ("mosaic": wgmma + TMA, mosaic.py, blocks pass_bk x pass_bv; bf16,
  # K >= 64) kernels; "auto": Mosaic on a GPU where it applies. H200 B1
  # T32768 H16 D128 fwd+bwd (session 17): Triton 6.73, Mosaic 6.37 ms.
  state_pass: str = "auto"
  # The output kernel likewise ("mosaic": mosaic.output, block bv);
  # H200 (session 17): 6.69 vs 6.73 ms, within noise: "triton".
  output_kernel: str = "triton"

  def params(self, kernel):
    return compiler_params(getattr(self, f"{kernel}_warps"), self.num_stages)


GRAD_K_BK_BOUNDED = 64   # Tuning.grad_k_bk=None on the bounded path


DEFAULT_TUNING = Tuning()


GRAD_K_ORDERS = ("held", "pull")


def check_tuning(tune):
  """ValueError naming the field unless tune is a valid Tuning: block sizes
  powers of two >= 16, warp and stage counts >= 1, split_grad_k a bool."""
  if not isinstance(tune, Tuning):
    raise ValueError(f"tune must be a gla_pallas.Tuning, got {tune!r}")
  for name in ("block_k", "pass_bk", "pass_bv", "bv", "grad_bv",
               "state_side_bk", "grad_k_bk"):
    size = getattr(tune, name)
    if size is None and name == "grad_k_bk":
      continue
    if (isinstance(size, bool) or not isinstance(size, int) or size < TILE
        or size & (size - 1)):
      raise ValueError(f"tune.{name} must be a power of two >= {TILE}, got "
                       f"{size!r}")
  for name in ("intra_warps", "pass_warps", "output_warps", "dv_warps",
               "grad_k_warps", "state_side_warps", "num_stages"):
    if getattr(tune, name) < 1:
      raise ValueError(f"tune.{name} must be >= 1, got "
                       f"{getattr(tune, name)!r}")
  if not isinstance(tune.split_grad_k, bool):
    raise ValueError(f"tune.split_grad_k must be True or False, got "
                     f"{tune.split_grad_k!r}")
  for name, allowed in (("state_pass", STATE_PASS_CHOICES),
                        ("output_kernel", STAGE_KERNELS),
                        ("grad_k_order", GRAD_K_ORDERS)):
    if getattr(tune, name) not in allowed:
      raise ValueError(f"tune.{name} must be one of {allowed}, got "
                       f"{getattr(tune, name)!r}")
