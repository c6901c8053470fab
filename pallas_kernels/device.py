"""What the default device is, for choosing kernels at trace time."""
from __future__ import annotations

import jax


def gpu_compute_major() -> int:
  """The default device's CUDA compute capability major (9 on Hopper), or 0
  off a GPU or where the device does not say."""
  if jax.default_backend() != "gpu":
    return 0
  try:
    return int(str(jax.devices()[0].compute_capability).split(".")[0])
  except (AttributeError, ValueError):
    return 0
