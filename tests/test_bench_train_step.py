"""The training-step benchmark runs a row on CPU and tabulates it."""
import math

from conftest import load_config
from experiments import step_timing as bench


def test_row_reports_time_memory_flops_and_losses():
  config = load_config("default.py", "tiny,smoke")
  spec = dict(seq_len=32, batch=4, backend="xla", attention="xla",
              grouped_matmul="auto", remat="none")
  row = bench.run_row(config, spec, steps=2, warmup=1, profile_dir=None,
                      config_name="default.py")
  assert row["step_ms"] > 0 and row["compile_s"] > 0
  assert row["tokens_per_sec"] == 4 * 32 / (row["step_ms"] / 1e3)
  assert row["model_tflop_per_token"] > 0
  assert row["mfu"] is None          # no known peak on a CPU
  assert len(row["losses"]) == 3 and all(map(math.isfinite, row["losses"]))
  # A second row at the same length gets its loss gap to the first.
  md = bench.table([row, dict(row, remat="sublayer")])
  assert "| default.py | 32 x 4 | xla | xla | auto | sublayer |" in md
  assert md.rstrip().endswith("| 0.0e+00 |")
