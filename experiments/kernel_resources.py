r"""Resource report of the Pallas (Triton) kernels, on any machine, no GPU.

Lowers the GLA / KDA forward + backward for CUDA (jax's cross-platform
lowering: no GPU needed), captures each pallas_call's Triton IR (TTIR) and
its launch parameters (num_warps, num_stages), then, when the `triton`
package is importable, compiles the TTIR for sm_90 and reports per kernel:

  REG    registers per thread (255 = the cap: the kernel spills)
  STACK  stack-frame bytes per thread (local memory: spilled registers)
  SMEM   shared memory bytes
  COMPILE_S  seconds `triton.compile` took on this machine (TTIR to cubin,
         ptxas included): a guide to the kernel's share of jit time
  and instruction counts in the SASS: HMMA / HGMMA (tensor-core matrix
  ops: mma.sync / wgmma), FFMA, LDL / STL (local-memory loads / stores:
  spills), BAR.SYNC (block barriers: layout conversions), MUFU.EX2 (exps).

The kernels do not depend on T, so a small T gives the same code as the
benchmark shapes; K and V do matter (--d). The `triton` package here need not
be the Triton inside jaxlib / XLA (the TTIR is passed as text); the report
is the compiler's view of the same IR, a guide to register pressure, not a
timing. `pip install triton` (CPU machines included: it bundles ptxas and
cuobjdump); without it, --ttir_only writes the IR alone.

  python -m experiments.kernel_resources --ops=kda --paths=bounded
  python -m experiments.kernel_resources --ops=kda,gla --d=128 \
      --out=/tmp/kernel_resources --warps=4   # force 4 warps everywhere

Writes OUT/<op>_<path>/NN_<kernel>.ttir (and .ptx, .sass, .cubin) and
OUT/resources.md. Results worth keeping go to results/kernels.md.
"""
from __future__ import annotations

import collections
import glob
import os
import re
import subprocess
import tempfile
import time

from absl import app, flags
import jax
import jax.numpy as jnp

_OUT = flags.DEFINE_string("out", "/tmp/kernel_resources", "Output folder.")
_OPS = flags.DEFINE_list("ops", ["kda", "gla"], "Ops: kda, gla.")
_PATHS = flags.DEFINE_list("paths", ["bounded", "unbounded"],
                           "Intra-chunk paths: bounded, unbounded.")
_D = flags.DEFINE_integer("d", 128, "K = V.")
_T = flags.DEFINE_integer("t", 256, "Sequence length (the code is T-free).")
_ARCH = flags.DEFINE_integer("arch", 90, "Compute capability to compile for.")
_WARPS = flags.DEFINE_integer("warps", 0,
                              "0: the kernels' own num_warps; N: force N.")
_TTIR_ONLY = flags.DEFINE_bool("ttir_only", False,
                               "Only write the TTIR (no triton needed).")

SASS_COUNTS = ("HMMA", "HGMMA", "FFMA", "LDL", "STL", "BAR.SYNC", "MUFU.EX2")


def launch_params(fn, args):
  """{kernel name: (num_warps, num_stages)} of every pallas_call in fn."""
  found = {}

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        cp = eqn.params.get("compiler_params")
        name = str(eqn.params.get("name_and_src_info",
                                  eqn.params.get("name"))).split()[0]
        found[name] = (getattr(cp, "num_warps", None) or 4,
                       getattr(cp, "num_stages", None) or 3)
      for value in eqn.params.values():
        for sub in value if isinstance(value, (list, tuple)) else [value]:
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            walk(inner)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


def capture_ttir(fn, args, out_dir, arch=90):
  """Lowers jax.jit(fn)(*args) for CUDA; writes each Pallas kernel's TTIR.

  Returns [(file, kernel name, num_warps, num_stages)] in lowering order.
  """
  # pylint: disable=g-import-not-at-top,protected-access
  from jax._src.pallas.triton import lowering
  os.makedirs(out_dir, exist_ok=True)
  params = launch_params(fn, args)
  found, orig_lower = [], lowering.lower_jaxpr_to_triton_module

  def lower(jaxpr, grid_mapping, *a, **kw):
    res = orig_lower(jaxpr, grid_mapping, *a, **kw)
    name = jaxpr.debug_info.func_name if jaxpr.debug_info else "kernel"
    path = os.path.join(out_dir, f"{len(found) + 1:02d}_{name}.ttir")
    with open(path, "w") as f:
      f.write(res.module.operation.get_asm())
    found.append((path, name) + params.get(name, (4, 3)))
    return res

  lowering.lower_jaxpr_to_triton_module = lower
  restore_gpu_info = _assume_gpu_without_one(arch)
  try:
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  finally:
    lowering.lower_jaxpr_to_triton_module = orig_lower
    restore_gpu_info()
  return found


def _assume_gpu_without_one(arch):
  """jax >= 0.11 asks the attached GPU for its compute capability while
  lowering a Triton kernel (and fails without one); the lowering needs no
  device, so with none attached it is told `arch`. Returns the undo."""
  try:
    from jax._src.pallas.triton import gpu_info  # pylint: disable=g-import-not-at-top
  except ImportError:   # jax 0.10: the lowering asks nothing
    return lambda: None
  original = gpu_info.get_gpu_info

  def get_gpu_info():
    try:
      return original()
    except ValueError:   # no GPU attached
      return gpu_info.GpuInfo(gpu_version=None,
                              arch_name=f"{arch // 10}.{arch % 10}",
                              compute_capability=arch)

  gpu_info.get_gpu_info = get_gpu_info
  return lambda: setattr(gpu_info, "get_gpu_info", original)


def compile_report(ttir, num_warps, num_stages, arch):
  """Compiles one TTIR file with the `triton` package; resource numbers."""
  import triton  # pylint: disable=g-import-not-at-top
  from triton.backends.compiler import GPUTarget  # pylint: disable=g-import-not-at-top
  # A fresh, throw-away cache directory: a cached cubin would hide the
  # compile time. The caller's TRITON_CACHE_DIR is restored afterwards.
  previous = os.environ.get("TRITON_CACHE_DIR")
  with tempfile.TemporaryDirectory(prefix="triton_cache_") as cache:
    os.environ["TRITON_CACHE_DIR"] = cache
    try:
      start = time.perf_counter()
      kernel = triton.compile(ttir, target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=num_warps,
                                           num_stages=num_stages))
      compile_s = time.perf_counter() - start
    finally:
      if previous is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
      else:
        os.environ["TRITON_CACHE_DIR"] = previous
  stem = ttir[:-len(".ttir")]
  with open(stem + ".ptx", "w") as f:
    f.write(kernel.asm["ptx"])
  with open(stem + ".cubin", "wb") as f:
    f.write(kernel.asm["cubin"])
  tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia",
                       "bin")
  cuobjdump = os.path.join(tools, "cuobjdump")
  usage = subprocess.run([cuobjdump, "-res-usage", stem + ".cubin"],
                         capture_output=True, text=True, check=True).stdout
  sass = subprocess.run([cuobjdump, "-sass", stem + ".cubin"],
                        capture_output=True, text=True, check=True).stdout
  with open(stem + ".sass", "w") as f:
    f.write(sass)
  row = {k: int(v) for k, v in re.findall(r"(REG|STACK):(\d+)", usage)}
  row["SMEM"] = int(kernel.metadata.shared)
  row["COMPILE_S"] = round(compile_s, 1)
  with open(ttir) as f:
    row["TTIR_LINES"] = sum(1 for _ in f)
  ops = collections.Counter(re.findall(r"\b([A-Z][A-Z0-9]*(?:\.SYNC|\.EX2)?)\b",
                                       sass))
  row.update({k: ops.get(k, 0) for k in SASS_COUNTS})
  return row


def op_inputs(op, t, d):
  bf, f32 = jnp.bfloat16, jnp.float32
  spec = lambda *s, dt=bf: jax.ShapeDtypeStruct(s, dt)  # noqa: E731
  x = [spec(1, t, 2, d), spec(1, t, 2, d), spec(1, t, 2, d),
       spec(1, t, 2, d, dt=f32)]
  return x + [spec(1, t, 2, dt=f32)] if op == "kda" else x


def op_fn(op, bounded):
  """The op's forward + backward (value_and_grad of a scalar) on its Pallas
  path: every kernel of the op is lowered."""
  # pylint: disable=g-import-not-at-top
  from pallas_kernels.linear_attention.gla.chunk import gla_pallas
  from pallas_kernels.linear_attention.kda.chunk import kda_pallas
  g_min = -5.0 if bounded else None
  kw = dict(scale=None, initial_state=None, chunk_size=64, g_min=g_min,
            bounded=bounded)
  fn = kda_pallas if op == "kda" else gla_pallas

  def loss(*x):
    o, s = fn(*x, **kw)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)
  n = 5 if op == "kda" else 4
  return jax.value_and_grad(loss, argnums=tuple(range(n)))


def main(argv):
  del argv
  for flag, values, allowed in (("ops", _OPS.value, ("kda", "gla")),
                                ("paths", _PATHS.value,
                                 ("bounded", "unbounded"))):
    bad = sorted(set(values) - set(allowed))
    if bad:
      raise app.UsageError(f"--{flag}: unknown value(s) {bad}; allowed "
                           f"values: {', '.join(allowed)}")
  os.makedirs(_OUT.value, exist_ok=True)
  lines = [f"arch sm_{_ARCH.value}, K = V = {_D.value}, bf16, jax "
           f"{jax.__version__}", "",
           "| op | path | kernel | warps | stages | REG | STACK | SMEM | "
           + " | ".join(SASS_COUNTS) + " | TTIR lines | compile s |",
           "|---" * (10 + len(SASS_COUNTS)) + "|"]
  for op in _OPS.value:
    for path in _PATHS.value:
      out_dir = os.path.join(_OUT.value, f"{op}_{path}")
      for f in glob.glob(os.path.join(out_dir, "*")):
        os.remove(f)
      kernels = capture_ttir(op_fn(op, path == "bounded"),
                             op_inputs(op, _T.value, _D.value), out_dir,
                             arch=_ARCH.value)
      seen = set()
      for ttir, name, warps, stages in kernels:
        if name in seen:  # a kernel re-run in the backward: same code
          continue
        seen.add(name)
        warps = _WARPS.value or warps
        if _TTIR_ONLY.value:
          print(f"{op} {path} {name}: {ttir} (warps {warps}, stages {stages})")
          continue
        try:
          r = compile_report(ttir, warps, stages, _ARCH.value)
        except Exception as e:  # pylint: disable=broad-except
          print(f"{op} {path} {name}: compile failed: {type(e).__name__}: "
                f"{str(e)[:500]}")
          continue
        lines.append(f"| {op} | {path} | {name} | {warps} | {stages} | "
                     f"{r.get('REG')} | {r.get('STACK')} | {r['SMEM']} | "
                     + " | ".join(str(r[k]) for k in SASS_COUNTS)
                     + f" | {r['TTIR_LINES']} | {r['COMPILE_S']} |")
        print(lines[-1], flush=True)
  text = "\n".join(lines)
  with open(os.path.join(_OUT.value, "resources.md"), "w") as f:
    f.write(text + "\n")


if __name__ == "__main__":
  app.run(main)
