r"""Decoding cost at a context length: time per output token, cache memory.

For each layer pattern (default the config's and "M", the all-MLA model of
the same width and depth), each context length L and each batch B, builds
a cache of B sequences of T_max = L positions whose MLA layers are filled
up to L - steps (random latents; the KDA state is constant in L, so its
values do not matter for the cost), then times a jitted loop of `steps`
greedy decode steps (the last one reaching position L) after one compiled
warm-up run. Params are random, from numpy (a timing, not a quality
measure). A step emits B tokens: ms per output token is the step's time
over B. At B = 1 it is the latency of one sequence; at larger B the step
reads B caches against one pass over the weights, so the cache's share of
the time grows with B.

  python -m experiments.bench_decode --config=configs/gpu_small.py \
      --contexts=65536,1048576 --out=/tmp/bench_decode

Prints a table (ms per step and per output token, cache MiB: total, KDA,
MLA; the compiled loop's temporary MiB, XLA's count of what it holds
beside its arguments, where a copy of a layer's cache would show; ratios
to the all-MLA row of the same L and B) and writes OUT/rows.jsonl and
OUT/table.md. A row that runs out of device memory is reported as such
and the next rows still run. With --profile, one more run of the loop
is traced (OUT/trace_<pattern>_<L>_<B>) and each row adds the device time
and the number of device ops per step and the busiest ops: a wall time per
step far above the device time means the step is bound by launching its
ops, not by computing them.

  python -m experiments.bench_decode --config=configs/gpu_small.py \
      --contexts=65536,1048576 --profile --out=/tmp/bench_decode
  python -m experiments.bench_decode --config=configs/gpu_small.py \
      --contexts=1048576 --batches=1,8 --out=/tmp/bench_decode_batch
"""
from __future__ import annotations

import functools
import json
import os
import time
import zlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from experiments.step_timing import top_ops
from moe_jax import decode
from moe_jax.config_validation import validate_config
from moe_jax.model import build_model


def define_flags():
  """Defines the command's flags; only when it runs as a command, so
  that tests import this module beside other experiments without
  their flags clashing."""
  global _CONFIG, _CONTEXTS, _PATTERNS, _BATCHES, _STEPS, _OUT, _PROFILE
  _CONFIG = config_flags.DEFINE_config_file(
      "config", "configs/gpu_small.py", "Config file (path.py[:variants]).",
      lock_config=False)
  _CONTEXTS = flags.DEFINE_list("contexts", ["65536"], "Context lengths L.")
  _PATTERNS = flags.DEFINE_list("patterns", [], "model.layer_pattern values; "
                                "default the config's and M (all-MLA).")
  _BATCHES = flags.DEFINE_list("batches", ["1"], "Sequences decoded "
                               "together (B), one row per value.")
  _STEPS = flags.DEFINE_integer("steps", 32, "Timed decode steps.")
  _OUT = flags.DEFINE_string("out", "", "Output folder ('' = print only).")
  _PROFILE = flags.DEFINE_bool("profile", False, "Trace one more run per "
                               "row: device ms, device ops and top ops per "
                               "step (needs --out).")


def bench_row(config, context: int, batch: int = 1, steps: int = 32,
              seed: int = 0, trace_dir: str | None = None) -> dict:
  """One row: time per step and per output token (step / batch) and cache
  bytes of config's model with a cache of `context` positions for `batch`
  sequences (see the module docstring). With trace_dir, one more run is
  traced there and the row adds device_ms_per_step, ops_per_step and
  top_ops ([name, ms per step, count per step] of the 8 busiest)."""
  if not 1 <= steps < context:
    raise ValueError(f"steps must be in [1, context={context}), got {steps}")
  model = build_model(config)
  shapes = nn.meta.unbox(jax.eval_shape(
      model.init, jax.random.PRNGKey(seed), jnp.zeros((1, 8), jnp.int32)))
  # Random params from numpy (compiling the initialisers costs more than
  # the timed loop at small sizes): unit vectors, 1/sqrt(fan_in) matrices.
  rng = np.random.default_rng(seed)
  def param(s):
    if len(s.shape) == 1:
      return jnp.ones(s.shape, s.dtype)
    return jnp.asarray(rng.standard_normal(s.shape, np.float32)
                       / np.sqrt(s.shape[-2]), s.dtype)
  params = jax.tree.map(param, shapes["params"])
  router_state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                              shapes.get("router_state", {}))
  cache = decode.init_cache(model, params, router_state, batch, context)
  report = decode.cache_report(cache)

  def rewind(path, x):
    # MLA layers hold L - steps tokens; what a run wrote past them does not
    # change the next run's cost.
    return jnp.full_like(x, context - steps) if path[-1].key == "index" else x

  def fill(path, x):
    # Latents of unit scale.
    if path[-1].key in ("c_kv", "rope_key"):
      key = jax.random.fold_in(jax.random.PRNGKey(seed),
                               zlib.crc32(str(path).encode()) % 2**31)
      return jax.random.normal(key, x.shape, x.dtype)
    return rewind(path, x)
  # The cache is donated to each jitted call and returned, so it is never
  # held twice (all-MLA's is 32 GiB at 1M and batch 8).
  fill_cache, rewind_cache = (
      jax.jit(functools.partial(jax.tree_util.tree_map_with_path, f),
              donate_argnums=0) for f in (fill, rewind))
  cache = fill_cache(cache)

  @functools.partial(jax.jit, donate_argnums=2)
  def run(params, router_state, cache, token):
    def body(_, carry):
      token, cache = carry
      logits, cache = decode.decode_step(model, params, router_state, cache,
                                         token)
      return jnp.argmax(logits, -1).astype(jnp.int32), cache
    return jax.lax.fori_loop(0, steps, body, (token, cache))

  first = jnp.zeros((batch,), jnp.int32)

  start = time.perf_counter()
  loop = run.lower(params, router_state, cache, first).compile()
  compile_s = time.perf_counter() - start
  # What the loop holds beside its arguments (the cache is donated and
  # aliased to the output): a copy of a layer's cache shows up here.
  temp_bytes = loop.memory_analysis().temp_size_in_bytes

  def timed(cache):
    """Seconds of one run of the loop, and the cache rewound for the next."""
    start = time.perf_counter()
    token, cache = loop(params, router_state, cache, first)
    token.block_until_ready()
    return time.perf_counter() - start, rewind_cache(cache)

  _, cache = timed(cache)   # warm-up
  seconds, cache = timed(cache)
  by_kind = {k: sum(r["bytes"] for r in report if r["kind"] == k)
             for k in ("KDA", "MLA")}
  profile = {}
  if trace_dir:
    with jax.profiler.trace(trace_dir):
      _, cache = timed(cache)
    ops = top_ops(trace_dir, 10**9)
    profile = {
        "device_ms_per_step": sum(ms for _, ms, _ in ops) / steps,
        "ops_per_step": sum(n for _, _, n in ops) / steps,
        "top_ops": [[name, ms / steps, n / steps] for name, ms, n in ops[:8]]}
  return {**profile, "pattern": config.model.layer_pattern, "context": context,
          "batch": batch, "steps": steps,
          "ms_per_step": 1e3 * seconds / steps,
          "ms_per_token": 1e3 * seconds / steps / batch,
          "cache_bytes": by_kind["KDA"] + by_kind["MLA"],
          "kda_cache_bytes": by_kind["KDA"],
          "mla_cache_bytes": by_kind["MLA"], "loop_temp_bytes": temp_bytes,
          "compile_s": compile_s,
          "device": jax.devices()[0].device_kind}


def run_row(config, context: int, batch: int, steps: int,
            trace_dir: str | None) -> dict:
  """bench_row, or a row naming the error when the device runs out of
  memory (the rows after it still run)."""
  try:
    return bench_row(config, context, batch, steps, trace_dir=trace_dir)
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    first = str(e).splitlines()[0]
    return {"pattern": config.model.layer_pattern, "context": context,
            "batch": batch, "error": "out of memory: " + first[:200]}


def table(rows: list[dict]) -> str:
  """Markdown table; ratios to the all-MLA ("M") row of the same context and
  batch; profiled rows add device ms and device ops per step."""
  ref = {(r["context"], r["batch"]): r for r in rows
         if r["pattern"] == "M" and "error" not in r}
  profiled = any("device_ms_per_step" in r for r in rows)
  extra = " device ms/step | ops/step |" if profiled else ""
  lines = ["| pattern | L | B | ms/step | ms/token | cache MiB | KDA MiB | "
           "MLA MiB | loop temp MiB | time / all-MLA | cache / all-MLA |"
           + extra, "|" + "---|" * (13 if profiled else 11)]
  mib = lambda b: f"{b / 2**20:.4g}"  # noqa: E731
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['pattern']} | {r['context']} | {r['batch']} | "
                   f"{r['error']} |")
      continue
    m = ref.get((r["context"], r["batch"]))
    ratio = lambda k: f"{r[k] / m[k]:.2f}" if m else "-"  # noqa: E731
    cells = ""
    if profiled:
      cells = (f" {r['device_ms_per_step']:.3f} | {r['ops_per_step']:.0f} |"
               if "device_ms_per_step" in r else " - | - |")
    lines.append(
        f"| {r['pattern']} | {r['context']} | {r['batch']} | "
        f"{r['ms_per_step']:.3f} | {r['ms_per_token']:.3f} | "
        f"{mib(r['cache_bytes'])} | {mib(r['kda_cache_bytes'])} | "
        f"{mib(r['mla_cache_bytes'])} | {mib(r['loop_temp_bytes'])} | "
        f"{ratio('ms_per_token')} | "
        f"{ratio('cache_bytes')} |" + cells)
  text = "\n".join(lines) + "\n"
  for r in rows:
    if r.get("top_ops"):
      text += (f"\nBusiest device ops per step, {r['pattern']} at "
               f"L={r['context']}, B={r['batch']} (name, ms, count):\n\n"
               + "".join(f"- `{n[:80]}` {ms:.4f} ms x {k:g}\n"
                         for n, ms, k in r["top_ops"]))
  return text


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  try:
    contexts = [int(c) for c in _CONTEXTS.value]
    batches = [int(b) for b in _BATCHES.value]
  except ValueError as e:
    raise app.UsageError(f"--contexts and --batches must be integers, got "
                         f"{_CONTEXTS.value} and {_BATCHES.value}") from e
  if min(batches, default=0) < 1:
    raise app.UsageError(f"--batches must be >= 1, got {_BATCHES.value}")
  if _PROFILE.value and not _OUT.value:
    raise app.UsageError("--profile needs --out (where the traces go)")
  patterns = _PATTERNS.value or [config.model.layer_pattern, "M"]
  rows = []
  for pattern in dict.fromkeys(patterns):
    cfg = config.copy_and_resolve_references()
    cfg.model.layer_pattern = pattern
    validate_config(cfg)
    for context in contexts:
      for batch in batches:
        trace = (os.path.join(_OUT.value, f"trace_{pattern}_{context}_{batch}")
                 if _PROFILE.value else None)
        rows.append(run_row(cfg, context, batch, _STEPS.value, trace))
        print(json.dumps(rows[-1]), flush=True)
  text = table(rows)
  print(text)
  if _OUT.value:
    os.makedirs(_OUT.value, exist_ok=True)
    with open(os.path.join(_OUT.value, "rows.jsonl"), "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(_OUT.value, "table.md"), "w") as f:
      f.write(text)


if __name__ == "__main__":
  define_flags()
  app.run(main)
