"""bench_kernels' float64 accuracy check: its numpy recurrence is the
reference recurrence, and our bounded kernels (interpret mode, bf16) are
within bf16 tolerance of it over several chunks."""
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import bench_kernels as bk
from pallas_kernels.linear_attention import reference


@pytest.mark.parametrize("op", ["gla", "kda"])
def test_float64_recurrence_matches_the_reference_recurrence(op):
  x = {n: a[:, :, :2, ...] for n, a in bk.make_inputs(1, 40, seed=3).items()}
  x = {n: a[..., :32] if a.ndim == 4 else a for n, a in x.items()}
  want_o, want_s = bk.float64_recurrence(op, x, heads=2)
  f32 = {n: a.astype(jnp.float32) for n, a in x.items()}
  if op == "kda":
    o, s = reference.naive_recurrent_kda(f32["q"], f32["k"], f32["v"],
                                         f32["g"], f32["beta"])
  else:
    o, s = reference.naive_recurrent_gla(f32["q"], f32["k"], f32["v"],
                                         f32["g"])
  np.testing.assert_allclose(np.asarray(o[0]), want_o, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(s[0]), want_s, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", ["gla", "kda"])
def test_bounded_bf16_within_tolerance_of_float64(op):
  err_o, err_s = bk.check_accuracy(op, 150, heads=2, backend="interpret",
                                   dim=32)
  assert np.isfinite(err_o) and np.isfinite(err_s)
  assert 0 < err_o < 2e-2 and 0 < err_s < 2e-2, (err_o, err_s)
