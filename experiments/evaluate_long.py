r"""Length-extrapolation evaluation of a checkpoint: tables and figures.

  python -m experiments.evaluate_long --workdir=runs/curriculum
  python -m experiments.evaluate_long --workdir=runs/curriculum --step=160 \
      --tasks=passkey --factors=1,2,4 --depths=0,0.5,1 --samples=16

From a training workdir's checkpoint (the latest, or --step) and the model
config saved with it, measures (moe_jax/eval/long_context.py):
  - loss against position on held-out windows of max(factors) x the
    training length (the seq_len of the curriculum stage the checkpoint
    belongs to), from the validation split of the run's own data;
  - passkey retrieval accuracy over context length (factors x training
    length) x needle depth (greedy answers: the teacher-forced argmax of
    every answer digit, which is what greedy decoding produces);
  - MQAR accuracy over the number of key-value pairs x length.
Writes into --out (default WORKDIR/long_context/step_N): long_context.md
(the tables), results.json, and loss_by_position.png, passkey.png, mqar.png
where matplotlib is installed (tables only otherwise). Lengths too short
for a task's prompt are skipped with a log line.

The one-GPU results of the curriculum (configs/gpu_small.py:curriculum,
final stage 256K; passkey up to 4x = 1M, loss up to 16x needs a token file
with a validation split of more than 4M tokens, --config.data.val_path):
  python -m experiments.evaluate_long --workdir=runs/gs_ladder \
      --factors=1,2,4 --samples=8
  python -m experiments.evaluate_long --workdir=runs/gs_ladder_rope \
      --factors=1,2,4 --samples=8
  python -m experiments.evaluate_long --workdir=runs/gs_ladder_unb \
      --factors=1,2,4 --samples=8
and, per stage, --step=2000, 2500, 2700 (the stages' last steps).
The same checkpoint with MLA's queries scaled past the training length
(model.mla.logn_scale_len; the params do not change):
  python -m experiments.evaluate_long --workdir=runs/gs_ladder \
      --factors=1,2,4 --samples=8 --logn_scale_len=262144
"""
from __future__ import annotations

import json
import os

import ml_collections
import numpy as np
from absl import app, flags, logging

from experiments.generate import load_checkpoint
from moe_jax.config_validation import validate_config
from moe_jax.curriculum import stage_at, stages_of
from moe_jax.data import make_datasets
from moe_jax.eval import long_context as lc
from moe_jax.model import build_model

TASKS = ("loss", "passkey", "mqar")


def define_flags():
  """Defines the command's flags; only when it runs as a command."""
  global _WORKDIR, _STEP, _OUT, _TASKS, _FACTORS, _DEPTHS, _SAMPLES, \
      _PAIRS, _SEED, _BATCH, _LOGN
  _WORKDIR = flags.DEFINE_string("workdir", "runs/default",
                                 "Training workdir (with checkpoints/).")
  _STEP = flags.DEFINE_integer("step", None,
                               "Checkpoint step; default the latest.")
  _OUT = flags.DEFINE_string("out", None, "Output folder; default "
                             "WORKDIR/long_context/step_N.")
  _TASKS = flags.DEFINE_list("tasks", list(TASKS), f"Any of {TASKS}.")
  _FACTORS = flags.DEFINE_list(
      "factors", ["1", "2", "4", "8", "16"], "Context lengths as multiples "
      "of the training length (loss: up to the largest).")
  _DEPTHS = flags.DEFINE_list("depths", ["0", "0.25", "0.5", "0.75", "1"],
                              "Passkey needle depths in [0, 1].")
  _SAMPLES = flags.DEFINE_integer("samples", 8, "Sequences per cell.")
  _PAIRS = flags.DEFINE_list("mqar_pairs", ["4", "8", "16", "32"],
                             "MQAR key-value pair counts.")
  _SEED = flags.DEFINE_integer("seed", 0, "Generator seed.")
  _LOGN = flags.DEFINE_integer(
      "logn_scale_len", None, "Evaluate with model.mla.logn_scale_len set "
      "to this (0 = off; e.g. the training length: MLA queries scaled by "
      "log(p + 1) / log(L) past L); default as trained.")
  _BATCH = flags.DEFINE_integer(
      "batch_size", 1, "Sequences per forward (0 = all --samples of a cell "
      "at once; one compilation per length either way).")


def train_length(config: ml_collections.ConfigDict, step: int) -> int:
  """The seq_len the checkpoint of `step` was trained at."""
  if "curriculum" not in config:
    return config.data.seq_len
  return stage_at(stages_of(config), step - 1).seq_len


def _no_nan(tree):
  """NaN (a cell a task skips) as null, so that results.json is JSON."""
  if isinstance(tree, dict):
    return {k: _no_nan(v) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    return [_no_nan(v) for v in tree]
  return None if isinstance(tree, float) and tree != tree else tree


def evaluate_long(workdir: str, *, step: int | None = None,
                  out: str | None = None, tasks=TASKS,
                  factors=(1, 2, 4, 8, 16),
                  depths=(0.0, 0.25, 0.5, 0.75, 1.0), samples: int = 8,
                  mqar_pairs=(4, 8, 16, 32), seed: int = 0,
                  batch_size: int = 1,
                  logn_scale_len: int | None = None) -> dict:
  """Runs the tasks on a checkpoint; writes tables, JSON and figures.

  logn_scale_len: model.mla.logn_scale_len for the evaluation (None: the
    trained model's). The params do not depend on it.

  Returns:
    dict(step, train_len, out, loss (rows), passkey, mqar (grids as lists),
    figures (paths written)).
  """
  unknown = sorted(set(tasks) - set(TASKS))
  if unknown:
    raise ValueError(f"unknown tasks {unknown}; allowed: {list(TASKS)}")
  config, model, params, router_state, step = load_checkpoint(workdir, step)
  if logn_scale_len is not None:
    config.model.mla.logn_scale_len = logn_scale_len
    validate_config(config)
    model = build_model(config)
  train_len = train_length(config, step)
  out = out or os.path.join(workdir, "long_context", f"step_{step}")
  os.makedirs(out, exist_ok=True)
  scorer = lc.batched(lc.make_scorer(model, params, router_state),
                      batch_size)
  lengths = sorted({int(round(f * train_len)) for f in factors})
  logn = config.model.mla.get("logn_scale_len", 0)
  result = {"step": step, "train_len": train_len, "out": out, "figures": [],
            "logn_scale_len": logn}
  md = [f"# Length extrapolation of {workdir}, step {step}\n",
        f"Training length {train_len}; lengths {lengths}; MLA query "
        f"log-n scaling past {logn or 'off'}.\n"]

  def figure(name, plot, *args):
    path = os.path.join(out, name)
    if plot(*args, path):
      result["figures"].append(path)

  if "loss" in tasks:
    _, val_tokens, _, _ = make_datasets(dict(config.data.to_dict(),
                                             seed=config.seed))
    rows = lc.loss_by_position(scorer, val_tokens, train_len, max(lengths),
                               samples)
    result["loss"] = rows
    md += ["\n## Loss against position (held-out windows of "
           f"{max(lengths)}, {samples} sequences)\n\n", lc.loss_table(rows)]
    figure("loss_by_position.png", lc.plot_loss, rows, train_len)
  if "passkey" in tasks:
    usable = [n for n in lengths if n > lc.passkey_overhead()]
    if len(usable) < len(lengths):
      logging.warning("passkey: skipping lengths %s (the prompt needs more "
                      "than %d tokens)", sorted(set(lengths) - set(usable)),
                      lc.passkey_overhead())
    if usable:
      res = lc.passkey_accuracy(scorer, usable, depths, samples, seed)
      result["passkey"] = dict(res, accuracy=res["accuracy"].tolist(),
                               digit_accuracy=res["digit_accuracy"].tolist())
      md += [f"\n## Passkey retrieval accuracy ({samples} keys per cell)\n\n",
             lc.passkey_table(res)]
      figure("passkey.png", lc.plot_passkey, res)
  if "mqar" in tasks:
    res = lc.mqar_accuracy(scorer, lengths, mqar_pairs, samples, seed)
    result["mqar"] = dict(res, accuracy=res["accuracy"].tolist())
    md += [f"\n## MQAR accuracy ({samples} sequences per cell; n/a: too "
           "short for the pairs)\n\n", lc.mqar_table(res)]
    figure("mqar.png", lc.plot_mqar, res)

  with open(os.path.join(out, "long_context.md"), "w") as f:
    f.write("".join(md))
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(_no_nan(result), f, indent=1)
  return result


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # orbax logs every file at INFO
  try:
    res = evaluate_long(
        _WORKDIR.value, step=_STEP.value, out=_OUT.value, tasks=_TASKS.value,
        factors=[float(f) for f in _FACTORS.value],
        depths=[float(d) for d in _DEPTHS.value], samples=_SAMPLES.value,
        mqar_pairs=[int(p) for p in _PAIRS.value], seed=_SEED.value,
        batch_size=_BATCH.value, logn_scale_len=_LOGN.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  with open(os.path.join(res["out"], "long_context.md")) as f:
    print(f.read())
  print(f"--- written to {res['out']}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
