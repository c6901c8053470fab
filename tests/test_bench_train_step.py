"""The training-step benchmark runs a row on CPU and tabulates it."""
import math

from conftest import load_config
from experiments import step_timing as bench


SPEC = dict(seq_len=32, batch=4, backend="xla", attention="xla",
            grouped_matmul="auto", remat="none")


def test_row_reports_time_memory_flops_and_losses(tmp_path):
  config = load_config("default.py", "tiny,smoke")
  progress = str(tmp_path / "row.progress.jsonl")
  prof = str(tmp_path / "trace")
  row = bench.run_row(config, dict(SPEC, microbatches=2), steps=2, warmup=1,
                      profile_dir=prof, config_name="default.py",
                      progress=progress)
  assert row["step_ms"] > 0 and row["compile_s"] > 0 and row["setup_s"] > 0
  assert row["tokens_per_sec"] == 4 * 32 / (row["step_ms"] / 1e3)
  assert row["model_tflop_per_token"] > 0
  assert row["mfu"] is None          # no known peak on a CPU
  assert len(row["losses"]) == 3 and all(map(math.isfinite, row["losses"]))
  assert row["xla_temp_gib"] > 0 and row["xla_accessed_gib"] > 0
  # A second row at the same length gets its loss gap to the first.
  md = bench.table([row, dict(row, remat="sublayer", microbatches=1)])
  assert "| xla | auto | none, 2 microbatches |" in md
  assert "| default.py | 32 x 4 | xla | xla | auto | sublayer |" in md
  assert md.rstrip().endswith("| 0.0e+00 |")
  # The profiled step's ops, by part of the model: nearly all attributed,
  # the same total as the per-op list.
  groups = dict(bench.ops_by_module(prof))
  ms = {g: sum(ph.values()) for g, ph in groups.items()}
  total = sum(ms.values())
  assert math.isclose(total, sum(t for _, t, _ in bench.top_ops(prof, 10**9)))
  assert ms.get("unattributed", 0.0) < 0.2 * total
  for group in ("kda kernels and elementwise", "moe router",
                "moe routed experts (dispatch, grouped matmuls, combine)",
                "optimizer, loss and metrics"):
    assert ms[group] > 0, group
  assert groups["kda kernels and elementwise"]["backward"] > 0
  assert "| moe router |" in bench.module_table(list(groups.items()))
  # The progress file holds what a row stopped by a time limit reports:
  # stopped while profiling, the whole timed row.
  part = bench.partial_row(SPEC, progress, "timed out after 9 s")
  assert part == dict(row, profile_error="timed out after 9 s")
  assert "error" not in part and "| 32 x 4 |" in bench.table([part])
  # Stopped before its timed row: the phases and steps it finished.
  lines = open(progress).read().splitlines()
  with open(progress, "w") as f:
    f.write("\n".join(ln for ln in lines if '"row"' not in ln) + "\n")
  part = bench.partial_row(SPEC, progress, "timed out after 9 s")
  assert part["error"] == "timed out after 9 s"
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
  progress.write_text('{"phase": "init", "s": 9.1}\n'
                      '{"phase": "setup", "s": 12.4}\n'
                      '{"phase": "compile", "s": 95.2}\n'
                      '{"step": 0, "ms": 812.0, "loss": 5.5}\n')
  row = bench.partial_row(SPEC, str(progress), "timed out after 150 s")
  said = ("timed out after 150 s (setup 12 s (init 9 s); compile 95 s; "
          "steps 812 ms)")
  assert bench.describe_error(row) == said
  assert f"| {said} |" in bench.table([row])
  # No progress file: the child died before its setup finished.
  row = bench.partial_row(SPEC, str(tmp_path / "none.jsonl"), "failed")
  assert bench.describe_error(row) == "failed" and "losses" not in row


def test_ops_are_grouped_by_module_and_phase():
  hlo = ('  %loop_add_fusion.3 = f32[4]{0} fusion(%p), kind=kLoop, '
         'metadata={op_name="jit(train_step)/jvp(HybridLM)/layer_2_moe/'
         'router/add" stack_frame_id=4}\n'
         '  ROOT %custom-call.7 = bf16[8]{0} custom-call(%a), '
         'metadata={op_name="jit(train_step)/transpose(jvp(HybridLM))/'
         'layer_0_kda/pallas_call"}\n')
  assert bench.hlo_op_names(hlo) == {
      "loop_add_fusion_3": "jit(train_step)/jvp(HybridLM)/layer_2_moe/router/add",
      "custom_call_7": "jit(train_step)/transpose(jvp(HybridLM))/layer_0_kda/"
                       "pallas_call"}
  pre = "jit(train_step)/transpose(jvp(HybridLM))/jvp(HybridLM)/"
  cases = {
      "jit(train_step)/jvp(HybridLM)/layer_3_mla/q_proj/dot_general":
          ("mla projections", "forward"),
      pre + "checkpoint/rematted_computation/layer_0_kda/pallas_call":
          ("kda kernels and elementwise", "recompute"),
      "jit(train_step)/transpose(jvp(HybridLM))/layer_1_moe/shared/mul":
          ("moe shared expert", "backward"),
      "jit(train_step)/jvp(HybridLM)/layer_1_moe/jit(argsort)/sort":
          ("moe routed experts (dispatch, grouped matmuls, combine)",
           "forward"),
      "jit(train_step)/jvp(HybridLM)/layer_1_ffn_norm_attn_res/exp":
          ("attn_res depth mixing", "forward"),
      "jit(train_step)/jvp(HybridLM)/final_norm/rsqrt": ("norms", "forward"),
      "jit(train_step)/jvp(HybridLM)/head/dot_general":
          ("embedding and head", "forward"),
      "jit(train_step)/mul": ("optimizer, loss and metrics", "forward"),
  }
  for op_name, want in cases.items():
    assert bench.module_group(op_name) == want, op_name


def test_lower_only_row_reports_lowering_time_and_module_size():
  config = load_config("default.py", "tiny,smoke")
  row = bench.lower_row(config, SPEC, "cuda", config_name="default.py")
  assert row["lower_s"] > 0 and row["module_mb"] > 0.01
  assert row["platform"] == "cuda" and "step_ms" not in row
  md = bench.lower_table([row])
  assert "| default.py | 32 x 4 | xla | xla | auto | none | cuda |" in md


def test_gpu_training_step_has_no_while_loop():
  # On a GPU each iteration of a while loop waits for the host to read its
  # predicate: searchsorted's binary search once cost gpu_small ~1000 such
  # round trips per step. The Pallas step, lowered for the card, has none.
  config = load_config("default.py", "tiny,smoke")
  config.model.kda.chunk_size = 64   # the kernels' chunk
  text, _ = bench.lowered_step(config, dict(SPEC, seq_len=128, batch=2,
                                            backend="pallas",
                                            grouped_matmul="pallas"), "cuda")
  assert "kda_chunk" in text and "stablehlo.while" not in text


def test_events_match_by_hlo_name_op_annotation_or_kernel_name(tmp_path,
                                                               monkeypatch):
  (tmp_path / bench.HLO_FILE).write_text(
      '  %loop_add_fusion.3 = f32[4]{0} fusion(%p), kind=kLoop, metadata={'
      'op_name="jit(train_step)/jvp(HybridLM)/layer_2_moe/router/add"}\n')
  events = [
      ("loop_add_fusion_3", 2.0, {}),                      # by its name
      ("nvjet_gemm", 3.0, {"hlo_op": "custom-call.9", "tf_op":
                           "jit(train_step)/transpose(jvp(HybridLM))/"
                           "layer_1_moe/shared/up/dot_general"}),
      ("kda_chunk_grad_k", 4.0, {}),         # our kernels, by kernel name
      ("gmm_mosaic_mosaic_gpu_kernel", 5.0, {}),
      ("mystery_kernel", 1.0, {}),
  ]
  monkeypatch.setattr(bench, "_device_events", lambda _: iter(events))
  groups = dict(bench.ops_by_module(str(tmp_path)))
  assert groups["moe router"]["forward"] == 2.0
  assert groups["moe shared expert"]["backward"] == 3.0
  assert groups["kda kernels and elementwise"]["backward"] == 4.0
  routed = "moe routed experts (dispatch, grouped matmuls, combine)"
  assert groups[routed]["?"] == 5.0          # forward, recompute or backward
  assert groups["unattributed"]["?"] == 1.0
  # The unmatched event is named with its stats, for the next matcher.
  assert bench.unattributed_ops(str(tmp_path)) == [
      ("mystery_kernel", 1.0, 1, "")]
  md = bench.module_table(list(groups.items()))
  assert "| unattributed | 0.0 | 0.0 | 0.0 | 1.0 | 1.0 | 6.7% |" in md
