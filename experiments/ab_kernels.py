r"""Versions of a kernel op timed side by side, in one process (GPU).

Call-to-call noise on the device machines is +-15% (results/kernels.md), so
a change is judged against the version before it in the SAME process, on
the same inputs. A version is one of
  * "main": the working tree's op (kda/chunk.py, gla/chunk.py) with its
    Tuning's defaults, or with options, each overriding the one setting it
    names: "main+mosaic" / "main+triton" (the state and dstate passes on
    Mosaic GPU / Triton, Tuning.state_pass), "main+mosaic_out" (the output
    kernel on Mosaic GPU, Tuning.output_kernel), e.g. "main+mosaic_out";
  * "git:REV": the kernel package of git revision REV (git archive of
    pallas_kernels/, loaded in isolation beside the working tree's, run
    with its own defaults), e.g. a commit before a change, or one from
    before the per-op folders (pallas_kernels/linear_attention/kda_pallas.py);
    imports an old module makes inside a function resolve against the
    working tree;
  * "tree:FOLDER": the same for a folder holding a pallas_kernels/ package
    (e.g. `git archive REV pallas_kernels | tar -x -C FOLDER` where the
    run has no git history, as on the device machines);
  * a path to a .py copy of an op module (kda/chunk.py, gla/chunk.py) that
    imports the working tree's kernels, run with its defaults.

  PYTHONPATH=. python -m experiments.ab_kernels \
      --versions=kda:git:46adc08,kda:main,kda:main+triton \
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
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time

from absl import app, flags
import jax
import jax.numpy as jnp

from experiments.timing import median_ms

_VERSIONS = flags.DEFINE_list(
    "versions", ["kda:main", "kda:main+triton", "gla:main",
                 "gla:main+triton"],
    "op:version entries: op kda|gla; version main (the working tree's "
    "defaults) with options, each overriding one setting: one of +mosaic, "
    "+triton (state passes), +mosaic_out; or git:REV (the kernel package of "
    "a git revision), or tree:FOLDER (a folder holding one); or a path to a "
    ".py copy of the op's module.")
_SHAPES = flags.DEFINE_list("shapes", ["1x32768", "8x8192"], "BxT shapes.")
_ITERS = flags.DEFINE_integer("iters", 10, "Timed calls (median).")
_OUT = flags.DEFINE_string("out", "/tmp/ab_kernels", "Output folder.")
_INTERPRET = flags.DEFINE_bool("interpret", False,
                               "Interpret mode, H=2 D=32 (CPU smoke test).")

G_MIN = -5.0
OPS = ("kda", "gla")
PASSES = ("mosaic", "triton")        # Tuning.state_pass
OPTIONS = PASSES + ("mosaic_out",)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PACKAGE = "pallas_kernels"


def parse_versions(entries):
  """[(label, op, source, options)]; raises app.UsageError on a bad entry,
  naming the flag and the allowed values."""
  out = []
  for entry in entries:
    op, _, version = entry.partition(":")
    name, *options = version.split("+")
    ok = (op in OPS and all(o in OPTIONS for o in options)
          and len(set(options)) == len(options)
          and (name == "main" or (not options and (
              name.endswith(".py") or
              (name.startswith("git:") and len(name) > 4) or
              (name.startswith("tree:") and len(name) > 5)))))
    if not ok:
      raise app.UsageError(
          f"--versions: bad entry {entry!r}; expected op:version with op one "
          f"of {', '.join(OPS)} and version main (with options "
          f"{', '.join('+' + o for o in OPTIONS)}), git:REV, tree:FOLDER or a "
          "path to a .py file")
    if len(set(options) & set(PASSES)) > 1:
      raise app.UsageError(f"--versions: bad entry {entry!r}; "
                           f"{', '.join('+' + o for o in PASSES)} are state "
                           "passes: give one")
    if name.endswith(".py") and not os.path.isfile(name):
      raise app.UsageError(f"--versions: no such file {name!r} in {entry!r}")
    if name.startswith("tree:") and not os.path.isdir(
        os.path.join(name[5:], _PACKAGE)):
      raise app.UsageError(f"--versions: no {_PACKAGE}/ in {name[5:]!r} "
                           f"({entry!r})")
    out.append((entry, op, name, frozenset(options)))
  return out


def _git_tree(rev):
  """A temporary folder holding revision rev's pallas_kernels/."""
  try:
    tar = subprocess.run(["git", "archive", rev, _PACKAGE], cwd=_ROOT,
                         capture_output=True, check=True).stdout
  except subprocess.CalledProcessError as e:
    raise ValueError(f"git:{rev}: {e.stderr.decode()[:500]}") from None
  folder = tempfile.mkdtemp(prefix=f"ab_kernels_{rev}_")
  with tarfile.open(fileobj=io.BytesIO(tar)) as f:
    f.extractall(folder, filter="data")
  return folder


def _package_at(folder):
  """The op modules of the pallas_kernels/ package in `folder`, imported
  with the working tree's package set aside, then the working tree's put
  back (the old modules keep their own globals). Returns {op: module
  holding {op}_pallas}."""
  ours = {n: m for n, m in sys.modules.items()
          if n == _PACKAGE or n.startswith(_PACKAGE + ".")}
  for n in ours:
    del sys.modules[n]
  sys.path.insert(0, folder)
  try:
    importlib.import_module(f"{_PACKAGE}.linear_attention")
    found = {}
    for op in OPS:
      for name in (f"{op}.chunk", f"{op}_pallas"):   # folders, then files
        try:
          found[op] = importlib.import_module(
              f"{_PACKAGE}.linear_attention.{name}")
          break
        except ImportError:
          continue
    return found
  finally:
    sys.path.remove(folder)
    for n in [n for n in sys.modules
              if n == _PACKAGE or n.startswith(_PACKAGE + ".")]:
      del sys.modules[n]
    sys.modules.update(ours)


_PACKAGES = {}


def load_module(op, source):
  """The module whose {op}_pallas a version runs."""
  if source == "main":
    return importlib.import_module(f"{_PACKAGE}.linear_attention.{op}.chunk")
  if source.startswith(("git:", "tree:")):
    if source not in _PACKAGES:
      kind, _, where = source.partition(":")
      _PACKAGES[source] = _package_at(
          _git_tree(where) if kind == "git" else where)
    if op not in _PACKAGES[source]:
      raise ValueError(f"{source} has no {op} Pallas op")
    return _PACKAGES[source][op]
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
  # op's defaults.
  named = {
      "state_pass": next((o for o in PASSES if o in options), None),
      "output_kernel": "mosaic" if "mosaic_out" in options else None}
  named = {key: value for key, value in named.items() if value is not None}
  if named:
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
