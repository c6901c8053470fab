"""Packed documents: a packed row computes what each document alone would.

KDA (the per-token reference and the XLA chunked path), the short conv, MLA
and the whole tiny model are compared with running every document of a row
alone, forward and (KDA) gradients, fp32. Documents start mid-chunk, at a
chunk boundary, span several chunks, and T is not a multiple of the chunk.
The data side: windows of data.packing='documents' start at document starts
(or continue a long document) and carry the right segment ids; 'concat' is
today's stream of random windows, unchanged.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.default import get_config
from moe_jax.config_validation import ConfigError, validate_config
from moe_jax.data.pipeline import (TokenBatcher, eval_batches, make_datasets,
                                   packing_kwargs, segment_ids_of)
from moe_jax.data.stdlib_corpus import BOS
from moe_jax.eval.step import apply_model
from moe_jax.layers.kda import KDA, causal_depthwise_conv
from moe_jax.layers.mla import GatedMLA
from moe_jax.layers.norms import l2_normalize
from moe_jax import sharding
from moe_jax.model import build_model
from moe_jax.train.step import make_grad_fn
from pallas_kernels.linear_attention import kda as kda_op
from pallas_kernels.linear_attention import naive_recurrent_kda
from pallas_kernels.linear_attention.kda import chunk as kda_chunk

CHUNK = 16
T = 60  # pads to 64: the padding joins the last document
# Per row, document lengths: starts at 5 (mid-chunk), 16 (chunk boundary),
# a 33-token document over three chunks; a 1-token document, starts mid-chunk.
LENGTHS = ([5, 11, 33, 11], [30, 3, 1, 21, 5])


def _segment_ids():
  return jnp.asarray(np.stack([np.repeat(np.arange(len(l)), l)
                               for l in LENGTHS]), jnp.int32)


def _alone_index():
  """Gather indices between a packed [B, T] layout and one row per document.

  Returns (doc_rows [D, T], doc_pos [D, T], doc_valid [D, T]): document d's
  tokens from packed row doc_rows, positions doc_pos, left-aligned and
  zero-padded after its end; and (back_doc [B, T], back_pos [B, T]): where
  each packed token sits in that layout.
  """
  doc_rows, doc_pos, doc_valid, back_doc, back_pos = [], [], [], [], []
  for row, lengths in enumerate(LENGTHS):
    start = 0
    for n in lengths:
      d = len(doc_rows)
      doc_rows.append(np.full(T, row))
      doc_pos.append(np.minimum(start + np.arange(T), T - 1))
      doc_valid.append(np.arange(T) < n)
      back_doc += [d] * n
      back_pos += list(range(n))
      start += n
  shape = (len(LENGTHS), T)
  return (np.stack(doc_rows), np.stack(doc_pos), np.stack(doc_valid),
          np.reshape(back_doc, shape), np.reshape(back_pos, shape))


def _alone(fn, arrays):
  """fn run on each document alone, put back in the packed layout: [B, T, ...].

  Every document is one row, left-aligned and zero-padded to T: fn is
  causal, so the padding after a document does not change its outputs, and
  all documents run in one call (one compile).
  """
  doc_rows, doc_pos, doc_valid, back_doc, back_pos = _alone_index()
  def one_per_row(a):
    x = a[doc_rows, doc_pos]
    return jnp.where(doc_valid.reshape(doc_valid.shape + (1,) * (
        x.ndim - 2)), x, jnp.zeros((), x.dtype))
  out = fn(*(one_per_row(a) for a in arrays))
  return out[back_doc, back_pos]


@pytest.fixture(scope="module")
def kda_inputs():
  b, h, dk, dv = len(LENGTHS), 2, 8, 8
  ks = jax.random.split(jax.random.PRNGKey(0), 6)
  q = jax.random.normal(ks[0], (b, T, h, dk))
  k = l2_normalize(jax.random.normal(ks[1], (b, T, h, dk)), 1e-6)
  v = jax.random.normal(ks[2], (b, T, h, dv))
  g = -jax.nn.softplus(jax.random.normal(ks[3], (b, T, h, dk)))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, T, h)))
  w = jax.random.normal(ks[5], (b, T, h, dv))  # cotangent of the output
  return (q, k, v, g, beta), w


def _kda_alone(q, k, v, g, beta):
  return naive_recurrent_kda(q, k, v, g, beta)[0]


KDA_PACKED = {
    "reference": lambda *a, segment_ids: naive_recurrent_kda(
        *a, segment_ids=segment_ids),
    "xla_chunked": lambda *a, segment_ids: kda_op(
        *a, backend="xla", chunk_size=CHUNK, segment_ids=segment_ids),
}


@pytest.mark.parametrize("impl", sorted(KDA_PACKED))
def test_kda_packed_equals_documents_alone(kda_inputs, impl):
  (q, k, v, g, beta), w = kda_inputs
  seg = _segment_ids()
  packed = KDA_PACKED[impl]

  def loss(fn, *xs):
    return jnp.sum(fn(*xs) * w)

  o, state = jax.jit(lambda *xs: packed(*xs, segment_ids=seg))(
      q, k, v, g, beta)
  want = _alone(_kda_alone, (q, k, v, g, beta))
  np.testing.assert_allclose(o, want, rtol=1e-4, atol=1e-4)
  # The final state is the row's last document's own.
  for row, lengths in enumerate(LENGTHS):
    last = slice(T - lengths[-1], T)
    _, s_last = naive_recurrent_kda(
        *(x[row:row + 1, last] for x in (q, k, v, g, beta)))
    np.testing.assert_allclose(state[row:row + 1], s_last, rtol=1e-4,
                               atol=1e-4)

  argnums = tuple(range(5))
  got = jax.jit(jax.grad(lambda *xs: loss(
      lambda *ys: packed(*ys, segment_ids=seg)[0], *xs), argnums))(
          q, k, v, g, beta)
  ref = jax.jit(jax.grad(lambda *xs: loss(
      lambda *ys: _alone(_kda_alone, ys), *xs), argnums))(q, k, v, g, beta)
  for name, a, b in zip("qkvgb", got, ref):
    assert np.all(np.isfinite(a)), name
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=name)


def test_kda_layer_hands_segment_ids_to_the_pallas_kernels(monkeypatch):
  # Traced only (the kernels' values: tests/test_pallas_packing.py):
  # the layer's ids reach the Pallas op, which builds its document index.
  seen = []
  index = kda_chunk.checked_document_index
  monkeypatch.setattr(kda_chunk, "checked_document_index",
                      lambda s, bt, tp: (s is not None and seen.append(s.shape))
                      or index(s, bt, tp))
  layer = KDA(d_model=32, num_heads=2, backend="interpret")
  x = jnp.zeros((len(LENGTHS), T, 32))
  variables = jax.eval_shape(layer.init, jax.random.PRNGKey(0), x[:, :8])
  jax.make_jaxpr(lambda v, x, s: layer.apply(v, x, segment_ids=s))(
      variables, x, _segment_ids())
  assert seen == [(len(LENGTHS), T)]


def test_short_conv_does_not_read_across_documents():
  x = jax.random.normal(jax.random.PRNGKey(1), (len(LENGTHS), T, 6))
  kernel = jax.random.normal(jax.random.PRNGKey(2), (4, 6))
  y, _ = jax.jit(lambda x, s: causal_depthwise_conv(
      x, kernel, segment_ids=s))(x, _segment_ids())
  want = _alone(lambda xs: causal_depthwise_conv(xs, kernel)[0], (x,))
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rope_dim", [0, 8])
def test_mla_packed_equals_documents_alone(rope_dim):
  mla = GatedMLA(d_model=32, num_heads=2, kv_lora_rank=16,
                 qk_nope_head_dim=16, v_head_dim=16,
                 qk_rope_head_dim=rope_dim)
  x = jax.random.normal(jax.random.PRNGKey(3), (len(LENGTHS), T, 32))
  params = jax.jit(mla.init)(jax.random.PRNGKey(4), x[:, :4])
  got = jax.jit(lambda p, x, s: mla.apply(p, x, segment_ids=s))(
      params, x, _segment_ids())
  want = jax.jit(lambda p, x: _alone(lambda xs: mla.apply(p, xs), (x,)))(
      params, x)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def tiny_model():
  config = get_config("tiny")
  config.model.kda.backend = "xla"
  model = build_model(config)
  tokens = jax.random.randint(jax.random.PRNGKey(5), (len(LENGTHS), T), 0,
                              config.model.vocab_size)
  variables = jax.jit(model.init)(jax.random.PRNGKey(6), tokens[:, :8])
  return model, variables, tokens


def test_model_packed_row_equals_documents_alone(tiny_model):
  model, variables, tokens = tiny_model
  seg = _segment_ids()
  batch = {"inputs": tokens, "segment_ids": seg}
  got = jax.jit(lambda v, b: apply_model(model, v, b))(variables, batch)
  apply = jax.jit(model.apply)
  want = jax.jit(lambda v, t: _alone(lambda ts: model.apply(v, ts),
                                     (t,)))(variables, tokens)
  assert np.all(np.isfinite(got))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  # Without ids the documents see each other: the masks are doing work.
  unmasked = apply(variables, tokens)
  assert np.max(np.abs(unmasked - want)) > 1e-2


def test_model_grads_with_context_parallelism():
  """tiny,smoke on packed documents: a mesh with context=4 (8 tokens a
  device, data=2) gives the one-device loss and gradients. Documents start
  at a device's first token, twice on one device, and span three devices."""
  config = get_config("tiny,smoke")
  config.data.packing = "documents"
  config.model.kda.backend = "xla"
  config.mesh.context = 4
  validate_config(config)
  model = build_model(config)
  b, t = config.data.batch_size, config.data.seq_len
  assert (b, t) == (4, 32)
  rng = np.random.default_rng(7)
  tokens = rng.integers(0, 256, (b, t + 1)).astype(np.int32)
  starts = np.zeros((b, t), np.int32)
  for row, row_starts in enumerate([[8, 13, 14], [3, 24], [5, 29], []]):
    starts[row, row_starts] = 1
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
           "segment_ids": np.cumsum(starts, axis=1).astype(np.int32)}
  variables = jax.jit(model.init)(jax.random.PRNGKey(0), batch["inputs"])
  args = (variables["params"], variables["router_state"])
  grad_fn = make_grad_fn(model, config.model.moe)
  (loss_ref, *_), grads_ref = jax.jit(grad_fn)(*args, batch)

  mesh = sharding.make_mesh(config.mesh)
  assert dict(mesh.shape)["context"] == 4
  sharded = sharding.shard_batch(
      batch, sharding.batch_sharding(mesh, config.mesh.rules, (b, t)), b)
  lowered = sharding.jit_in_mesh(grad_fn, mesh).lower(*args, sharded)
  assert "all_gather" in lowered.as_text()  # the context-parallel paths ran
  (loss, *_), grads = lowered.compile()(*args, sharded)
  assert np.isfinite(loss)
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
  for (path, g), g_ref in zip(jax.tree_util.tree_leaves_with_path(grads),
                              jax.tree.leaves(grads_ref)):
    assert np.all(np.isfinite(g)), jax.tree_util.keystr(path)
    np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-5,
                               err_msg=jax.tree_util.keystr(path))


def _stream(lengths):
  """A token stream of documents [BOS, body...] with bodies in [0, 256)."""
  rng = np.random.default_rng(0)
  docs = [np.concatenate([[BOS], rng.integers(0, 256, n - 1)])
          for n in lengths]
  return np.concatenate(docs).astype(np.uint16), np.cumsum([0] + lengths)


def test_document_windows_and_segment_ids():
  lengths = [7, 3, 40, 12, 5, 90, 9, 4, 25]
  tokens, starts = _stream(lengths)
  seq_len = 16
  data = TokenBatcher(tokens, seq_len, 32, seed=3, packing="documents",
                      document_start_token=BOS)
  # Allowed starts: each document's start and every 16th position inside
  # a longer one (the same document continues in the next window).
  allowed = set()
  for a, n in zip(starts[:-1], lengths):
    allowed.update(range(int(a), int(a) + n, seq_len))
  allowed = {s for s in allowed if s <= len(tokens) - seq_len - 1}
  seen = set()
  for step in range(4):
    window_starts = data.global_starts(step)
    batch = data.batch_at(step)
    assert set(batch) == {"inputs", "targets", "segment_ids"}
    assert batch["segment_ids"].dtype == np.int32
    for row, s in enumerate(window_starts):
      assert int(s) in allowed
      seen.add(int(s))
      np.testing.assert_array_equal(batch["inputs"][row],
                                    tokens[s:s + seq_len])
      np.testing.assert_array_equal(batch["targets"][row],
                                    tokens[s + 1:s + seq_len + 1])
      # Id = number of documents started after position 0.
      pos = s + np.arange(seq_len)
      want = np.searchsorted(starts, pos, side="right") - np.searchsorted(
          starts, s, side="right")
      np.testing.assert_array_equal(batch["segment_ids"][row], want)
  assert len(seen) > len(allowed) // 2
  # Deterministic and resumable: a pure function of (seed, step).
  again = TokenBatcher(tokens, seq_len, 32, seed=3, packing="documents",
                       document_start_token=BOS)
  again.set_state({"step": 2})
  nxt = next(again)
  for key in nxt:
    np.testing.assert_array_equal(nxt[key], data.batch_at(2)[key])
  np.testing.assert_array_equal(
      segment_ids_of(np.array([[BOS, 1, BOS, BOS, 2]]), BOS),
      [[0, 0, 1, 2, 2]])
  # Evaluation windows stay contiguous; they gain the same segment ids.
  plain, = eval_batches(tokens, seq_len, 4, max_batches=1)
  packed, = eval_batches(tokens, seq_len, 4, max_batches=1,
                         document_start_token=BOS)
  np.testing.assert_array_equal(packed["inputs"], plain["inputs"])
  np.testing.assert_array_equal(packed["segment_ids"],
                                segment_ids_of(plain["inputs"], BOS))
  assert "segment_ids" not in plain


def test_concat_windows_unchanged():
  tokens, _ = _stream([7, 3, 40, 12, 5, 90])
  data = TokenBatcher(tokens, 16, 8, seed=3)
  rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([3, 5])))
  starts = rng.integers(0, len(tokens) - 16, size=8, dtype=np.int64)
  batch = data.batch_at(5)
  assert set(batch) == {"inputs", "targets"}
  idx = starts[:, None] + np.arange(17)
  np.testing.assert_array_equal(batch["inputs"], tokens[idx][:, :-1])
  np.testing.assert_array_equal(batch["targets"], tokens[idx][:, 1:])
  assert packing_kwargs({"packing": "concat"}) == {}
  assert packing_kwargs({}) == {}


def test_packing_errors():
  config = get_config("tiny")
  config.data.packing = "docs"
  with pytest.raises(ConfigError, match=r"data\.packing.*concat.*documents"):
    validate_config(config)
  config.data.packing = "documents"
  for backend in ("auto", "pallas", "xla"):   # every KDA backend takes ids
    config.model.kda.backend = backend
    validate_config(config)
  config.mesh.context = 2   # context parallelism takes segment ids too
  validate_config(config)
  config.mesh.context = 1
  config.data.source, config.data.path = "token_file", "/tmp/x.bin"
  with pytest.raises(ConfigError, match="data.source='stdlib'"):
    validate_config(config)
  with pytest.raises(ValueError, match="data.packing must be one of"):
    TokenBatcher(np.arange(100), 8, 2, packing="doc")
  with pytest.raises(ValueError, match="document_start_token"):
    TokenBatcher(np.arange(100), 8, 2, packing="documents")
  with pytest.raises(ValueError, match="data.source='stdlib'"):
    make_datasets({"source": "token_file", "path": "/tmp/x.bin",
                   "seq_len": 8, "batch_size": 2, "packing": "documents"})


def test_kda_decode_prefill_caches_the_last_document_only():
  """A packed prefill continuing a cache (random state and conv tails)
  leaves the cache a prefill of its last document alone would: that
  document's state, conv inputs (here 2 tokens, fewer than the tail of 3:
  the tail's first row must not come from the document before) and id.
  Decoding the packed model against its forward: tests/test_decode.py."""
  layer = KDA(d_model=32, num_heads=2, backend="xla", chunk_size=CHUNK)
  x = jax.random.normal(jax.random.PRNGKey(8), (2, 12, 32))
  seg = jnp.asarray([[3] * 10 + [4] * 2, [3] * 3 + [5] * 7 + [6] * 2],
                    jnp.int32)
  shapes = jax.eval_shape(lambda x: layer.init(jax.random.PRNGKey(9), x,
                                               decode=True), x)
  rng = np.random.default_rng(10)  # numpy values: no init to compile
  params, stale = (jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(
      s.shape) / np.sqrt(s.shape[0]), s.dtype), shapes[c])
                   for c in ("params", "cache"))
  stale["segment_id"] = jnp.asarray([3, 3], jnp.int32)  # the first continues
  def prefill(cache, x, ids, new_sequence):
    _, mutated = layer.apply({"params": params, "cache": cache},
                             x, decode=True, new_sequence=new_sequence,
                             segment_ids=ids, mutable=["cache"])
    return mutated["cache"]
  packed = jax.jit(functools.partial(prefill, new_sequence=False))(
      stale, x, seg)
  alone = jax.jit(functools.partial(prefill, new_sequence=True))(
      stale, x[:, -2:], seg[:, -2:])
  assert set(packed) == {"state", "segment_id", "q_conv_tail",
                         "k_conv_tail", "v_conv_tail"}
  np.testing.assert_array_equal(packed["segment_id"], [4, 6])
  np.testing.assert_array_equal(packed["q_conv_tail"][:, 0], 0)
  for name in packed:
    assert np.all(np.isfinite(packed[name])), name
    np.testing.assert_allclose(packed[name], alone[name], rtol=1e-5,
                               atol=1e-5, err_msg=name)
