"""Load-balancing ablation on the default model: QB (exact, histogram), sign
rule, auxiliary loss, and no balancing, with everything else held fixed.

Run the whole sweep (resumable; rerun to continue) and write the comparison:
  python -m experiments.sweep --config=configs/ablations.py --workdir=runs/ablations
With 32 sequences per batch (the run recorded in results/load_balancing.md):
  python -m experiments.sweep --config=configs/ablations.py:batch32 --workdir=runs/abl_b32
A tiny, fast version (what the tests and notebook 02 use):
  python -m experiments.sweep --config=configs/ablations.py:tiny,smoke --workdir=/tmp/abl
On a GPU, against the ~100M model:
  python -m experiments.sweep --config=configs/ablations.py:gpu_small --workdir=runs/abl_gpu
"""
from moe_jax.config_base import apply_variant, load_config_file


def get_config(arg: str | None = None):
  """The base config of the sweep: default.py, or gpu_small.py if named.

  `arg` lists variants of configs/default.py (e.g. 'tiny,smoke'); the word
  'gpu_small' switches the base to configs/gpu_small.py.
  """
  names = [a for a in (arg or "").split(",") if a]
  if "gpu_small" in names:
    names.remove("gpu_small")
    gpu_small = load_config_file("gpu_small.py", __file__)
    return gpu_small.get_config(",".join(names))
  default = load_config_file("default.py", __file__)
  return apply_variant(default.get_config(), ",".join(names), default.VARIANTS)


def get_sweep():
  """One entry per strategy: {'name': ..., 'overrides': {dotted.field: value}}."""
  return [
      {"name": "qb-exact", "overrides": {"model.moe.balancing": "qb",
                                         "model.moe.qb_estimator": "exact"}},
      {"name": "qb-histogram", "overrides": {
          "model.moe.balancing": "qb", "model.moe.qb_estimator": "histogram"}},
      {"name": "sign", "overrides": {"model.moe.balancing": "sign"}},
      {"name": "aux", "overrides": {"model.moe.balancing": "aux"}},
      {"name": "none", "overrides": {"model.moe.balancing": "none"}},
  ]
