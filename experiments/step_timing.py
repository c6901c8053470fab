"""The training-step benchmark's measuring code, free of absl flags.

experiments/bench_train_step.py is the command (flags, one process per row,
the printed table); this module holds what it runs, so tests and notebooks
can import it beside other experiment modules without their flags clashing.
"""
from __future__ import annotations

import collections
import json
import os
import re
import statistics
import time

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) by device-name part.
PEAKS = {"H100": 989.0, "H200": 989.0, "B200": 2250.0, "A100": 312.0}


def peak_tflops(device_kind: str, override: float = 0.0) -> float | None:
  """override if set, else the card's peak from PEAKS, else None (a CPU)."""
  if override:
    return override
  for name, peak in PEAKS.items():
    if name in device_kind:
      return peak
  return None


def row_name(r: dict) -> str:
  mb = r.get("microbatches", 1)
  return (f"T{r['seq_len']}_{r['backend']}_{r['attention']}_"
          f"{r['grouped_matmul']}_{r['remat']}"
          + (f"_mb{mb}" if mb > 1 else ""))


def configure(config, r: dict):
  """A validated copy of config with the row's settings."""
  from moe_jax.config_validation import validate_config
  c = config.copy_and_resolve_references()
  c.data.seq_len, c.data.batch_size = r["seq_len"], r["batch"]
  c.model.kda.backend = r["backend"]
  c.model.mla.attention_impl = r["attention"]
  c.model.moe.grouped_matmul = r["grouped_matmul"]
  c.model.remat = r["remat"]
  c.train.microbatches = r.get("microbatches", 1)
  validate_config(c)
  return c


def compiled_stats(compiled) -> dict:
  """XLA's own estimates for a compiled step: its temporary buffers and
  arguments (GiB) and the bytes its ops access (GiB; fusions count their
  operands and outputs once). Keys whose analysis this backend lacks are
  None."""
  out = dict(xla_temp_gib=None, xla_arg_gib=None, xla_accessed_gib=None)
  try:
    mem = compiled.memory_analysis()
    out["xla_temp_gib"] = mem.temp_size_in_bytes / 2**30
    out["xla_arg_gib"] = mem.argument_size_in_bytes / 2**30
  except Exception:  # noqa: BLE001 - optional on some backends
    pass
  try:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    if cost and "bytes accessed" in cost:
      out["xla_accessed_gib"] = cost["bytes accessed"] / 2**30
  except Exception:  # noqa: BLE001
    pass
  return out


def _build_row(config, r: dict):
  """(config with the row's settings, build_train_step's TrainSetup, the
  training batches, put: a batch -> on the devices in the step's layout)."""
  from moe_jax import sharding
  from moe_jax.data import make_datasets
  from moe_jax.train.loop import build_train_step
  c = configure(config, r)
  train_iter, _, _, _ = make_datasets(dict(c.data.to_dict(), seed=c.seed))
  setup = build_train_step(c)
  def put(b):
    return sharding.shard_batch(b, setup.batch_sharding, c.data.batch_size)
  return c, setup, train_iter, put


def lowered_step(config, r: dict, platform: str) -> tuple[str, float]:
  """One row's train step lowered for `platform` (e.g. "cuda", on any
  machine: the Pallas kernels lower for the card on a CPU): the module's
  text and the seconds the trace and lowering took (the row's setup not
  counted)."""
  import jax
  from moe_jax import sharding
  from moe_jax.train.step import init_train_state
  c, setup, train_iter, put = _build_row(config, r)
  state = jax.eval_shape(lambda: init_train_state(
      setup.model, setup.tx, setup.rng, c.data.seq_len))
  batch = put(next(train_iter))
  t0 = time.perf_counter()
  with sharding.use_mesh(setup.mesh):
    text = setup.train_step.jitted.trace(state, batch).lower(
        lowering_platforms=(platform,)).as_text()
  return text, time.perf_counter() - t0


def lower_row(config, r: dict, platform: str, config_name: str = "") -> dict:
  """Lowers one row's step for `platform` without compiling or running it:
  the seconds it takes and the module's text size in MB, what grows with
  the kernels a step carries and XLA then compiles."""
  text, lower_s = lowered_step(config, r, platform)
  return dict(r, config=config_name, platform=platform, lower_s=lower_s,
              module_mb=len(text) / 1e6)


def lower_table(rows: list[dict]) -> str:
  """Markdown table of `lower_row` rows."""
  out = [_lead(r) + (f"| {describe_error(r)} | |" if "error" in r else
                     f"| {r['platform']} | {r['lower_s']:.1f} | "
                     f"{r['module_mb']:.1f} |") for r in rows]
  return (_head(("lowered for", "lower s", "module text MB"))
          + "\n".join(out) + "\n")


def run_row(config, r: dict, steps: int, warmup: int, profile_dir: str | None,
            config_name: str = "", peak_override: float = 0.0,
            progress: str | None = None, compile_only: bool = False) -> dict:
  """Compiles and times one row in this process; returns its JSON row.

  compile_only: stop after the compile and report only XLA's estimates
  (`compiled_stats`): what a step would hold and move, on any backend (a
  CPU answers whether a change saves memory before a GPU is spent on it).

  progress: a file that gets one JSON line per finished phase ({"phase":
  "init" | "setup" | "compile", "s": seconds}; setup includes init, the
  jitted initialisation's compile and run) and per step ({"step": i,
  "ms": ..., "loss": ...}) as they happen, and the whole row ({"row":
  ...}) once the timed steps are done, before any profile, so a row
  stopped by a time limit still says where its time went (`partial_row`).
  """
  def note(**kv):
    if progress:
      with open(progress, "a") as f:
        f.write(json.dumps(kv) + "\n")
  t_start = time.perf_counter()
  import jax
  import numpy as np
  from moe_jax.planning import plan
  from moe_jax.train.step import init_train_state

  # The step the training loop runs, in the loop's layout.
  c, setup, train_iter, put = _build_row(config, r)
  batches = [next(train_iter) for _ in range(1 if compile_only
                                             else warmup + steps)]
  step_fn = setup.train_step
  t_init = time.perf_counter()
  state = init_train_state(setup.model, setup.tx, setup.rng, c.data.seq_len,
                           shardings=setup.state_shardings)

  jax.block_until_ready(state)
  init_s = time.perf_counter() - t_init   # the jitted init: compile + run
  setup_s = time.perf_counter() - t_start
  note(phase="init", s=init_s)
  note(phase="setup", s=setup_s)
  t0 = time.perf_counter()
  compiled = step_fn.lower(state, put(batches[0])).compile()
  compile_s = time.perf_counter() - t0
  note(phase="compile", s=compile_s)
  stats = compiled_stats(compiled)
  dev = jax.devices()[0]
  if compile_only:
    return dict(r, config=config_name, device=dev.device_kind,
                jax=jax.__version__, setup_s=setup_s, init_s=init_s,
                compile_s=compile_s, **stats)
  losses, times = [], []
  for i, b in enumerate(batches):
    b = put(b)
    jax.block_until_ready(b)
    t0 = time.perf_counter()
    state, metrics = compiled(state, b)
    loss = float(metrics["loss"])   # waits for the step
    times.append(time.perf_counter() - t0)
    losses.append(loss)
    note(step=i, ms=1e3 * times[-1], loss=loss)
  step_s = statistics.median(times[warmup:])
  tokens = c.data.batch_size * c.data.seq_len
  flops = plan(c, {}, seq_len=c.data.seq_len,
               global_batch=c.data.batch_size)["flops_per_token"]
  peak = peak_tflops(dev.device_kind, peak_override)
  mem = dev.memory_stats() or {}
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
  row = dict(
      r, config=config_name, device=dev.device_kind,
      jax=jax.__version__, step_ms=1e3 * step_s,
      tokens_per_sec=tokens / step_s,
      model_tflop_per_token=flops["train_model"] / 1e12,
      tflops=flops["train_model"] * tokens / step_s / 1e12,
      peak_tflops=peak,
      mfu=(flops["train_model"] * tokens / step_s / (peak * 1e12)
           if peak else None),
      peak_gib=(mem["peak_bytes_in_use"] / 2**30
                if "peak_bytes_in_use" in mem else None),
      setup_s=setup_s, init_s=init_s, compile_s=compile_s, params=n_params,
      losses=losses,
      step_ms_all=[1e3 * t for t in times], **stats)
  # The timed row is complete: a profile stopped by the row's time limit
  # does not lose it (`partial_row`).
  note(row=row)
  if profile_dir:
    os.makedirs(profile_dir, exist_ok=True)
    # The compiled module's text: its op_name metadata attributes each
    # profiled op to a module of the model (`ops_by_module`).
    with open(os.path.join(profile_dir, HLO_FILE), "w") as f:
      f.write(compiled.as_text())
    b = put(batches[-1])
    with jax.profiler.trace(profile_dir):
      state, metrics = compiled(state, b)
      jax.block_until_ready(metrics)
  return row


def _device_events(trace_dir: str):
  """(name, ms, stats dict) of every device op event in a trace.

  Reads the XSpace the profiler wrote; on a GPU the device plane's "XLA
  Ops" line holds one event per HLO op (fusions, custom calls such as the
  Pallas kernels, cuBLAS GEMMs); without that line, the kernels of every
  stream line. A trace of a CPU run has no device plane: its XLA thunks.
  """
  import glob
  from jax.profiler import ProfileData
  files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"),
                    recursive=True)
  if not files:
    return
  data = ProfileData.from_file(files[0])
  planes = [p for p in data.planes if p.name.startswith("/device:")]
  if planes:
    has_ops = any(ln.name == "XLA Ops" for p in planes for ln in p.lines)
    lines = [ln for p in planes for ln in p.lines
             if ((ln.name == "XLA Ops") if has_ops else ln.name not in (
                 "XLA Modules", "Steps", "XLA TraceMe"))]
  else:
    lines = [ln for p in data.planes if p.name == "/host:CPU"
             for ln in p.lines if ln.name.startswith("tf_XLA")]
  for line in lines:
    for ev in line.events:
      stats = dict(ev.stats)
      if not planes and "hlo_op" not in stats:
        continue   # host work on the CPU client's thread, not an op
      yield ev.name, ev.duration_ns / 1e6, stats


def _busiest(events, top: int) -> list[tuple[str, float, int]]:
  """(name, total ms, count) of the `top` names of (name, ms) events with
  the most total time."""
  total: dict[str, float] = collections.defaultdict(float)
  count: dict[str, int] = collections.Counter()
  for name, ms in events:
    total[name] += ms
    count[name] += 1
  ranked = sorted(total.items(), key=lambda kv: -kv[1])[:top]
  return [(name, ms, count[name]) for name, ms in ranked]


def top_ops(trace_dir: str, top: int) -> list[tuple[str, float, int]]:
  """(op name, total ms, count) of the busiest device ops in a trace."""
  return _busiest(((name, ms) for name, ms, _ in _device_events(trace_dir)),
                  top)


# The compiled step's text, written beside the trace of a profiled row.
HLO_FILE = "step.hlo.txt"
PHASES = ("forward", "recompute", "backward")
_INSTRUCTION = re.compile(
    r'^\s*(?:ROOT )?%?([\w.\-]+) = [^\n]*?op_name="([^"]*)"', re.M)
_LAYER = re.compile(r"^layer_\d+_(\w+)$")
# A named submodule of a mixer or MoE layer (the rest are primitives).
_SUBMODULE = re.compile(r"^(\w+_proj|\w+_down|\w+_up|kv_norm|router|shared)$")


def _norm_name(name: str) -> str:
  return name.replace(".", "_").replace("-", "_")


def hlo_op_names(hlo_text: str) -> dict[str, str]:
  """{instruction name ('.' and '-' as '_'): its op_name metadata} of a
  compiled module's text (fusions, custom calls and plain ops alike)."""
  return {_norm_name(m.group(1)): m.group(2)
          for m in _INSTRUCTION.finditer(hlo_text)}


def module_group(op_name: str) -> tuple[str, str]:
  """(group, phase) of an op from its op_name metadata.

  group: the model part it computes: "kda projections", "kda kernels and
  elementwise", "mla projections", "mla attention and elementwise",
  "moe router", "moe shared expert", "moe routed experts (dispatch, grouped
  matmuls, combine)", "attn_res depth mixing", "norms", "embedding and
  head", "model (other)", or "optimizer, loss and metrics" outside the
  model. phase: "recompute" (a rematerialised forward), "backward" or
  "forward".
  """
  parts = op_name.split("/")
  phase = ("recompute" if "rematted_computation" in parts
           else "backward" if any(p.startswith("transpose(") for p in parts)
           else "forward")
  if not any("HybridLM" in p for p in parts):
    return "optimizer, loss and metrics", phase
  for i, p in enumerate(parts):
    m = _LAYER.match(p)
    kind = m.group(1) if m else p if p.startswith("final_") or p in (
        "head", "embed") else None
    if kind is None:
      continue
    sub = next((q for q in parts[i + 1:] if _SUBMODULE.match(q)), "")
    if "attn_res" in kind:
      return "attn_res depth mixing", phase
    if kind.endswith("norm"):
      return "norms", phase
    if kind in ("kda", "mla"):
      proj = sub.endswith(("_proj", "_down", "_up"))
      return (f"{kind} projections" if proj else
              f"{kind} {'kernels' if kind == 'kda' else 'attention'} and "
              "elementwise"), phase
    if kind == "moe":
      return {"router": "moe router", "shared": "moe shared expert"}.get(
          sub, "moe routed experts (dispatch, grouped matmuls, combine)"
      ), phase
    if kind in ("head", "embed"):
      return "embedding and head", phase
    return "model (other)", phase
  if any("one_hot" in p for p in parts):
    return "embedding and head", phase
  return "model (other)", phase


# Our kernels' names (pallas_call name=..., plus Mosaic's suffix) and cuDNN's
# attention: where a GPU trace gives a kernel neither an HLO name nor an
# op_name annotation, its name still says which part it computes. Its phase
# is known only for backward-only kernels.
_KERNEL_GROUPS = (
    (re.compile(r"^(kda|gla)_|^chunk_output"), "kda kernels and elementwise"),
    (re.compile(r"^t?gmm"),
     "moe routed experts (dispatch, grouped matmuls, combine)"),
    (re.compile(r"sdpa|^mha|flash_attention"),
     "mla attention and elementwise"),
)
_BACKWARD_KERNEL = re.compile(r"grad|dstate|_dv|bprop|bwd|backward")


def kernel_group(name: str) -> tuple[str, str] | None:
  """(group, phase) of a kernel from its name alone, or None: phase
  "backward" for backward-only kernels, else "?" (forward or recompute)."""
  for pattern, group in _KERNEL_GROUPS:
    if pattern.search(name):
      return group, ("backward" if _BACKWARD_KERNEL.search(name) else "?")
  return None


def _attributed_events(trace_dir: str):
  """(name, ms, stats, op_name or None) of every device event of a profiled
  row: the event's HLO instruction (its hlo_op stat, else its name) looked
  up in the compiled text the row saved beside the trace (HLO_FILE), else
  the event's own tf_op stat where a GPU kernel carries one. Nothing
  without the text."""
  path = os.path.join(trace_dir, HLO_FILE)
  if not os.path.exists(path):
    return
  with open(path) as f:
    names = hlo_op_names(f.read())
  for name, ms, stats in _device_events(trace_dir):
    op = names.get(_norm_name(str(stats.get("hlo_op", name))),
                   names.get(_norm_name(name)))
    if op is None and "jit(" in str(stats.get("tf_op", "")):
      op = str(stats["tf_op"])   # a GPU kernel annotated with its op_name
    yield name, ms, stats, op


def ops_by_module(trace_dir: str) -> list[tuple[str, dict[str, float]]]:
  """[(group, {phase: ms})] of a profiled row, busiest group first.

  Each device event is matched to its HLO instruction (`_attributed_events`)
  and grouped by `module_group` of the instruction's op_name; an unmatched
  kernel by its name (`kernel_group`), else "unattributed". Phases are
  PHASES and "?" (unknown). [] without the compiled text.
  """
  groups: dict[str, dict[str, float]] = collections.defaultdict(
      lambda: dict.fromkeys(PHASES + ("?",), 0.0))
  for name, ms, _, op in _attributed_events(trace_dir):
    group, phase = (module_group(op) if op is not None else
                    kernel_group(name) or ("unattributed", "?"))
    groups[group][phase] += ms
  return sorted(groups.items(), key=lambda kv: -sum(kv[1].values()))


def unattributed_ops(trace_dir: str, top: int = 8
                     ) -> list[tuple[str, float, int, str]]:
  """(name, total ms, count, its stats) of the busiest events that
  `ops_by_module` could not attribute: what a new trace format or kernel
  naming needs matched. Stats are 'key=value' pairs, values cut short."""
  missed = [(name, ms, stats)
            for name, ms, stats, op in _attributed_events(trace_dir)
            if op is None and kernel_group(name) is None]
  seen: dict[str, str] = {}
  for name, _, stats in missed:
    seen.setdefault(name, ", ".join(
        f"{k}={str(v)[:60]}" for k, v in sorted(stats.items())))
  return [(n, ms, k, seen[n])
          for n, ms, k in _busiest(((n, ms) for n, ms, _ in missed), top)]


def module_table(groups: list[tuple[str, dict[str, float]]]) -> str:
  """Markdown table of `ops_by_module`: ms per phase (and of unknown phase),
  total and share."""
  total = sum(sum(ph.values()) for _, ph in groups) or 1.0
  out = ["| part of the step | forward ms | recompute ms | backward ms | "
         "phase unknown ms | total ms | share |",
         "|---|---|---|---|---|---|---|"]
  for group, ph in groups:
    t = sum(ph.values())
    cells = [f"{ph.get(p, 0.0):.1f}" for p in PHASES + ("?",)]
    out.append(f"| {group} | " + " | ".join(cells)
               + f" | {t:.1f} | {t / total:.1%} |")
  return "\n".join(out) + "\n"


def partial_row(r: dict, progress: str, error: str) -> dict:
  """The row of a child process that did not finish: `error`, plus the
  phases and steps its progress file recorded (setup_s, compile_s, losses,
  step_ms_all). A row whose timed steps all finished (it stopped while
  profiling) is returned whole, with `error` as its profile_error."""
  events = []
  if os.path.exists(progress):
    with open(progress) as f:
      events = [json.loads(line) for line in f if line.strip()]
  timed = [e["row"] for e in events if "row" in e]
  if timed:
    return dict(timed[-1], profile_error=error)
  out = dict(r, error=error)
  for e in events:
    if "phase" in e:
      out[f"{e['phase']}_s"] = e["s"]
  steps = [e for e in events if "step" in e]
  if steps:
    out["losses"] = [e["loss"] for e in steps]
    out["step_ms_all"] = [e["ms"] for e in steps]
  return out


def describe_error(r: dict) -> str:
  """The error with where the row's time went: setup, compile, steps."""
  done = [f"{k[:-2]} {r[k]:.0f} s" for k in ("setup_s", "compile_s")
          if k in r]
  if "init_s" in r and "setup_s" in r:
    done[0] += f" (init {r['init_s']:.0f} s)"
  if r.get("step_ms_all"):
    ms = ", ".join(f"{v:.0f}" for v in r["step_ms_all"])
    done.append(f"steps {ms} ms")
  return r["error"] + (f" ({'; '.join(done)})" if done else "")


_ROW_COLUMNS = ("config", "T x B", "kda", "attention", "gmm", "remat")


def _head(columns) -> str:
  """A markdown table's header: the row columns, then `columns`."""
  names = _ROW_COLUMNS + tuple(columns)
  return ("| " + " | ".join(names) + " |\n"
          + "|" + "---|" * len(names) + "\n")


def _lead(r: dict) -> str:
  """The row columns of r's line, open at the end for the measured ones."""
  mb = r.get("microbatches", 1)
  remat = r["remat"] + (f", {mb} microbatches" if mb > 1 else "")
  return (f"| {r.get('config', '')} | {r['seq_len']} x {r['batch']} | "
          f"{r['backend']} | {r['attention']} | {r['grouped_matmul']} | "
          f"{remat} ")


def compile_table(rows: list[dict]) -> str:
  """Markdown table of compile-only rows: XLA's memory and traffic."""
  fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
  out = []
  for r in rows:
    if "error" in r:
      out.append(_lead(r) + f"| {describe_error(r)} |" + " |" * 3)
      continue
    out.append(_lead(r) + f"| {fmt(r['xla_temp_gib'])} | "
               f"{fmt(r['xla_arg_gib'])} | {fmt(r['xla_accessed_gib'])} | "
               f"{r['compile_s']:.0f} |")
  return (_head(("XLA temp GiB", "XLA args GiB", "XLA bytes accessed GiB",
                 "compile s")) + "\n".join(out) + "\n")


def table(rows: list[dict]) -> str:
  """Markdown table of the rows (loss gap: to the previous row, same T)."""
  head = _head(("step ms", "tokens/s", "TFLOP/s", "MFU", "peak GiB",
                "compile s", "loss gap"))
  out, prev = [], {}
  for r in rows:
    lead = _lead(r)
    if "error" in r:
      out.append(lead + f"| {describe_error(r)} |" + " |" * 6)
      continue
    gap = ""
    p = prev.get(r["seq_len"])
    if p is not None:
      n = min(len(p["losses"]), len(r["losses"]))
      pairs = zip(r["losses"][:n], p["losses"][:n])
      gap = f"{max(abs(a - b) / abs(b) for a, b in pairs):.1e}"
    prev[r["seq_len"]] = r
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    out.append(lead + f"| {r['step_ms']:.1f} | {r['tokens_per_sec']:,.0f} | "
               f"{r['tflops']:.1f} | {fmt(r['mfu'], '.1%')} | "
               f"{fmt(r['peak_gib'], '.1f')} | {r['compile_s']:.0f} | "
               f"{gap} |")
  return head + "\n".join(out) + "\n"
