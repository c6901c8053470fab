"""The training-step benchmark runs a row on CPU and tabulates it."""
import math

from conftest import load_config
from experiments import step_timing as bench


SPEC = dict(seq_len=32, batch=4, backend="xla", attention="xla",
            grouped_matmul="auto", remat="none")


def test_row_reports_time_memory_flops_and_losses(tmp_path):
  config = load_config("default.py", "tiny,smoke")
  progress = str(tmp_path / "row.progress.jsonl")
  row = bench.run_row(config, SPEC, steps=2, warmup=1, profile_dir=None,
                      config_name="default.py", progress=progress)
  assert row["step_ms"] > 0 and row["compile_s"] > 0 and row["setup_s"] > 0
  assert row["tokens_per_sec"] == 4 * 32 / (row["step_ms"] / 1e3)
  assert row["model_tflop_per_token"] > 0
  assert row["mfu"] is None          # no known peak on a CPU
  assert len(row["losses"]) == 3 and all(map(math.isfinite, row["losses"]))
  assert row["xla_temp_gib"] > 0 and row["xla_accessed_gib"] > 0
  # A second row at the same length gets its loss gap to the first.
  md = bench.table([row, dict(row, remat="sublayer")])
  assert "| default.py | 32 x 4 | xla | xla | auto | sublayer |" in md
  assert md.rstrip().endswith("| 0.0e+00 |")
  # The progress file holds what a row stopped by a time limit reports.
  part = bench.partial_row(SPEC, progress, "timed out after 9 s")
  assert part["compile_s"] == row["compile_s"]
  assert part["losses"] == row["losses"]
  assert part["step_ms_all"] == row["step_ms_all"]
  # --compile_only: no step runs; XLA's estimates grow with the tokens per
  # step (they are not constants).
  big = bench.run_row(config, dict(SPEC, batch=16), steps=2, warmup=1,
                      profile_dir=None, config_name="default.py",
                      compile_only=True)
  assert "step_ms" not in big and "losses" not in big
  assert big["compile_s"] > 0 and big["xla_arg_gib"] > 0
  assert big["xla_temp_gib"] > row["xla_temp_gib"]
  assert big["xla_accessed_gib"] > row["xla_accessed_gib"]
  md = bench.compile_table([big])
  assert "| default.py | 32 x 16 | xla | xla | auto | none | " in md
  assert "XLA temp GiB" in md and md.count("\n") == 3


def test_unfinished_row_says_where_its_time_went(tmp_path):
  progress = tmp_path / "p.jsonl"
  progress.write_text('{"phase": "setup", "s": 12.4}\n'
                      '{"phase": "compile", "s": 95.2}\n'
                      '{"step": 0, "ms": 812.0, "loss": 5.5}\n')
  row = bench.partial_row(SPEC, str(progress), "timed out after 150 s")
  assert bench.describe_error(row) == (
      "timed out after 150 s (setup 12 s; compile 95 s; steps 812 ms)")
  md = bench.table([row])
  assert "| timed out after 150 s (setup 12 s; compile 95 s; steps 812 ms) |" in md
  # No progress file: the child died before its setup finished.
  row = bench.partial_row(SPEC, str(tmp_path / "none.jsonl"), "failed")
  assert bench.describe_error(row) == "failed" and "losses" not in row

