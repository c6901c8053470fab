"""Wall-clock timing shared by the GPU experiment scripts (flag-free, so
that any of them can import it: the absl-flag modules cannot import each
other)."""
import time

import jax
import numpy as np


def median_ms(fn, iters, warmup=2):
  """Median milliseconds of fn() over `iters` calls after `warmup` calls.

  fn's result is waited for with jax.block_until_ready (a no-op on what is
  not a JAX array: a torch caller synchronises its device itself).
  """
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(times))
