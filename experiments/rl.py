r"""Agentic RL post-training: warm-up on demonstrations, then GRPO.

Run from the repository root:
  python -m experiments.rl --config=configs/rl.py --workdir=runs/rl
  python -m experiments.rl --config=configs/rl.py:tiny --workdir=runs/rl_tiny
Writes <workdir>/metrics.jsonl (splits warmup, rl, heldout), TensorBoard
events, and checkpoints under <workdir>/warmup and <workdir>/rl; prints the
held-out pass@1 and best-of-N before and after RL. Rerunning a workdir
resumes it: a finished warm-up is restored, the RL phase continues from its
newest checkpoint.
"""
import json
import sys

from absl import app, flags
from ml_collections import config_flags

from moe_jax.config_validation import ConfigError
from moe_jax.rl.loop import RLWorkdirError, run
from moe_jax.train.checkpoint import CheckpointError


def define_flags():
  config = config_flags.DEFINE_config_file(
      "config", "configs/rl.py",
      "Config file, optionally with variants: path.py[:variant,variant].",
      lock_config=True)
  workdir = flags.DEFINE_string("workdir", "runs/rl",
                                "Where checkpoints and metrics go.")
  return config, workdir


def main(argv):
  del argv
  try:
    results = run(_CONFIG.value, _WORKDIR.value)
  except (ConfigError, CheckpointError, RLWorkdirError) as e:
    # The message says all there is to say: no traceback.
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
  print(json.dumps(results, indent=1))


if __name__ == "__main__":
  _CONFIG, _WORKDIR = define_flags()
  app.run(main)
