"""Training loop: checkpoint round trip, crash safety, metrics, notebook."""
import json
import os

import numpy as np
import pytest

from conftest import execute_notebook, load_config
from moe_jax.train import loop
from moe_jax.train.checkpoint import Checkpointer
from moe_jax.train.metrics import read_metrics


def test_smoke_run_writes_metrics_and_checkpoints(smoke_run):
  config, workdir, result = smoke_run
  rows = read_metrics(workdir)
  train = [r for r in rows if r["split"] == "train"]
  evals = [r for r in rows if r["split"] == "eval"]
  assert [r["step"] for r in train] == [2, 4, 6]
  assert [r["step"] for r in evals] == [3, 6]
  for r in train:
    assert np.isfinite(r["loss"]) and "maxvio/layer_0" in r
    assert "tokens_per_sec" in r and "lr" in r
  for r in evals:
    assert {"val_loss", "val_bpb", "unigram_bpb",
            "maxvio_global/layer_0", "maxvio_global/layer_1"} <= set(r)
  assert Checkpointer(workdir).latest_step() == 6
  assert os.listdir(os.path.join(workdir, "tensorboard"))
  assert result["step"] == 6


def test_resume_matches_uninterrupted_run(smoke_run, tmp_path):
  config, _, uninterrupted = smoke_run
  workdir = str(tmp_path)
  first = loop.train_and_evaluate(config, workdir, stop_at_step=3)
  assert first["step"] == 3
  resumed = loop.train_and_evaluate(config, workdir)  # restores step 3
  assert resumed["step"] == 6
  np.testing.assert_allclose(resumed["loss"], uninterrupted["loss"],
                             rtol=0, atol=1e-6)
  np.testing.assert_allclose(resumed["val_loss"], uninterrupted["val_loss"],
                             rtol=0, atol=1e-6)
  saved = json.load(open(os.path.join(workdir, "checkpoints", "6", "config",
                                      "metadata")))
  assert saved["model"]["d_model"] == config.model.d_model


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(
    smoke_run, tmp_path, monkeypatch):
  config, _, _ = smoke_run
  workdir = str(tmp_path)
  loop.train_and_evaluate(config, workdir, stop_at_step=3)
  real = loop.make_train_step

  def poisoned(*args, **kwargs):
    step = real(*args, **kwargs)

    def bad(state, batch):
      new_state, metrics = step(state, batch)
      return new_state, dict(metrics, loss=metrics["loss"] * np.nan)
    return bad

  monkeypatch.setattr(loop, "make_train_step", poisoned)
  with pytest.raises(loop.NonFiniteError, match="non-finite loss"):
    loop.train_and_evaluate(config, workdir)
  assert Checkpointer(workdir).latest_step() == 3


def test_quickstart_notebook_executes(smoke_run, monkeypatch):
  _, workdir, _ = smoke_run
  monkeypatch.setenv("MOE_JAX_WORKDIR", workdir)
  _, outputs = execute_notebook("00_quickstart.ipynb")
  assert os.path.exists(os.path.join(workdir, "maxvio.png"))
  assert "layer_0" in outputs and "final_loss" in outputs


@pytest.mark.slow
def test_default_config_beats_unigram_baseline(tmp_path):
  """The README's main job: val bits/byte <= 0.75 x unigram bits/byte."""
  result = loop.train_and_evaluate(load_config("default.py"), str(tmp_path))
  assert result["step"] == 300
  assert np.isfinite(result["val_bpb"])
  assert result["val_bpb"] <= 0.75 * result["unigram_bpb"], result
