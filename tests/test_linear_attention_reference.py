"""Pure-JAX linear attention oracles and the public op API (docs/design.md §4).

The naive per-token recurrence is the ground truth; the chunked reference
(the "xla" backend) must match it in values, final states and gradients, for
bounded and unbounded decay, any T, with an initial state.
"""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.linear_attention import (
    chunk_gla_ref, chunk_kda_ref, gla, gla_step, kda, kda_step,
    naive_recurrent_gla, naive_recurrent_kda)

B, T, H, K, V = 2, 100, 2, 16, 8  # K != V catches transposed states
RTOL, ATOL = 1e-4, 1e-5
# Unbounded decay: within a chunk the cumsum b reaches ~-1000, where fp32
# differences b_i - b_j carry ~1e-4 absolute error, i.e. ~1e-5 in outputs
# relative to the per-token scan. Inherent to the cumsum form (the kernels
# share it), so the absolute floor is a little looser there.
ATOL_UNBOUNDED = 5e-5

naive_gla = jax.jit(naive_recurrent_gla)
naive_kda = jax.jit(naive_recurrent_kda)
chunk_gla = jax.jit(chunk_gla_ref, static_argnames="chunk_size")
chunk_kda = jax.jit(chunk_kda_ref, static_argnames="chunk_size")


def make_inputs(seed, decay="bounded", t=T):
  """Realistic inputs: l2-normalised k, beta = sigmoid, g bounded or unbounded.

  Drawn with numpy so that new shapes cost no compilation.
  """
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape)  # noqa: E731
  sigmoid = lambda x: 1.0 / (1.0 + np.exp(-x))  # noqa: E731
  q = normal(B, t, H, K)
  k = normal(B, t, H, K)
  k = k / np.linalg.norm(k, axis=-1, keepdims=True)
  v = normal(B, t, H, V)
  x = normal(B, t, H, K)
  if decay == "bounded":
    g = -5.0 * sigmoid(2.0 * x - 2.0)  # g_min = -5, many slow channels
  else:
    g = -np.logaddexp(0.0, 8.0 * x)    # -softplus: unbounded, down to ~-30
  beta = sigmoid(normal(B, t, H))
  s0 = 0.5 * normal(B, H, K, V)
  return tuple(jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta, s0))


def assert_close(actual, expected, atol=ATOL):
  chex.assert_trees_all_equal_shapes_and_dtypes(actual, expected)
  chex.assert_tree_all_finite(actual)
  np.testing.assert_allclose(np.asarray(actual), np.asarray(expected),
                             rtol=RTOL, atol=atol)


@pytest.mark.parametrize("chunk_size,decay", [
    (32, "bounded"), (64, "bounded"), (64, "unbounded")])
def test_gla_chunked_matches_naive(chunk_size, decay):
  q, k, v, g, _, s0 = make_inputs(0, decay)
  if decay == "unbounded":
    assert float(g.min()) < -20.0
  atol = ATOL if decay == "bounded" else ATOL_UNBOUNDED
  o_ref, s_ref = naive_gla(q, k, v, g, initial_state=s0)
  o, s = chunk_gla(q, k, v, g, initial_state=s0, chunk_size=chunk_size)
  assert_close(o, o_ref, atol)
  assert_close(s, s_ref, atol)


@pytest.mark.parametrize("chunk_size,decay", [
    (32, "bounded"), (64, "bounded"), (64, "unbounded")])
def test_kda_chunked_matches_naive(chunk_size, decay):
  q, k, v, g, beta, s0 = make_inputs(1, decay)
  if decay == "unbounded":
    assert float(g.min()) < -20.0
  atol = ATOL if decay == "bounded" else ATOL_UNBOUNDED
  o_ref, s_ref = naive_kda(q, k, v, g, beta, initial_state=s0)
  o, s = chunk_kda(q, k, v, g, beta, initial_state=s0, chunk_size=chunk_size)
  assert_close(o, o_ref, atol)
  assert_close(s, s_ref, atol)


def test_no_initial_state_and_input_dtype():
  """initial_state=None means zeros; o follows v.dtype, the state stays fp32."""
  q, k, v, g, beta, _ = make_inputs(2)
  zeros = jnp.zeros((B, H, K, V), jnp.float32)
  o, s = chunk_kda(q, k, v, g, beta, chunk_size=32)
  o_ref, s_ref = naive_kda(q, k, v, g, beta, initial_state=zeros)
  assert_close(o, o_ref)
  assert_close(s, s_ref)
  o16, s16 = chunk_gla(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16),
                       v.astype(jnp.bfloat16), g, chunk_size=32)
  assert o16.dtype == jnp.bfloat16 and s16.dtype == jnp.float32


def _projected_loss(fn, has_beta, ro, rs):
  """A random projection of outputs and final state, a scalar for jax.grad."""
  def loss(q, k, v, g, beta, s0):
    args = (q, k, v, g, beta) if has_beta else (q, k, v, g)
    o, s = fn(*args, initial_state=s0)
    return jnp.sum(o * ro) + jnp.sum(s * rs)
  return loss


@pytest.mark.parametrize("op", ["gla", "kda"])
def test_gradients_match_naive(op):
  kr = jax.random.split(jax.random.PRNGKey(99), 2)
  ro = jax.random.normal(kr[0], (B, T, H, V))
  rs = jax.random.normal(kr[1], (B, H, K, V))
  naive, chunked = ((naive_recurrent_gla, chunk_gla_ref) if op == "gla" else
                    (naive_recurrent_kda, chunk_kda_ref))
  chunked = functools.partial(chunked, chunk_size=32)  # T=100: 4 chunks, padded
  names = ["q", "k", "v", "g", "beta", "s0"]
  argnums = (0, 1, 2, 3, 4, 5) if op == "kda" else (0, 1, 2, 3, 5)
  grad_fns = [jax.jit(jax.grad(_projected_loss(fn, op == "kda", ro, rs),
                               argnums=argnums)) for fn in (naive, chunked)]
  # Same shapes for both decays: each gradient compiles once. Unbounded decay
  # checks that masking before the exp keeps inf*0 out of the backward pass.
  tol = 1e-4
  for decay in ("bounded", "unbounded"):
    inputs = make_inputs(3, decay)
    g_naive, g_chunk = (f(*inputs) for f in grad_fns)
    for n, ga, gb in zip([names[i] for i in argnums], g_chunk, g_naive):
      chex.assert_tree_all_finite(ga)
      rel = float(jnp.linalg.norm(ga - gb) / jnp.linalg.norm(gb))
      assert rel < tol, f"{decay} d{n}: relative error {rel:.2e}"
      np.testing.assert_allclose(np.asarray(ga), np.asarray(gb), rtol=tol,
                                 atol=tol * float(jnp.abs(gb).max()),
                                 err_msg=f"{decay} d{n}")


def test_gla_reference_stores_its_pair_decays():
  """The pair decays enter GLA's score reduce through an optimization barrier.

  Fused into that reduce, XLA's GPU compile of it ran for minutes (6+ min at
  B1 T2048, H100): the "xla" backend was unusable on a GPU. CPU tests cannot
  time a GPU compile, so this pins the barrier in the forward and in the
  gradient, where the cotangent's reduce reads the same decays.
  """
  q, k, v, g, _, s0 = make_inputs(5)
  fwd = jax.make_jaxpr(chunk_gla_ref)(q, k, v, g, initial_state=s0)
  loss = lambda *a: jnp.sum(chunk_gla_ref(*a)[0])  # noqa: E731
  grad = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, g)
  for name, jaxpr in (("forward", fwd), ("gradient", grad)):
    assert "optimization_barrier" in str(jaxpr), name


@pytest.mark.parametrize("op", ["gla", "kda"])
def test_recurrent_step_matches_naive(op):
  q, k, v, g, beta, s0 = make_inputs(5)
  if op == "gla":
    o_ref, s_ref = naive_gla(q, k, v, g, initial_state=s0)
    step = jax.jit(lambda i, s: gla_step(q[:, i], k[:, i], v[:, i], g[:, i], s))
  else:
    o_ref, s_ref = naive_kda(q, k, v, g, beta, initial_state=s0)
    step = jax.jit(lambda i, s: kda_step(q[:, i], k[:, i], v[:, i], g[:, i],
                                         beta[:, i], s))
  s, outs = s0, []
  for i in range(T):
    o, s = step(i, s)
    chex.assert_shape(o, (B, H, V))
    outs.append(o)
  assert_close(jnp.stack(outs, axis=1), o_ref)
  assert_close(s, s_ref)


@pytest.mark.parametrize("op", ["gla", "kda"])
def test_split_sequence_with_state_passing(op):
  """State out of the first half fed into the second == one call."""
  q, k, v, g, beta, s0 = make_inputs(6)
  t1 = T // 2  # 50: not a chunk multiple; both halves share one compilation
  if op == "gla":
    f = lambda q, k, v, g, beta, s: chunk_gla(q, k, v, g, initial_state=s,  # noqa: E731
                                              chunk_size=32)
  else:
    f = lambda q, k, v, g, beta, s: chunk_kda(q, k, v, g, beta,  # noqa: E731
                                              initial_state=s, chunk_size=32)
  o_full, s_full = f(q, k, v, g, beta, s0)
  o1, s1 = f(*[x[:, :t1] for x in (q, k, v, g, beta)], s0)
  o2, s2 = f(*[x[:, t1:] for x in (q, k, v, g, beta)], s1)
  assert_close(jnp.concatenate([o1, o2], axis=1), o_full)
  assert_close(s2, s_full)


def test_ops_dispatch_to_xla_reference_on_cpu():
  """backend="auto" is "xla" without a GPU; the ops return the chunked oracle."""
  q, k, v, g, beta, s0 = make_inputs(7)
  o, s = jax.jit(lambda *a: kda(*a, initial_state=s0, g_min=-5.0))(
      q, k, v, g, beta)
  o_ref, s_ref = chunk_kda(q, k, v, g, beta, initial_state=s0, chunk_size=64)
  assert_close(o, o_ref)
  assert_close(s, s_ref)
  o, s = jax.jit(lambda *a: gla(*a, initial_state=s0, backend="xla",
                                chunk_size=32))(q, k, v, g)
  o_ref, s_ref = chunk_gla(q, k, v, g, initial_state=s0, chunk_size=32)
  assert_close(o, o_ref)
  assert_close(s, s_ref)


# --- validation: all static, so zeros of the right shapes suffice ------------

def _z(*shape):
  return jnp.zeros(shape, jnp.float32)


Q, KK, VV, G = _z(B, 8, H, K), _z(B, 8, H, K), _z(B, 8, H, V), _z(B, 8, H, K)
BETA = _z(B, 8, H)


@pytest.mark.parametrize("kwargs,match", [
    (dict(q=_z(B, 8, K)), "q must have rank 4"),
    (dict(k=_z(B, 8, H, K + 1)), "k must have the same shape as q"),
    (dict(g=_z(B, 8, H)), "g must have the same shape as q"),
    (dict(v=_z(B, 9, H, V)), "v must have shape"),
    (dict(v=_z(B, 8, H)), "v must have shape"),
    (dict(beta=_z(B, 8)), "beta must have rank 3"),
    (dict(beta=_z(B, 8, H + 1)), "beta must have shape"),
    (dict(initial_state=_z(B, H, V, K)), "initial_state must have shape"),
    (dict(chunk_size=48), "chunk_size must be one of"),
    (dict(backend="cuda"), "backend must be one of"),
    (dict(g_min=0.0), "g_min"),
    (dict(g_min=1.5), "g_min"),
    (dict(g_min=float("-inf")), "g_min"),
    (dict(g_min=jnp.float32(-5.0)), "g_min"),
])
def test_kda_validation(kwargs, match):
  args = dict(q=Q, k=KK, v=VV, g=G, beta=BETA)
  args.update({n: kwargs.pop(n) for n in list(kwargs) if n in args})
  with pytest.raises(ValueError, match=match):
    kda(args["q"], args["k"], args["v"], args["g"], args["beta"], **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(q=_z(B, 8, H, K, 1)), "q must have rank 4"),
    (dict(v=_z(B + 1, 8, H, V)), "v must have shape"),
    (dict(backend="gpu"), "backend must be one of"),
    (dict(g_min=0), "g_min"),
])
def test_gla_validation(kwargs, match):
  args = dict(q=Q, k=KK, v=VV, g=G)
  args.update({n: kwargs.pop(n) for n in list(kwargs) if n in args})
  with pytest.raises(ValueError, match=match):
    gla(args["q"], args["k"], args["v"], args["g"], **kwargs)


@pytest.mark.parametrize("backend", ["pallas", "interpret"])
def test_pallas_bounded_path_refuses_bad_g_min(backend):
  x = jnp.zeros((1, 16, 1, 16), jnp.float32)  # shapes the kernel accepts
  with pytest.raises(ValueError, match=r"g_min in \[-5.5, 0\)"):
    gla(x, x, x, x - 1.0, backend=backend, g_min=-9.0)


def test_auto_backend_picks_a_kernel_only_when_it_fits(monkeypatch):
  from pallas_kernels.linear_attention import ops
  monkeypatch.setattr(ops.jax, "default_backend", lambda: "gpu")
  xla, pallas = ops._IMPLS["xla"]["gla"], ops._IMPLS["pallas"]["gla"]
  # Bounded path with a safe g_min; the unbounded kernel otherwise.
  assert ops._resolve("gla", "auto", chunk_size=64, g_min=-5.0) == (
      pallas, -5.0)
  assert ops._resolve("gla", "auto", chunk_size=64, g_min=None) == (
      pallas, None)
  assert ops._resolve("gla", "auto", chunk_size=64, g_min=-9.0) == (
      pallas, None)
  # Shapes the kernels refuse go to XLA.
  assert ops._resolve("gla", "auto", chunk_size=32, g_min=-5.0)[0] is xla
  assert ops._resolve("gla", "auto", chunk_size=64, g_min=-5.0,
                      dims=(24, 16))[0] is xla
  assert ops._resolve("gla", "auto", chunk_size=64, g_min=-5.0,
                      dims=(16, 512))[0] is xla
  # A bounded-only kernel is never picked without a safe g_min.
  monkeypatch.setattr(ops, "_BOUNDED_ONLY", {"kda"})
  assert ops._resolve("kda", "auto", chunk_size=64, g_min=None)[0] is (
      ops._IMPLS["xla"]["kda"])
  assert ops._resolve("kda", "auto", chunk_size=64, g_min=-5.0)[0] is (
      ops._IMPLS["pallas"]["kda"])
  # Off GPU, auto is always XLA.
  monkeypatch.setattr(ops.jax, "default_backend", lambda: "cpu")
  assert ops._resolve("gla", "auto", chunk_size=64, g_min=-5.0)[0] is xla


def test_auto_backend_logs_a_g_min_fallback_once(monkeypatch, caplog):
  from pallas_kernels.linear_attention import ops
  monkeypatch.setattr(ops.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(ops, "_FALLBACKS_LOGGED", set())
  with caplog.at_level("WARNING", logger=ops.__name__):
    for _ in range(3):
      ops._resolve("gla", "auto", chunk_size=64, g_min=-9.0)
    ops._resolve("gla", "auto", chunk_size=64, g_min=-5.0)  # in range
    ops._resolve("gla", "auto", chunk_size=64, g_min=None)  # no bound
  msgs = [r.getMessage() for r in caplog.records]
  assert len(msgs) == 1, msgs
  assert "g_min=-9.0 is outside [-5.5, 0)" in msgs[0]
  assert "unbounded Pallas path" in msgs[0]


@pytest.mark.parametrize("c", [16, 64])
@pytest.mark.parametrize("kind", ["random", "near_all_ones"])
def test_unit_lower_triangular_inverse_matches_numpy(c, kind):
  from pallas_kernels.linear_attention.kda.naive import (
      unit_lower_triangular_inverse)
  rng = np.random.default_rng(c)
  if kind == "random":  # Entries like KDA's L: |L_ij| <= beta |k_i||k_j| < 1.
    n = np.tril(rng.uniform(-0.3, 0.3, (3, c, c)), -1)
  else:  # Similar keys, beta ~ 1, no decay: the case that broke N-power tricks.
    n = np.tril(rng.uniform(0.97, 1.0, (3, c, c)), -1)
  n = n.astype(np.float32)
  got = np.asarray(jax.jit(unit_lower_triangular_inverse)(jnp.asarray(n)))
  want = np.linalg.inv(np.eye(c) + n.astype(np.float64))
  assert np.all(np.isfinite(got))
  scale = np.abs(want).max()
  np.testing.assert_allclose(got / scale, want / scale, rtol=0, atol=1e-5)
