"""Context-parallel GLA / KDA equal the unsharded ops (docs/design.md §8).

Every test compares the sequence-sharded op (8 fake CPU devices) with the
unsharded `ops.gla` / `ops.kda` (backend "xla") on the same inputs: outputs,
final state and gradients wrt every input, including the initial state.
T per device (24) is not a multiple of the chunk (16), so the local ops pad.
Packed documents (segment ids, `_segment_ids`) put a document start exactly
at a device boundary, one document over three devices, two starts on one
device, and the initial state in a first document that crosses a device.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from pallas_kernels.linear_attention import ops
from pallas_kernels.linear_attention.context_parallel import (
    gla_context_parallel, kda_context_parallel)

B, H, K, V = 2, 2, 8, 4  # K != V catches transposed states / transitions
T_LOCAL, CHUNK = 24, 16
RTOL, ATOL = 1e-4, 1e-5


def _inputs(seed, t, with_state=True):
  """Realistic inputs: l2-normalised k, sigmoid beta, log decay in (-1.4, 0)."""
  rng = np.random.default_rng(seed)
  normal = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
  q, k, v = normal(B, t, H, K), normal(B, t, H, K), normal(B, t, H, V)
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  # A mix of slow and fast channels: the state survives a device boundary.
  g = -np.exp(normal(B, t, H, K) - 2.5).clip(0, 1.4).astype(np.float32)
  beta = (1 / (1 + np.exp(-normal(B, t, H)))).astype(np.float32)
  s0 = normal(B, H, K, V) if with_state else None
  return dict(q=q, k=k, v=v, g=g, beta=beta, s0=s0)


def _segment_ids(t):
  """[B, T] packed documents for T = P * T_LOCAL, P >= 4 devices.

  Row 0: starts at 10 (mid device 0) and at T_LOCAL (exactly device 1's first
  token: invisible locally); that document runs to 3 T_LOCAL + 18, over
  devices 1, 2 and 3. Row 1: the first document (with the initial state)
  crosses into device 1, which then holds two starts (30, 35); the next
  start is at device 2's first token and that document runs to the end.
  """
  ids = np.zeros((B, t), np.int32)
  ids[0, [10, T_LOCAL, 3 * T_LOCAL + 18]] = 1
  ids[1, [30, 35, 2 * T_LOCAL]] = 1
  return np.cumsum(ids, axis=1).astype(np.int32)


def _loss_fn(op, **kw):
  """<o, ct_o> + <S, ct_s>: gradients see every output and the final state."""

  def loss(args, cts, segment_ids):
    names = ("q", "k", "v", "g") + (("beta",) if "kda" in op else ())
    fn = {"gla": ops.gla, "kda": ops.kda, "gla_cp": gla_context_parallel,
          "kda_cp": kda_context_parallel}[op]
    o, s = fn(*(args[n] for n in names), initial_state=args.get("s0"),
              segment_ids=segment_ids, chunk_size=CHUNK, **kw)
    return jnp.sum(o * cts[0]) + jnp.sum(s * cts[1]), (o, s)

  return jax.jit(jax.value_and_grad(loss, has_aux=True))


@functools.lru_cache(maxsize=None)
def _reference(op):
  return _loss_fn(op, backend="xla")


def _check(op, mesh_shape, mesh_names, axis_types=None, with_state=True,
           packed=False):
  n_ctx = dict(zip(mesh_names, mesh_shape))["context"]
  t = n_ctx * T_LOCAL
  x = _inputs(sum(mesh_shape) + 7 * with_state, t, with_state)
  if not with_state:
    x.pop("s0")
  seg = _segment_ids(t) if packed else None
  rng = np.random.default_rng(1)
  cts = (rng.standard_normal((B, t, H, V)).astype(np.float32),
         rng.standard_normal((B, H, K, V)).astype(np.float32))
  mesh = jax.make_mesh(mesh_shape, mesh_names, axis_types=axis_types)
  (_, (o, s)), grads = _loss_fn(op + "_cp", mesh=mesh, backend="xla")(
      x, cts, seg)
  (_, (o_ref, s_ref)), grads_ref = _reference(op)(x, cts, seg)
  assert np.all(np.isfinite(o)) and np.all(np.isfinite(s))
  np.testing.assert_allclose(o, o_ref, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(s, s_ref, rtol=RTOL, atol=ATOL)
  # The state really crosses devices: each device alone (zero state, its
  # own slice of the segment ids) differs.
  names = ("q", "k", "v", "g") + (("beta",) if op == "kda" else ())
  local = jax.jit(functools.partial(getattr(ops, op), backend="xla",
                                    chunk_size=CHUNK))
  device = lambda i: slice(i * T_LOCAL, (i + 1) * T_LOCAL)  # noqa: E731
  o_cold = np.concatenate([
      local(*(x[n][:, device(i)] for n in names),
            segment_ids=None if seg is None else seg[:, device(i)])[0]
      for i in range(n_ctx)], axis=1)
  assert np.abs(o_cold - np.asarray(o_ref)).max() > 1e-2
  for name in grads_ref:
    if op == "gla" and name == "beta":
      continue
    assert np.all(np.isfinite(grads[name])), name
    np.testing.assert_allclose(grads[name], grads_ref[name], rtol=RTOL,
                               atol=ATOL, err_msg=f"d/d{name}")
    assert np.abs(np.asarray(grads_ref[name])).max() > 0, name


# (mesh shape, mesh axis names, packed documents)
MESHES = [((8,), ("context",), True), ((2, 4), ("data", "context"), False),
          ((2, 4), ("data", "context"), True)]


@pytest.mark.parametrize("op", ["gla", "kda"])
@pytest.mark.parametrize("mesh_shape,mesh_names,packed", MESHES)
def test_matches_unsharded_with_initial_state(op, mesh_shape, mesh_names,
                                              packed):
  _check(op, mesh_shape, mesh_names, packed=packed)


@pytest.mark.parametrize("op", ["gla", "kda"])
def test_auto_axes_heads_over_tensor_no_initial_state(op):
  """Auto-typed mesh, heads split over 'tensor' (the default head axis)."""
  _check(op, (4, 2), ("context", "tensor"),
         axis_types=(AxisType.Auto, AxisType.Auto), with_state=False)


def test_ambient_mesh_inside_jit_with_sharded_inputs():
  """mesh=None reads jax.set_mesh's mesh; inputs already sequence-sharded."""
  t = 4 * T_LOCAL
  x = _inputs(3, t)
  mesh = jax.make_mesh((2, 4), ("data", "context"))
  ref = jax.jit(functools.partial(ops.kda, backend="xla", chunk_size=CHUNK))(
      x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["s0"])
  with jax.set_mesh(mesh):
    tok = NamedSharding(mesh, P("data", "context"))
    args = [jax.device_put(x[n], tok) for n in ("q", "k", "v", "g", "beta")]
    out = jax.jit(functools.partial(kda_context_parallel, chunk_size=CHUNK))(
        *args, initial_state=x["s0"])
  for a, b in zip(out, ref):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def test_size_one_axis_is_the_plain_op_and_errors_are_clear():
  x = _inputs(4, 20)
  args = [x[n] for n in ("q", "k", "v", "g")]
  seg = np.repeat(np.array([[0, 1], [0, 1]], np.int32), [7, 13], axis=1)
  mesh1 = jax.make_mesh((1, 8), ("context", "data"))
  o1, s1 = gla_context_parallel(*args, mesh=mesh1, chunk_size=CHUNK,
                                backend="xla", segment_ids=seg)
  o2, s2 = ops.gla(*args, chunk_size=CHUNK, backend="xla", segment_ids=seg)
  np.testing.assert_array_equal(o1, o2)
  np.testing.assert_array_equal(s1, s2)
  mesh8 = jax.make_mesh((8,), ("context",))
  with pytest.raises(ValueError, match="not divisible"):
    gla_context_parallel(*args, mesh=mesh8, chunk_size=CHUNK)  # T=20
  with pytest.raises(ValueError, match="not in the mesh"):
    gla_context_parallel(*args, mesh=mesh8, axis="seq", chunk_size=CHUNK)
  with pytest.raises(ValueError, match="beta"):
    kda_context_parallel(*args, x["beta"][..., 0], mesh=mesh8)
  with pytest.raises(ValueError, match=r"segment_ids must have shape \[B, T\]"):
    kda_context_parallel(*args, x["beta"], mesh=mesh8, segment_ids=seg[0])
  with pytest.raises(ValueError, match="already splits"):
    x8 = _inputs(4, 8 * T_LOCAL)
    gla_context_parallel(*[x8[n] for n in ("q", "k", "v", "g")], mesh=mesh8,
                         batch_axes="context", chunk_size=CHUNK)


@pytest.mark.parametrize("op", ["gla", "kda"])
def test_pallas_interpret_backend_inside_context_parallel(op):
  """The Pallas kernels (interpreted on CPU) run as the local op, on packed
  documents: two starts on device 0 (its transition vanishes), the last
  document crosses into device 1 (whose outputs are corrected by it)."""
  if "interpret" not in ops.available_backends(op):
    pytest.skip(f"no interpret backend registered for {op}")
  t, k_dim = 128, 16  # kernel shapes: chunk 64, dims multiples of 16
  rng = np.random.default_rng(11)
  normal = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
  q, k, v = normal(1, t, 1, k_dim), normal(1, t, 1, k_dim), normal(1, t, 1, 16)
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  g = (-5.0 / (1 + np.exp(-normal(1, t, 1, k_dim) - 2))).astype(np.float32)
  beta = (1 / (1 + np.exp(-normal(1, t, 1)))).astype(np.float32)
  args = (q, k, v, g) + ((beta,) if op == "kda" else ())
  mesh = jax.make_mesh((2,), ("context",))
  fn = gla_context_parallel if op == "gla" else kda_context_parallel

  def loss(f, *a):
    o, s = f(*a)
    return jnp.sum(o ** 2) + jnp.sum(s), (o, s)

  seg = np.cumsum(np.isin(np.arange(t), [20, 40]))[None].astype(np.int32)
  cp = functools.partial(fn, mesh=mesh, chunk_size=64, backend="interpret",
                         g_min=-5.0, segment_ids=seg)
  ref = functools.partial(getattr(ops, op), chunk_size=64, backend="xla",
                          segment_ids=seg)
  argnums = tuple(range(len(args)))
  grad = lambda f: jax.jit(jax.grad(functools.partial(loss, f),  # noqa: E731
                                    argnums=argnums, has_aux=True))
  g_cp, (o, s) = grad(cp)(*args)
  g_ref, (o_ref, s_ref) = grad(ref)(*args)
  assert all(np.all(np.isfinite(a)) for a in (o, s) + tuple(g_cp))
  np.testing.assert_allclose(o, o_ref, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(s, s_ref, rtol=1e-4, atol=1e-4)
  for a, b in zip(g_cp, g_ref):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_bf16_inputs_keep_dtype_and_match():
  x = _inputs(8, 4 * T_LOCAL)
  names = ("q", "k", "v", "g", "beta")
  args = [jnp.asarray(x[n], jnp.bfloat16 if n in ("q", "k", "v") else
                      jnp.float32) for n in names]
  mesh = jax.make_mesh((4,), ("context",))
  o, s = jax.jit(functools.partial(kda_context_parallel, mesh=mesh,
                                   chunk_size=CHUNK))(*args)
  o_ref, s_ref = jax.jit(functools.partial(ops.kda, backend="xla",
                                           chunk_size=CHUNK))(*args)
  assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(o, np.float32),
                             np.asarray(o_ref, np.float32), rtol=2e-2,
                             atol=2e-2)
  np.testing.assert_allclose(s, s_ref, rtol=1e-4, atol=1e-4)
