r"""The routed experts alone: grouped-matmul TFLOP/s against the card's peak.

Times forward + backward of the routed SwiGLU experts on group-sorted rows
(`expert_parallel.expert_ffn`: gate/up product, SwiGLU, down product) for
each grouped matmul, at MoE shapes given as N:D:F:E:k (tokens, model width,
expert width, experts, top-k). Groups come from uniform random routing. The
ideal count is the routed FLOPs alone: 3 x 2 x N x k x 3 x D x F (forward
and backward). XLA's ragged_dot lowering is chosen by XLA flags, so each
--xla_variants entry runs in its own process with its flags set.

  python -m experiments.bench_moe --shapes=65536:1024:384:64:8 \
      --matmuls=pallas,ragged_dot \
      --xla_variants=default:,cudnn:--xla_gpu_experimental_use_ragged_dot_fusion=true

The Mosaic GPU kernels (grouped_matmul/mosaic.py; bf16, widths multiples of
64) are the "mosaic" rows, their tunings --mosaic_tunings:

  python -m experiments.bench_moe --shapes=65536:1024:384:64:8 \
      --matmuls=mosaic,pallas --mosaic_tunings=,128:128:4,128:256:3
"""
from __future__ import annotations

import json
import time
import os
import subprocess
import sys

from absl import app, flags

_SHAPES = flags.DEFINE_list("shapes", ["65536:1024:384:64:8",
                                       "32768:512:96:64:4"],
                            "N:D:F:E:k routed-expert shapes.")
_MATMULS = flags.DEFINE_list("matmuls", ["pallas", "ragged_dot"],
                             "model.moe.grouped_matmul values.")
_XLA = flags.DEFINE_list("xla_variants", ["default:"],
                         "name:XLA_FLAGS entries for the ragged_dot rows.")
_TUNINGS = flags.DEFINE_list(
    "tunings", [""], "Pallas rows: bm:bn:bk:warps:stages[:schedule] of gmm "
    "(tgmm takes bn/2bk as its output block); '' = the default Tuning.")
_MOSAIC_TUNINGS = flags.DEFINE_list(
    "mosaic_tunings", [""], "Mosaic rows: bm:bn:steps[:tgmm_bk:tgmm_bn] "
    "(block_m, block_n, mosaic_steps, tgmm output block; each block 64, 128 "
    "or 256); '' = Tuning(kernel='mosaic').")
_ITERS = flags.DEFINE_integer("iters", 20, "Timed repeats (median).")
_PEAK = flags.DEFINE_float("peak_tflops", 989.0, "Dense bf16 peak.")
_CHECK = flags.DEFINE_bool(
    "check", True, "Before timing, compare each non-reference row's values "
    "and gradients with a per-expert fp32 reference at the same shape.")
_CHILD = flags.DEFINE_string("child", "", "Internal: one variant name.")


def reference_ffn(xs, sizes, wg, wu, wd):
  """Per-expert fp32 SwiGLU on each expert's own rows (the obviously-right
  form of expert_ffn at bench shapes).

  Expert e's rows are the contiguous block [start_e, start_e + size_e); each
  expert runs on a window of cap = max(sizes) rows from its start (rows past
  its size masked), under lax.map (one compile), and every row takes its
  value from its expert's window. Memory O(E cap D + M D): at the gpu_1b
  shape a few GiB, where per-expert [M, D] outputs would need E times M D.
  sizes must be concrete (cap is a static shape).
  """
  import jax
  import jax.numpy as jnp
  import numpy as np
  from pallas_kernels.grouped_matmul.naive import group_of_rows
  m, e = xs.shape[0], wg.shape[0]
  cap = max(int(np.max(np.asarray(sizes))), 1)
  starts = jnp.cumsum(sizes) - sizes                            # [E]
  # cap zero rows at the end: a window never runs past the array (no clamp).
  x32 = jnp.pad(xs.astype(jnp.float32), ((0, cap), (0, 0)))
  hp = jax.lax.Precision.HIGHEST

  def one(args):
    start, size, a, b, c = args
    rows = jax.lax.dynamic_slice_in_dim(x32, start, cap)         # [cap, D]
    h = (jax.nn.silu(jnp.dot(rows, a.astype(jnp.float32), precision=hp))
         * jnp.dot(rows, b.astype(jnp.float32), precision=hp))
    y = jnp.dot(h, c.astype(jnp.float32), precision=hp)          # [cap, D]
    return jnp.where((jnp.arange(cap) < size)[:, None], y, 0.0)

  out = jax.lax.map(one, (starts, sizes, wg, wu, wd))           # [E, cap, D]
  g = group_of_rows(sizes, m)                                   # E: no group
  ge = jnp.minimum(g, e - 1)
  pos = jnp.clip(jnp.arange(m) - starts[ge], 0, cap - 1)
  return jnp.where((g < e)[:, None], out[ge, pos], 0.0)


def time_one(shape: str, matmul: str, iters: int, tuning: str = "") -> dict:
  import functools
  import jax
  import jax.numpy as jnp
  import numpy as np
  from moe_jax.layers import expert_parallel
  from moe_jax.layers.expert_parallel import expert_ffn
  from pallas_kernels.grouped_matmul import Tuning, gmm
  # Each row starts from the plain kernels: an earlier row's tuning must not
  # leak into this one.
  expert_parallel.gmm = gmm
  expert_parallel.MOSAIC_TUNING = Tuning(kernel="mosaic")
  if matmul == "mosaic" and tuning:
    bm, bn, steps, *tg = (int(v) for v in tuning.split(":"))
    tbk, tbn = tg or (bm, bn)
    expert_parallel.MOSAIC_TUNING = Tuning(
        kernel="mosaic", block_m=bm, block_n=bn, mosaic_steps=steps,
        tgmm_block_k=tbk, tgmm_block_n=tbn)
  elif matmul != "mosaic" and tuning:
    fields = tuning.split(":")
    bm, bn, bk, nw, ns = (int(v) for v in fields[:5])
    expert_parallel.gmm = functools.partial(gmm, tuning=Tuning(
        block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns,
        tgmm_block_k=bk * 2, tgmm_block_n=bn, tgmm_num_warps=nw,
        tgmm_num_stages=ns, schedule=(fields[5:] or ["visits"])[0]))
  n, d, f, e, k = (int(v) for v in shape.split(":"))
  m = n * k
  keys = jax.random.split(jax.random.PRNGKey(0), 6)
  xs = jax.random.normal(keys[0], (m, d), jnp.bfloat16)
  wg, wu = (jax.random.normal(kk, (e, d, f), jnp.bfloat16) * d**-0.5
            for kk in keys[1:3])
  wd = jax.random.normal(keys[3], (e, f, d), jnp.bfloat16) * f**-0.5
  ids = jax.random.randint(keys[4], (m,), 0, e)
  sizes = jnp.bincount(ids, length=e).astype(jnp.int32)
  ct = jax.random.normal(keys[5], (m, d), jnp.bfloat16)

  def loss(xs, wg, wu, wd):
    y = expert_ffn(xs, sizes, wg, wu, wd, matmul)
    return jnp.sum(y.astype(jnp.float32) * ct)

  fb = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
  fwd = jax.jit(loss)
  out = {}
  if _CHECK.value:
    # Relative L2 error of the output and of every gradient against fp32.
    y = jax.jit(lambda *a: expert_ffn(*a[:1], sizes, *a[1:], matmul))(
        xs, wg, wu, wd)
    y_ref = jax.jit(lambda *a: reference_ffn(a[0], sizes, *a[1:]))(
        xs, wg, wu, wd)
    g = fb(xs, wg, wu, wd)
    g_ref = jax.jit(jax.grad(
        lambda xs, *w: jnp.sum(reference_ffn(xs, sizes, *w)
                               * ct.astype(jnp.float32)),
        argnums=(0, 1, 2, 3)))(xs, wg, wu, wd)
    rel = lambda a, b: float(jnp.linalg.norm(  # noqa: E731
        a.astype(jnp.float32) - b) / jnp.linalg.norm(b))
    out["rel_err"] = {n: rel(a, b) for n, a, b in zip(
        ("y", "dx", "dw_gate", "dw_up", "dw_down"), (y, *g), (y_ref, *g_ref))}
  for name, fn in (("fwd", fwd), ("fwd+bwd", fb)):
    jax.block_until_ready(fn(xs, wg, wu, wd))
    times = []
    for _ in range(iters):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(xs, wg, wu, wd))
      times.append(time.perf_counter() - t0)
    out[name] = float(np.median(times))
  flop_fwd = 2 * m * 3 * d * f
  return dict(shape=shape, matmul=matmul, tuning=tuning,
              rel_err=out.get("rel_err"), fwd_ms=out["fwd"] * 1e3,
              fwdbwd_ms=out["fwd+bwd"] * 1e3,
              fwd_tflops=flop_fwd / out["fwd"] / 1e12,
              fwdbwd_tflops=3 * flop_fwd / out["fwd+bwd"] / 1e12,
              device=jax.devices()[0].device_kind)


def main(argv):
  del argv
  variants = dict(v.split(":", 1) for v in _XLA.value)
  if _CHILD.value:
    rows = []
    for shape in _SHAPES.value:
      for mm in _MATMULS.value:
        if mm != "ragged_dot" and _CHILD.value != next(iter(variants)):
          continue   # XLA flags change ragged_dot only
        tunes = {"pallas": _TUNINGS.value, "mosaic": _MOSAIC_TUNINGS.value}
        for tune in tunes.get(mm, [""]):
          try:
            rows.append(dict(time_one(shape, mm, _ITERS.value, tune),
                             xla=_CHILD.value))
          except Exception as e:  # pylint: disable=broad-except
            rows.append(dict(shape=shape, matmul=mm, xla=_CHILD.value,
                             tuning=tune,
                             error=f"{type(e).__name__}: {str(e)[:200]}"))
          print(json.dumps(rows[-1]), flush=True)
    return
  rows = []
  for name, xla_flags in variants.items():
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " "
                                      + xla_flags).strip())
    cmd = [sys.executable, "-m", "experiments.bench_moe",
           f"--child={name}"] + [a for a in sys.argv[1:]
                                 if not a.startswith("--child")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
      if line.startswith("{"):
        rows.append(json.loads(line))
    if proc.returncode:
      print(proc.stderr[-2000:])
  peak = _PEAK.value
  print(f"\n| N:D:F:E:k | grouped matmul | tuning | XLA flags | max rel err "
        f"| fwd ms | fwd+bwd ms "
        f"| fwd TFLOP/s | fwd+bwd TFLOP/s | of {peak:.0f} peak |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    if "error" in r:
      print(f"| {r['shape']} | {r['matmul']} | {r.get('tuning', '')} | "
            f"{r['xla']} | {r['error']} | | | | | |")
      continue
    err = r.get("rel_err")
    err = max(err.values()) if err else float("nan")
    print(f"| {r['shape']} | {r['matmul']} | {r['tuning'] or 'default'} | "
          f"{r['xla']} | {err:.1e} | {r['fwd_ms']:.3f} "
          f"| {r['fwdbwd_ms']:.3f} | {r['fwd_tflops']:.0f} | "
          f"{r['fwdbwd_tflops']:.0f} | {r['fwdbwd_tflops'] / peak:.0%} |")


if __name__ == "__main__":
  app.run(main)
