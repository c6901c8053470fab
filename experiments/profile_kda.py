r"""Per-kernel timing of the Pallas KDA (GPU): where the milliseconds go.

Times each pallas_call of kda/chunk.py's op on its own (inputs precomputed,
one jit per kernel), then the whole forward and forward+backward, for the
bounded and unbounded paths and several K-slice widths (block_k) and warp
counts. A table per configuration, so that a slow kernel is named rather
than guessed.

  PYTHONPATH=. python -m experiments.profile_kda --out=/tmp/prof_kda
  PYTHONPATH=. python -m experiments.profile_kda --b=1 --t=32768 \
      --configs=bounded:128,bounded:32,unbounded:32 --warps=0,1,2,8 \
      --stages=0,1,3 --pass_bv=64,32
  PYTHONPATH=. python -m experiments.profile_kda --configs=bounded:32 \
      --set_warps=state:4,grad_k:8
  PYTHONPATH=. python -m experiments.profile_kda \
      --configs=bounded:32,bounded:32:mosaic:mosaic_out  # Triton vs Mosaic

--warps=0 keeps each kernel's own warp count (kda.tuning.Tuning's *_warps);
N forces N warps on every kernel, so one sweep gives each kernel's best
count. --stages likewise (0: Tuning.num_stages).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os

from absl import app, flags
import jax
import jax.numpy as jnp

from experiments.timing import (median_ms, parse_int_overrides,
                                parse_kernel_config)
from pallas_kernels.linear_attention.common.output import output_call
from pallas_kernels.linear_attention.common.tiles import pad_to
from pallas_kernels.linear_attention.kda import backward, chunk, intra
from pallas_kernels.linear_attention.kda import passes as kda_passes
from pallas_kernels.linear_attention.kda import tuning as kp

_OUT = flags.DEFINE_string("out", "/tmp/profile_kda", "Output folder.")
_B = flags.DEFINE_integer("b", 1, "Batch.")
_T = flags.DEFINE_integer("t", 32768, "Sequence length.")
_H = flags.DEFINE_integer("h", 16, "Heads.")
_D = flags.DEFINE_integer("d", 128, "K = V.")
_CONFIGS = flags.DEFINE_list("configs", ["bounded:128", "bounded:64",
                                         "bounded:32", "unbounded:32"],
                             "path:block_k[:mosaic][:mosaic_out] (mosaic: "
                             "the state and dstate passes on Mosaic GPU, "
                             "Tuning.state_pass; mosaic_out: the output "
                             "kernel on Mosaic GPU; else Triton).")
_PASS_BV = flags.DEFINE_list("pass_bv", ["0"],
                              "0: default; N: V block width of the "
                              "sequential state passes (Tuning.pass_bv).")
_WARPS = flags.DEFINE_list("warps", ["0"], "0: kernel defaults; N: force N.")
_SET_WARPS = flags.DEFINE_list(
    "set_warps", [], "kernel:N pairs applied on top of each --warps value "
    "(e.g. state:4,grad_k:8), for one kernel's count without a full sweep.")
_STAGES = flags.DEFINE_list("stages", ["0"], "0: default; N: force N.")
_ITERS = flags.DEFINE_integer("iters", 10, "Timed iterations (median).")
_INTERPRET = flags.DEFINE_bool("interpret", False,
                               "Interpret mode (a CPU smoke test).")


def inputs(b, t, h, d, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 6)
  nrm = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
  q = nrm(jax.random.normal(keys[0], (b, t, h, d)))
  k = nrm(jax.random.normal(keys[1], (b, t, h, d)))
  v = jax.random.normal(keys[2], (b, t, h, d))
  g = -5.0 * jax.nn.sigmoid(2.0 * jax.random.normal(keys[3], (b, t, h, d))
                            - 1.0)
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], (b, t, h)))
  do = jax.random.normal(keys[5], (b, t, h, d))
  bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
  return bf(q), bf(k), bf(v), g, beta, bf(do)


def profile(x, bounded, tune, iters, interpret=False):
  """{kernel name: ms} for one configuration (tune: a kda.tuning.Tuning,
  its state_pass already "triton" or "mosaic")."""
  q, k, v, g, beta, do = x
  bsz, _, h, dk = q.shape
  scale = dk ** -0.5
  tag = " (mosaic)" if tune.state_pass == "mosaic" else ""
  s0 = jnp.zeros((bsz, h, dk, v.shape[-1]), jnp.float32)
  lay = chunk.call_layout(q, v, tune)
  prep = jax.jit(lambda *a: chunk.prepare(*a, lay))
  qp, kp_, vp, gp, betap, s0p = prep(q, k, v, g, beta, s0)
  dop = pad_to(do, lay["tp"], lay["dv"])
  dsfp = jnp.zeros_like(s0p)
  c = {}
  g_min = -5.0 if bounded else None   # the op's clamp, as kda_pallas runs it
  common = dict(lay=lay, tune=tune, interpret=interpret)
  f = jax.jit(functools.partial(intra.intra_call, bounded=bounded,
                                for_backward=True, g_min=g_min, **common))
  c["prepare (XLA pads)"] = median_ms(
      lambda: prep(q, k, v, g, beta, s0), iters)
  # Two kernels: the scores, then the solve.
  c["1 intra (b, Aqk, Lk, M, W, U)"] = median_ms(
      lambda: f(qp, kp_, gp, betap, vp), iters)
  w, u, aqk, qg, kg, ec, bp, m, lk = f(qp, kp_, gp, betap, vp)
  f = jax.jit(functools.partial(kda_passes.run_state_pass, **common))
  c["2 state pass" + tag] = median_ms(lambda: f(w, u, kg, ec, s0p), iters)
  states, v_new, _ = f(w, u, kg, ec, s0p)
  f = jax.jit(functools.partial(output_call, lay=lay, scale=scale,
                                dtype=v.dtype, interpret=interpret,
                                num_warps=tune.output_warps,
                                name="kda_chunk_output",
                                kernel=tune.output_kernel))
  c["3 output" + (" (mosaic)" if tune.output_kernel == "mosaic" else "")] = (
      median_ms(lambda: f(qg, aqk, v_new, states), iters))
  f = jax.jit(functools.partial(backward.dvintra_call, scale=scale, **common))
  c["b1 dv_intra"] = median_ms(lambda: f(aqk, dop), iters)
  dvi = f(aqk, dop)
  f = jax.jit(functools.partial(kda_passes.run_dstate_pass, scale=scale,
                                **common))
  c["b2 dstate pass" + tag] = median_ms(
      lambda: f(qg, kg, ec, w, dop, dvi, dsfp), iters)
  dstates, dv_new, _ = f(qg, kg, ec, w, dop, dvi, dsfp)
  f = jax.jit(functools.partial(backward.grad_v_call, scale=scale,
                                dtype=v.dtype, bounded=bounded, **common))
  c["b3 grad_v (dv, dU', dA, dL)"] = median_ms(
      lambda: f(m, lk, betap, vp, dop, v_new, dv_new), iters)
  _, du, da, dlk, _ = f(m, lk, betap, vp, dop, v_new, dv_new)
  f = jax.jit(functools.partial(backward.grad_k_call, scale=scale,
                                bounded=bounded, g_min=g_min,
                                block_k=kp.grad_k_block(tune, bounded),
                                **common))
  c["b4 grad_k (dq, dk, dg)"] = median_ms(
      lambda: f(qp, kp_, bp, betap, dop, v_new, du, da, dlk, states, dstates,
                gp=gp), iters)

  run = lambda *a: chunk.kda_pallas(  # noqa: E731
      *a, scale=None, initial_state=None, chunk_size=64, g_min=g_min,
      bounded=bounded, interpret=interpret, tune=tune)
  fwd = jax.jit(lambda q, k, v, g, beta: run(q, k, v, g, beta)[0])

  @jax.jit
  def fwd_bwd(q, k, v, g, beta, do):
    _, vjp = jax.vjp(lambda *a: run(*a)[0], q, k, v, g, beta)
    return vjp(do)

  c["total fwd"] = median_ms(lambda: fwd(q, k, v, g, beta), iters)
  c["total fwd+bwd"] = median_ms(lambda: fwd_bwd(q, k, v, g, beta, do),
                                 iters)
  return c


_KERNELS = tuple(f.name[:-len("_warps")] for f in dataclasses.fields(kp.Tuning)
                 if f.name.endswith("_warps"))


def main(argv):
  del argv
  base = kp.DEFAULT_TUNING
  try:   # the flags are checked before any input is built
    overrides = parse_int_overrides("--set_warps", _SET_WARPS.value, ":",
                                    "kernel:N", _KERNELS)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  configs = []
  for cfg in _CONFIGS.value:
    try:
      configs.append(parse_kernel_config(cfg))
    except ValueError as e:
      raise app.UsageError(str(e)) from None
  os.makedirs(_OUT.value, exist_ok=True)
  print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}  "
        f"B={_B.value} T={_T.value} H={_H.value} D={_D.value} bf16")
  x = inputs(_B.value, _T.value, _H.value, _D.value)
  results = []
  sweep = [(int(w), int(st), int(p)) for w in _WARPS.value
           for st in _STAGES.value for p in _PASS_BV.value]
  for warps, stages, pass_bv in sweep:
    warp_fields = {f"{n}_warps": warps or getattr(base, f"{n}_warps")
                   for n in _KERNELS}
    warp_fields.update({f"{n}_warps": w for n, w in overrides.items()})
    for bounded, block_k, mosaic, mosaic_out in configs:
      tune = dataclasses.replace(
          base, block_k=block_k, pass_bv=pass_bv or base.pass_bv,
          num_stages=stages or base.num_stages,
          state_pass="mosaic" if mosaic else "triton",
          output_kernel="mosaic" if mosaic_out else "triton", **warp_fields)
      path = "bounded" if bounded else "unbounded"
      name = (f"{path} block_k={block_k}{' mosaic' if mosaic else ''}"
              f"{' mosaic_out' if mosaic_out else ''} "
              f"warps={warps or 'default'}"
              f"{' ' + ','.join(_SET_WARPS.value) if overrides else ''} "
              f"stages={tune.num_stages} pass_bv={tune.pass_bv}")
      try:
        kp.check_tuning(tune)
        c = profile(x, bounded, tune, _ITERS.value, _INTERPRET.value)
      except Exception as e:  # pylint: disable=broad-except
        print(f"{name} failed: {type(e).__name__}: {str(e)[:500]}")
        continue
      results.append(dict(config=name, ms=c))
      with open(os.path.join(_OUT.value, "rows.jsonl"), "a") as fh:
        fh.write(json.dumps(results[-1]) + "\n")
      print(f"\n{name}\n" + "\n".join(f"  {k:<36} {ms:9.3f} ms"
                                      for k, ms in c.items()), flush=True)


if __name__ == "__main__":
  app.run(main)
