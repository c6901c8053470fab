r"""Per-kernel timing of the Pallas GLA (GPU): where the milliseconds go.

Times each pallas_call of gla/chunk.py's op on its own (inputs precomputed,
one jit per kernel), then the whole forward and forward+backward, for each
configuration; GLA's counterpart of profile_kda. A table per configuration,
so that a slow kernel is named rather than guessed.

  PYTHONPATH=. python -m experiments.profile_gla --out=/tmp/prof_gla
  PYTHONPATH=. python -m experiments.profile_gla \
      --configs=bounded:32,bounded:32:mosaic:mosaic_out
  PYTHONPATH=. python -m experiments.profile_gla --configs=bounded:32 \
      --tune=grad_k_warps=8,pass_bv=32

--tune sets any int field of gla.tuning.Tuning (name=int pairs) on top of
each configuration's block_k and options (mosaic: Tuning.state_pass;
mosaic_out: Tuning.output_kernel).
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
from pallas_kernels.linear_attention.gla import backward, chunk, intra, passes
from pallas_kernels.linear_attention.gla import tuning as gp

_OUT = flags.DEFINE_string("out", "/tmp/profile_gla", "Output folder.")
_B = flags.DEFINE_integer("b", 1, "Batch.")
_T = flags.DEFINE_integer("t", 32768, "Sequence length.")
_H = flags.DEFINE_integer("h", 16, "Heads.")
_D = flags.DEFINE_integer("d", 128, "K = V.")
_CONFIGS = flags.DEFINE_list(
    "configs", ["bounded:32", "unbounded:32"],
    "path:block_k[:mosaic][:mosaic_out] (mosaic: the state and dstate passes "
    "on Mosaic GPU, Tuning.state_pass; mosaic_out: the output kernel on "
    "Mosaic GPU, Tuning.output_kernel; else Triton).")
_TUNE = flags.DEFINE_list("tune", [], "name=int pairs setting fields of "
                          "gla.tuning.Tuning (e.g. grad_k_warps=8).")
_ITERS = flags.DEFINE_integer("iters", 10, "Timed iterations (median).")
_INTERPRET = flags.DEFINE_bool("interpret", False,
                               "Interpret mode (a CPU smoke test).")

_INT_FIELDS = tuple(f.name for f in dataclasses.fields(gp.Tuning)
                    if f.type in (int, "int"))


def parse_flags():
  """[(label, Tuning)] and the Tuning overrides; raises
  app.UsageError naming the flag and the allowed values."""
  try:
    overrides = parse_int_overrides("--tune", _TUNE.value, "=", "name=int",
                                    _INT_FIELDS)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  configs = []
  for cfg in _CONFIGS.value:
    try:
      c = parse_kernel_config(cfg)
      tune = dataclasses.replace(
          gp.DEFAULT_TUNING, block_k=c.block_k,
          state_pass="mosaic" if c.mosaic else "triton",
          output_kernel="mosaic" if c.mosaic_out else "triton", **overrides)
      gp.check_tuning(tune)
    except ValueError as e:
      raise app.UsageError(f"--configs / --tune: {e}") from None
    configs.append((cfg, c.bounded, tune))
  return configs, overrides


def inputs(b, t, h, d, seed=0):
  """bf16 q, k (l2-normalised), v, do; fp32 g = -5 sigmoid(.) in [-5, 0)."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 5)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
  bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
  q = unit(jax.random.normal(keys[0], (b, t, h, d)))
  k = unit(jax.random.normal(keys[1], (b, t, h, d)))
  v = jax.random.normal(keys[2], (b, t, h, d))
  g = -5.0 * jax.nn.sigmoid(2.0 * jax.random.normal(keys[3], (b, t, h, d))
                            - 1.0)
  do = jax.random.normal(keys[4], (b, t, h, d))
  return bf(q), bf(k), bf(v), g, bf(do)


def profile(x, bounded, tune, iters, interpret=False):
  """{kernel name: ms} for one configuration (tune: a gla.tuning.Tuning)."""
  q, k, v, g, do = x
  bsz, _, h, dk = q.shape
  scale = dk ** -0.5
  g_min = -5.0 if bounded else None   # the op's clamp, as gla_pallas runs it
  lay = chunk.call_layout(q, v, tune)
  tp, kp, dv = lay["tp"], lay["kp"], lay["dv"]
  prep = jax.jit(lambda q, k, v, g, do: (
      pad_to(q, tp, kp), pad_to(k, tp, kp), pad_to(v, tp, dv),
      pad_to(g, tp, kp), pad_to(do, tp, dv)))
  qp, kp_, vp, gp_, dop = prep(q, k, v, g, do)
  s0p = jnp.zeros((bsz, h, kp, dv), jnp.float32)
  common = dict(lay=lay, tune=tune, interpret=interpret)
  mosaic = " (mosaic)" if tune.state_pass == "mosaic" else ""
  c = {"prepare (XLA pads)": median_ms(lambda: prep(q, k, v, g, do), iters)}
  f = jax.jit(functools.partial(intra.intra_call, bounded=bounded,
                                g_min=g_min, for_backward=True, **common))
  c["1 intra (b, A, q exp(b), k exp(bC-b))"] = median_ms(
      lambda: f(qp, kp_, gp_), iters)
  aqk, qg, kg, ec, bp = f(qp, kp_, gp_)
  f = jax.jit(functools.partial(passes.run_state_pass, **common))
  c["2 state pass" + mosaic] = median_ms(lambda: f(kg, vp, ec, s0p), iters)
  states, _ = f(kg, vp, ec, s0p)
  f = jax.jit(functools.partial(
      output_call, lay=lay, scale=scale, dtype=v.dtype, interpret=interpret,
      num_warps=tune.output_warps, name="gla_chunk_output",
      kernel=tune.output_kernel))
  c["3 output" + (" (mosaic)" if tune.output_kernel == "mosaic" else "")] = (
      median_ms(lambda: f(qg, aqk, vp, states), iters))
  f = jax.jit(functools.partial(passes.run_dstate_pass, scale=scale,
                                **common))
  c["b1 dstate pass" + mosaic] = median_ms(lambda: f(qg, dop, ec, s0p), iters)
  dstates, _ = f(qg, dop, ec, s0p)
  f = jax.jit(functools.partial(backward.dv_call, scale=scale, dtype=v.dtype,
                                bounded=bounded, **common))
  c["b2 dv (dv, dA)"] = median_ms(lambda: f(aqk, kg, vp, dop, dstates), iters)
  _, da = f(aqk, kg, vp, dop, dstates)
  f = jax.jit(functools.partial(backward.grad_k_call, scale=scale,
                                bounded=bounded, g_min=g_min, **common))
  c["b3 grad_k (dq, dk, dg)"] = median_ms(
      lambda: f(qp, kp_, bp, gp_, dop, vp, da, states, dstates), iters)

  run = lambda *a: chunk.gla_pallas(  # noqa: E731
      *a, scale=None, initial_state=None, chunk_size=64, g_min=g_min,
      bounded=bounded, tune=tune, interpret=interpret)
  fwd = jax.jit(lambda q, k, v, g: run(q, k, v, g)[0])

  @jax.jit
  def fwd_bwd(q, k, v, g, do):
    _, vjp = jax.vjp(lambda *a: run(*a)[0], q, k, v, g)
    return vjp(do)

  c["total fwd"] = median_ms(lambda: fwd(q, k, v, g), iters)
  c["total fwd+bwd"] = median_ms(lambda: fwd_bwd(q, k, v, g, do), iters)
  return c


def main(argv):
  del argv
  configs, overrides = parse_flags()   # before any input is built
  os.makedirs(_OUT.value, exist_ok=True)
  print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}  "
        f"B={_B.value} T={_T.value} H={_H.value} D={_D.value} bf16")
  x = inputs(_B.value, _T.value, _H.value, _D.value)
  for label, bounded, tune in configs:
    name = label + (" " + ",".join(_TUNE.value) if overrides else "")
    try:
      c = profile(x, bounded, tune, _ITERS.value, _INTERPRET.value)
    except Exception as e:  # pylint: disable=broad-except
      print(f"{name} failed: {type(e).__name__}: {str(e)[:500]}")
      continue
    with open(os.path.join(_OUT.value, "rows.jsonl"), "a") as fh:
      fh.write(json.dumps(dict(config=name, tune=dataclasses.asdict(tune),
                               ms=c)) + "\n")
    print(f"\n{name}\n" + "\n".join(f"  {k:<40} {ms:9.3f} ms"
                                    for k, ms in c.items()), flush=True)


if __name__ == "__main__":
  app.run(main)
