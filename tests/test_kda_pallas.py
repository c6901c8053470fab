"""Pallas KDA (forward + backward kernels) in interpret mode vs the oracles.

Both intra-chunk paths: bounded (g_min given: dense diagonal tiles, g clamped
to g_min) and unbounded (g_min=None: position-pair diagonal tiles, any g).
CPU interpret mode is slow to compile: tiny shapes, and the op is called
eagerly so that its inner jits (`_kda_fwd_impl`, `_kda_bwd_impl`) compile
once per configuration and are shared by every test of it (module-scoped
fixtures hold the results). Configurations:
  * A, fp32 [B=1, T=130, H=2, K=16, V=96], both paths, forward only: 3 chunks,
    the last one holding 2 rows of a 16-row tile; V=96 runs in 3 blocks of 32;
  * D, fp32 [B=1, T=130, H=2, K=32, V=48], scale 0.3, block_k=16, both
    paths, values and gradients: 2 K slices in the chunk kernels, V in 3
    blocks of 16, 3 chunks (the last partial), an initial state;
  * B, bf16 [B=2, T=100, H=2, K=48, V=16], block_k=32, both paths: K padded
    to 64 and walked in two K slices, 2 chunks.
Gradients (q, k, v, g, beta, initial state) are checked against jax.vjp of
the chunked XLA reference with random cotangents for o and the final state.
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.linear_attention import (
    available_backends, chunk_kda_ref, kda, naive_recurrent_kda)
from pallas_kernels.linear_attention.common.tiles import mm_dot
from pallas_kernels.linear_attention.kda.chunk import kda_pallas
from pallas_kernels.linear_attention.kda.intra import inverse_row
from pallas_kernels.linear_attention.kda.tuning import Tuning

B, T, H, K, V = 1, 130, 2, 16, 96
G_MIN = -5.0
PATHS = {"bounded": G_MIN, "unbounded": None}
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "ds0")


def make_inputs(seed, b=B, t=T, h=H, dk=K, dv=V, similar_keys=False,
                g_low=G_MIN):
  """q, k, v, g, beta, s0 (fp32). l2-normalised k, g = g_low sigmoid(2x - 2).

  similar_keys: near-identical keys, beta ~ 1, almost no decay, the case
  where L is close to the all-ones lower matrix (hard for the inverse).
  """
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape)  # noqa: E731
  sigmoid = lambda x: 1.0 / (1.0 + np.exp(-x))  # noqa: E731
  q = normal(b, t, h, dk)
  if similar_keys:
    k = normal(1, 1, h, dk) + 0.05 * normal(b, t, h, dk)
    beta = np.full((b, t, h), 0.999)
    g = np.full((b, t, h, dk), -1e-3)
  else:
    k = normal(b, t, h, dk)
    beta = sigmoid(normal(b, t, h))
    g = g_low * sigmoid(2.0 * normal(b, t, h, dk) - 2.0)
  k = k / np.linalg.norm(k, axis=-1, keepdims=True)
  v = normal(b, t, h, dv)
  s0 = 0.5 * normal(b, h, dk, dv)
  return tuple(jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta, s0))


def cotangents(seed, o_shape, s_shape):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal(o_shape), jnp.float32),
          jnp.asarray(rng.standard_normal(s_shape), jnp.float32))


def run_kda(q, k, v, g, beta, s0, g_min=G_MIN):
  """The public op on the interpret backend, called eagerly (see module doc)."""
  return kda(q, k, v, g, beta, initial_state=s0, backend="interpret",
             g_min=g_min)


naive_kda = jax.jit(naive_recurrent_kda)
chunk_kda = jax.jit(chunk_kda_ref)


@functools.partial(jax.jit, static_argnames=("scale",))
def ref_grads(q, k, v, g, beta, s0, do, ds, scale=None):
  """jax.vjp of the chunked reference (fp32)."""
  _, vjp = jax.vjp(lambda *a: chunk_kda_ref(*a[:5], scale=scale,
                                            initial_state=a[5]),
                   q, k, v, g, beta, s0)
  return vjp((do, ds))


def pallas_grads(fn, args, cts):
  """(o, s) and the 6 gradients of the op `fn` (eager: shared inner jits)."""
  out, vjp = jax.vjp(fn, *args)
  return out, vjp(cts)


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def assert_finite(*xs):
  for x in xs:
    assert np.all(np.isfinite(np.asarray(x, np.float32)))


def assert_grads_close(got, want, rel, elem=None):
  """Norm-based relative error per gradient, plus (fp32) an elementwise check
  with atol scaled by max|ref| (dg is a within-chunk reverse cumsum of terms
  that cancel: compare it against its scale)."""
  for name, a, b in zip(GRAD_NAMES, got, want):
    assert_finite(a)
    assert a.shape == b.shape, name
    assert rel_err(a, b) < rel, (name, rel_err(a, b))
    if elem is not None:
      b = np.asarray(b, np.float64)
      np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=elem,
                                 atol=elem * np.max(np.abs(b)), err_msg=name)


@pytest.fixture(scope="module")
def fp32_run():
  """Inputs and (o, s) of the main fp32 shape, with an initial state."""
  inputs = make_inputs(0)
  return inputs, run_kda(*inputs)


@pytest.fixture(scope="module")
def fp32_run_unbounded(fp32_run):
  inputs, _ = fp32_run
  return inputs, run_kda(*inputs, g_min=None)


def test_registered():
  assert "interpret" in available_backends("kda")
  assert "pallas" in available_backends("kda")


@pytest.mark.parametrize("path", sorted(PATHS))
def test_forward_fp32_matches_oracles(path, fp32_run, fp32_run_unbounded):
  inputs, (o, s) = fp32_run if path == "bounded" else fp32_run_unbounded
  assert o.shape == (B, T, H, V) and o.dtype == jnp.float32
  assert s.shape == (B, H, K, V) and s.dtype == jnp.float32
  assert_finite(o, s)
  q, k, v, g, beta, s0 = inputs
  for oracle in (naive_kda, chunk_kda):
    o_ref, s_ref = oracle(q, k, v, g, beta, initial_state=s0)
    np.testing.assert_allclose(o, o_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s, s_ref, rtol=1e-4, atol=1e-5)


def test_forward_fp32_without_initial_state():
  q, k, v, g, beta, _ = make_inputs(1)
  o, s = run_kda(q, k, v, g, beta, None)
  o_ref, s_ref = naive_kda(q, k, v, g, beta)
  assert_finite(o, s)
  np.testing.assert_allclose(o, o_ref, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(s, s_ref, rtol=1e-4, atol=1e-5)


def test_forward_fp32_similar_keys():
  # L near the all-ones lower matrix: the inverse must stay fp32-accurate
  # (the (I - N)(I + N^2)... product lost ~1e-3 here).
  q, k, v, g, beta, s0 = make_inputs(2, similar_keys=True)
  o, s = run_kda(q, k, v, g, beta, s0)
  o_ref, s_ref = naive_kda(q, k, v, g, beta, initial_state=s0)
  assert_finite(o, s)
  assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


# bf16, config B: K=48 (padded to 64, two K slices of 32), V=16, T=100.
BF16_SHAPE = dict(b=2, t=100, dk=48, dv=16)


def _bf16_op(g_min):
  return functools.partial(kda_pallas, scale=None, chunk_size=64,
                           g_min=g_min, interpret=True,
                           tune=Tuning(block_k=32))


@pytest.mark.parametrize("with_state", [True, False])
def test_forward_bf16_k_not_pow2(with_state):
  q, k, v, g, beta, s0 = make_inputs(3, **BF16_SHAPE)
  s0 = s0 if with_state else None
  qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
  o, s = _bf16_op(G_MIN)(qb, kb, vb, g, beta, initial_state=s0)
  assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
  assert_finite(o, s)
  up = lambda x: x.astype(jnp.float32)  # noqa: E731
  o_ref, s_ref = naive_kda(up(qb), up(kb), up(vb), g, beta, initial_state=s0)
  assert rel_err(o, o_ref) < 1e-2
  assert rel_err(s, s_ref) < 1e-2


@pytest.mark.parametrize("path", sorted(PATHS))
def test_bf16_values_and_gradients(path):
  q, k, v, g, beta, s0 = make_inputs(13, **BF16_SHAPE)
  qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
  up = lambda x: x.astype(jnp.float32)  # noqa: E731
  op = _bf16_op(PATHS[path])
  cts = cotangents(14, v.shape, s0.shape)
  (o, s), got = pallas_grads(
      lambda *a: op(*a[:5], initial_state=a[5]), (qb, kb, vb, g, beta, s0),
      (cts[0].astype(jnp.bfloat16), cts[1]))
  assert o.dtype == jnp.bfloat16 and got[0].dtype == jnp.bfloat16
  assert got[2].dtype == jnp.bfloat16 and got[3].dtype == jnp.float32
  o_ref, s_ref = naive_kda(up(qb), up(kb), up(vb), g, beta, initial_state=s0)
  assert rel_err(o, o_ref) < 1e-2 and rel_err(s, s_ref) < 1e-2
  want = ref_grads(up(qb), up(kb), up(vb), g, beta, s0,
                   up(cts[0].astype(jnp.bfloat16)), cts[1])
  assert_grads_close(got, want, rel=2e-2)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_largest_head_dims_values_and_gradients(path):
  # K = V = 256, the largest head dims the op accepts, at its default
  # blocks (fp32, an initial state, one partly filled chunk of two).
  inputs = make_inputs(11, b=1, t=70, h=1, dk=256, dv=256)
  cts = cotangents(12, inputs[2].shape, inputs[5].shape)
  (o, s), got = pallas_grads(
      lambda *a: run_kda(*a, g_min=PATHS[path]), inputs, cts)
  o_ref, s_ref = naive_kda(*inputs[:5], initial_state=inputs[5])
  assert_finite(o, s)
  assert rel_err(o, o_ref) < 1e-4 and rel_err(s, s_ref) < 1e-4
  assert_grads_close(got, ref_grads(*inputs, *cts), rel=1e-4)


# Config D: K slices and V blocks in every kernel, both paths, values and
# gradients (fp32).
D_SHAPE = dict(t=130, dk=32, dv=48)
D_SCALE = 0.3


def d_op(g_min):
  # block_k=16 everywhere (grad_k too): several K slices at K=32.
  op = functools.partial(kda_pallas, scale=D_SCALE, chunk_size=64,
                         g_min=g_min, interpret=True,
                         tune=Tuning(block_k=16, grad_k_bk=16))
  return lambda q, k, v, g, beta, s0: op(q, k, v, g, beta, initial_state=s0)


@pytest.fixture(scope="module")
def config_d():
  inputs = make_inputs(6, **D_SHAPE)
  cts = cotangents(7, inputs[2].shape, inputs[5].shape)
  return inputs, cts, ref_grads(*inputs, *cts, scale=D_SCALE)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_k_slices_and_v_blocks_values_and_gradients(path, config_d):
  inputs, cts, want = config_d
  q, k, v, g, beta, s0 = inputs
  (o, s), got = pallas_grads(d_op(PATHS[path]), inputs, cts)
  o_ref, s_ref = naive_kda(q, k, v, g, beta, scale=D_SCALE, initial_state=s0)
  assert_finite(o, s)
  np.testing.assert_allclose(o, o_ref, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(s, s_ref, rtol=1e-4, atol=1e-5)
  assert_grads_close(got, want, rel=1e-4, elem=1e-4)


def test_bounded_clamp_has_zero_grad():
  # Config D, bounded: g below g_min is clamped, with zero gradient there.
  q, k, v, g, beta, s0 = make_inputs(4, **D_SHAPE)
  g = g.at[0, 5:9, 1, :4].set(2.0 * G_MIN)
  clamped = np.asarray(g < G_MIN)
  cts = cotangents(5, v.shape, s0.shape)
  _, got = pallas_grads(d_op(G_MIN), (q, k, v, g, beta, s0), cts)
  want = ref_grads(q, k, v, jnp.where(g < G_MIN, G_MIN, g), beta, s0, *cts,
                   scale=D_SCALE)
  want = want[:3] + (jnp.where(g < G_MIN, 0.0, want[3]),) + want[4:]
  assert_grads_close(got, want, rel=1e-4, elem=1e-4)
  assert np.all(np.asarray(got[3])[clamped] == 0.0)
  assert np.any(np.asarray(got[3])[~clamped] != 0.0)


def test_g_below_g_min_is_clamped(fp32_run):
  # g = -20 spans 15 * 20 = 300 nats in a diagonal tile: unclamped, the dense
  # dot would overflow. The op computes KDA on max(g, g_min), finite.
  (q, k, v, g, beta, s0), _ = fp32_run
  g_low = g.at[0, 10:100, 0, :8].set(-20.0)
  o, s = run_kda(q, k, v, g_low, beta, s0)
  assert_finite(o, s)
  o_ref, s_ref = naive_kda(q, k, v, jnp.maximum(g_low, G_MIN), beta,
                           initial_state=s0)
  np.testing.assert_allclose(o, o_ref, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(s, s_ref, rtol=1e-4, atol=1e-5)


def test_unbounded_path_handles_very_negative_decay():
  # g down to -40 per step (spans of ~600 nats in a 16-row tile): the bounded
  # tiling would overflow; the position-pair diagonal does not, and there is
  # no clamp: values and gradients equal the reference on the raw g.
  inputs = make_inputs(8, g_low=-40.0, **D_SHAPE)
  q, k, v, g, beta, s0 = inputs
  assert float(jnp.min(g)) < -35.0
  cts = cotangents(9, v.shape, s0.shape)
  (o, s), got = pallas_grads(d_op(None), inputs, cts)
  assert_finite(o, s)
  o_ref, s_ref = naive_kda(q, k, v, g, beta, scale=D_SCALE, initial_state=s0)
  # (the fp32 oracles themselves differ by ~1e-5 here: atol 3e-5)
  np.testing.assert_allclose(o, o_ref, rtol=1e-4, atol=3e-5)
  np.testing.assert_allclose(s, s_ref, rtol=1e-4, atol=3e-5)
  assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5
  assert_grads_close(got, ref_grads(*inputs, *cts, scale=D_SCALE), rel=1e-4,
                     elem=1e-4)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_strict_causality_in_partial_last_tile(path, fp32_run,
                                               fp32_run_unbounded):
  # T=130: the last tile holds rows 128, 129 (of 128..143). Perturb row 129
  # (q, k, v, g, beta): outputs of rows < 129 must be bit-identical.
  (q, k, v, g, beta, s0), (o, s) = (
      fp32_run if path == "bounded" else fp32_run_unbounded)
  rng = np.random.default_rng(9)
  bump = lambda x: x.at[:, 129:].add(  # noqa: E731
      jnp.asarray(rng.standard_normal(x[:, 129:].shape), jnp.float32))
  g2 = g.at[:, 129:].set(G_MIN * 0.99)
  beta2 = beta.at[:, 129:].set(0.9)
  o2, s2 = run_kda(bump(q), bump(k), bump(v), g2, beta2, s0,
                   g_min=PATHS[path])
  assert_finite(o2, s2)
  np.testing.assert_array_equal(np.asarray(o[:, :129]),
                                np.asarray(o2[:, :129]))
  assert not np.array_equal(np.asarray(o[:, 129:]), np.asarray(o2[:, 129:]))
  assert not np.array_equal(np.asarray(s), np.asarray(s2))


# ---------------------------------------------------------------------------
# Bad inputs: clear errors, raised before any kernel is built.
# ---------------------------------------------------------------------------

_Z = lambda *shape: jnp.zeros(shape, jnp.float32)  # noqa: E731
_GOOD = dict(q=_Z(1, 16, 2, 16), k=_Z(1, 16, 2, 16), v=_Z(1, 16, 2, 16),
             g=_Z(1, 16, 2, 16), beta=_Z(1, 16, 2))


def _call(via_ops, initial_state=None, chunk_size=64, g_min=G_MIN, **arrays):
  a = dict(_GOOD, **arrays)
  args = (a["q"], a["k"], a["v"], a["g"], a["beta"])
  if via_ops:
    return kda(*args, initial_state=initial_state, backend="interpret",
               chunk_size=chunk_size, g_min=g_min)
  return kda_pallas(*args, scale=None, initial_state=initial_state,
                    chunk_size=chunk_size, g_min=g_min, interpret=True)


@pytest.mark.parametrize("via_ops", [True, False])
@pytest.mark.parametrize("arrays,match", [
    (dict(q=_Z(16, 2, 16)), "q must have rank 4"),
    (dict(k=_Z(1, 16, 2, 32)), "k must have the same shape as q"),
    (dict(g=_Z(1, 16, 1, 16)), "g must have the same shape as q"),
    (dict(v=_Z(1, 8, 2, 16)), "v must have shape"),
    (dict(beta=_Z(1, 16, 2, 1)), "beta must have"),
    (dict(beta=_Z(1, 8, 2)), "beta must have shape"),
    (dict(initial_state=_Z(1, 2, 16, 32)), "initial_state must have shape"),
])
def test_bad_shapes(via_ops, arrays, match):
  with pytest.raises(ValueError, match=match):
    _call(via_ops, **arrays)


@pytest.mark.parametrize("via_ops", [True, False])
@pytest.mark.parametrize("dk,dv,match", [
    (24, 16, "K a multiple of 16"),
    (272, 16, r"K a multiple of 16 in \[16, 256\]"),
    (16, 8, "V a multiple of 16"), (16, 272, "V a multiple of 16")])
def test_bad_head_dims(via_ops, dk, dv, match):
  qk = _Z(1, 16, 2, dk)
  with pytest.raises(ValueError, match=match):
    _call(via_ops, q=qk, k=qk, g=qk, v=_Z(1, 16, 2, dv))


@pytest.mark.parametrize("via_ops", [True, False])
@pytest.mark.parametrize("g_min", [-8.0, -5.6])
def test_bounded_path_refuses_bad_g_min(via_ops, g_min):
  with pytest.raises(ValueError, match=r"g_min.*\[-5\.5, 0\).*g_min=None"):
    _call(via_ops, g_min=g_min)


def test_forced_bounded_path_needs_g_min():
  with pytest.raises(ValueError, match=r"g_min.*\[-5\.5, 0\)"):
    kda_pallas(*(_GOOD[n] for n in ("q", "k", "v", "g", "beta")), scale=None,
               initial_state=None, chunk_size=64, g_min=None, interpret=True,
               bounded=True)


def test_g_min_not_negative():
  # ops.kda rejects g_min >= 0 itself; the kernel entry gives its own error.
  with pytest.raises(ValueError, match=r"g_min.*\[-5\.5, 0\)"):
    _call(False, g_min=0.0)
  with pytest.raises(ValueError, match="g_min"):
    _call(True, g_min=0.0)


@pytest.mark.parametrize("via_ops", [True, False])
def test_chunk_size_not_64(via_ops):
  with pytest.raises(ValueError, match="chunk_size"):
    _call(via_ops, chunk_size=32)


@pytest.mark.parametrize("name", ["block_k", "grad_k_bk", "pass_bv"])
@pytest.mark.parametrize("block_k", [8, 48])
def test_bad_block_k(name, block_k):
  with pytest.raises(ValueError, match=f"^tune.{name} must be a power of two"):
    kda_pallas(*(_GOOD[n] for n in ("q", "k", "v", "g", "beta")), scale=None,
               initial_state=None, chunk_size=64, g_min=G_MIN, interpret=True,
               tune=Tuning(**{name: block_k}))


@pytest.mark.parametrize("field,value,message", [
    ("state_pass", "cuda", r"tune.state_pass must be one of \('auto', "),
    ("output_kernel", "auto", r"tune.output_kernel must be one of "),
    ("grad_k_warps", 0, "tune.grad_k_warps must be an int >= 1")])
def test_bad_tuning(field, value, message):
  with pytest.raises(ValueError, match=message):
    kda_pallas(*(_GOOD[n] for n in ("q", "k", "v", "g", "beta")), scale=None,
               initial_state=None, chunk_size=64, g_min=G_MIN, interpret=True,
               tune=Tuning(**{field: value}))
  with pytest.raises(ValueError, match="tune must be a kda.tuning.Tuning"):
    kda_pallas(*(_GOOD[n] for n in ("q", "k", "v", "g", "beta")), scale=None,
               initial_state=None, chunk_size=64, g_min=G_MIN, interpret=True,
               tune={field: value})


def test_float16_refused():
  half = _Z(1, 16, 2, 16).astype(jnp.float16)
  with pytest.raises(ValueError, match="float32 or bfloat16"):
    _call(False, q=half, k=half, v=half)


def test_auto_picks_the_unbounded_kernel_without_a_usable_g_min(monkeypatch):
  from pallas_kernels.linear_attention import ops
  monkeypatch.setattr(ops.jax, "default_backend", lambda: "gpu")
  pick = lambda **kw: ops._resolve(  # noqa: E731
      "kda", "auto", chunk_size=64, **kw)
  assert pick(g_min=None) == (ops._IMPLS["pallas"]["kda"], None)
  assert pick(g_min=-8.0) == (ops._IMPLS["pallas"]["kda"], None)
  assert pick(g_min=-5.0) == (ops._IMPLS["pallas"]["kda"], -5.0)
  monkeypatch.setattr(ops.jax, "default_backend", lambda: "cpu")
  assert pick(g_min=None)[0] is ops._IMPLS["xla"]["kda"]


def _inverse_ttir(tmp_path, dtype):
  """The Triton IR of the kernel that holds the triangular inverse
  (kda_chunk_solve), lowered for sm_90."""
  from experiments import kernel_resources  # pylint: disable=g-import-not-at-top
  spec = lambda *s, dt=dtype: jax.ShapeDtypeStruct(s, dt)  # noqa: E731
  args = (spec(1, 128, 2, 64), spec(1, 128, 2, 64), spec(1, 128, 2, 64),
          spec(1, 128, 2, 64, dt=jnp.float32), spec(1, 128, 2, dt=jnp.float32))

  def fwd(q, k, v, g, beta):
    return kda_pallas(q, k, v, g, beta, scale=None, initial_state=None,
                      chunk_size=64, g_min=G_MIN)[0]
  found = kernel_resources.capture_ttir(fwd, args, str(tmp_path))
  [path] = [f for f, name, *_ in found if name == "kda_chunk_solve"]
  return open(path).read()


def _f32_dot_precisions(ttir):
  """The input precisions of the tt.dot ops on fp32 operands in `ttir`
  (the triangular inverse's; "ieee" where none is printed, the default)."""
  found = re.findall(r"tt\.dot [^:\n]*?(?:inputPrecision = (\w+) )?: "
                     r"tensor<\w+xf32>", ttir)
  return {p or "ieee" for p in found}


def test_inverse_dot_reaches_the_gpu_lowering(tmp_path):
  # The triangular inverse's fp32 dots are one TF32 MMA each for bf16
  # inputs; fp32 inputs keep IEEE (their contract). (Interpret mode always
  # runs IEEE: the CPU has no TF32, so the TF32 numbers are checked on a
  # card, results/kernels.md, and emulated below.)
  assert _f32_dot_precisions(
      _inverse_ttir(tmp_path / "a", jnp.bfloat16)) == {"tf32"}
  assert _f32_dot_precisions(
      _inverse_ttir(tmp_path / "b", jnp.float32)) == {"ieee"}


def _tf32(x):
  """fp32 rounded to TF32 (10 mantissa bits, to nearest, ties away)."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  bits = (bits + jnp.uint32(0x1000)) & jnp.uint32(0xFFFFE000)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _exact_dot(x, y, dims):
  """An fp32 dot at full precision (HIGHEST)."""
  return jax.lax.dot_general(x, y, (dims, ((), ())), precision="highest",
                             preferred_element_type=jnp.float32)


def _dot_tf32(a, b, dims=((1,), (0,))):
  """An emulated TF32 tensor-core dot: operands rounded to TF32, fp32
  accumulation."""
  return _exact_dot(_tf32(a), _tf32(b), dims)


def test_inverse_accuracy_per_dot_form():
  # The solve kernel's block inverse (recursive doubling on the diagonal
  # tiles, block forward substitution off it) with its fp32 dots IEEE (fp32
  # inputs, interpret mode) and emulated as one TF32 pass (bf16 inputs on
  # the GPU), vs float64 on the hard case (near-identical keys, beta ~ 1,
  # g ~ 0): IEEE at fp32 accuracy (3e-7), TF32 at 9e-4, under the bf16
  # rounding of M (3.9e-3) that the W, U and backward dots apply anyway.
  rng = np.random.default_rng(11)
  k = rng.standard_normal((1, 64)) + 0.05 * rng.standard_normal((64, 64))
  k /= np.linalg.norm(k, axis=1, keepdims=True)
  lmat = 0.999 * (k @ k.T) * np.exp(-1e-3 * (np.arange(64)[:, None]
                                             - np.arange(64)[None, :]))
  lmat *= np.tri(64, k=-1)
  want = np.linalg.inv(np.eye(64) + lmat)
  row, col = (jnp.asarray(x) for x in np.meshgrid(
      np.arange(16), np.arange(16), indexing="ij"))
  lmat32 = jnp.asarray(lmat, jnp.float32)
  errs = {}
  for name, dot in (("ieee", mm_dot), ("tf32", _dot_tf32)):
    mt = {}
    for i in range(4):
      mt = inverse_row(i, [lmat32[16 * i:16 * i + 16, 16 * j:16 * j + 16]
                               for j in range(i + 1)], mt, row, col, dot)
    got = np.zeros((64, 64))
    for (i, j), tile in mt.items():
      got[16 * i:16 * i + 16, 16 * j:16 * j + 16] = np.asarray(tile)
    errs[name] = np.abs(got - want).max() / np.abs(want).max()
  assert errs["ieee"] < 2e-6 and errs["tf32"] < 2e-3, errs
