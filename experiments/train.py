r"""Trains a model from an ml_collections config file.

  python -m experiments.train --config=configs/default.py --workdir=runs/default
  python -m experiments.train --config=configs/default.py:sign \
      --config.model.moe.num_experts=64 --workdir=runs/sign64

Re-running with the same --workdir resumes from its latest checkpoint.

Multi-host (one process per host, same command everywhere):
  python -m experiments.train --config=... --workdir=/shared/run \
      --coordinator_address=host0:1234 --num_processes=4 --process_id=$I
Each process reads its slice of every global batch; only process 0 writes
metrics; checkpoints are written collectively by orbax.
"""
import logging as logging_std

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from moe_jax.config_validation import validate_config
from moe_jax.sharding import init_distributed
from moe_jax.train.loop import train_and_evaluate

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/default.py",
    "Config file, optionally with variants: path.py[:variant,variant].",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "runs/default",
                               "Where checkpoints and metrics go.")
_STOP_AT = flags.DEFINE_integer(
    "stop_at_step", None, "Stop (after checkpointing) at this step, keeping "
    "the schedule of train.steps; rerun to continue.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "Multi-host: host:port of process 0; with "
    "--num_processes and --process_id calls jax.distributed.initialize.")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Multi-host: total number of processes.")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "Multi-host: this process's index in "
    "[0, num_processes).")


class _DropOrbaxInfo(logging_std.Filter):
  """Orbax logs every save step at INFO; keep its warnings and errors only."""

  def filter(self, record):
    return record.levelno >= logging_std.WARNING or (
        "/orbax/" not in record.pathname)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  try:  # Before anything touches a JAX backend.
    init_distributed(_COORDINATOR.value, _NUM_PROCESSES.value,
                     _PROCESS_ID.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  logging.get_absl_handler().addFilter(_DropOrbaxInfo())
  config = _CONFIG.value
  validate_config(config)  # Before anything touches an accelerator.
  logging.info("Config:\n%s", config)
  result = train_and_evaluate(config, _WORKDIR.value,
                              stop_at_step=_STOP_AT.value)
  summary = {k: result[k] for k in ("step", "loss", "val_loss", "val_bpb",
                                    "unigram_bpb", "val_bpb_over_unigram")
             if k in result}
  if jax.process_index() != 0:
    return
  print("final:", " ".join(f"{k}={v:.4f}" if isinstance(v, float) else
                           f"{k}={v}" for k, v in summary.items()))


if __name__ == "__main__":
  app.run(main)
