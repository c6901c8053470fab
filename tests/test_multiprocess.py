"""Multi-host training with real processes (2 CPU processes on localhost).

Two `experiments.train` processes joined by jax.distributed (gloo collectives
on CPU) each own one device of a data=2 mesh, read their slice of every
global batch and save checkpoints collectively through orbax. Their metrics
must equal a single process driving 2 (fake) devices, and a single process
must resume from the checkpoint the two processes wrote. The single process
is this test's own (2 of its 8 fake devices): it compiles the step once for
both of its runs.
"""
import json
import logging
import os
import socket
import subprocess
import sys

import numpy as np

from conftest import load_config
from moe_jax.train import loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "--config=configs/default.py:tiny,smoke"


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _env(devices):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  env.pop("MOE_JAX_TEST_CACHE", None)
  return env


def _train_cmd(workdir, *extra):
  """6 steps of an 8-step schedule: the resume below continues to 8."""
  return [sys.executable, "-m", "experiments.train", CONFIG,
          "--config.mesh.num_devices=-1", "--config.train.steps=8",
          "--stop_at_step=6", f"--workdir={workdir}", *extra]


def _single_process_config():
  """The config of _train_cmd on 2 devices of this process."""
  config = load_config("default.py", "tiny,smoke")
  config.mesh.num_devices = 2
  config.train.steps = 8
  return config


def _metrics(workdir):
  rows = [json.loads(line) for line in open(os.path.join(workdir,
                                                         "metrics.jsonl"))]
  return {(r["step"], r["split"]): r for r in rows}


def _close(a, b, keys=("loss", "val_loss")):
  for key in set(a) & set(b):
    ra, rb = a[key], b[key]
    for name in keys:
      if name in ra:
        np.testing.assert_allclose(ra[name], rb[name], rtol=1e-4,
                                   err_msg=f"{key} {name}")


def test_two_processes_equal_one_and_resume_on_one(tmp_path, caplog):
  multi, single = str(tmp_path / "multi"), str(tmp_path / "single")
  port = _free_port()
  procs = [subprocess.Popen(
      _train_cmd(multi, f"--coordinator_address=localhost:{port}",
                 "--num_processes=2", f"--process_id={i}"),
      cwd=ROOT, env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True) for i in range(2)]
  try:
    outs = [p.communicate(timeout=600)[0] for p in procs]
  finally:  # a hung peer must not outlive the test
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  assert "on 2 devices, 2 processes" in outs[0]
  config = _single_process_config()
  loop.train_and_evaluate(config, single, stop_at_step=6)

  got, want = _metrics(multi), _metrics(single)
  losses = [k for k in want if "loss" in want[k]]
  assert len(losses) >= 3 and all(k in got for k in losses)
  _close(got, want)
  assert sorted(os.listdir(os.path.join(multi, "checkpoints"))) == ["3", "6"]

  # A single process (2 devices) resumes from the checkpoint the two
  # processes wrote and continues to step 8.
  with caplog.at_level(logging.INFO):
    result = loop.train_and_evaluate(config, multi)
  assert any(r.getMessage().startswith("Resumed from step 6")
             for r in caplog.records), [r.getMessage() for r in caplog.records]
  assert result["step"] == 8
  rows = [json.loads(line) for line in open(os.path.join(multi,
                                                         "metrics.jsonl"))]
  # Train losses are logged every 2 steps: 2, 4, 6 by the two processes
  # (process 0 only), then 8 by the resumed run; nothing re-run from 0.
  assert [r["step"] for r in rows if r["split"] == "train"] == [2, 4, 6, 8]
