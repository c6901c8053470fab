"""The loop keeps the device busy: one compile, metrics fetched in batches."""
import logging

import jax
import pytest

from conftest import load_config
from moe_jax.train import loop
from moe_jax.train.checkpoint import Checkpointer
from moe_jax.train.metrics import read_metrics


def test_train_step_compiles_once(tmp_path, caplog):
  """Steps, evals and saves between them never retrace the train step."""
  config = load_config("default.py", "tiny,smoke")
  with jax.log_compiles(True), caplog.at_level(logging.WARNING):
    loop.train_and_evaluate(config, str(tmp_path))
  compiles = [r for r in caplog.records
              if r.getMessage().startswith("Compiling jit(train_step)")]
  assert len(compiles) == 1, [r.getMessage()[:80] for r in compiles]
  # Router rows are still written for every step, though fetched in batches.
  steps = [r["step"] for r in read_metrics(str(tmp_path))
           if r["split"] == "router"]
  assert steps == list(range(1, config.train.steps + 1))


def test_first_non_finite_step_is_named_and_never_saved(
    smoke_run, tmp_path, monkeypatch):
  """Metrics are fetched every log_every steps; the error still names the
  first bad step, and no state after it reaches a checkpoint."""
  config, _, _ = smoke_run
  config = config.copy_and_resolve_references()
  config.train.log_every = 3        # fetch at 3 and 6 only
  config.train.checkpoint_every = 6
  real = loop.make_train_step

  def poisoned(*args, **kwargs):
    step = real(*args, **kwargs)

    def bad(state, batch):   # non-finite from step 5 on (state.step 4)
      new_state, metrics = step(state, batch)
      scale = jax.numpy.where(state.step >= 4, jax.numpy.nan, 1.0)
      return new_state, dict(metrics, loss=metrics["loss"] * scale)
    return bad

  monkeypatch.setattr(loop, "make_train_step", poisoned)
  with pytest.raises(loop.NonFiniteError, match="at step 5"):
    loop.train_and_evaluate(config, str(tmp_path))
  assert Checkpointer(str(tmp_path)).latest_step() is None
