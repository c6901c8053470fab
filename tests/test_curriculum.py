"""Context curriculum: stage parsing and validation, the ladder in the loop.

One tiny ladder (32 -> 64 tokens, 3 steps each, 128 tokens per step) runs
once per module with its train steps recorded; a second run stops mid-stage
2 and resumes, and must end where the uninterrupted ladder ended.
"""
import os
import shutil

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from conftest import assert_config_error, load_config, set_field
from moe_jax.config_validation import ConfigError, validate_config
from moe_jax.curriculum import Stage, stage_at, stage_end_eval_due, stages_of
from moe_jax.eval import long_context as lc
from moe_jax.train import loop
from moe_jax.train.checkpoint import Checkpointer
from moe_jax.train.metrics import read_metrics
from moe_jax.train.optimizer import make_schedule

LADDER = "32:3,64:3"


def _ladder_config():
  config = load_config("default.py", "tiny,smoke")  # 32 x 4, 6 steps
  config.curriculum.stages = LADDER
  config.train.checkpoint_every = 2  # and each stage's end: 2, 3, 4, 6
  config.train.keep_checkpoints = 4
  config.curriculum.stage_end_factor = 2  # up to 64, then 128 tokens
  return config


def _saved(workdir: str, step: int):
  """(params, data state) of checkpoint `step`."""
  ckpt = Checkpointer(workdir)
  try:
    r = ckpt.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(), data=ocp.args.JsonRestore()))
    return r.state["params"], r.data
  finally:
    ckpt.close()


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
  """(config, workdir, result, calls): calls = [(stage index, global step
  before the call, batch shape, params before the call as numpy)]."""
  config = _ladder_config()
  workdir = str(tmp_path_factory.mktemp("ladder"))
  calls = []
  real = loop.build_train_step

  def recording(cfg, stage=None):
    setup = real(cfg, stage)

    def step(state, batch):
      calls.append((stage.index, int(state.step), batch["inputs"].shape,
                    jax.device_get(state.params)))
      return setup.train_step(state, batch)
    return setup._replace(train_step=step)

  with pytest.MonkeyPatch.context() as m:
    m.setattr(loop, "build_train_step", recording)
    result = loop.train_and_evaluate(config, workdir)
  return config, workdir, result, calls


def test_stages_of_derives_batches_and_step_ranges():
  config = _ladder_config()
  config.curriculum.stages = "32:2, 64:3,128:1:1"
  config.train.steps = 6
  assert stages_of(config) == [Stage(0, 32, 4, 0, 2), Stage(1, 64, 2, 2, 5),
                               Stage(2, 128, 1, 5, 6)]
  stages = stages_of(config)
  assert [stage_at(stages, s).index for s in range(7)] == [0, 0, 1, 1, 1, 2,
                                                           2]
  config.curriculum.stages = ""  # no curriculum: one stage of data.*
  assert stages_of(config) == [Stage(0, 32, 4, 0, 6)]


@pytest.mark.parametrize("overrides,match", [
    ({"curriculum.stages": "64:3,32:3"},
     r"stages\[1\] \(32:3\): seq_len must be strictly increasing, got 32 "
     "after 64"),
    ({"curriculum.stages": "32:3,32:3"}, "strictly increasing"),
    ({"curriculum.stages": "32:0,64:6"},
     r"stages\[0\] \(32:0\): steps must be >= 1"),
    ({"curriculum.stages": "32"}, "entry '32' is malformed; allowed: comma"),
    ({"curriculum.stages": "32:3,64:x"}, "steps 'x' is not an integer"),
    ({"curriculum.stages": "32:3,64:2"}, r"train.steps=6 must equal the sum "
     r"of the curriculum.stages steps \(5\); set --config.train.steps=5"),
    ({"curriculum.stages": "32:3,48:3"},
     r"128\) is not a multiple of seq_len 48"),
    ({"curriculum.stages": "32:3,64:3:4"}, r"batch_size 4 gives 256 tokens "
     r"per step, not data.batch_size \* data.seq_len = 128; allowed: "
     "batch_size 2, or curriculum.constant_tokens=False"),
    ({"train.microbatches": 2, "curriculum.stages": "32:3,128:3"},
     r"stages\[1\] \(128:3\): batch_size 1 is not divisible by "
     "train.microbatches=2"),
    ({"curriculum.stage_warmup_steps": -1},
     "curriculum.stage_warmup_steps must be an integer >= 0"),
    ({"curriculum.stage_end_stages": "first"},
     r"curriculum.stage_end_stages must be one of \['every', 'last'\], "
     "got 'first'"),
])
def test_bad_stages_are_clear_config_errors(overrides, match):
  config = _ladder_config()
  for field, value in overrides.items():
    set_field(config, field, value)
  with pytest.raises(ConfigError, match=match):
    validate_config(config)


def test_stage_end_evaluation_at_every_stage_or_the_last():
  config = _ladder_config()
  stages = stages_of(config)
  assert [stage_end_eval_due(config, stages, s) for s in stages] == [True,
                                                                     True]
  config.curriculum.stage_end_stages = "last"
  assert [stage_end_eval_due(config, stages, s) for s in stages] == [False,
                                                                     True]
  config.curriculum.stage_end_factor = 0
  assert not any(stage_end_eval_due(config, stages, s) for s in stages)


def test_explicit_batches_may_vary_tokens_when_allowed():
  config = _ladder_config()
  config.curriculum.stages = "32:3,64:3:4"
  config.curriculum.constant_tokens = False
  validate_config(config)
  assert stages_of(config)[1].tokens_per_step == 256
  assert_config_error("curriculum.stages", "32:3,64:3:4", "constant_tokens")


def test_stage_warmup_ramps_the_rate_again_at_each_stage():
  tcfg = _ladder_config().train
  tcfg.schedule = "constant"
  base = make_schedule(tcfg)
  ramped = make_schedule(tcfg, restarts=(3, 5), restart_warmup=2)
  steps = np.arange(7)
  want = np.array([float(base(s)) for s in steps])
  want[[3, 5]] *= 0.5  # the first step of each ramp: 1/2 of the rate
  np.testing.assert_allclose([float(ramped(s)) for s in steps], want,
                             rtol=1e-6)
  assert isinstance(optax.adamw(ramped), optax.GradientTransformation)


def test_ladder_runs_stages_in_order_with_their_shapes(ladder):
  _, _, result, calls = ladder
  assert [(c[0], c[1], c[2]) for c in calls] == [
      (0, 0, (4, 32)), (0, 1, (4, 32)), (0, 2, (4, 32)),
      (1, 3, (2, 64)), (1, 4, (2, 64)), (1, 5, (2, 64))]
  assert result["step"] == 6 and np.isfinite(result["loss"])


def test_state_carries_over_between_stages(ladder):
  _, workdir, _, calls = ladder
  end_of_stage_0, data_state = _saved(workdir, 3)
  assert data_state == {"step": 3, "stage": 0, "seq_len": 32}
  start_of_stage_1 = calls[3][3]
  jax.tree.map(np.testing.assert_array_equal, start_of_stage_1,
               jax.device_get(end_of_stage_0))
  assert _saved(workdir, 6)[1] == {"step": 6, "stage": 1, "seq_len": 64}


def test_metrics_rows_carry_the_stage(ladder):
  _, workdir, _, _ = ladder
  rows = read_metrics(workdir)
  meta = [r for r in rows if r["split"] == "meta"][0]
  assert [(s["seq_len"], s["batch_size"], s["start"], s["end"])
          for s in meta["stages"]] == [(32, 4, 0, 3), (64, 2, 3, 6)]
  got = [(r["split"], r["step"], r["stage"], r["seq_len"]) for r in rows
         if r["split"] in ("train", "eval")]
  # Each stage's last step is logged and evaluated at its length.
  assert got == [("train", 2, 0, 32), ("train", 3, 0, 32), ("eval", 3, 0, 32),
                 ("train", 4, 1, 64), ("train", 6, 1, 64), ("eval", 6, 1, 64)]


def test_each_stage_ends_with_its_length_extrapolation(ladder):
  _, workdir, _, _ = ladder
  rows = [r for r in read_metrics(workdir) if r["split"] == "long_context"]
  assert [(r["step"], r["stage"], r["seq_len"]) for r in rows] == [
      (3, 0, 32), (6, 1, 64)]
  assert sorted(k for k in rows[1] if k.startswith("loss/")) == sorted(
      f"loss/pos_{lo}_{hi}" for lo, hi in lc.position_buckets(64, 128))
  assert not any(k.startswith("passkey/") for k in rows[0])  # 64 < prompt
  assert 0 <= rows[1]["passkey/len_128"] <= 1
  assert all(np.isfinite(v) for r in rows for k, v in r.items()
             if k.startswith("loss/"))


def test_interrupted_ladder_resumes_mid_stage_like_an_uninterrupted_one(
    ladder, tmp_path):
  """A ladder killed after its mid-stage-2 checkpoint (step 4) resumes in
  stage 2 and ends where the uninterrupted ladder ended."""
  config, workdir, uninterrupted, _ = ladder
  killed = str(tmp_path / "run")
  shutil.copytree(workdir, killed)
  shutil.rmtree(os.path.join(killed, "checkpoints", "6"))
  resumed = loop.train_and_evaluate(config, killed)  # from step 4
  assert resumed["step"] == 6 and resumed["seq_len"] == 64
  for k in ("loss", "val_loss"):
    assert resumed[k] == uninterrupted[k], k
  jax.tree.map(np.testing.assert_array_equal, _saved(killed, 6)[0],
               _saved(workdir, 6)[0])
  rows = [{k: v for k, v in r.items() if k != "tokens_per_sec"}
          for r in read_metrics(killed)]
  assert rows == [{k: v for k, v in r.items() if k != "tokens_per_sec"}
                  for r in read_metrics(workdir)]


def test_bad_stage_lists_stop_before_the_workdir_is_touched(tmp_path):
  config = _ladder_config()
  config.curriculum.stages = "64:3,32:3"
  with pytest.raises(ConfigError, match="seq_len must be strictly increasing"):
    loop.train_and_evaluate(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()
  # A stage longer than the validation split holds: before any compile.
  config.curriculum.stages = "32:3,131072:3:1"
  config.curriculum.constant_tokens = False
  with pytest.raises(ConfigError, match=r"stages\[1\] \(seq_len 131072, "
                     r"batch 1\): .*tokens"):
    loop.train_and_evaluate(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()
