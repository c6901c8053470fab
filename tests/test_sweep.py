"""The load-balancing sweep runs, resumes, summarises, and notebook 02 reads it."""
import json
import os

import pytest

from conftest import ROOT, execute_notebook
from experiments import sweep


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("sweep"))
  spec = str(ROOT / "configs" / "ablations.py") + ":tiny,smoke"
  rows = sweep.run_sweep(spec, workdir, only=("qb-exact", "sign"))
  return spec, workdir, rows


def test_sweep_summary_has_every_column(tiny_sweep):
  _, workdir, rows = tiny_sweep
  assert [r["name"] for r in rows] == ["qb-exact", "sign"]
  for r in rows:
    assert set(sweep.COLUMNS) <= set(r)
    assert r["val_loss"] > 0 and r["tokens_per_sec"] > 0
  assert json.load(open(os.path.join(workdir, "summary.json"))) == rows
  table = open(os.path.join(workdir, "summary.md")).read()
  assert "maxvio_batch_last20" in table and "| sign |" in table


def test_sweep_resumes_without_retraining(tiny_sweep, monkeypatch):
  spec, workdir, rows = tiny_sweep

  def fail(*args, **kwargs):
    raise AssertionError("a finished entry was retrained")

  monkeypatch.setattr(sweep, "train_and_evaluate", fail)
  assert sweep.run_sweep(spec, workdir, only=("qb-exact", "sign")) == rows


def test_sweep_rejects_unknown_entry(tiny_sweep):
  spec, workdir, _ = tiny_sweep
  with pytest.raises(ValueError, match=r"not in the sweep; allowed: "
                     r"\['qb-exact', 'qb-histogram', 'sign', 'aux', 'none'\]"):
    sweep.run_sweep(spec, workdir, only=("magic",))


def test_every_sweep_entry_is_a_valid_config():
  from moe_jax.config_base import setter
  from moe_jax.config_validation import validate_config
  base, entries = sweep.load_sweep(str(ROOT / "configs" / "ablations.py"))
  for entry in entries:
    config = base.copy_and_resolve_references()
    setter(**entry["overrides"])(config)
    validate_config(config)


def test_load_balancing_notebook_executes(tiny_sweep, monkeypatch):
  _, workdir, _ = tiny_sweep
  monkeypatch.setenv("MOE_JAX_SWEEP_DIR", workdir)
  _, outputs = execute_notebook("02_load_balancing.ipynb")
  assert os.path.exists(os.path.join(workdir, "loads_by_strategy.png"))
  assert "strategies plotted: ['qb-exact', 'sign']" in outputs


def test_summary_counts_each_step_once_after_a_resume(tmp_path):
  # Steps 1..10 were logged, the run died before checkpointing step 10,
  # resumed from step 2 and re-logged steps 3..10 with other values.
  def router(step, v):
    return {"split": "router", "step": step, "maxvio/moe_0": v}
  rows = [router(s, 100.0) for s in range(1, 11)] + [
      router(s, float(s)) for s in range(3, 11)]
  rows += [{"split": "train", "step": s, "tokens_per_sec": 10.0}
           for s in range(1, 11)]
  rows += [{"split": "eval", "step": 10, "val_loss": 2.0,
            "maxvio_global/moe_0": 0.5}]
  with open(tmp_path / "metrics.jsonl", "w") as f:
    f.write("\n".join(json.dumps(r) for r in rows) + "\n")
  row = sweep.summarize(str(tmp_path), "x")
  # 10 distinct steps: the last 20% are steps 9 and 10 (the 18 raw rows'
  # last 20% would be steps 8..10: 9.0).
  assert row["maxvio_batch_last20"] == 9.5
  assert row["val_loss"] == 2.0 and row["maxvio_global"] == 0.5
