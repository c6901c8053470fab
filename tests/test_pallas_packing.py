"""Packed documents (segment_ids) in the Pallas KDA and GLA kernels,
interpret mode.

Each packed row must compute what its documents compute alone: outputs,
the final state (the row's last document's) and the gradients w.r.t. q, k,
v, g, (KDA) beta and the initial state (the row's first document's),
against the chunked XLA reference with the same segment ids AND against the
per-token recurrence run on each document alone. Rows of T = 150 (chunks 64, 64 and a
partial 22):
  * row 0, lengths [5, 90, 3, 1, 51]: documents start mid-chunk, the second
    spans two chunks, chunk 1 holds four documents (one of a single token),
    the last document crosses into the partial last chunk;
  * row 1, lengths [64, 30, 56]: the first document fills chunk 0 exactly
    (a start at a chunk boundary: chunk 1 reads no state), then a start
    mid-chunk and a document over two chunks.
Configurations, each compiled once (module fixtures): KDA in fp32 on the
bounded path and in bf16 on the unbounded path, GLA in fp32 on the bounded
path (K = V = 16: each op's references compile once).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.linear_attention import (
    chunk_gla_ref, chunk_kda_ref, gla, kda, naive_recurrent_gla,
    naive_recurrent_kda)
from pallas_kernels.linear_attention.common.documents import (
    chunk_document_index)
from pallas_kernels.linear_attention.kda.chunk import kda_pallas

T = 150
LENGTHS = ([5, 90, 3, 1, 51], [64, 30, 56])
B = len(LENGTHS)
G_MIN = -5.0
K = V = 16
# op: (the public op, its per-token recurrence, its chunked reference,
# whether it takes beta)
OPS = {"kda": (kda, naive_recurrent_kda, chunk_kda_ref, True),
       "gla": (gla, naive_recurrent_gla, chunk_gla_ref, False)}
# name: (op, dtype, g_min)
CONFIGS = {"kda_fp32_bounded": ("kda", jnp.float32, G_MIN),
           "kda_bf16_unbounded": ("kda", jnp.bfloat16, None),
           "gla_fp32_bounded": ("gla", jnp.float32, G_MIN)}


def segment_ids():
  return jnp.asarray(np.stack([np.repeat(np.arange(len(l)), l)
                               for l in LENGTHS]), jnp.int32)


def make_inputs(seed, dk=K, dv=V, h=1):
  """q, k, v, g, beta, s0 and the cotangents (do, ds), fp32. The decay rate
  of g's channels spans 0.01 to 5 (g >= G_MIN): slow channels carry the
  state across chunks, so every mask on the carried state matters."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape)  # noqa: E731
  sigmoid = lambda x: 1.0 / (1.0 + np.exp(-x))  # noqa: E731
  k = normal(B, T, h, dk)
  k = k / np.linalg.norm(k, axis=-1, keepdims=True)
  arrays = (normal(B, T, h, dk), k, normal(B, T, h, dv),
            -np.geomspace(0.01, -G_MIN, dk) * sigmoid(normal(B, T, h, dk)),
            sigmoid(normal(B, T, h)), 0.5 * normal(B, h, dk, dv),
            normal(B, T, h, dv), normal(B, h, dk, dv))
  return tuple(jnp.asarray(a, jnp.float32) for a in arrays)


def _documents_as_rows():
  """Gather indices from the packed [B, T] layout to one left-aligned,
  zero-padded row per document, and back. Returns (row [D], pos [D, T],
  valid [D, T], first [D] (the row's first document), last [B] (each row's
  last document), back_doc [B, T], back_pos [B, T])."""
  rows, pos, valid, first, last, back_doc, back_pos = ([] for _ in range(7))
  for r, lengths in enumerate(LENGTHS):
    start = 0
    for i, n in enumerate(lengths):
      d = len(rows)
      rows.append(r)
      pos.append(np.minimum(start + np.arange(T), T - 1))
      valid.append(np.arange(T) < n)
      first.append(i == 0)
      back_doc += [d] * n
      back_pos += list(range(n))
      start += n
    last.append(len(rows) - 1)
  return (np.array(rows), np.stack(pos), np.stack(valid), np.array(first),
          np.array(last), np.reshape(back_doc, (B, T)),
          np.reshape(back_pos, (B, T)))


def alone(recurrence, *args):
  """recurrence(*xs, initial_state) on each document alone (zero padding
  after a document's end is inert: q = k = v = beta = 0, g = 0), put back
  in the packed layout; the row's initial state (args[-1]) starts its first
  document."""
  rows, pos, valid, first, last, back_doc, back_pos = _documents_as_rows()

  def one_per_row(x):
    x = x[rows[:, None], pos]
    return jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)), x, 0.0)

  s0_docs = jnp.where(first[:, None, None, None], args[-1][rows], 0.0)
  o, s = recurrence(*map(one_per_row, args[:-1]), initial_state=s0_docs)
  return o[back_doc, back_pos], s[last]


def vjp_of(fn, args, cts):
  """(o, s) and the gradients of fn(*args)."""
  out, vjp = jax.vjp(fn, *args)
  return out, vjp(cts)


@functools.partial(jax.jit, static_argnames="op")
def references(args, cts, op):
  """Both references' (o, s) and gradients, fp32, in one compile.
  args: (q, k, v, g, [beta,] s0)."""
  _, recurrence, chunked, _ = OPS[op]
  return {"chunked": vjp_of(
      lambda *a: chunked(*a[:-1], initial_state=a[-1], chunk_size=64,
                         segment_ids=segment_ids()), args, cts),
          "alone": vjp_of(functools.partial(alone, recurrence), args, cts)}


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def packed_run(request):
  """A configuration's Pallas results and both references' (fp32, on the
  inputs as the kernels saw them: rounded to bf16 for the bf16 run)."""
  op, dtype, g_min = CONFIGS[request.param]
  public, _, _, with_beta = OPS[op]
  q, k, v, g, beta, s0, do, ds = make_inputs(0)
  q, k, v = (x.astype(dtype) for x in (q, k, v))
  do = do.astype(dtype)
  args = (q, k, v, g) + ((beta,) if with_beta else ()) + (s0,)
  # The public op, called eagerly: its inner jits compile once per
  # configuration.
  fn = functools.partial(public, backend="interpret", g_min=g_min,
                         segment_ids=segment_ids())
  got = vjp_of(lambda *a: fn(*a[:-1], initial_state=a[-1]), args, (do, ds))
  up = lambda x: x.astype(jnp.float32)  # noqa: E731
  refs = references(tuple(map(up, args)), (up(do), ds), op=op)
  names = ("dq", "dk", "dv", "dg") + (("dbeta",) if with_beta else ()) + (
      "ds0",)
  return request.param, dtype, got, refs, names


@pytest.mark.parametrize("reference", ["chunked", "alone"])
def test_packed_values_and_gradients(packed_run, reference):
  name, dtype, ((o, s), grads), refs, grad_names = packed_run
  (o_ref, s_ref), grads_ref = refs[reference]
  assert o.dtype == dtype and s.dtype == jnp.float32
  rel = 1e-4 if dtype == jnp.float32 else 2e-2
  for what, a, b in (("o", o, o_ref), ("state", s, s_ref)) + tuple(
      zip(grad_names, grads, grads_ref)):
    a = np.asarray(a, np.float32)
    assert np.all(np.isfinite(a)), (name, what)   # NaN never passes
    assert a.shape == b.shape and len(grads) == len(grad_names), (name, what)
    assert rel_err(a, b) < rel, (name, what, rel_err(a, b))
    if dtype == jnp.float32:   # and elementwise, against each one's scale
      np.testing.assert_allclose(a, b, rtol=rel, atol=rel * np.max(np.abs(b)),
                                 err_msg=f"{name} {what}")


def test_chunk_document_index():
  # Per chunk: the document starts up to each token (0 = the document the
  # entering state belongs to); the padding joins the last document.
  index = np.asarray(chunk_document_index(segment_ids(), 192))
  want0 = np.concatenate([[0] * 5, [1] * 59,          # chunk 0
                          [0] * 31, [1] * 3, [2], [3] * 29,  # chunk 1
                          [0] * 64])                   # chunk 2 (+ padding)
  want1 = np.concatenate([[0] * 64, [1] * 30, [2] * 34, [0] * 64])
  np.testing.assert_array_equal(index, np.stack([want0, want1]))
  # An id that comes back later starts a new document.
  again = chunk_document_index(jnp.asarray([[0, 0, 1, 1, 0, 0] + [0] * 58]),
                               64)
  np.testing.assert_array_equal(np.asarray(again)[0, :6], [0, 0, 1, 1, 2, 2])


@pytest.mark.parametrize("op", sorted(OPS))
def test_packed_kernels_lower_for_cuda(op):
  # Interpret mode does not run the Triton lowering: the packed forward and
  # backward lower for CUDA here on the CPU (compiling needs a card).
  public, _, _, with_beta = OPS[op]
  spec = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)  # noqa: E731
  args = [spec(1, 128, 1, 64)] * 3 + [spec(1, 128, 1, 64, dt=jnp.float32)]
  args += [spec(1, 128, 1, dt=jnp.float32)] if with_beta else []

  def forward_backward(ids, *xs):
    out, vjp = jax.vjp(lambda *a: public(*a, backend="pallas", g_min=G_MIN,
                                         segment_ids=ids), *xs)
    return vjp(out)

  text = jax.jit(forward_backward).trace(
      jax.ShapeDtypeStruct((1, 128), jnp.int32), *args).lower(
          lowering_platforms=("cuda",)).as_text()
  kernels = {"kda": ("scores", "solve", "output", "dv_intra", "grad_v",
                     "grad_k"),
             "gla": ("intra", "output", "dv", "grad_k")}[op]
  for name in kernels:
    assert f'"{op}_chunk_{name}"' in text, name


def test_segment_ids_bad_shape():
  q, k, v, g, beta, s0, _, _ = make_inputs(2)
  with pytest.raises(ValueError, match=r"segment_ids must have shape \[B, T\]"):
    kda(q, k, v, g, beta, initial_state=s0, backend="interpret",
        segment_ids=segment_ids()[:, :-1])
  with pytest.raises(ValueError, match=r"segment_ids must have shape \[B, T\]"):
    kda_pallas(q, k, v, g, beta, scale=None, initial_state=s0, chunk_size=64,
               g_min=None, interpret=True, segment_ids=segment_ids()[:1])
  with pytest.raises(ValueError, match=r"segment_ids must have shape \[B, T\]"):
    gla(q, k, v, g, initial_state=s0, backend="interpret",
        segment_ids=segment_ids()[:, 1:])
