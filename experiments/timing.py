"""Timing and config parsing shared by the GPU experiment scripts
(flag-free, so that any of them can import it: the absl-flag modules cannot
import each other)."""
import collections
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


def parse_int_overrides(flag, pairs, sep, form, allowed):
  """{name: int} of a profiler's override flag: entries name<sep>int with
  name in `allowed`. ValueError naming the flag, the form (e.g. "kernel:N")
  and the allowed names otherwise."""
  key = form.split(sep)[0]
  out = {}
  for pair in pairs:
    name, _, value = pair.partition(sep)
    if name not in allowed or not value.isdigit():
      raise ValueError(f"{flag}: bad entry {pair!r}; expected {form} with "
                       f"{key} one of {', '.join(allowed)}")
    out[name] = int(value)
  return out


KernelConfig = collections.namedtuple(
    "KernelConfig", "bounded block_k mosaic mosaic_out")
KERNEL_OPTIONS = ("mosaic", "mosaic_out")
KERNEL_CONFIG_FORM = "path:block_k[:mosaic][:mosaic_out]"


def parse_kernel_config(entry):
  """KernelConfig of a profiler's `path:block_k[:option]...` entry (path
  bounded or unbounded; options, each at most once: mosaic, the state and
  dstate passes on Mosaic GPU; mosaic_out, the output kernel on Mosaic
  GPU). ValueError naming the form otherwise."""
  path, _, rest = entry.partition(":")
  block_k, *options = rest.split(":")
  if (path not in ("bounded", "unbounded") or not block_k.isdigit()
      or not set(options) <= set(KERNEL_OPTIONS)
      or len(set(options)) != len(options)):
    raise ValueError(f"--configs: bad entry {entry!r}; expected "
                     f"{KERNEL_CONFIG_FORM} with path bounded or unbounded")
  return KernelConfig(path == "bounded", int(block_k), "mosaic" in options,
                      "mosaic_out" in options)
