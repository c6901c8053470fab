"""Mosaic GPU grouped matmul (grouped_matmul/mosaic.py) in the GPU interpreter.

Against the masked-dense reference in fp32, bf16 operands. One tiny shape
covers: M = 200 rows padded to 4 tiles of 64 (a partial last tile), a group
spanning two tiles, a tile holding four groups, empty groups (leading,
middle, trailing), 35 rows past the last group (zeros), two K steps and two
column blocks. The interpreter fills fresh buffers with NaN, so a row the
kernel leaves unwritten fails the finiteness check. The gradients (dx: the
same kernel on w^T; dw: tgmm_mosaic) go through jax.grad of gmm's custom
VJP. tgmm's layout "rows" (wgmma reads x transposed, the default on a
GPU) needs an interpreter that runs transposed operands (jax >= 0.11);
jax 0.10's runs everything else (skipping the layout casts, which it does
not model). The Pallas -> Mosaic GPU lowering is checked for cuda on the
CPU, at this shape and gpu_1b's, both layouts.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_config, set_field

from moe_jax.config_validation import ConfigError, validate_config
from pallas_kernels.grouped_matmul import (Tuning, gmm, gmm_reference,
                                           tgmm_reference)
from pallas_kernels.grouped_matmul import mosaic
from pallas_kernels.linear_attention.common.mosaic import (
    LAYOUTS, gpu_interpreter, interpreter_transposes)

M, K, N = 200, 128, 128
SIZES = (0, 90, 3, 2, 40, 0, 30, 0)   # sum 165: rows 165..199 in no group
TUNE = Tuning(kernel="mosaic", block_m=64, block_n=64, tgmm_block_k=64,
              tgmm_block_n=64, mosaic_steps=2)
TOL = 1e-2   # bf16 operands, fp32 accumulation, bf16 result


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert np.all(np.isfinite(a)), "non-finite output"
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.fixture(scope="module")
def operands():
  kx, kw, kc = jax.random.split(jax.random.PRNGKey(5), 3)
  return dict(
      x=jax.random.normal(kx, (M, K), jnp.bfloat16),
      w=(K**-0.5 * jax.random.normal(kw, (len(SIZES), K, N))).astype(
          jnp.bfloat16),
      ct=jax.random.normal(kc, (M, N), jnp.float32),
      sizes=jnp.asarray(SIZES, jnp.int32))


def _f32(a):
  return a.astype(jnp.float32)


def test_gmm_mosaic_values_and_grads_match_reference(operands):
  x, w, ct, sizes = (operands[k] for k in ("x", "w", "ct", "sizes"))
  out = gmm(x, w, sizes, tuning=TUNE, interpret=True)
  assert out.shape == (M, N) and out.dtype == jnp.bfloat16
  assert _rel(out, gmm_reference(_f32(x), _f32(w), sizes)) < TOL
  np.testing.assert_array_equal(np.asarray(_f32(out[sum(SIZES):])), 0)

  def loss(fn):
    return lambda x, w: jnp.sum(_f32(fn(x, w, sizes)) * ct)

  ours = functools.partial(gmm, tuning=TUNE, interpret=True)
  dx, dw = jax.grad(loss(ours), (0, 1))(x, w)
  dx_ref, dw_ref = jax.grad(loss(gmm_reference), (0, 1))(_f32(x), _f32(w))
  assert dx.dtype == dw.dtype == jnp.bfloat16
  assert _rel(dx, dx_ref) < TOL
  assert _rel(dw, dw_ref) < TOL
  # Rows in no group get no gradient; empty groups a zero one.
  np.testing.assert_array_equal(np.asarray(_f32(dx[sum(SIZES):])), 0)
  for g in (0, 5, 7):
    np.testing.assert_array_equal(np.asarray(_f32(dw[g])), 0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tgmm_mosaic_matches_reference_in_fp32(operands, layout):
  if layout == "rows" and not interpreter_transposes():
    pytest.skip("jax 0.10's GPU interpreter runs no transposed wgmma operand "
                "(jax < 0.11); 'rows' is checked by lowering")
  x, ct, sizes = operands["x"], operands["ct"], operands["sizes"]
  dy = ct.astype(jnp.bfloat16)
  out = mosaic.tgmm_mosaic(x, dy, sizes, tuning=TUNE, layout=layout,
                           interpret=True)
  assert out.shape == (len(SIZES), K, N) and out.dtype == jnp.float32
  # Same bf16 operands, fp32 sums: only the order of the sums differs.
  assert _rel(out, tgmm_reference(x, dy, sizes)) < 1e-5


def test_no_races_in_the_gpu_interpreter(operands):
  from jax._src.pallas.mosaic_gpu.interpret import (  # noqa: PLC0415
      interpret_pallas_call)
  # jax 0.11's detector models TMA stores as asynchronous; 0.10's is coarser.
  x, w, sizes = operands["x"], operands["w"], operands["sizes"]
  dy = operands["ct"].astype(jnp.bfloat16)
  kw = dict(tuning=TUNE, interpret=gpu_interpreter(detect_races=True))
  jax.block_until_ready(mosaic.gmm_mosaic(x, w, sizes, **kw))
  assert not interpret_pallas_call.get_races().races_found
  jax.block_until_ready(mosaic.tgmm_mosaic(x, dy, sizes, **kw))
  assert not interpret_pallas_call.get_races().races_found


@pytest.mark.parametrize("tune,k,n", [
    (TUNE, K, N),
    (Tuning(kernel="mosaic"), 1024, 768),   # gpu_1b's gate/up product
    (Tuning(kernel="mosaic"), 384, 1024),   # and its down product
])
def test_kernels_lower_for_cuda(tune, k, n):
  # The Pallas -> Mosaic GPU lowering (wgmma shapes and swizzles, layout
  # casts, TMA slices, shared memory within the limit) runs on the CPU;
  # compiling the module to a cubin needs a card.
  spec = jax.ShapeDtypeStruct
  sizes = spec((len(SIZES),), jnp.int32)
  x = spec((M, k), jnp.bfloat16)
  calls = [("gmm_mosaic", functools.partial(mosaic.gmm_mosaic, tuning=tune),
            (x, spec((len(SIZES), k, n), jnp.bfloat16)))]
  for layout in LAYOUTS:
    calls.append(("tgmm_mosaic", functools.partial(
        mosaic.tgmm_mosaic, tuning=tune, layout=layout),
                  (x, spec((M, n), jnp.bfloat16))))
  for name, fn, args in calls:
    text = jax.jit(fn).trace(*args, sizes).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and name in text


def test_call_sites_of_one_product_share_one_lowered_kernel():
  # A model's layers call the same products: the step's module must carry
  # each kernel once (lowering and compiling it per call site cost gpu_1b
  # about 10 s of lowering and 13 MB of module text).
  spec = jax.ShapeDtypeStruct
  args = (spec((M, K), jnp.bfloat16), spec((len(SIZES), K, N), jnp.bfloat16),
          spec((len(SIZES),), jnp.int32))

  def kernels(calls):
    def fn(x, w, sizes):
      y = sum(gmm(x + i, w, sizes, tuning=TUNE) for i in range(calls))
      return y.astype(jnp.float32).sum()
    text = jax.jit(jax.grad(fn, argnums=(0, 1))).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    return text.count("mosaic_gpu")

  assert kernels(3) == kernels(1) > 0


@pytest.mark.parametrize("x_shape,dtype,tune,match", [
    ((8, 128), jnp.float32, TUNE, "bfloat16 only"),
    ((8, 96), jnp.bfloat16, TUNE, "K a multiple of 64, got K=96"),
    ((8, 128), jnp.bfloat16, Tuning(kernel="mosaic", block_m=32),
     r"Tuning.block_m in \(64, 128, 256\), got 32"),
])
def test_mosaic_limits_are_named(x_shape, dtype, tune, match):
  x = jnp.zeros(x_shape, dtype)
  w = jnp.zeros((3, x_shape[1], 64), dtype)
  with pytest.raises(ValueError, match=match):
    gmm(x, w, jnp.zeros((3,), jnp.int32), tuning=tune, interpret=True)


def test_tuning_rejects_unknown_kernel():
  with pytest.raises(ValueError, match="Tuning.kernel must be one of"):
    Tuning(kernel="cutlass")


@pytest.mark.parametrize("fields,match", [
    ({"model.moe.d_expert": 96}, r"model.moe.d_expert a multiple of 64, "
     "got 96"),
    ({"model.moe.d_expert": 64, "model.d_model": 64,
      "model.dtype": "float32"}, "needs model.dtype='bfloat16'"),
])
def test_config_rejects_mosaic_where_it_cannot_run(fields, match):
  config = load_config("default.py", "tiny,smoke")
  set_field(config, "model.moe.grouped_matmul", "mosaic")
  for field, value in fields.items():
    set_field(config, field, value)
  with pytest.raises(ConfigError, match=match):
    validate_config(config)
