"""experiments/float64_check.py (bench_kernels --check_t): its numpy
recurrence is the reference recurrence, and our bounded kernels (interpret
mode, bf16) are within bf16 tolerance of it over several chunks."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import float64_check
from pallas_kernels.linear_attention.gla import naive as gla_naive
from pallas_kernels.linear_attention.kda import naive as kda_naive


def _inputs(t, h=2, d=32, seed=3):
  keys = jax.random.split(jax.random.PRNGKey(seed), 5)
  k = jax.random.normal(keys[1], (1, t, h, d))
  x = dict(q=jax.random.normal(keys[0], (1, t, h, d)),
           k=k / jnp.linalg.norm(k, axis=-1, keepdims=True),
           v=jax.random.normal(keys[2], (1, t, h, d)),
           beta=jax.nn.sigmoid(jax.random.normal(keys[4], (1, t, h))))
  x = {n: a.astype(jnp.bfloat16) for n, a in x.items()}
  x["g"] = -5.0 * jax.nn.sigmoid(2.0 * jax.random.normal(keys[3], (1, t, h, d))
                                 - 1.0)
  return x


@pytest.mark.parametrize("op", ["gla", "kda"])
def test_float64_recurrence_matches_the_reference_recurrence(op):
  x = _inputs(40)
  want_o, want_s = float64_check.float64_recurrence(op, x, heads=2)
  f32 = {n: a.astype(jnp.float32) for n, a in x.items()}
  if op == "kda":
    o, s = kda_naive.naive_recurrent_kda(f32["q"], f32["k"], f32["v"],
                                         f32["g"], f32["beta"])
  else:
    o, s = gla_naive.naive_recurrent_gla(f32["q"], f32["k"], f32["v"],
                                         f32["g"])
  np.testing.assert_allclose(np.asarray(o[0]), want_o, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(s[0]), want_s, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", ["gla", "kda"])
def test_bounded_bf16_within_tolerance_of_float64(op):
  err_o, err_s = float64_check.relative_errors(op, _inputs(150), -5.0,
                                               heads=2, backend="interpret")
  assert np.isfinite(err_o) and np.isfinite(err_s)
  assert 0 < err_o < 2e-2 and 0 < err_s < 2e-2, (err_o, err_s)
