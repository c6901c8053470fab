r"""Throughput of the whole training step: ms, tokens/s, MFU, memory, compile.

For a config, each row is one (sequence length, linear-attention backend,
MLA attention implementation, grouped matmul, remat) combination at a fixed
number of tokens per step (batch = tokens / length). Each row runs in its own
process (a clean device-memory peak; an out-of-memory row is reported, not
fatal): it compiles the jitted train step once, runs --warmup steps, then
--steps steps, each waited for, and reports the median step time over the
timed window. All rows train from the same init on the same batches of the
embedded corpus, so their losses must agree (bf16 tolerance): the table
shows each row's largest relative loss gap to the row above it at the same
length, over every step it ran.

MFU counts model FLOPs analytically (moe_jax.planning): 3 x the forward's
2 x active matmul parameters per token (routed top-k experts, shared expert,
projections, router, head), plus MLA's causal attention 2 x heads x (d_qk +
d_v) x (T + 1) / 2, KDA's chunked intra-chunk and state terms and the
AttnRes mixing, all per token. Rematerialised FLOPs do not count. The peak
is the card's dense bf16 rate (printed with the card's name).

  python -m experiments.bench_train_step --config=configs/gpu_1b.py \
      --seq_lens=8192,32768 --backends=pallas,xla --attention=cudnn \
      --out=/tmp/bench_step
  python -m experiments.bench_train_step --config=configs/gpu_small.py \
      --grouped_matmuls=pallas,ragged_dot --profile   # + top ops per row

Writes OUT/rows.jsonl (one JSON row each, losses included), OUT/table.md,
and with --profile OUT/<row>/ (a jax.profiler trace) and OUT/top_ops.md.
"""
from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import time

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/gpu_small.py", "Config file (path.py[:variants]).",
    lock_config=False)
_SEQ_LENS = flags.DEFINE_list("seq_lens", [], "Sequence lengths; default "
                              "the config's data.seq_len.")
_TOKENS = flags.DEFINE_integer("tokens_per_step", 0, "Tokens per step; 0 = "
                               "the config's batch_size x seq_len.")
_BACKENDS = flags.DEFINE_list("backends", ["pallas", "xla"],
                              "model.kda.backend values.")
_ATTENTION = flags.DEFINE_list("attention", ["cudnn"],
                               "model.mla.attention_impl values.")
_GMM = flags.DEFINE_list("grouped_matmuls", ["auto"],
                         "model.moe.grouped_matmul values.")
_REMAT = flags.DEFINE_list("remat", [], "model.remat values; default the "
                           "config's.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per row.")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed steps after compile.")
_PROFILE = flags.DEFINE_bool("profile", False, "Trace one step per row and "
                             "summarise the top device ops.")
_TOP = flags.DEFINE_integer("top", 15, "Ops per row in the profile summary.")
_PEAK = flags.DEFINE_float("peak_tflops", 0.0, "Dense bf16 peak of the card; "
                           "0 = from its name (H100 / H200: 989).")
_OUT = flags.DEFINE_string("out", "/tmp/bench_train_step", "Output folder.")
_ISOLATE = flags.DEFINE_bool("isolate", True, "One process per row.")
_ROW = flags.DEFINE_string("row", "", "Internal: run this one row (JSON).")

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) by device-name part.
PEAKS = {"H100": 989.0, "H200": 989.0, "B200": 2250.0, "A100": 312.0}


def peak_tflops(device_kind: str) -> float | None:
  """The flag's peak, else the card's from PEAKS, else None (e.g. a CPU)."""
  if flags.FLAGS.is_parsed() and _PEAK.value:
    return _PEAK.value
  for name, peak in PEAKS.items():
    if name in device_kind:
      return peak
  return None


def row_specs(config) -> list[dict]:
  """The product of the flag lists, as row specs (JSON-able dicts)."""
  lens = [int(t) for t in _SEQ_LENS.value] or [config.data.seq_len]
  tokens = _TOKENS.value or config.data.batch_size * config.data.seq_len
  remats = _REMAT.value or [config.model.remat]
  rows = []
  for t, be, att, gmm, rm in itertools.product(
      lens, _BACKENDS.value, _ATTENTION.value, _GMM.value, remats):
    if tokens % t:
      raise app.UsageError(f"--tokens_per_step={tokens} is not a multiple "
                           f"of seq_len {t}")
    rows.append(dict(seq_len=t, batch=tokens // t, backend=be, attention=att,
                     grouped_matmul=gmm, remat=rm))
  return rows


def row_name(r: dict) -> str:
  return (f"T{r['seq_len']}_{r['backend']}_{r['attention']}_"
          f"{r['grouped_matmul']}_{r['remat']}")


def configure(config, r: dict):
  """A validated copy of config with the row's settings."""
  from moe_jax.config_validation import validate_config
  c = config.copy_and_resolve_references()
  c.data.seq_len, c.data.batch_size = r["seq_len"], r["batch"]
  c.model.kda.backend = r["backend"]
  c.model.mla.attention_impl = r["attention"]
  c.model.moe.grouped_matmul = r["grouped_matmul"]
  c.model.remat = r["remat"]
  c.train.microbatches = 1
  validate_config(c)
  return c


def run_row(config, r: dict, steps: int, warmup: int, profile_dir: str | None,
            config_name: str = "") -> dict:
  """Compiles and times one row in this process; returns its JSON row."""
  import jax
  import numpy as np
  from moe_jax import sharding
  from moe_jax.data import make_datasets
  from moe_jax.model import build_model
  from moe_jax.planning import plan
  from moe_jax.train.optimizer import make_optimizer, make_schedule
  from moe_jax.train.step import (abstract_train_state, init_train_state,
                                  make_train_step, train_state_shardings)

  c = configure(config, r)
  train_iter, _, _, _ = make_datasets(dict(c.data.to_dict(), seed=c.seed))
  batches = [next(train_iter) for _ in range(warmup + steps)]
  mesh = sharding.make_mesh(c.mesh)
  rules = c.mesh.rules
  model, tx = build_model(c), make_optimizer(c.train)
  rng = jax.random.PRNGKey(c.seed)
  abstract = abstract_train_state(model, tx, rng, c.data.seq_len)
  state_sh = train_state_shardings(abstract, tx, mesh, rules)
  batch_sh = sharding.batch_sharding(mesh, rules,
                                     (c.data.batch_size, c.data.seq_len))
  step_fn = sharding.jit_in_mesh(
      make_train_step(model, tx, c.model.moe, make_schedule(c.train)), mesh,
      in_shardings=(state_sh, batch_sh),
      out_shardings=(state_sh, sharding.replicated(mesh)), donate_argnums=(0,))
  state = init_train_state(model, tx, rng, c.data.seq_len, shardings=state_sh)
  put = lambda b: sharding.shard_batch(b, batch_sh, c.data.batch_size)  # noqa: E731

  t0 = time.perf_counter()
  compiled = step_fn.lower(state, put(batches[0])).compile()
  compile_s = time.perf_counter() - t0
  losses, times = [], []
  for i, b in enumerate(batches):
    b = put(b)
    jax.block_until_ready(b)
    t0 = time.perf_counter()
    state, metrics = compiled(state, b)
    loss = float(metrics["loss"])   # waits for the step
    times.append(time.perf_counter() - t0)
    losses.append(loss)
  if profile_dir:
    b = put(batches[-1])
    with jax.profiler.trace(profile_dir):
      state, metrics = compiled(state, b)
      jax.block_until_ready(metrics)
  step_s = statistics.median(times[warmup:])
  tokens = c.data.batch_size * c.data.seq_len
  flops = plan(c, {}, seq_len=c.data.seq_len,
               global_batch=c.data.batch_size)["flops_per_token"]
  dev = jax.devices()[0]
  peak = peak_tflops(dev.device_kind)
  mem = dev.memory_stats() or {}
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
  return dict(
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
      compile_s=compile_s, params=n_params, losses=losses,
      step_ms_all=[1e3 * t for t in times])


def top_ops(trace_dir: str, top: int) -> list[tuple[str, float, int]]:
  """(op name, total ms, count) of the busiest device ops in a trace.

  Reads the XSpace the profiler wrote; on a GPU the device plane's "XLA
  Ops" line holds one event per HLO op (fusions, custom calls such as the
  Pallas kernels, cuBLAS GEMMs).
  """
  import glob
  import collections
  from jax.profiler import ProfileData
  files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"),
                    recursive=True)
  if not files:
    return []
  data = ProfileData.from_file(files[0])
  total: dict[str, float] = collections.defaultdict(float)
  count: dict[str, int] = collections.Counter()
  planes = [p for p in data.planes if p.name.startswith("/device:")]
  has_ops = any(ln.name == "XLA Ops" for p in planes for ln in p.lines)
  for plane in planes:
    for line in plane.lines:
      # Without an "XLA Ops" line, the kernels of every stream line.
      if (line.name != "XLA Ops") if has_ops else (
          line.name in ("XLA Modules", "Steps", "XLA TraceMe")):
        continue
      for ev in line.events:
        total[ev.name] += ev.duration_ns / 1e6
        count[ev.name] += 1
  ranked = sorted(total.items(), key=lambda kv: -kv[1])[:top]
  return [(name, ms, count[name]) for name, ms in ranked]


def table(rows: list[dict]) -> str:
  """Markdown table of the rows (loss gap: to the previous row, same T)."""
  head = ("| config | T x B | kda | attention | gmm | remat | step ms | "
          "tokens/s | TFLOP/s | MFU | peak GiB | compile s | loss gap |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
  out, prev = [], {}
  for r in rows:
    lead = (f"| {r.get('config', '')} | {r['seq_len']} x {r['batch']} | "
            f"{r['backend']} | {r['attention']} | {r['grouped_matmul']} | "
            f"{r['remat']} ")
    if "error" in r:
      out.append(lead + f"| {r['error']} |" + " |" * 6)
      continue
    gap = ""
    p = prev.get(r["seq_len"])
    if p is not None:
      n = min(len(p["losses"]), len(r["losses"]))
      gap = f"{max(abs(a - b) / abs(b) for a, b in zip(r['losses'][:n], p['losses'][:n])):.1e}"
    prev[r["seq_len"]] = r
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    out.append(lead + f"| {r['step_ms']:.1f} | {r['tokens_per_sec']:,.0f} | "
               f"{r['tflops']:.1f} | {fmt(r['mfu'], '.1%')} | "
               f"{fmt(r['peak_gib'], '.1f')} | {r['compile_s']:.0f} | "
               f"{gap} |")
  return head + "\n".join(out) + "\n"


def main(argv):
  del argv
  config = _CONFIG.value
  name = os.path.basename(config_flags.get_config_filename(
      flags.FLAGS["config"]))
  if _ROW.value:   # child: one row, JSON on the last stdout line
    r = json.loads(_ROW.value)
    prof = os.path.join(_OUT.value, row_name(r)) if _PROFILE.value else None
    print(json.dumps(run_row(config, r, _STEPS.value, _WARMUP.value, prof,
                             name)))
    return
  os.makedirs(_OUT.value, exist_ok=True)
  rows = []
  for r in row_specs(config):
    print(f"== {row_name(r)} (batch {r['batch']})", flush=True)
    if _ISOLATE.value:
      cmd = [sys.executable, "-m", "experiments.bench_train_step",
             f"--row={json.dumps(r)}"] + [
                 a for a in sys.argv[1:] if not a.startswith("--row")]
      proc = subprocess.run(cmd, capture_output=True, text=True)
      last = (proc.stdout.strip().splitlines() or [""])[-1]
      try:
        res = json.loads(last)
      except json.JSONDecodeError:
        err = proc.stderr.strip().splitlines()
        oom = any("RESOURCE_EXHAUSTED" in ln or "out of memory" in ln.lower()
                  for ln in err)
        res = dict(r, error="out of memory" if oom else "failed")
        with open(os.path.join(_OUT.value, row_name(r) + ".err"), "w") as f:
          f.write(proc.stderr)
        print("   " + (err[-1] if err else "no output")[:300], flush=True)
    else:
      prof = (os.path.join(_OUT.value, row_name(r)) if _PROFILE.value
              else None)
      res = run_row(config, r, _STEPS.value, _WARMUP.value, prof, name)
    rows.append(res)
    with open(os.path.join(_OUT.value, "rows.jsonl"), "a") as f:
      f.write(json.dumps(res) + "\n")
    if "error" not in res and _PROFILE.value:
      ops = top_ops(os.path.join(_OUT.value, row_name(r)), 10**9)
      step = sum(ms for _, ms, _ in ops) or 1.0
      summary = (f"\n### {row_name(r)}: {step:.1f} ms of device ops\n\n"
                 "| op | ms | share | count |\n|---|---|---|---|\n" +
                 "".join(f"| `{n[:90]}` | {ms:.2f} | {ms / step:.1%} | {k} |\n"
                         for n, ms, k in ops[:_TOP.value]))
      with open(os.path.join(_OUT.value, "top_ops.md"), "a") as f:
        f.write(summary)
      print(summary, flush=True)
    if "error" not in res:
      print(f"   {res['step_ms']:.1f} ms  {res['tokens_per_sec']:,.0f} tok/s"
            f"  MFU {res['mfu'] if res['mfu'] is None else round(res['mfu'], 3)}"
            f"  peak {res['peak_gib']} GiB  compile {res['compile_s']:.0f} s",
            flush=True)
  md = table(rows)
  ok = [r for r in rows if "error" not in r]
  if ok:
    md = (f"Card: {ok[0]['device']}, assumed dense bf16 peak "
          f"{ok[0]['peak_tflops']} TFLOP/s; jax {ok[0]['jax']}; model "
          f"{ok[0]['model_tflop_per_token'] * 1e3:.3f} GFLOP per token "
          "(train, analytic).\n\n" + md)
  with open(os.path.join(_OUT.value, "table.md"), "w") as f:
    f.write(md)
  print(md)


if __name__ == "__main__":
  app.run(main)
