"""experiments/kernel_resources.py: the TTIR capture runs without a GPU.

Compiling the captured IR needs the `triton` package, which the project does
not install; only the JAX half (lowering for CUDA on the CPU, the kernels'
launch parameters) is tested here.
"""
import pytest

from experiments import kernel_resources as kr
from pallas_kernels.linear_attention.kda import tuning as kda_tuning


def test_captures_every_kda_kernel_with_its_launch_parameters(tmp_path):
  fn = kr.op_fn("kda", True)
  args = kr.op_inputs("kda", 128, 32)
  try:
    found = kr.capture_ttir(fn, args, str(tmp_path))
  except (ImportError, AttributeError) as e:  # private jax hooks moved
    pytest.skip(f"jax's Pallas Triton lowering hooks are not there: {e}")
  by_name = {name: (warps, stages) for _, name, warps, stages in found}
  tune = kda_tuning.DEFAULT_TUNING
  # Every kernel with the warps of its kda.tuning.Tuning field.
  short = {"kda_chunk_scores": "scores", "kda_chunk_solve": "solve",
           "kda_state_pass": "state",
           "kda_chunk_output": "output", "kda_chunk_dv_intra": "dv_intra",
           "kda_dstate_pass": "dstate", "kda_chunk_grad_v": "grad_v",
           "kda_chunk_grad_k": "grad_k"}
  assert set(by_name) == set(short)
  for name, key in short.items():
    assert by_name[name] == (getattr(tune, f"{key}_warps"),
                             tune.num_stages), name
  for path, name, _, _ in found:
    text = open(path).read()
    assert "tt.func" in text and name in text
  for kernel in ("kda_chunk_scores", "kda_chunk_solve"):
    path = next(p for p, n, _, _ in found if n == kernel)
    assert "tt.dot" in open(path).read(), kernel
