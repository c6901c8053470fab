"""Sweeps run over seeds, resume, summarise with statistics, and notebooks
02 and 03 read them."""
import json
import os

import numpy as np
import pytest

from conftest import ROOT, execute_notebook
from experiments import sweep
from moe_jax.eval import sweep_stats

EVIDENCE = str(ROOT / "configs" / "evidence.py")


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
  """The tiny residuals sweep, two entries x two seeds (the sweep declares
  three seeds; the seeds argument overrides them). Its tiny models have a
  QB-balanced MoE, so notebook 02 reads it too."""
  workdir = str(tmp_path_factory.mktemp("sweep"))
  spec = EVIDENCE + ":residuals,tiny"
  summary = sweep.run_sweep(spec, workdir, only=("standard", "block-2"),
                            seeds=("0", "1"))
  return spec, workdir, summary


def test_sweep_summary_has_every_column(tiny_sweep):
  _, workdir, summary = tiny_sweep
  for r in summary["runs"]:
    assert set(sweep.COLUMNS) <= set(r)
    assert r["val_loss"] > 0 and r["tokens_per_sec"] > 0
    assert np.isfinite([r[c] for c in sweep.STAT_COLUMNS]).all()
  assert json.load(open(os.path.join(workdir, "summary.json"))) == summary
  table = open(os.path.join(workdir, "summary.md")).read()
  assert "maxvio_batch_last20" in table and "| block-2 | 1 |" in table
  assert "| block-2 | standard |" in table and "max-min over seeds" in table
  # The claims of the entries that ran get a verdict; the others say so.
  verdicts = summary["verdicts"]
  assert any(v.startswith("block-2 lowers val loss vs standard residuals: ")
             and v.split(": ")[1].split(" (")[0] in sweep_stats.VERDICTS
             for v in verdicts)
  assert ("full lowers val loss vs standard residuals: not run (full "
          "missing)") in verdicts
  assert "- block-2 lowers val loss vs standard residuals: " in table


def test_seeds_train_in_distinct_workdirs_and_aggregate(tiny_sweep):
  _, workdir, summary = tiny_sweep
  runs = summary["runs"]
  assert summary["seeds"] == [0, 1]
  assert [(r["name"], r["seed"], r["workdir"]) for r in runs] == [
      (n, s, os.path.join(n, f"seed_{s}"))
      for n in ("standard", "block-2") for s in (0, 1)]
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
  assert summary["baselines"] == {"standard": "standard",
                                  "block-2": "standard"}
  (comparison,) = summary["comparisons"]
  assert (comparison["name"], comparison["baseline"]) == ("block-2",
                                                          "standard")
  diff = comparison["val_loss"]
  block, standard = entries["block-2"]["val_loss"], entries["standard"][
      "val_loss"]
  assert diff["diff"] == pytest.approx(block["mean"] - standard["mean"])
  assert diff["significant"] == (abs(diff["diff"]) > block["spread"]
                                 and abs(diff["diff"]) > standard["spread"])


def test_sweep_resumes_without_retraining(tiny_sweep, monkeypatch):
  spec, workdir, summary = tiny_sweep

  def fail(*args, **kwargs):
    raise AssertionError("a finished entry was retrained")

  monkeypatch.setattr(sweep, "train_and_evaluate", fail)
  assert sweep.run_sweep(spec, workdir, only=("standard", "block-2"),
                         seeds=("0", "1")) == summary


def test_sweep_rejects_unknown_entry_and_bad_seeds(tiny_sweep):
  spec, workdir, _ = tiny_sweep
  with pytest.raises(ValueError, match=r"not in the sweep; allowed: "
                     r"\['standard', 'block-4', 'block-2', 'full'\]"):
    sweep.run_sweep(spec, workdir, only=("magic",))
  for seeds in (("0", "0"), ("-1",), ("a",)):
    with pytest.raises(ValueError, match="allowed: distinct integers >= 0"):
      sweep.run_sweep(spec, workdir, only=("standard",), seeds=seeds)


def test_evidence_sweep_names_are_validated():
  allowed = (r"allowed sweeps: \['residuals', 'residual_length', 'decay', "
             r"'balancing', 'balancing_extreme'\]")
  for arg in ("", ":residual", ":residuals,decay"):
    with pytest.raises(ValueError, match=allowed):
      sweep.load_sweep(EVIDENCE + arg)
  _, swept = sweep.load_sweep(EVIDENCE + ":balancing_extreme")
  assert swept["seeds"] == [0, 1, 2] and swept["baseline"] == "sign"
  assert {c["candidate"] for c in swept["claims"]} == {"qb-exact",
                                                       "qb-histogram"}
  base, _ = sweep.load_sweep(EVIDENCE + ":balancing_extreme")
  assert (base.model.moe.num_experts, base.model.moe.top_k) == (256, 8)
  base, _ = sweep.load_sweep(EVIDENCE + ":balancing_extreme,cpu")
  assert (base.model.moe.num_experts, base.data.batch_size) == (256, 32)
  with pytest.raises(ValueError, match=r"at most one size, got \['cpu', "
                     r"'tiny'\]; allowed sizes: \['gpu_small', 'cpu', 'tiny'\]"):
    sweep.load_sweep(EVIDENCE + ":decay,cpu,tiny")


def test_sweep_declarations_are_checked(tmp_path):
  def declare(sweep_dict):
    path = tmp_path / "bad_sweep.py"
    path.write_text(
        "from moe_jax.config_base import base_config\n"
        "def get_config(arg=None):\n  return base_config()\n"
        f"def get_sweep():\n  return {sweep_dict!r}\n")
    return str(path)
  a = {"name": "a", "overrides": {}}
  b = {"name": "b", "overrides": {}, "baseline": "c"}
  claim = {"text": "t", "column": "val_loss", "candidate": "a",
           "baseline": "z", "claim": "lower"}
  with pytest.raises(ValueError, match=r"baseline 'c' is not an entry; "
                     r"allowed: \['a', 'b'\]"):
    sweep.load_sweep(declare({"entries": [a, b]}))
  with pytest.raises(ValueError, match="entry names repeat"):
    sweep.load_sweep(declare([a, a]))
  with pytest.raises(ValueError, match=r"claim 't' names baseline 'z', not "
                     r"an entry; allowed: \['a'\]"):
    sweep.load_sweep(declare({"entries": [a], "claims": [claim]}))
  with pytest.raises(ValueError, match=r"claim='less'; allowed: \['lower'"):
    sweep.load_sweep(declare({"entries": [a], "claims": [
        dict(claim, baseline="a", claim="less")]}))


@pytest.mark.parametrize("spec", [
    "ablations.py", "evidence.py:residuals", "evidence.py:residual_length",
    "evidence.py:decay", "evidence.py:balancing",
    "evidence.py:balancing_extreme", "evidence.py:residual_length,tiny",
    "evidence.py:residual_length,cpu", "evidence.py:balancing_extreme,cpu"])
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
  assert "strategies plotted: ['standard', 'block-2']" in outputs


def test_attention_residuals_notebook_executes(tiny_sweep, monkeypatch):
  _, workdir, _ = tiny_sweep
  monkeypatch.setenv("MOE_JAX_SWEEP_DIR", workdir)
  _, outputs = execute_notebook("03_attention_residuals.ipynb")
  assert os.path.exists(os.path.join(workdir, "depth_attention.png"))
  # 2 layers, 2 sublayers per block: 4 sublayer mixes and the final one,
  # reading the embedding, then the partial sum, then the closed block.
  assert "mixes: 5 sources: 3" in outputs
  assert "sources per mix: [1, 2, 2, 3, 3]" in outputs
  assert "weights of every mix sum to 1: True" in outputs
  assert "block sizes plotted: [(2, 'block-2')]" in outputs
  # One per sublayer input (4) and the final hidden state, per model.
  assert "standard: 5 hidden RMS values" in outputs
  assert "block-2: 5 hidden RMS values" in outputs
  assert "hidden norms finite: True" in outputs


def test_summary_counts_each_step_once_after_a_resume(tmp_path):
  # Steps 1..10 were logged, the run died before checkpointing step 10,
  # resumed from step 2 and re-logged steps 3..10 with other values.
  def router(step, v):
    return {"split": "router", "step": step, "maxvio/moe_0": v}
  rows = [router(s, 100.0) for s in range(1, 11)] + [
      router(s, float(s)) for s in range(3, 11)]
  # The first interval held the compilation.
  rows += [{"split": "train", "step": s,
            "tokens_per_sec": 0.5 if s == 1 else 10.0} for s in range(1, 11)]
  rows += [{"split": "eval", "step": 10, "val_loss": 2.0,
            "maxvio_global/moe_0": 0.5}]
  with open(tmp_path / "metrics.jsonl", "w") as f:
    f.write("\n".join(json.dumps(r) for r in rows) + "\n")
  row = sweep.summarize(str(tmp_path), "x")
  # 10 distinct steps: the last 20% are steps 9 and 10 (the 18 raw rows'
  # last 20% would be steps 8..10: 9.0).
  assert row["maxvio_batch_last20"] == 9.5
  assert row["val_loss"] == 2.0 and row["maxvio_global"] == 0.5
  assert row["tokens_per_sec"] == 10.0
