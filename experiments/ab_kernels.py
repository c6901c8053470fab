r"""Versions of a kernel module timed side by side, in one process (GPU).

Call-to-call noise on the device machines is +-15% (results/kernels.md), so
a change is judged against the version before it in the SAME process, on
the same inputs. A version is the working tree's module ("main": all of
its defaults), the same with options, each overriding only the setting it
names ("main+split": the split backward, kda_pallas split_grad_k /
gla_pallas Tuning.split_grad_k; "main+mosaic" / "main+triton": the state
and dstate passes on Mosaic GPU / Triton, state_pass / Tuning.state_pass;
"main+mosaic_out": the output kernel on Mosaic GPU, output_kernel /
Tuning.output_kernel; "main+ieee" / "+tf32x3" / "+tf32" / "+bf16x3": KDA's
triangular inverse on FFMA or tensor-core MMAs, inverse_dot; "main+rows" /
"main+slices": KDA's score loops with the K slices inside / outside the
rows, intra_order; "main+one_intra": KDA's scores, inverse, W and U in one
kernel, solve_apart=False; "main+held" / "main+stream" / "main+pull":
the grad_k order, kda_pallas grad_k_order / gla_pallas
Tuning.grad_k_order, no "stream" on GLA; any combination, e.g.
"main+split+mosaic+mosaic_out"), or any file holding an older copy of the
module (run with its defaults), e.g. one taken from git before the device
call (before session 19 any option also set the passes and the output
kernel to Triton unless +mosaic / +mosaic_out were given):

  git show 8206e6d:pallas_kernels/linear_attention/kda_pallas.py \
      > /tmp/kda_8206e6d.py
  PYTHONPATH=. python -m experiments.ab_kernels \
      --versions=kda:/tmp/kda_8206e6d.py,kda:main,kda:main+split,kda:main+mosaic \
      --shapes=1x32768,8x8192 --out=/tmp/ab

Each version is timed like bench_kernels times the public op (bf16 q, k, v,
do; fp32 g in [-5, 0); bounded path, g_min = -5): a jit of the forward
returning o, and a jit of jax.vjp returning o and the input gradients;
median of --iters calls after two warm-up calls. Each version's o and
gradients are also compared with the first version's of the same op and
shape ("vs first": the largest norm-relative difference over o and the
gradients), so that a version that computes something else (a miscompiled
kernel, a broken option) is seen, not just timed. Rows go to OUT/rows.jsonl
as they come (partial results survive a timeout) and to a markdown table.
--interpret runs the kernels in interpret mode on small heads (H=2, D=32;
D=64 when a version uses mosaic, which needs K >= 64): a CPU smoke test,
its milliseconds mean nothing.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import sys
import time

from absl import app, flags
import jax
import jax.numpy as jnp

from experiments.timing import median_ms

_VERSIONS = flags.DEFINE_list(
    "versions", ["kda:main", "kda:main+split", "gla:main", "gla:main+split"],
    "op:version entries: op kda|gla; version main (the module's defaults) "
    "with options, each overriding one setting: +split, one of +mosaic, "
    "+triton (state passes), +mosaic_out, one of +ieee, +tf32x3, +tf32, "
    "+bf16x3 (kda's inverse dots), one of +rows, +slices (kda's intra "
    "order), +one_intra (kda: the intra work in one kernel), "
    "one of +held, +stream (kda), +pull (grad_k order); or a path to a .py "
    "copy of the op's kernel module.")
_SHAPES = flags.DEFINE_list("shapes", ["1x32768", "8x8192"], "BxT shapes.")
_ITERS = flags.DEFINE_integer("iters", 10, "Timed calls (median).")
_OUT = flags.DEFINE_string("out", "/tmp/ab_kernels", "Output folder.")
_INTERPRET = flags.DEFINE_bool("interpret", False,
                               "Interpret mode, H=2 D=32 (CPU smoke test).")

G_MIN = -5.0
OPS = ("kda", "gla")
ORDERS = ("held", "stream", "pull")   # kda_pallas grad_k_order
PASSES = ("mosaic", "triton")        # state_pass
INVERSES = ("ieee", "tf32x3", "tf32", "bf16x3")   # kda_pallas inverse_dot
INTRA = ("rows", "slices")                       # kda_pallas intra_order
OPTIONS = (("split",) + PASSES + ("mosaic_out",) + INVERSES + INTRA
           + ("one_intra",) + ORDERS)
# GLA's grad_k: held, pull; one_intra: kda_pallas solve_apart=False.
KDA_ONLY = INVERSES + INTRA + ("one_intra", "stream")


def parse_versions(entries):
  """[(label, op, module source, options)]; raises app.UsageError on a bad
  entry, naming the flag and the allowed values."""
  out = []
  for entry in entries:
    op, _, version = entry.partition(":")
    name, *options = version.split("+")
    ok = (op in OPS and all(o in OPTIONS for o in options)
          and len(set(options)) == len(options)
          and (name == "main" or (name.endswith(".py") and not options)))
    if not ok:
      raise app.UsageError(
          f"--versions: bad entry {entry!r}; expected op:version with op one "
          f"of {', '.join(OPS)} and version main (with options "
          f"{', '.join('+' + o for o in OPTIONS)}) or a path to a .py file")
    if op == "gla" and set(options) & set(KDA_ONLY):
      raise app.UsageError(f"--versions: bad entry {entry!r}; "
                           f"{', '.join('+' + o for o in KDA_ONLY)} are kda "
                           "options")
    for group, what in ((ORDERS, "grad_k orders"),
                        (PASSES, "state passes"),
                        (INVERSES, "inverse dots"),
                        (INTRA, "intra orders")):
      if len(set(options) & set(group)) > 1:
        raise app.UsageError(f"--versions: bad entry {entry!r}; "
                             f"{', '.join('+' + o for o in group)} are "
                             f"{what}: give one")
    if name != "main" and not os.path.isfile(name):
      raise app.UsageError(f"--versions: no such file {name!r} in {entry!r}")
    out.append((entry, op, name, frozenset(options)))
  return out


def load_module(op, source):
  if source == "main":
    return importlib.import_module(
        f"pallas_kernels.linear_attention.{op}.chunk")
  mod_name = "ab_" + os.path.splitext(os.path.basename(source))[0]
  spec = importlib.util.spec_from_file_location(mod_name, source)
  mod = importlib.util.module_from_spec(spec)
  sys.modules[mod_name] = mod   # dataclasses look their module up here
  spec.loader.exec_module(mod)
  return mod


def make_inputs(bsz, t, h, d, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 6)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
  bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
  return dict(
      q=bf(jax.random.normal(keys[0], (bsz, t, h, d))),
      k=bf(unit(jax.random.normal(keys[1], (bsz, t, h, d)))),
      v=bf(jax.random.normal(keys[2], (bsz, t, h, d))),
      g=G_MIN * jax.nn.sigmoid(
          2.0 * jax.random.normal(keys[3], (bsz, t, h, d)) - 1.0),
      beta=bf(jax.nn.sigmoid(jax.random.normal(keys[4], (bsz, t, h)))),
      do=bf(jax.random.normal(keys[5], (bsz, t, h, d))))


def jitted_fns(op, mod, options, interpret):
  """(fwd, fwd_bwd) jits of the module's op on the bounded path, with
  `options` (a subset of OPTIONS)."""
  names = ("q", "k", "v", "g", "beta") if op == "kda" else ("q", "k", "v", "g")
  impl = mod.kda_pallas if op == "kda" else mod.gla_pallas
  kw = dict(scale=None, initial_state=None, chunk_size=64, g_min=G_MIN)
  if interpret:
    kw["interpret"] = True
  # Each option overrides the one setting it names; the rest stay the
  # module's defaults.
  named = {
      "split_grad_k": True if "split" in options else None,
      "state_pass": next((o for o in PASSES if o in options), None),
      "output_kernel": "mosaic" if "mosaic_out" in options else None,
      "inverse_dot": next((o for o in INVERSES if o in options), None),
      "intra_order": next((o for o in INTRA if o in options), None),
      "solve_apart": False if "one_intra" in options else None,
      "grad_k_order": next((o for o in ORDERS if o in options), None)}
  named = {key: value for key, value in named.items() if value is not None}
  if op == "kda":
    kw.update(named)
  elif named:
    kw["tune"] = dataclasses.replace(mod.DEFAULT_TUNING, **named)
  call = lambda d: impl(*[d[n] for n in names], **kw)[0]  # noqa: E731

  def fwd_bwd(x):
    o, vjp = jax.vjp(call, {n: x[n] for n in names})
    return o, vjp(x["do"])

  return jax.jit(call), jax.jit(fwd_bwd)


def max_rel_diff(result, baseline):
  """The largest ||a - b|| / ||b|| over the leaves of two (o, grads) pytrees
  (0 for the baseline itself; inf for a non-finite leaf)."""
  worst = 0.0
  for a, b in zip(jax.tree.leaves(result), jax.tree.leaves(baseline)):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    num, den = jnp.linalg.norm(a - b), jnp.linalg.norm(b)
    if not bool(jnp.all(jnp.isfinite(a))):
      return float("inf")
    worst = max(worst, float(num / jnp.maximum(den, 1e-30)))
  return worst


def main(argv):
  del argv
  versions = parse_versions(_VERSIONS.value)
  shapes = []
  for s in _SHAPES.value:
    b, _, t = s.partition("x")
    if not (b.isdigit() and t.isdigit()):
      raise app.UsageError(f"--shapes: bad entry {s!r}; expected BxT")
    shapes.append((int(b), int(t)))
  mosaic = any(v[3] & {"mosaic", "mosaic_out"} for v in versions)
  h, d = ((2, 64 if mosaic else 32) if _INTERPRET.value else (16, 128))
  os.makedirs(_OUT.value, exist_ok=True)
  dev = jax.devices()[0]
  print(f"device: {dev.device_kind}, jax {jax.__version__}, H={h} D={d} bf16",
        flush=True)
  md = [f"device: {dev.device_kind}, jax {jax.__version__}, H={h} D={d} "
        "bf16, bounded (g_min = -5)", "",
        "| version | B | T | fwd ms | fwd+bwd ms | vs first | first call s |",
        "|---|---|---|---|---|---|---|"]
  for bsz, t in shapes:
    x = make_inputs(bsz, t, h, d)
    baseline = {}   # op -> (o, grads) of its first version at this shape
    for label, op, source, options in versions:
      try:
        fwd, fwd_bwd = jitted_fns(op, load_module(op, source), options,
                                  _INTERPRET.value)
        t0 = time.perf_counter()
        result = jax.block_until_ready(fwd_bwd(x))
        first = time.perf_counter() - t0
        diff = max_rel_diff(result, baseline.setdefault(op, result))
        del result
        ms = [median_ms(lambda f=f: jax.block_until_ready(f(x)), _ITERS.value)
              for f in (fwd, fwd_bwd)]
      except Exception as e:  # pylint: disable=broad-except
        print(f"{label} B={bsz} T={t} failed: {type(e).__name__}: "
              f"{str(e)[:1500]}", flush=True)
        continue
      finally:
        jax.clear_caches()
      row = dict(version=label, B=bsz, T=t, fwd_ms=ms[0], fwd_bwd_ms=ms[1],
                 vs_first=diff, first_call_s=first, device=dev.device_kind)
      with open(os.path.join(_OUT.value, "rows.jsonl"), "a") as fh:
        fh.write(json.dumps(row) + "\n")
      md.append(f"| {label} | {bsz} | {t} | {ms[0]:.3f} | {ms[1]:.3f} | "
                f"{diff:.1e} | {first:.0f} |")
      print(f"{label:<40} B={bsz} T={t:>6}  fwd {ms[0]:8.3f} ms  fwd+bwd "
            f"{ms[1]:8.3f} ms  vs first {diff:.1e}  (first call {first:.0f} "
            "s)", flush=True)
  with open(os.path.join(_OUT.value, "ab.md"), "w") as fh:
    fh.write("\n".join(md) + "\n")
  print("\n".join(md))


if __name__ == "__main__":
  app.run(main)
