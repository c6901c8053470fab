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
  # Packed documents: MLA's flash kernel with segment ids against the dense
  # masked XLA path; then unpacked rows (cuDNN, and the kernel without ids).
  python -m experiments.bench_train_step --config=configs/gpu_small.py \
      --config.data.packing=documents --seq_lens=4096,16384 \
      --attention=pallas,xla --backends=pallas --grouped_matmuls=pallas \
      --out=/tmp/bench_packed
  python -m experiments.bench_train_step --config=configs/gpu_small.py \
      --seq_lens=4096,16384 --attention=cudnn,pallas --backends=pallas \
      --grouped_matmuls=pallas --out=/tmp/bench_unpacked
  # Lowered for the GPU on any machine, not compiled: lowering s, module MB.
  python -m experiments.bench_train_step --config=configs/gpu_1b.py \
      --seq_lens=512 --tokens_per_step=1024 --backends=pallas --attention=xla \
      --grouped_matmuls=mosaic --lower_for=cuda
  # Gradient accumulation instead of rematerialisation: 4 passes of 2 x 8K.
  python -m experiments.bench_train_step --config=configs/gpu_1b.py \
      --seq_lens=8192 --backends=pallas --remat=none --microbatches=4
  # No step run: XLA's compiled memory and bytes accessed (any backend).
  python -m experiments.bench_train_step --config=configs/gpu_small.py \
      --seq_lens=256 --tokens_per_step=512 --backends=xla --attention=xla \
      --compile_only --config.model.residual=standard

Writes OUT/rows.jsonl (one JSON row each, losses included), OUT/table.md,
per row OUT/<row>.log (its process's stderr) and OUT/<row>.progress.jsonl
(setup, compile and each step as they finish), and with --profile
OUT/<row>/ (a jax.profiler trace and the compiled step's HLO text) and
OUT/top_ops.md: the busiest ops, then the step's device time by part of
the model (KDA, MLA, the MoE's router, shared and routed experts, AttnRes,
norms, head, the optimizer) and phase (forward, rematerialised forward,
backward), from each op's op_name metadata. On a GPU whose time is
rationed, give each row --row_timeout: a row that runs out of it is reported
with the phases and steps it finished, and the next row still runs.
"""
from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys

from absl import app, flags
from ml_collections import config_flags

from experiments.step_timing import (compile_table, configure,
                                    describe_error,
                                    lower_row, lower_table,
                                    module_table, ops_by_module,
                                    partial_row, row_name, run_row, table,
                                    top_ops, unattributed_ops)

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
                               "model.mla.attention_impl values (auto, xla, "
                               "cudnn, pallas).")
_GMM = flags.DEFINE_list("grouped_matmuls", ["auto"],
                         "model.moe.grouped_matmul values.")
_MICRO = flags.DEFINE_list(
    "microbatches", ["1"], "train.microbatches values (gradient accumulation "
    "passes per step, each of batch / microbatches sequences).")
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
_ROW_TIMEOUT = flags.DEFINE_integer(
    "row_timeout", 0, "Seconds a row's process may run (0: no limit). A row "
    "stopped by it is reported with the phases and steps it finished.")
_COMPILE_ONLY = flags.DEFINE_bool(
    "compile_only", False, "Compile each row and report XLA's estimates of "
    "its temporary memory and bytes accessed, without running a step (any "
    "backend, a CPU included).")
_LOWER_FOR = flags.DEFINE_string(
    "lower_for", "", "Only lower each row's step for this platform (e.g. "
    "cuda, on a CPU too): lowering seconds and module text MB, no compile.")
_ROW = flags.DEFINE_string("row", "", "Internal: run this one row (JSON).")

def row_specs(config) -> list[dict]:
  """The product of the flag lists, as row specs (JSON-able dicts)."""
  lens = [int(t) for t in _SEQ_LENS.value] or [config.data.seq_len]
  tokens = _TOKENS.value or config.data.batch_size * config.data.seq_len
  remats = _REMAT.value or [config.model.remat]
  rows = []
  for t, be, att, gmm, rm, mb in itertools.product(
      lens, _BACKENDS.value, _ATTENTION.value, _GMM.value, remats,
      [int(m) for m in _MICRO.value]):
    if tokens % t:
      raise app.UsageError(f"--tokens_per_step={tokens} is not a multiple "
                           f"of seq_len {t}")
    rows.append(dict(seq_len=t, batch=tokens // t, backend=be, attention=att,
                     grouped_matmul=gmm, remat=rm, microbatches=mb))
    configure(config, rows[-1])   # every row validated before any runs
  return rows


def _progress_file(r: dict) -> str:
  return os.path.join(_OUT.value, row_name(r) + ".progress.jsonl")


def _run_isolated(r: dict, name: str) -> dict:
  """Runs one row in a child process (stderr to OUT/<row>.log) within
  --row_timeout; a row that fails or runs out of time still reports the
  phases and steps it finished."""
  cmd = [sys.executable, "-m", "experiments.bench_train_step",
         f"--row={json.dumps(r)}"] + [
             a for a in sys.argv[1:] if not a.startswith("--row")]
  progress, log = _progress_file(r), os.path.join(_OUT.value,
                                                  row_name(r) + ".log")
  if os.path.exists(progress):
    os.remove(progress)
  with open(log, "w") as err_file:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err_file,
                            text=True)
    try:
      stdout, _ = proc.communicate(timeout=_ROW_TIMEOUT.value or None)
    except subprocess.TimeoutExpired:
      res = partial_row(dict(r, config=name), progress,
                        f"timed out after {_ROW_TIMEOUT.value} s")
      print("   " + describe_error(res), flush=True)
      return res
    finally:
      # Killed or stopped (SIGTERM from an outer `timeout` included): the
      # row's process must not keep the device for the rows after it.
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  last = (stdout.strip().splitlines() or [""])[-1]
  try:
    return json.loads(last)
  except json.JSONDecodeError:
    with open(log) as f:
      err = f.read().strip().splitlines()
    oom = any("RESOURCE_EXHAUSTED" in ln or "out of memory" in ln.lower()
              for ln in err)
    res = partial_row(dict(r, config=name), progress,
                      "out of memory" if oom else "failed")
    print("   " + describe_error(res), flush=True)
    print("   " + (err[-1] if err else "no output")[:300], flush=True)
    return res


def main(argv):
  del argv
  config = _CONFIG.value
  name = os.path.basename(config_flags.get_config_filename(
      flags.FLAGS["config"]))
  if _ROW.value:   # child: one row, JSON on the last stdout line
    r = json.loads(_ROW.value)
    prof = os.path.join(_OUT.value, row_name(r)) if _PROFILE.value else None
    print(json.dumps(run_row(config, r, _STEPS.value, _WARMUP.value, prof,
                             name, _PEAK.value, _progress_file(r),
                             _COMPILE_ONLY.value)))
    return
  os.makedirs(_OUT.value, exist_ok=True)
  if _LOWER_FOR.value:   # in this process: nothing compiles or runs
    md = lower_table([lower_row(config, r, _LOWER_FOR.value, name)
                      for r in row_specs(config)])
    with open(os.path.join(_OUT.value, "table.md"), "w") as f:
      f.write(md)
    print(md)
    return
  # SIGTERM (e.g. an outer `timeout`) unwinds, so the running row's process
  # is killed with this one rather than left running on the device.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  rows = []
  for r in row_specs(config):
    print(f"== {row_name(r)} (batch {r['batch']})", flush=True)
    if _ISOLATE.value:
      res = _run_isolated(r, name)
    else:
      prof = (os.path.join(_OUT.value, row_name(r)) if _PROFILE.value
              else None)
      res = run_row(config, r, _STEPS.value, _WARMUP.value, prof, name,
                    _PEAK.value, compile_only=_COMPILE_ONLY.value)
    rows.append(res)
    with open(os.path.join(_OUT.value, "rows.jsonl"), "a") as f:
      f.write(json.dumps(res) + "\n")
    if "profile_error" in res:
      print(f"   profile not finished: {res['profile_error']}", flush=True)
    elif "error" not in res and _PROFILE.value:
      ops = top_ops(os.path.join(_OUT.value, row_name(r)), 10**9)
      step = sum(ms for _, ms, _ in ops) or 1.0
      summary = (f"\n### {row_name(r)}: {step:.1f} ms of device ops\n\n"
                 "| op | ms | share | count |\n|---|---|---|---|\n" +
                 "".join(f"| `{n[:90]}` | {ms:.2f} | {ms / step:.1%} | {k} |\n"
                         for n, ms, k in ops[:_TOP.value]))
      groups = ops_by_module(os.path.join(_OUT.value, row_name(r)))
      if groups:
        summary += ("\nBy part of the model (op_name metadata of the "
                    "compiled step):\n\n" + module_table(groups))
      missed = unattributed_ops(os.path.join(_OUT.value, row_name(r)))
      if missed:
        summary += ("\nBusiest unattributed ops (name, ms, count, the "
                    "event's stats):\n\n" + "".join(
                        f"- `{n[:90]}` {ms:.2f} ms x {k}: {st}\n"
                        for n, ms, k, st in missed))
      with open(os.path.join(_OUT.value, "top_ops.md"), "a") as f:
        f.write(summary)
      print(summary, flush=True)
    if "error" not in res and not _COMPILE_ONLY.value:
      print(f"   {res['step_ms']:.1f} ms  {res['tokens_per_sec']:,.0f} tok/s"
            f"  MFU {res['mfu'] and round(res['mfu'], 3)}"
            f"  peak {res['peak_gib']} GiB  compile {res['compile_s']:.0f} s",
            flush=True)
  ok = [r for r in rows if "error" not in r]
  if _COMPILE_ONLY.value:
    md = compile_table(rows)
  else:
    md = table(rows)
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
