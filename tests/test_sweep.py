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
  summary = sweep.run_sweep(spec, workdir, only=("qb-exact", "sign"))
  return spec, workdir, summary


def test_sweep_summary_has_every_column(tiny_sweep):
  _, workdir, summary = tiny_sweep
  rows = summary["runs"]
  # One seed (the config's), one workdir per entry and seed.
  assert [(r["name"], r["seed"], r["workdir"]) for r in rows] == [
      ("qb-exact", 0, os.path.join("qb-exact", "seed_0")),
      ("sign", 0, os.path.join("sign", "seed_0"))]
  for r in rows:
    assert set(sweep.COLUMNS) <= set(r)
    assert r["val_loss"] > 0 and r["tokens_per_sec"] > 0
  assert json.load(open(os.path.join(workdir, "summary.json"))) == summary
  table = open(os.path.join(workdir, "summary.md")).read()
  assert "maxvio_batch_last20" in table and "| sign | 0 |" in table
  # The first entry is the baseline; one seed has no spread: nothing is
  # significant.
  assert summary["baselines"] == {"qb-exact": "qb-exact", "sign": "qb-exact"}
  (comparison,) = summary["comparisons"]
  assert comparison["name"] == "sign"
  assert not any(comparison[c]["significant"] for c in sweep.STAT_COLUMNS)


def test_sweep_resumes_without_retraining(tiny_sweep, monkeypatch):
  spec, workdir, summary = tiny_sweep

  def fail(*args, **kwargs):
    raise AssertionError("a finished entry was retrained")

  monkeypatch.setattr(sweep, "train_and_evaluate", fail)
  assert sweep.run_sweep(spec, workdir, only=("qb-exact", "sign")) == summary


def test_sweep_rejects_unknown_entry(tiny_sweep):
  spec, workdir, _ = tiny_sweep
  with pytest.raises(ValueError, match=r"not in the sweep; allowed: "
                     r"\['qb-exact', 'qb-histogram', 'sign', 'aux', 'none'\]"):
    sweep.run_sweep(spec, workdir, only=("magic",))


@pytest.mark.parametrize("spec", [
    "ablations.py", "evidence.py:residuals", "evidence.py:residual_length",
    "evidence.py:decay", "evidence.py:balancing",
    "evidence.py:balancing_extreme", "evidence.py:residual_length,tiny"])
def test_every_sweep_entry_is_a_valid_config(spec):
  from moe_jax.config_base import setter
  from moe_jax.config_validation import validate_config
  base, swept = sweep.load_sweep(str(ROOT / "configs" / spec))
  for entry in swept["entries"]:
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


@pytest.fixture(scope="module")
def evidence_sweep(tmp_path_factory):
  """The tiny residuals sweep, two entries x two seeds (the sweep declares
  three seeds; --seeds overrides them)."""
  workdir = str(tmp_path_factory.mktemp("evidence"))
  spec = str(ROOT / "configs" / "evidence.py") + ":residuals,tiny"
  summary = sweep.run_sweep(spec, workdir, only=("standard", "block-2"),
                            seeds=("0", "1"))
  return workdir, summary


def test_seeds_train_in_distinct_workdirs_and_aggregate(evidence_sweep):
  import numpy as np
  workdir, summary = evidence_sweep
  runs = summary["runs"]
  assert summary["seeds"] == [0, 1]
  assert [(r["name"], r["seed"]) for r in runs] == [
      ("standard", 0), ("standard", 1), ("block-2", 0), ("block-2", 1)]
  assert len({r["workdir"] for r in runs}) == 4
  for r in runs:
    saved = json.load(open(os.path.join(workdir, r["workdir"], "config.json")))
    assert saved["seed"] == r["seed"]
  # Different seeds train differently (init and data order).
  assert runs[0]["val_loss"] != runs[1]["val_loss"]
  entries = {e["name"]: e for e in summary["entries"]}
  for name in ("standard", "block-2"):
    values = [r["val_loss"] for r in runs if r["name"] == name]
    stat = entries[name]["val_loss"]
    assert stat["n"] == 2 and stat["values"] == values
    assert stat["mean"] == pytest.approx(np.mean(values))
    assert stat["std"] == pytest.approx(np.std(values, ddof=1))
    assert stat["spread"] == pytest.approx(max(values) - min(values))
  (comparison,) = summary["comparisons"]
  assert (comparison["name"], comparison["baseline"]) == ("block-2",
                                                          "standard")
  diff = comparison["val_loss"]
  assert diff["diff"] == pytest.approx(entries["block-2"]["val_loss"]["mean"]
                                       - entries["standard"]["val_loss"]["mean"])
  assert diff["significant"] == (
      abs(diff["diff"]) > entries["block-2"]["val_loss"]["spread"]
      and abs(diff["diff"]) > entries["standard"]["val_loss"]["spread"])
  table = open(os.path.join(workdir, "summary.md")).read()
  assert "| block-2 | standard |" in table and "max-min over seeds" in table


def test_evidence_sweep_names_are_validated():
  spec = str(ROOT / "configs" / "evidence.py")
  allowed = (r"allowed sweeps: \['residuals', 'residual_length', 'decay', "
             r"'balancing', 'balancing_extreme'\]")
  for arg in ("", ":residual", ":residuals,decay"):
    with pytest.raises(ValueError, match=allowed):
      sweep.load_sweep(spec + arg)
  _, swept = sweep.load_sweep(spec + ":balancing_extreme")
  assert swept["seeds"] == [0, 1, 2] and swept["baseline"] == "sign"


def test_sweep_rejects_bad_seeds(evidence_sweep):
  workdir, _ = evidence_sweep
  spec = str(ROOT / "configs" / "evidence.py") + ":residuals,tiny"
  for seeds in (("0", "0"), ("-1",), ("a",)):
    with pytest.raises(ValueError, match="allowed: distinct integers >= 0"):
      sweep.run_sweep(spec, workdir, only=("standard",), seeds=seeds)


def test_attention_residuals_notebook_executes(evidence_sweep, monkeypatch):
  workdir, _ = evidence_sweep
  monkeypatch.setenv("MOE_JAX_SWEEP_DIR", workdir)
  _, outputs = execute_notebook("03_attention_residuals.ipynb")
  assert os.path.exists(os.path.join(workdir, "depth_attention.png"))
  # 2 layers: 4 sublayer mixes + the final one; sources: the embedding, the
  # completed block and the partial sum.
  assert "mixes: 5 sources: 3" in outputs
  assert "weights rows sum to 1: True" in outputs
  assert "block sizes plotted: [(2, 'block-2')]" in outputs
  assert "hidden norms finite: True" in outputs
  assert "standard: hidden RMS first" in outputs
