r"""Runs a config's get_sweep() locally, one workdir per entry and seed,
and compares the entries over seeds.

  python -m experiments.sweep --config=configs/ablations.py --workdir=runs/ablations
  python -m experiments.sweep --config=configs/ablations.py:tiny,smoke \
      --workdir=/tmp/abl --only=qb-exact,sign --seeds=0,1
  python -m experiments.sweep --config=configs/evidence.py:residuals \
      --workdir=runs/ev_residuals

get_sweep() (or get_sweep(arg), given the config's variant string) returns
either a list of entries {'name': ..., 'overrides': {dotted.field: value}}
or {'entries': [...], 'seeds': [0, 1, 2], 'baseline': name, 'claims':
[...]} (claims: see sweep_stats.claim_verdicts). An entry may
name its own {'baseline': name}; otherwise it is compared with the sweep's
baseline (default: the first entry). Seeds: --seeds, else the sweep's,
else the config's `seed`; each seed sets config.seed (init and data order).

Each entry and seed trains in WORKDIR/NAME/seed_S. Resumable: a run whose
checkpoint already reached train.steps is not retrained, and a partly
trained one continues from its latest checkpoint.

Writes WORKDIR/summary.json ({'seeds', 'baselines', 'runs', 'entries',
'comparisons', 'verdicts'}) and WORKDIR/summary.md. Per run: final val loss, mean
MaxVio_batch over the last 20% of steps (mean over MoE layers, and for the
first MoE layer), MaxVio_global over the validation set (mean over layers
and first layer) and training tokens/s (median over log intervals, so the
ones holding compilation do not count). Per entry: mean, std, n and spread
(max - min) over seeds of each column; against its baseline, the mean
difference, significant only when it exceeds both entries' max-min spread
(moe_jax/eval/sweep_stats.py). Per declared claim, one verdict line:
reproduced, not reproduced or within noise.
"""
from __future__ import annotations

import inspect
import json
import os

import numpy as np

from moe_jax.config_base import load_config_file, setter
from moe_jax.config_validation import validate_config
from moe_jax.eval import sweep_stats
from moe_jax.train.checkpoint import Checkpointer
from moe_jax.train.loop import train_and_evaluate
from moe_jax.train.metrics import read_metrics

COLUMNS = ("name", "val_loss", "maxvio_batch_last20", "maxvio_batch_last20_first",
           "maxvio_global", "maxvio_global_first", "tokens_per_sec")
# The columns aggregated over seeds.
STAT_COLUMNS = COLUMNS[1:]


def define_flags():
  """Defines the command's flags; only when it runs as a command, so that
  tests and notebooks import this module without absl flags."""
  global _CONFIG, _WORKDIR, _ONLY, _SEEDS
  from absl import flags
  _CONFIG = flags.DEFINE_string("config", "configs/ablations.py",
                                "Config file with get_sweep(): path.py[:arg].")
  _WORKDIR = flags.DEFINE_string("workdir", "runs/ablations",
                                 "Parent folder; one subfolder per entry.")
  _ONLY = flags.DEFINE_list("only", [], "Run only these entry names.")
  _SEEDS = flags.DEFINE_list("seeds", [], "Seeds, e.g. 0,1,2 (default: the "
                             "sweep's seeds, else the config's seed).")


def load_sweep(spec: str):
  """(base config, sweep) from 'path.py[:arg]'.

  The sweep is {'entries': [...], 'seeds': [...] or None, 'baseline': name,
  'claims': [...]};
  get_sweep(arg) is called with the arg when it takes one.
  """
  path, _, arg = spec.partition(":")
  module = load_config_file(path)
  if not hasattr(module, "get_sweep"):
    raise ValueError(f"--config={path} has no get_sweep()")
  takes_arg = bool(inspect.signature(module.get_sweep).parameters)
  sweep = module.get_sweep(arg or None) if takes_arg else module.get_sweep()
  if isinstance(sweep, list):
    sweep = {"entries": sweep}
  entries = sweep["entries"]
  names = [e["name"] for e in entries]
  if len(set(names)) != len(names):
    raise ValueError(f"--config={spec}: entry names repeat: {names}")
  baseline = sweep.get("baseline") or names[0]
  for name in [baseline] + [e["baseline"] for e in entries if "baseline" in e]:
    if name not in names:
      raise ValueError(f"--config={spec}: baseline {name!r} is not an entry; "
                       f"allowed: {names}")
  claims = sweep.get("claims", [])
  for c in claims:
    for key in ("candidate", "baseline"):
      if c[key] not in names:
        raise ValueError(f"--config={spec}: claim {c['text']!r} names "
                         f"{key} {c[key]!r}, not an entry; allowed: {names}")
    if c["claim"] not in sweep_stats.CLAIMS:
      raise ValueError(f"--config={spec}: claim {c['text']!r} has claim="
                       f"{c['claim']!r}; allowed: {list(sweep_stats.CLAIMS)}")
  return module.get_config(arg or None), {
      "entries": entries, "seeds": sweep.get("seeds"), "baseline": baseline,
      "claims": claims}


def _layer_order(key: str) -> int:
  return int(key.rsplit("_", 1)[1])


def _one_per_step(rows: list[dict]) -> list[dict]:
  """The last row of each step, by step: a resumed run re-logs the steps
  between its last checkpoint and the interruption."""
  by_step = {r["step"]: r for r in rows}
  return [by_step[k] for k in sorted(by_step)]


def summarize(workdir: str, name: str) -> dict:
  """The comparison row of one finished entry, from its metrics.jsonl."""
  rows = read_metrics(workdir)
  split = lambda s: _one_per_step([r for r in rows if r["split"] == s])  # noqa: E731
  router, evals, train = split("router"), split("eval"), split("train")
  if not router or not evals:
    raise ValueError(f"{workdir} has no router/eval rows: did it train?")
  last = router[-max(1, len(router) // 5):]  # the last 20% of steps
  layers = sorted({k for r in router for k in r if k.startswith("maxvio/")},
                  key=_layer_order)
  per_layer = {k: float(np.mean([r[k] for r in last])) for k in layers}
  final = evals[-1]
  globals_ = sorted((k for k in final if k.startswith("maxvio_global/")),
                    key=_layer_order)
  return {
      "name": name,
      "val_loss": final["val_loss"],
      "maxvio_batch_last20": float(np.mean(list(per_layer.values()))),
      "maxvio_batch_last20_first": per_layer[layers[0]],
      "maxvio_global": float(np.mean([final[k] for k in globals_])),
      "maxvio_global_first": final[globals_[0]],
      # The median over log intervals: the first interval (and the first
      # after a resume) includes compilation.
      "tokens_per_sec": float(np.median([r["tokens_per_sec"] for r in train])),
  }


def to_markdown(rows: list[dict]) -> str:
  """One line per run (entry and seed)."""
  cols = ("name", "seed") + STAT_COLUMNS
  lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  for r in rows:
    lines.append("| " + " | ".join(
        f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c])
        for c in cols) + " |")
  return "\n".join(lines) + "\n"


def run_dir(workdir: str, name: str, seed: int) -> str:
  """The workdir of one entry and seed."""
  return os.path.join(workdir, name, f"seed_{seed}")


def run_sweep(spec: str, workdir: str, only=(), seeds=()) -> dict:
  """Trains (or resumes) every entry x seed, writes and returns the summary.

  Returns {'seeds', 'baselines': {name: baseline name}, 'runs': per-run rows
  (COLUMNS + 'seed', 'workdir' relative to `workdir`), 'entries': per-entry
  statistics (sweep_stats.aggregate), 'comparisons': against the baselines
  (sweep_stats.compare)}.
  """
  base, sweep = load_sweep(spec)
  entries = sweep["entries"]
  if only:
    unknown = set(only) - {e["name"] for e in entries}
    if unknown:
      raise ValueError(f"--only names {sorted(unknown)} are not in the sweep; "
                       f"allowed: {[e['name'] for e in entries]}")
    entries = [e for e in entries if e["name"] in only]
  seeds = list(seeds or sweep["seeds"] or [base.seed])
  if (not all(str(s).isdigit() for s in seeds)
      or len({int(s) for s in seeds}) != len(seeds)):
    raise ValueError(f"--seeds={seeds}: allowed: distinct integers >= 0, "
                     "e.g. 0,1,2")
  seeds = [int(s) for s in seeds]
  runs = []  # (entry, seed, config)
  for entry in entries:  # Validate every entry before training any.
    for seed in seeds:
      config = base.copy_and_resolve_references()
      setter(**entry["overrides"])(config)
      config.seed = seed
      validate_config(config)
      runs.append((entry, seed, config))
  rows = []
  for entry, seed, config in runs:
    path = run_dir(workdir, entry["name"], seed)
    done = Checkpointer(path).latest_step() if os.path.isdir(
        os.path.join(path, "checkpoints")) else None
    if done != config.train.steps:
      print(f"[sweep] training {entry['name']} seed {seed} in {path}",
            flush=True)
      train_and_evaluate(config, path)
    else:
      print(f"[sweep] {entry['name']} seed {seed} already finished; "
            "not retrained")
    row = summarize(path, entry["name"])
    row.update(seed=seed, workdir=os.path.relpath(path, workdir))
    rows.append(row)
  baselines = {e["name"]: e.get("baseline", sweep["baseline"])
               for e in entries}
  stats = sweep_stats.aggregate(rows, STAT_COLUMNS)
  summary = {"seeds": seeds, "baselines": baselines, "runs": rows,
             "entries": stats,
             "comparisons": sweep_stats.compare(stats, STAT_COLUMNS, baselines),
             "verdicts": sweep_stats.claim_verdicts(rows, sweep["claims"])}
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  with open(os.path.join(workdir, "summary.md"), "w") as f:
    f.write(summary_markdown(summary))
  return summary


def summary_markdown(summary: dict) -> str:
  """The claims' verdicts, the per-entry statistics, the comparisons and
  the per-run table."""
  verdicts = "".join(f"- {v}\n" for v in summary["verdicts"])
  return (f"Seeds: {summary['seeds']}.\n\n"
          + (f"Claims:\n\n{verdicts}\n" if verdicts else "")
          + sweep_stats.to_markdown(summary["entries"], summary["comparisons"],
                                    STAT_COLUMNS)
          + "\nPer run:\n\n" + to_markdown(summary["runs"]))


def main(argv):
  from absl import app
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  import jax
  if not jax.config.jax_compilation_cache_dir:
    # Seeds of one entry compile the same programs: the second seed on
    # loads them from this cache instead of compiling again.
    jax.config.update("jax_compilation_cache_dir",
                      os.path.join(_WORKDIR.value, ".jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  summary = run_sweep(_CONFIG.value, _WORKDIR.value, _ONLY.value,
                      _SEEDS.value)
  print(summary_markdown(summary))


if __name__ == "__main__":
  from absl import app
  define_flags()
  app.run(main)
