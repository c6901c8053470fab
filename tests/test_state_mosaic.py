"""The Mosaic GPU kernels (common/mosaic.py) vs the Triton kernels.

Each pass runs in the GPU interpreter on CPU, tiny shapes: 3 chunks, K=128
(GLA: two K blocks of 64), V=32 in two V blocks of 16, an initial state.
The output kernel: K=128, V=128 in two blocks of 64, 4 chunks, two per
program. The reference is the Triton kernel of the same stage (interpreted), itself
tested against the naive recurrence in test_kda_pallas / test_gla_pallas.
Layout "rows" (wgmma reads kg, qg, W transposed) needs an interpreter that
runs transposed operands (jax >= 0.11); on jax 0.10 it is checked by
lowering for cuda only (test_passes_lower_for_cuda, every jax). The ops
with state_pass="mosaic" and output_kernel="mosaic" are checked end to end
(values and gradients, T not a multiple of 64, bf16) against the Triton
kernels and the chunked reference.
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.linear_attention import chunk_gla_ref, chunk_kda_ref
from pallas_kernels.linear_attention.common import mosaic as sm
from pallas_kernels.linear_attention.common.output import output_call
from pallas_kernels.linear_attention.gla import chunk as gla
from pallas_kernels.linear_attention.gla import passes as gla_passes
from pallas_kernels.linear_attention.gla import tuning as gla_tuning
from pallas_kernels.linear_attention.kda import chunk as kda
from pallas_kernels.linear_attention.kda import passes as kda_passes
from pallas_kernels.linear_attention.kda import tuning as kda_tuning

BF16 = jnp.bfloat16
SCALE = 0.3
N_CHUNKS, KP, DV = 3, 128, 32
PASSES = ("kda_state", "gla_state", "gla_dstate", "kda_dstate")


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.fixture(scope="module")
def pass_inputs():
  ks = jax.random.split(jax.random.key(17), 8)
  tp = N_CHUNKS * 64
  seq_k, seq_v = (1, tp, 2, KP), (1, tp, 2, DV)
  normal = lambda i, shape, s=1.0: s * jax.random.normal(ks[i], shape)  # noqa: E731
  return dict(
      kg=normal(0, seq_k, 0.3).astype(BF16), x=normal(1, seq_v).astype(BF16),
      w=normal(2, seq_k, 0.1).astype(BF16), qg=normal(3, seq_k, 0.3).astype(BF16),
      ec=jax.random.uniform(ks[4], (1, 2, N_CHUNKS, KP), minval=0.5,
                            maxval=1.0),
      s0=normal(5, (1, 2, KP, DV)), do=normal(6, seq_v).astype(BF16),
      dvi=normal(7, seq_v))


def _mosaic_call(name, d, layout, interpret=True):
  """(function, args) of one Mosaic pass."""
  t = functools.partial(sm.as_layout, layout=layout)
  kw = dict(bv=16, layout=layout, interpret=interpret)
  if name == "kda_state":
    return (functools.partial(sm.state_pass, **kw),
            (t(d["kg"]), d["x"], d["ec"], d["s0"], d["w"]))
  if name == "gla_state":
    return (functools.partial(sm.state_pass, bk=64, **kw),
            (t(d["kg"]), d["x"], d["ec"], d["s0"]))
  if name == "gla_dstate":
    return (functools.partial(sm.gla_dstate_pass, scale=SCALE, bk=64, **kw),
            (t(d["qg"]), d["do"], d["ec"], d["s0"]))
  return (functools.partial(sm.kda_dstate_pass, scale=SCALE, **kw),
          (t(d["qg"]), d["kg"], t(d["w"]), d["ec"], d["do"], d["dvi"],
           d["s0"]))


def _triton_pass(name, d):
  ktune = kda_tuning.Tuning()
  lay = kda.call_layout(jnp.zeros(d["kg"].shape, BF16), d["x"], ktune)
  tune = gla_tuning.Tuning(pass_bk=64, pass_bv=16)
  glay = gla.call_layout(jnp.zeros(d["kg"].shape, BF16), d["x"], tune)
  if name == "kda_state":
    return kda_passes.state_call(d["w"], d["x"], d["kg"], d["ec"], d["s0"],
                                 lay, ktune, True)
  if name == "gla_state":
    return gla_passes.state_call(d["kg"], d["x"], d["ec"], d["s0"], glay,
                                 tune, True)
  if name == "gla_dstate":
    return gla_passes.dstate_call(d["qg"], d["do"], d["ec"], d["s0"], glay,
                                  SCALE, tune, True)
  return kda_passes.dstate_call(d["qg"], d["kg"], d["ec"], d["w"], d["do"],
                                d["dvi"], d["s0"], lay, SCALE, ktune, True)


@pytest.mark.parametrize("layout", sm.LAYOUTS)
@pytest.mark.parametrize("name", PASSES)
def test_pass_matches_triton(name, layout, pass_inputs):
  if layout == "rows" and not sm.interpreter_transposes():
    pytest.skip("this jax's GPU interpreter runs no transposed wgmma operand "
                "(jax < 0.11); 'rows' is checked by lowering")
  fn, args = _mosaic_call(name, pass_inputs, layout)
  got = fn(*args)
  want = _triton_pass(name, pass_inputs)
  assert len(got) == len(want)
  for i, (a, b) in enumerate(zip(got, want)):
    assert a.shape == b.shape and a.dtype == b.dtype, (name, i)
    assert np.all(np.isfinite(np.asarray(a, np.float32))), (name, i)
    # Same operands and roundings; only the fp32 sums' order differs (a
    # stored bf16 state may land one ulp apart).
    assert rel_err(a, b) < 2e-3, (name, i, rel_err(a, b))
  # The carried fp32 state (last output): bf16 operands of its updates
  # (the stored states, KDA's V' / dV') may round one ulp apart.
  assert rel_err(got[-1], want[-1]) < 1e-3


@pytest.mark.parametrize("layout", sm.LAYOUTS)
@pytest.mark.parametrize("name", PASSES)
def test_passes_lower_for_cuda(name, layout, pass_inputs):
  # The Pallas -> Mosaic GPU lowering (layouts, wgmma shapes and swizzles,
  # TMA slices) runs on the CPU; compiling the module to a cubin needs a
  # card.
  fn, args = _mosaic_call(name, pass_inputs, layout, interpret=False)
  text = jax.jit(fn).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
  assert f"{name}_pass_mosaic" in text


@pytest.fixture(scope="module")
def output_inputs():
  ks = jax.random.split(jax.random.key(23), 4)
  n, kp, dv = 4, 128, 128
  tp = n * 64
  tril = jnp.tril(jax.random.normal(ks[1], (1, 2, n, 64, 64)))
  return dict(qg=(0.3 * jax.random.normal(ks[0], (1, tp, 2, kp))).astype(BF16),
              aqk=tril.reshape(1, 2, tp, 64).astype(BF16),
              x=jax.random.normal(ks[2], (1, tp, 2, dv)).astype(BF16),
              states=jax.random.normal(ks[3], (1, 2, n, kp, dv)).astype(BF16))


def _mosaic_output(d, interpret=True):
  fn = functools.partial(sm.output, scale=SCALE, out_dtype=BF16, bv=64,
                         per_program=2, interpret=interpret)
  return fn, (d["qg"], d["aqk"], d["x"], d["states"])


def test_output_matches_triton(output_inputs):
  fn, args = _mosaic_output(output_inputs)
  got = fn(*args)
  lay = kda.call_layout(output_inputs["qg"], output_inputs["x"],
                        kda_tuning.Tuning())
  want = output_call(*args, lay, SCALE, BF16, True, 4, "o")
  assert got.shape == want.shape and got.dtype == want.dtype
  assert np.all(np.isfinite(np.asarray(got, np.float32)))
  assert rel_err(got, want) < 2e-3


def test_output_lowers_for_cuda(output_inputs):
  fn, args = _mosaic_output(output_inputs, interpret=False)
  text = jax.jit(fn).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "chunk_output_mosaic" in text


# The ops end to end, bf16, T = 150 (3 chunks, the last partial), K = 64,
# V = 32, an initial state, the bounded path.
T, H, DK = 150, 2, 64


def _op_inputs():
  rng = np.random.default_rng(3)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
  k = normal(1, T, H, DK)
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  g = -5.0 * jax.nn.sigmoid(2.0 * normal(1, T, H, DK) - 2.0)
  return dict(q=normal(1, T, H, DK).astype(BF16), k=k.astype(BF16),
              v=normal(1, T, H, DV).astype(BF16), g=g,
              beta=jax.nn.sigmoid(normal(1, T, H)),
              s0=0.5 * normal(1, H, DK, DV),
              do=normal(1, T, H, DV), ds=normal(1, H, DK, DV))


def _op(name, kernels):
  """The op with its state passes and output kernel on `kernels` ("triton"
  or "mosaic")."""
  if name == "kda":
    def f(q, k, v, g, beta, s0):
      return kda.kda_pallas(q, k, v, g, beta, scale=SCALE, initial_state=s0,
                            chunk_size=64, g_min=-5.0, interpret=True,
                            tune=kda_tuning.Tuning(state_pass=kernels,
                                                   output_kernel=kernels))
    return f
  tune = gla_tuning.Tuning(state_pass=kernels, output_kernel=kernels)

  def f(q, k, v, g, beta, s0):
    del beta
    return gla.gla_pallas(q, k, v, g, scale=SCALE, initial_state=s0,
                          chunk_size=64, g_min=-5.0, interpret=True,
                          tune=tune)
  return f


def _run_op(name, state_pass, d):
  args = tuple(d[n] for n in ("q", "k", "v", "g", "beta", "s0"))
  out, vjp = jax.vjp(_op(name, state_pass), *args)
  return out, vjp((d["do"].astype(BF16), d["ds"]))


@pytest.fixture(scope="module")
def op_runs():
  d = _op_inputs()
  return d, {(name, sp): _run_op(name, sp, d)
             for name in ("kda", "gla") for sp in ("triton", "mosaic")}


@pytest.mark.parametrize("name", ("kda", "gla"))
def test_op_mosaic_matches_triton_and_reference(name, op_runs):
  d, runs = op_runs
  (o, s), grads = runs[(name, "mosaic")]
  (o_t, s_t), grads_t = runs[(name, "triton")]
  for a, b in zip((o, s) + tuple(grads), (o_t, s_t) + tuple(grads_t)):
    assert np.all(np.isfinite(np.asarray(a, np.float32)))
    assert rel_err(a, b) < 2e-3 if np.any(np.asarray(b)) else not np.any(
        np.asarray(a))
  up = lambda x: x.astype(jnp.float32)  # noqa: E731
  if name == "kda":
    o_ref, s_ref = chunk_kda_ref(up(d["q"]), up(d["k"]), up(d["v"]), d["g"],
                                 d["beta"], scale=SCALE,
                                 initial_state=d["s0"])
  else:
    o_ref, s_ref = chunk_gla_ref(up(d["q"]), up(d["k"]), up(d["v"]), d["g"],
                                 scale=SCALE, initial_state=d["s0"])
  assert rel_err(o, o_ref) < 1e-2 and rel_err(s, s_ref) < 1e-2


@pytest.mark.parametrize("name", ("kda", "gla"))
def test_op_runs_the_mosaic_kernels(name, op_runs):
  d, _ = op_runs
  args = tuple(d[n] for n in ("q", "k", "v", "g", "beta", "s0"))
  traced = {sp: str(jax.make_jaxpr(
      lambda *a, sp=sp: jax.vjp(_op(name, sp), *a)[0])(*args))
            for sp in ("triton", "mosaic")}
  triton_pass = re.compile(rf"\b{name}_state_pass\b(?!_mosaic)")
  assert f"{name}_state_pass_mosaic" in traced["mosaic"]
  assert "chunk_output_mosaic" in traced["mosaic"]
  assert not triton_pass.search(traced["mosaic"])
  assert triton_pass.search(traced["triton"])
  assert "_mosaic" not in traced["triton"]
  grads = str(jax.make_jaxpr(lambda *a: _run_op(name, "mosaic", dict(
      d, **dict(zip(("q", "k", "v", "g", "beta", "s0"), a))))[1])(*args))
  assert f"{name}_dstate_pass_mosaic" in grads


def test_bad_state_pass_inputs_name_the_field():
  d = _op_inputs()
  args = [d[n] for n in ("q", "k", "v", "g", "beta", "s0")]
  with pytest.raises(ValueError, match="tune.state_pass must be one of"):
    kda.kda_pallas(*args[:5], scale=None, initial_state=args[5],
                   chunk_size=64, g_min=-5.0, interpret=True,
                   tune=kda_tuning.Tuning(state_pass="cuda"))
  with pytest.raises(ValueError, match="tune.state_pass must be one of"):
    gla_tuning.check_tuning(gla_tuning.Tuning(state_pass="cuda"))
  with pytest.raises(ValueError, match="tune.output_kernel must be one of"):
    gla_tuning.check_tuning(gla_tuning.Tuning(output_kernel="cuda"))
  with pytest.raises(ValueError, match="tune.output_kernel must be one of"):
    kda.kda_pallas(*args[:5], scale=None, initial_state=args[5],
                   chunk_size=64, g_min=-5.0, interpret=True,
                   tune=kda_tuning.Tuning(output_kernel="cuda"))
  fp32 = [a.astype(jnp.float32) for a in args]
  with pytest.raises(ValueError, match="state_pass='mosaic' takes bfloat16"):
    kda.kda_pallas(*fp32[:5], scale=None, initial_state=fp32[5],
                   chunk_size=64, g_min=-5.0, interpret=True,
                   tune=kda_tuning.Tuning(state_pass="mosaic"))
  with pytest.raises(ValueError, match="output_kernel='mosaic' takes bf"):
    kda.kda_pallas(*fp32[:5], scale=None, initial_state=fp32[5],
                   chunk_size=64, g_min=-5.0, interpret=True,
                   tune=kda_tuning.Tuning(output_kernel="mosaic"))
  with pytest.raises(ValueError, match="output_kernel='mosaic' block_v"):
    sm.check_state_pass(128, 256, BF16, 128, 128, "rows", whole_k=True,
                        what="output_kernel")
  narrow = [a[..., :32] if a.ndim == 4 and a.shape[-1] == DK else a
            for a in args]
  narrow[5] = args[5][:, :, :32]
  with pytest.raises(ValueError, match="multiple of 64"):
    gla.gla_pallas(*narrow[:4], scale=None, initial_state=narrow[5],
                   chunk_size=64, g_min=-5.0, interpret=True,
                   tune=gla_tuning.Tuning(state_pass="mosaic"))
  with pytest.raises(ValueError, match="block_k must be"):
    sm.check_state_pass(128, 32, BF16, 64, 16, "rows", whole_k=True)
  with pytest.raises(ValueError, match="block_v must be"):
    sm.check_state_pass(128, 32, BF16, 128, 8, "rows", whole_k=True)
  with pytest.raises(ValueError, match="layout must be one of"):
    sm.check_state_pass(128, 32, BF16, 128, 16, "diag", whole_k=True)


def test_shared_memory_budget_is_checked():
  # KDA's reverse pass at K=256: 3 double-buffered [64, 256] bf16 operands
  # and the rest exceed 227 KB per block; the error says so before compiling.
  tp, kp, dv = 128, 256, 32
  z = lambda *s, dt=BF16: jnp.zeros(s, dt)  # noqa: E731
  with pytest.raises(ValueError, match="bytes of shared memory"):
    sm.kda_dstate_pass(z(1, tp, 1, kp), z(1, tp, 1, kp), z(1, tp, 1, kp),
                       z(1, 1, 2, kp, dt=jnp.float32), z(1, tp, 1, dv),
                       z(1, tp, 1, dv, dt=jnp.float32),
                       z(1, 1, kp, dv, dt=jnp.float32), scale=1.0)


# Race detection: the GPU interpreter's happens-before checker over shared
# memory, TMA copies and barriers. jax 0.11's models the async proxy (a
# plain load of a slot and a later TMA write into it need commit_smem
# between them: it found exactly that missing in _run_pass); jax 0.10's is
# coarser and runs as a weaker check.
def _races_found():
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call  # pylint: disable=g-import-not-at-top
  return interpret_pallas_call.get_races().races_found


def _detector_models_async_stores():
  return sm.interpreter_transposes()   # both arrived in jax 0.11


@pytest.mark.parametrize("name", PASSES + ("output",))
def test_no_races_in_the_gpu_interpreter(name, pass_inputs, output_inputs):
  layout = sm.default_layout(True)
  if name == "output":
    fn, args = _mosaic_output(output_inputs)
  else:
    fn, args = _mosaic_call(name, pass_inputs, layout)
  fn = functools.partial(fn, interpret=sm.gpu_interpreter(detect_races=True))
  jax.block_until_ready(fn(*args))
  assert not _races_found()


def test_race_detector_sees_an_unawaited_store(pass_inputs, monkeypatch):
  # The control: rewriting a shared-memory slot while a TMA store may still
  # be reading it must be reported, else the test above proves nothing.
  if not _detector_models_async_stores():
    pytest.skip("jax < 0.11: the race detector does not model TMA stores "
                "as asynchronous")
  real_to_gmem = sm._to_gmem

  def racy_to_gmem(value, slot_ref, dst):
    real_to_gmem(value, slot_ref, dst)
    slot_ref[...] = value        # no wait_smem_to_gmem before the rewrite

  monkeypatch.setattr(sm, "_to_gmem", racy_to_gmem)
  fn, args = _mosaic_call("gla_state", pass_inputs, "cols")
  fn = functools.partial(fn, interpret=sm.gpu_interpreter(detect_races=True))
  jax.block_until_ready(fn(*args))
  assert _races_found()


@pytest.mark.parametrize("name", ("kda_state", "kda_dstate"))
def test_race_detector_needs_the_proxy_fence(name, pass_inputs, monkeypatch):
  # Without the fence between a chunk's plain loads of a slot and the next
  # prefetch into it, the detector reports a race (what it found in session
  # 17): the fence in _run_pass is needed, not decoration.
  if not _detector_models_async_stores():
    pytest.skip("jax < 0.11: the race detector does not model the async "
                "proxy")
  monkeypatch.setattr(sm, "_release_slot", lambda: None)
  fn, args = _mosaic_call(name, pass_inputs, "cols")
  fn = functools.partial(fn, interpret=sm.gpu_interpreter(detect_races=True))
  jax.block_until_ready(fn(*args))
  assert _races_found()


def test_public_op_passes_pallas_options(op_runs):
  # ops.kda binds pallas_options to the Pallas kernel (here interpreted) and
  # the XLA oracle ignores them; unknown options name the allowed ones.
  from pallas_kernels.linear_attention import ops  # pylint: disable=g-import-not-at-top
  d, runs = op_runs
  args = tuple(d[n] for n in ("q", "k", "v", "g", "beta"))
  mosaic = dict(tune=kda_tuning.Tuning(state_pass="mosaic",
                                       output_kernel="mosaic"))
  o, s = ops.kda(*args, scale=SCALE, initial_state=d["s0"],
                 backend="interpret", g_min=-5.0, pallas_options=mosaic)
  (o_want, s_want), _ = runs[("kda", "mosaic")]
  np.testing.assert_array_equal(np.asarray(o, np.float32),
                                np.asarray(o_want, np.float32))
  np.testing.assert_array_equal(s, s_want)
  o_x, _ = ops.kda(*args, scale=SCALE, initial_state=d["s0"], backend="xla",
                   g_min=-5.0, pallas_options=mosaic)
  o_ref, _ = ops.kda(*args, scale=SCALE, initial_state=d["s0"],
                     backend="xla", g_min=-5.0)
  np.testing.assert_array_equal(np.asarray(o_x, np.float32),
                                np.asarray(o_ref, np.float32))
  with pytest.raises(ValueError, match=r"unknown option\(s\) \['warps'\] for "
                     r"kda; allowed: bounded, tune"):
    ops.kda(*args, scale=SCALE, initial_state=d["s0"], backend="interpret",
            g_min=-5.0, pallas_options=dict(warps=8))
  with pytest.raises(ValueError, match="pallas_options must be None or a "
                     "dict"):
    ops.kda(*args, backend="interpret", g_min=-5.0, pallas_options="mosaic")


def test_kda_layer_runs_the_mosaic_stages():
  # The model's KDA layer (config model.kda.pallas_stages) on the interpret
  # backend: bf16, head dim 64, T = 80; the Mosaic stages give the Triton
  # stages' output and parameter gradients.
  from moe_jax.layers.kda import KDA  # pylint: disable=g-import-not-at-top
  x = jax.random.normal(jax.random.key(5), (1, 80, 64), jnp.float32)

  def make(stages):
    return KDA(d_model=64, num_heads=1, backend="interpret", chunk_size=64,
               pallas_stages=stages, dtype=jnp.bfloat16)

  params = make("triton").init(jax.random.key(6), x)

  def loss(p, stages):
    return jnp.sum(make(stages).apply(p, x).astype(jnp.float32) ** 2)

  got = {st: jax.value_and_grad(loss)(params, st) for st in ("triton", "mosaic")}
  traced = str(jax.make_jaxpr(lambda p: loss(p, "mosaic"))(params))
  assert "kda_state_pass_mosaic" in traced and "chunk_output_mosaic" in traced
  (l_t, g_t), (l_m, g_m) = got["triton"], got["mosaic"]
  assert np.isfinite(float(l_m))
  np.testing.assert_allclose(float(l_m), float(l_t), rtol=1e-3)
  for a, b in zip(jax.tree.leaves(g_m), jax.tree.leaves(g_t)):
    assert rel_err(a, b) < 2e-2


def test_auto_state_pass_picks_mosaic_where_it_applies():
  # "auto" (the default): Mosaic on a GPU for bf16 with K a multiple of 64
  # and shared memory to spare (measured faster, session 17); Triton for
  # fp32, K <= 32, KDA at K = 256 (its reverse pass does not fit), and in
  # interpret mode.
  pick = functools.partial(sm.resolve_state_pass, "auto", dv=128, bv=16)
  assert pick(kp=128, dtype=BF16, bk=128, interpret=False, kda=True) == "mosaic"
  assert pick(kp=128, dtype=BF16, bk=64, interpret=False, kda=False) == "mosaic"
  assert pick(kp=128, dtype=BF16, bk=128, interpret=True, kda=True) == "triton"
  assert pick(kp=128, dtype=jnp.float32, bk=128, interpret=False,
              kda=True) == "triton"
  assert pick(kp=32, dtype=BF16, bk=32, interpret=False, kda=True) == "triton"
  assert pick(kp=256, dtype=BF16, bk=256, interpret=False, kda=True) == "triton"
  assert pick(kp=256, dtype=BF16, bk=64, interpret=False, kda=False) == "mosaic"
  assert sm.resolve_state_pass("triton", 128, 128, BF16, 128, 16, False,
                               True) == "triton"


@pytest.mark.parametrize("name", ("kda", "gla"))
def test_default_gpu_lowering_runs_the_mosaic_passes(name):
  # The ops with their defaults, lowered for a card (no interpret): the
  # state passes are the Mosaic kernels, the output stays Triton.
  spec = lambda *s, dt=BF16: jax.ShapeDtypeStruct(s, dt)  # noqa: E731
  q, v = spec(1, 128, 2, 128), spec(1, 128, 2, 128)
  g, beta = spec(1, 128, 2, 128, dt=jnp.float32), spec(1, 128, 2,
                                                       dt=jnp.float32)
  if name == "kda":
    fn = lambda q, k, v, g, beta: kda.kda_pallas(  # noqa: E731
        q, k, v, g, beta, scale=None, initial_state=None, chunk_size=64,
        g_min=-5.0)[0]
  else:
    fn = lambda q, k, v, g, beta: gla.gla_pallas(  # noqa: E731
        q, k, v, g, scale=None, initial_state=None, chunk_size=64,
        g_min=-5.0)[0]
  from experiments import kernel_resources  # pylint: disable=g-import-not-at-top
  undo = kernel_resources._assume_gpu_without_one(90)   # jax >= 0.11 asks
  try:
    text = jax.jit(fn).trace(q, q, v, g, beta).lower(
        lowering_platforms=("cuda",)).as_text()
  finally:
    undo()
  assert f"{name}_state_pass_mosaic" in text
  assert "chunk_output_mosaic" not in text
