r"""Runs a config's get_sweep() locally, one workdir per entry, and compares.

  python -m experiments.sweep --config=configs/ablations.py --workdir=runs/ablations
  python -m experiments.sweep --config=configs/ablations.py:tiny,smoke \
      --workdir=/tmp/abl --only=qb-exact,sign

Resumable: an entry whose checkpoint already reached train.steps is not
retrained, and a partly trained one continues from its latest checkpoint.
Writes WORKDIR/summary.md and WORKDIR/summary.json with, per entry: final val
loss, mean MaxVio_batch over the last 20% of steps (mean over MoE layers, and
for the first MoE layer), MaxVio_global over the validation set (mean over
layers and first layer) and training tokens/s.
"""
from __future__ import annotations

import importlib.util
import json
import os

from absl import app, flags
import numpy as np

from moe_jax.config_base import setter
from moe_jax.config_validation import validate_config
from moe_jax.train.checkpoint import Checkpointer
from moe_jax.train.loop import train_and_evaluate
from moe_jax.train.metrics import read_metrics

_CONFIG = flags.DEFINE_string("config", "configs/ablations.py",
                              "Config file with get_sweep(): path.py[:arg].")
_WORKDIR = flags.DEFINE_string("workdir", "runs/ablations",
                               "Parent folder; one subfolder per entry.")
_ONLY = flags.DEFINE_list("only", [], "Run only these entry names.")

COLUMNS = ("name", "val_loss", "maxvio_batch_last20", "maxvio_batch_last20_first",
           "maxvio_global", "maxvio_global_first", "tokens_per_sec")


def load_sweep(spec: str):
  """(base config, sweep entries) from 'path.py[:arg]'."""
  path, _, arg = spec.partition(":")
  module_spec = importlib.util.spec_from_file_location("sweep_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  if not hasattr(module, "get_sweep"):
    raise ValueError(f"--config={path} has no get_sweep()")
  return module.get_config(arg or None), module.get_sweep()


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
      "tokens_per_sec": float(np.mean([r["tokens_per_sec"] for r in train])),
  }


def to_markdown(rows: list[dict]) -> str:
  lines = ["| " + " | ".join(COLUMNS) + " |",
           "|" + "---|" * len(COLUMNS)]
  for r in rows:
    lines.append("| " + " | ".join(
        f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c])
        for c in COLUMNS) + " |")
  return "\n".join(lines) + "\n"


def run_sweep(spec: str, workdir: str, only=()) -> list[dict]:
  base, entries = load_sweep(spec)
  if only:
    unknown = set(only) - {e["name"] for e in entries}
    if unknown:
      raise ValueError(f"--only names {sorted(unknown)} are not in the sweep; "
                       f"allowed: {[e['name'] for e in entries]}")
    entries = [e for e in entries if e["name"] in only]
  configs = []
  for entry in entries:  # Validate every entry before training any.
    config = base.copy_and_resolve_references()
    setter(**entry["overrides"])(config)
    validate_config(config)
    configs.append(config)
  rows = []
  for entry, config in zip(entries, configs):
    run_dir = os.path.join(workdir, entry["name"])
    done = Checkpointer(run_dir).latest_step() if os.path.isdir(
        os.path.join(run_dir, "checkpoints")) else None
    if done != config.train.steps:
      print(f"[sweep] training {entry['name']} in {run_dir}", flush=True)
      train_and_evaluate(config, run_dir)
    else:
      print(f"[sweep] {entry['name']} already finished; not retrained")
    rows.append(summarize(run_dir, entry["name"]))
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(rows, f, indent=1)
  with open(os.path.join(workdir, "summary.md"), "w") as f:
    f.write(to_markdown(rows))
  return rows


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  rows = run_sweep(_CONFIG.value, _WORKDIR.value, _ONLY.value)
  print(to_markdown(rows))


if __name__ == "__main__":
  app.run(main)
