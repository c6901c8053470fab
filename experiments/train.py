r"""Trains a model from an ml_collections config file.

Run from the repository root (`python -m` finds the `experiments` package
and the `configs/` paths there):
  python -m experiments.train --config=configs/default.py --workdir=runs/default
  python -m experiments.train --config=configs/default.py:sign \
      --config.model.moe.num_experts=64 --workdir=runs/sign64

Re-running with the same --workdir resumes from its newest checkpoint that
verifies; its config must keep the shapes of the saved state (other changes
are logged, or refused with --strict_resume). Overrides may come before or
after --config.

Exit status: 0 when the run reached its last step, 75 (EX_TEMPFAIL) when
SIGTERM stopped it after saving (rerun to continue), 1 on an error.

Multi-host (one process per host, same command everywhere):
  python -m experiments.train --config=... --workdir=/shared/run \
      --coordinator_address=host0:1234 --num_processes=4 --process_id=$I
Each process reads its slice of every global batch; only process 0 writes
metrics; checkpoints are written collectively by orbax.
"""
import logging as logging_std
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from moe_jax.config_validation import ConfigError, validate_config
from moe_jax.data import TokenFileError
from moe_jax.data.vision import VisionDataError
from moe_jax.sharding import init_distributed
from moe_jax.train.checkpoint import CheckpointError
from moe_jax.train.loop import (EXIT_PREEMPTED, NonFiniteError, WorkdirError,
                                train_and_evaluate)

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/default.py",
    "Config file, optionally with variants: path.py[:variant,variant].",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "runs/default",
                               "Where checkpoints and metrics go.")
_STOP_AT = flags.DEFINE_integer(
    "stop_at_step", None, "Stop (after checkpointing) at this step, keeping "
    "the schedule of train.steps; rerun to continue.")
_STRICT_RESUME = flags.DEFINE_bool(
    "strict_resume", False, "Refuse to resume a workdir whose saved config "
    "differs in any field but placement ones (mesh, backends, compute dtype, "
    "logging intervals); without it only shape changes are refused.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "Multi-host: host:port of process 0; with "
    "--num_processes and --process_id calls jax.distributed.initialize.")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Multi-host: total number of processes.")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "Multi-host: this process's index in "
    "[0, num_processes).")

# Errors whose message says all there is to say: printed without traceback.
_USER_ERRORS = (ConfigError, CheckpointError, NonFiniteError, WorkdirError,
                TokenFileError, VisionDataError)


class _QuietLibraries(logging_std.Filter):
  """Drops library INFO noise: orbax's per-save lines, JAX's TPU probe."""

  def filter(self, record):
    if record.levelno >= logging_std.WARNING:
      return True
    if "/orbax/" in record.pathname:
      return False
    return not (record.pathname.endswith("xla_bridge.py")
                and "Unable to initialize backend" in record.getMessage())


def config_flag_first(argv: list[str]) -> list[str]:
  """argv with --config (and its value) moved before the --config.x.y=v.

  config_flags applies an override only after the file is loaded, and
  refuses one that comes first (it reads sys.argv itself, so the caller
  reorders sys.argv); the order on the command line is the user's.
  """
  head, rest, moved = argv[:1], [], []
  i = 1
  while i < len(argv):
    arg = argv[i]
    if arg == "--":
      rest.extend(argv[i:])
      break
    if arg.startswith(("--config=", "-config=")):
      moved.append(arg)
    elif arg in ("--config", "-config") and i + 1 < len(argv):
      moved.extend(argv[i:i + 2])
      i += 1
    else:
      rest.append(arg)
    i += 1
  return head + moved + rest


def final_line(result: dict) -> str:
  """The one-line summary printed at the end (process 0)."""
  parts = [f"step={result['step']}"]
  for k in ("loss", "val_loss", "val_bpb", "unigram_bpb",
            "val_bpb_over_unigram", "acc/all"):
    if k in result:
      parts.append(f"{k}={result[k]:.4f}")
  notes = []
  for key, what in (("train_step", "loss"), ("eval_step", "val_*")):
    if result.get(key) is not None and result[key] != result["step"]:
      notes.append(f"{what} from step {result[key]}")
  if result.get("preempted"):
    notes.append(f"stopped by SIGTERM after saving step {result['step']}; "
                 f"exit {EXIT_PREEMPTED}, rerun to continue")
  return "final: " + " ".join(parts) + "".join(f" | {n}" for n in notes)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  try:  # Before anything touches a JAX backend.
    init_distributed(_COORDINATOR.value, _NUM_PROCESSES.value,
                     _PROCESS_ID.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  logging.get_absl_handler().addFilter(_QuietLibraries())
  config = _CONFIG.value
  try:
    validate_config(config)  # Before anything touches an accelerator.
    result = train_and_evaluate(config, _WORKDIR.value,
                                stop_at_step=_STOP_AT.value,
                                strict_resume=_STRICT_RESUME.value)
  except _USER_ERRORS as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  if jax.process_index() == 0:
    print(final_line(result))
  return EXIT_PREEMPTED if result["preempted"] else 0


if __name__ == "__main__":
  sys.argv[:] = config_flag_first(sys.argv)
  app.run(main)
