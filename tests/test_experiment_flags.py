"""The GPU experiment scripts refuse bad flags before anything compiles, and
profile_kda, profile_gla and ab_kernels run end to end in interpret mode on
a tiny shape (CPU)."""
import json
import math
import os
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)   # one CPU device is enough
  return subprocess.run([sys.executable, "-m", *args], cwd=_ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("args, flag, allowed", [
    (("experiments.bench_kernels", "--fla=chunk_kda,fast_kda"), "--fla",
     "chunk_kda_safe_gate, chunk_kda, chunk_gla"),
    (("experiments.bench_kernels", "--ours=bounded,fast"), "--ours",
     "bounded, unbounded"),
    (("experiments.bench_kernels", "--xla_max_tokens=gla:2k"),
     "--xla_max_tokens", "op:N with op one of gla, kda"),
    (("experiments.profile_kda", "--set_warps=grad_q:8"), "--set_warps",
     "scores, solve, state, output, dv_intra, dstate, grad_v, grad_k"),
    (("experiments.profile_kda", "--set_warps=grad_k:eight"), "--set_warps",
     "expected kernel:N"),
    (("experiments.profile_kda", "--configs=bounded:32:fused"), "--configs",
     "path:block_k[:mosaic][:mosaic_out]"),
    (("experiments.ab_kernels", "--versions=kda:v2"), "--versions",
     "version main (with options +mosaic, +triton, +mosaic_out), git:REV, "
     "tree:FOLDER or a path to a .py file"),
    (("experiments.ab_kernels", "--versions=kda:main+mosaic+triton"),
     "--versions", "+mosaic, +triton are state passes: give one"),
    (("experiments.ab_kernels", "--versions=kda:main+split"), "--versions",
     "version main (with options +mosaic, +triton, +mosaic_out)"),
    (("experiments.ab_kernels", "--versions=gla:/no/such/gla.py"),
     "--versions", "no such file"),
    (("experiments.profile_gla", "--tune=warps=8"), "--tune",
     "block_k, pass_bk, pass_bv, bv, grad_bv, intra_warps"),
    (("experiments.profile_gla", "--configs=bounded:24"), "--configs",
     "tune.block_k must be a power of two"),
])
def test_bad_flag_names_the_flag_and_the_allowed_values(args, flag, allowed):
  res = _run(*args)
  assert res.returncode != 0
  assert flag in res.stderr and allowed in res.stderr, res.stderr[-2000:]


def test_train_overrides_before_config_apply_and_errors_are_one_line(
    tmp_path):
  # (Run, not imported: experiments.train's flags would clash with other
  # entry points' in this process.)
  res = _run("experiments.train", "--config.train.steps=0",
             f"--workdir={tmp_path / 'run'}", "--config",
             "configs/default.py:tiny,smoke", "--config.train.log_every=1")
  assert res.returncode == 1
  assert res.stderr.strip() == ("error: train.steps must be in [1, inf], "
                                "got 0"), res.stderr[-2000:]
  assert not (tmp_path / "run").exists()


def test_profile_kda_interpret_smoke(tmp_path):
  res = _run("experiments.profile_kda", "--interpret", "--b=1", "--t=80",
             "--h=1", "--d=32", "--configs=bounded:32", "--iters=1",
             "--set_warps=state:4", f"--out={tmp_path}")
  assert res.returncode == 0, res.stderr[-2000:]
  [row] = [json.loads(line) for line in open(tmp_path / "rows.jsonl")]
  assert "state:4" in row["config"]
  assert len(row["ms"]) == 10   # 7 kernels, the XLA pads and two totals
  assert all(math.isfinite(ms) and ms > 0 for ms in row["ms"].values())


def test_ab_kernels_interpret_smoke(tmp_path):
  # A git revision's kernel package (here: HEAD's), loaded beside the
  # working tree's, timed against the working tree's op with its state
  # passes on Mosaic GPU.
  res = _run("experiments.ab_kernels", "--interpret", "--shapes=1x80",
             "--iters=1", "--versions=gla:git:HEAD,gla:main+mosaic",
             f"--out={tmp_path}")
  assert res.returncode == 0, res.stderr[-2000:]
  rows = [json.loads(line) for line in open(tmp_path / "rows.jsonl")]
  assert [r["version"] for r in rows] == ["gla:git:HEAD", "gla:main+mosaic"]
  assert all(math.isfinite(r["fwd_bwd_ms"]) and r["fwd_bwd_ms"] > 0
             for r in rows)
  # The same op computed both ways: o and the gradients agree.
  assert rows[0]["vs_first"] == 0.0 and rows[1]["vs_first"] < 1e-2
  assert (tmp_path / "ab.md").exists()


def test_profile_gla_interpret_smoke(tmp_path):
  # Both options: the Mosaic GPU passes and output (K >= 64).
  res = _run("experiments.profile_gla", "--interpret", "--b=1", "--t=80",
             "--h=1", "--d=64", "--configs=bounded:32:mosaic:mosaic_out",
             "--iters=1", "--tune=grad_k_warps=8", f"--out={tmp_path}")
  assert res.returncode == 0, res.stderr[-2000:]
  [row] = [json.loads(line) for line in open(tmp_path / "rows.jsonl")]
  assert row["tune"]["grad_k_warps"] == 8
  assert row["tune"]["state_pass"] == "mosaic"
  assert row["tune"]["output_kernel"] == "mosaic"
  assert {"2 state pass (mosaic)", "3 output (mosaic)",
          "b1 dstate pass (mosaic)"} <= set(row["ms"])
  assert len(row["ms"]) == 9   # 6 kernels, the XLA pads and two totals
  assert all(math.isfinite(ms) and ms > 0 for ms in row["ms"].values())
