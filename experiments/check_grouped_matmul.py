r"""Are the grouped matmuls right on this device, at training shapes?

Two checks, each printing one line per case:

  kernels: `gmm` (each schedule; "mosaic" = Tuning(kernel="mosaic"), the
    Mosaic GPU kernels, which also check their tgmm against
    naive.tgmm_reference) and `jax.lax.ragged_dot` against the masked-dense
    reference (naive.gmm_reference) at MoE shapes, for several
    group-size patterns (uniform, skewed, empty groups, balanced, rows past
    the last group). Before each call a NaN-filled buffer of the output's
    size is freed, so a row a kernel leaves unwritten shows as NaN or stale
    data instead of as the zeros of fresh memory. Each call is made twice.
  model: a config's loss and gradients on one batch, with the router bias
    of every MoE layer moved by Gaussian noise of each --bias_scales value
    (routing away from the balanced init), for the grouped matmuls
    --matmuls and for the loop dispatch (every expert on every token,
    masked: the obviously-right reference), all in the config's dtype.

  python -m experiments.check_grouped_matmul --checks=kernels,model \
      --config=configs/gpu_small.py --batch_size=8

The Mosaic kernels need bf16 and K, N multiples of 64 (gpu_1b's shapes):

  python -m experiments.check_grouped_matmul --checks=kernels,model \
      --shapes=131072:1024:768:64,131072:384:1024:64 \
      --schedules=visits,mosaic --config=configs/gpu_1b.py --batch_size=1 \
      --matmuls=ragged_dot,pallas:visits,mosaic

Pallas rows need a GPU; on a CPU the kernel check interprets them and the
model check takes "interpret:SCHEDULE" rows (slow: tiny configs only).
"""
from __future__ import annotations

import functools
import time

from absl import app, flags

_CHECKS = flags.DEFINE_list("checks", ["kernels", "model"],
                            "kernels and/or model.")
_SHAPES = flags.DEFINE_list(
    "shapes", ["131072:512:192:64", "131072:96:512:64"],
    "M:K:N:E of the kernel check (the default: gpu_small's gate/up and "
    "down products).")
_SCHEDULES = flags.DEFINE_list(
    "schedules", ["visits", "tiles"],
    "gmm schedules (Tuning.schedule), or mosaic (Tuning(kernel='mosaic')).")
_CONFIG = flags.DEFINE_string("config", "configs/gpu_small.py",
                              "Config file[:variants] of the model check.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Model check batch size.")
_MATMULS = flags.DEFINE_list(
    "matmuls", ["ragged_dot", "pallas:visits", "pallas:tiles"],
    "Model check rows: ragged_dot | pallas:SCHEDULE | interpret:SCHEDULE | "
    "mosaic.")
_SCALES = flags.DEFINE_list("bias_scales", ["0", "0.5"],
                            "Std of the noise added to the router biases.")


def _rel(a, b):
  """(norm-relative difference, number of non-finite entries of a)."""
  import numpy as np
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  bad = int((~np.isfinite(a)).sum())
  return float(np.linalg.norm(np.nan_to_num(a) - b) / np.linalg.norm(b)), bad


def group_size_patterns(m: int, e: int, key) -> dict:
  """Named group sizes [E] int32 over m rows."""
  import jax
  import jax.numpy as jnp
  k1, k2 = jax.random.split(key)
  uniform = jnp.bincount(jax.random.randint(k1, (m,), 0, e), length=e)
  p = jax.nn.softmax(3.0 * jax.random.normal(k2, (e,)))
  return {k: v.astype(jnp.int32) for k, v in dict(
      uniform=uniform,
      skewed=jnp.floor(p * (m - m // 16)),      # some groups near empty
      empty=uniform.at[0].set(0).at[7].set(0).at[e - 1].set(0),
      balanced=jnp.full((e,), m // e),
      tail=jnp.full((e,), (m - m // 8) // e).at[3].add(3),
  ).items()}


def check_kernels():
  import jax
  import jax.numpy as jnp
  from pallas_kernels.grouped_matmul import (Tuning, gmm, gmm_reference, tgmm,
                                             tgmm_reference)
  for shape in _SHAPES.value:
    m, k, n, e = (int(v) for v in shape.split(":"))
    ks = jax.random.split(jax.random.PRNGKey(m + n), 3)
    x = jax.random.normal(ks[0], (m, k), jnp.bfloat16)
    w = (jax.random.normal(ks[1], (e, k, n)) * k**-0.5).astype(jnp.bfloat16)
    ref_fn = jax.jit(gmm_reference)
    fns = {"ragged_dot": jax.jit(jax.lax.ragged_dot)}
    interpret = jax.default_backend() == "cpu"   # a slow smoke run
    tunes = {s: Tuning(kernel="mosaic") if s == "mosaic" else Tuning(
        schedule=s) for s in _SCHEDULES.value}
    for s, tune in tunes.items():
      fns[s] = jax.jit(functools.partial(gmm, tuning=tune,
                                         interpret=interpret))
    if "mosaic" in tunes:   # the weight gradient's kernel, [E, K, N] fp32
      dy = jax.random.normal(ks[2], (m, n), jnp.bfloat16)
      tgmm_fn = jax.jit(functools.partial(tgmm, tuning=tunes["mosaic"],
                                          interpret=interpret))
    for name, sizes in group_size_patterns(m, e, ks[2]).items():
      ref = ref_fn(x, w, sizes)
      cells = [f"M{m} K{k} N{n} E{e} {name:8s} rows {int(sizes.sum())}"]
      for fname, fn in fns.items():
        for rep in range(2):
          junk = jnp.full((m, n), jnp.nan, jnp.bfloat16).block_until_ready()
          del junk
          try:
            err, bad = _rel(fn(x, w, sizes), ref)
          except ValueError as exc:   # a kernel's limits (named)
            cells.append(f"{fname} n/a: {exc}")
            break
          cells.append(f"{fname}#{rep} {err:.1e} nonfinite {bad}")
      if "mosaic" in tunes:
        try:
          err, bad = _rel(tgmm_fn(x, dy, sizes), tgmm_reference(x, dy, sizes))
          cells.append(f"tgmm:mosaic {err:.1e} nonfinite {bad}")
        except ValueError as exc:
          cells.append(f"tgmm:mosaic n/a: {exc}")
      print(" | ".join(cells), flush=True)


def check_model():
  import jax
  import numpy as np
  from moe_jax.config_base import load_config_file
  from moe_jax.config_validation import validate_config
  from moe_jax.data import make_datasets
  from moe_jax.layers import expert_parallel
  from moe_jax.model import build_model
  from moe_jax.train.optimizer import make_optimizer
  from moe_jax.train.step import init_train_state, make_grad_fn
  from pallas_kernels.grouped_matmul import Tuning

  path, _, variants = _CONFIG.value.partition(":")
  module = load_config_file(path)
  base = module.get_config(variants) if variants else module.get_config()
  base.data.batch_size = _BATCH.value

  def config(matmul, dispatch):
    c = base.copy_and_resolve_references()
    c.model.moe.grouped_matmul, c.model.moe.dispatch = matmul, dispatch
    validate_config(c)
    return c

  train_iter, *_ = make_datasets(dict(base.data.to_dict(), seed=0))
  batch = jax.tree.map(jax.numpy.asarray, next(train_iter))
  c0 = config("ragged_dot", "loop")
  state = init_train_state(build_model(c0), make_optimizer(c0.train),
                           jax.random.PRNGKey(0), c0.data.seq_len)
  leaves, treedef = jax.tree.flatten(state.router_state)
  keys = jax.random.split(jax.random.PRNGKey(7), len(leaves))

  def moved_bias(scale):
    return jax.tree.unflatten(treedef, [
        x + scale * jax.random.normal(kk, x.shape, x.dtype)
        if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x
        for x, kk in zip(leaves, keys)])

  plain_gmm = expert_parallel.gmm
  ref = {}
  t0 = time.time()
  try:
    for row in ["loop"] + _MATMULS.value:
      matmul, _, schedule = row.partition(":")
      expert_parallel.gmm = (functools.partial(
          plain_gmm, tuning=Tuning(schedule=schedule)) if schedule
                             else plain_gmm)
      c = (config("ragged_dot", "loop") if row == "loop"
           else config(matmul, "ragged"))
      grad_fn = jax.jit(make_grad_fn(build_model(c), c.model.moe))
      for scale in (float(s) for s in _SCALES.value):
        (loss, *_), grads = grad_fn(state.params, moved_bias(scale), batch)
        grads = [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)]
        if row == "loop":
          ref[scale] = (float(loss), grads)
        ref_loss, ref_grads = ref[scale]
        num = sum(float(np.sum((a - b) ** 2)) for a, b in zip(grads,
                                                                 ref_grads))
        den = sum(float(np.sum(b ** 2)) for b in ref_grads)
        finite = all(np.isfinite(g).all() for g in grads)
        print(f"{row:16s} bias noise {scale:4.2f}: loss {float(loss):.6f} "
              f"(loop {ref_loss:.6f}), grads vs loop {np.sqrt(num / den):.2e}"
              f", finite {finite} [{time.time() - t0:.0f} s]", flush=True)
  finally:
    expert_parallel.gmm = plain_gmm


def main(argv):
  del argv
  import jax
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}",
        flush=True)
  if "kernels" in _CHECKS.value:
    check_kernels()
  if "model" in _CHECKS.value:
    check_model()


if __name__ == "__main__":
  app.run(main)
