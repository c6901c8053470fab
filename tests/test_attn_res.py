"""Block Attention Residuals: the mixtures against the plain form, the
two-phase block mixture, and block size 1 == full AttnRes."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_config
from moe_jax.layers import attn_res
from moe_jax.layers.attn_res import (AttnResMix, BlockAttnResState,
                                     attn_res_merge, attn_res_mix,
                                     attn_res_mix_many,
                                     attn_res_mix_reference)
from moe_jax.layers.norms import rms_normalize
from moe_jax.model import build_model


def _sources(key, n, shape=(2, 5, 8)):
  return [jax.random.normal(k, shape) for k in jax.random.split(key, n)]


def test_zero_query_is_uniform_average():
  srcs = _sources(jax.random.PRNGKey(0), 4)
  mix = AttnResMix(8)
  params = nn.meta.unbox(mix.init(jax.random.PRNGKey(1), srcs))
  assert not np.any(params["params"]["query"])  # zero-initialised
  out = mix.apply(params, srcs)
  np.testing.assert_allclose(out, sum(srcs) / 4, rtol=1e-6, atol=1e-6)


def test_nonzero_query_weights_sources_by_softmax():
  srcs = _sources(jax.random.PRNGKey(2), 3)
  w = jax.random.normal(jax.random.PRNGKey(3), (8,))
  out = AttnResMix(8).apply({"params": {"query": w}}, srcs)
  v = jnp.stack(srcs)
  keys = v / jnp.sqrt(jnp.mean(v * v, -1, keepdims=True) + 1e-6)
  weights = jax.nn.softmax(jnp.einsum("sbtd,d->sbt", keys, w), axis=0)
  np.testing.assert_allclose(out, jnp.einsum("sbt,sbtd->btd", weights, v),
                             rtol=1e-5, atol=1e-6)
  assert not np.allclose(out, sum(srcs) / 3)
  # With 'intermediates' mutable, the mix sows its weights averaged over
  # batch and tokens [S], and its output is unchanged.
  sown_out, sown = AttnResMix(8).apply({"params": {"query": w}}, srcs,
                                      mutable=["intermediates"])
  np.testing.assert_array_equal(sown_out, out)
  (mean_weights,) = sown["intermediates"]["weights"]
  np.testing.assert_allclose(mean_weights, weights.mean(axis=(1, 2)),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(mean_weights.sum()), 1.0, rtol=1e-6)


def _mixers(queries):
  return [AttnResMix(8).bind({"params": {"query": w}}) for w in queries]


def _run(layers_per_block, fns, emb, queries, one_shot=False):
  """Runs sublayers fns with block AttnRes; returns every sublayer's input
  and the final mixture: the two-phase mix (BlockAttnResState.mix), or with
  one_shot each mixture over state.sources() in one call."""
  state = BlockAttnResState(emb, layers_per_block)
  mixers, hs = _mixers(queries), []
  for j in range(len(fns) + 1):
    hs.append(mixers[j](state.sources()) if one_shot else
              state.mix(mixers, j))
    if j < len(fns):
      state.add(fns[j](hs[-1]))
  return hs


def _full_attn_res(fns, emb, queries):
  """Reference: every earlier sublayer output is its own source."""
  outs = [emb]
  for f, w in zip(fns, queries[:-1]):
    h = AttnResMix(8).apply({"params": {"query": w}}, outs)
    outs.append(f(h))
  return AttnResMix(8).apply({"params": {"query": queries[-1]}}, outs)


def _layer_fns(n=6):
  mats = [jax.random.normal(k, (8, 8)) / 3 for k in
          jax.random.split(jax.random.PRNGKey(5), n)]
  return [lambda h, m=m: jnp.tanh(h @ m) for m in mats]


def _grads_close(grads, ref_grads, tol):
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.all(np.isfinite(a))
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.abs(b).max())


def test_one_layer_per_block_equals_full_attn_res():
  emb = jax.random.normal(jax.random.PRNGKey(4), (2, 5, 8))
  fns = _layer_fns()
  queries = list(jax.random.normal(jax.random.PRNGKey(6), (7, 8)))
  np.testing.assert_allclose(_run(1, fns, emb, queries)[-1],
                             _full_attn_res(fns, emb, queries), rtol=1e-6)
  # Larger blocks really are different (the test can fail).
  assert not np.allclose(_run(3, fns, emb, queries)[-1],
                         _full_attn_res(fns, emb, queries), atol=1e-3)


def test_two_phase_block_mix_equals_one_mixture_per_sublayer():
  """Block sizes 2 and 4 over 6 sublayers (the final mix at a block start
  and merged with a partial sum): every sublayer's input, and the gradients
  of a loss on all of them (embedding and queries) through both phases."""
  emb = jax.random.normal(jax.random.PRNGKey(4), (2, 5, 8))
  fns = _layer_fns()
  queries = jax.random.normal(jax.random.PRNGKey(7), (7, 8))
  g = jax.random.normal(jax.random.PRNGKey(8), (7, 2, 5, 8))

  def loss(emb, queries, layers_per_block, one_shot):
    hs = _run(layers_per_block, fns, emb, list(queries), one_shot)
    return sum(jnp.sum(h * g_j) for h, g_j in zip(hs, g))

  for layers_per_block in (2, 4):
    two_phase = _run(layers_per_block, fns, emb, list(queries))
    one_shot = _run(layers_per_block, fns, emb, list(queries), True)
    for a, b in zip(two_phase, one_shot):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    _grads_close(jax.grad(loss, (0, 1))(emb, queries, layers_per_block,
                                        False),
                 jax.grad(loss, (0, 1))(emb, queries, layers_per_block,
                                        True), 1e-5)


def test_block_state_sources():
  emb = jnp.zeros((1, 1, 2))
  s = BlockAttnResState(emb, 2)
  assert len(s.sources()) == 1
  s.add(jnp.ones((1, 1, 2)))
  assert len(s.sources()) == 2            # embedding + partial
  s.add(jnp.ones((1, 1, 2)))
  assert len(s.sources()) == 2            # embedding + completed block
  np.testing.assert_array_equal(s.sources()[1], 2 * jnp.ones((1, 1, 2)))
  s.add(jnp.ones((1, 1, 2)))
  assert len(s.sources()) == 3            # + new partial


def _mix_loss(mix, srcs, w, g):
  return jnp.sum(mix(srcs, w).astype(jnp.float32) * g)


@pytest.fixture(params=["per_source", "stacked"])
def source_layout(request, monkeypatch):
  """Both forms of the statistics and the mixture: per source (training
  sizes) and stacked (sources this small, e.g. a decode step's)."""
  if request.param == "per_source":
    monkeypatch.setattr(attn_res, "_STACK_MAX_ELEMENTS", 0)
  else:
    assert 2 * 7 * 16 <= attn_res._STACK_MAX_ELEMENTS
  return request.param


def test_mix_matches_reference_values_and_gradients(source_layout):
  """The hand-written backward against autodiff of the plain form: fp32 at
  1e-5 with one source, bf16 at bf16 precision with five, a random query
  (three sources and three queries: the test below)."""
  for n, dtype, tol in ((1, jnp.float32, 1e-5), (5, jnp.bfloat16, 2e-2)):
    keys = jax.random.split(jax.random.PRNGKey(7 + n), 3)
    srcs = tuple(s.astype(dtype) * (1 + i)
                 for i, s in enumerate(_sources(keys[0], n, (2, 7, 16))))
    w = jax.random.normal(keys[1], (16,))
    g = jax.random.normal(keys[2], (2, 7, 16))
    out = attn_res_mix(srcs, w)
    ref = attn_res_mix_reference(srcs, w)
    assert out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.asarray(ref, np.float32), rtol=tol, atol=tol)
    grad = jax.grad(_mix_loss, argnums=(1, 2))
    _grads_close(grad(attn_res_mix, srcs, w, g),
                 grad(attn_res_mix_reference, srcs, w, g), tol)


def _lse_reference(srcs, w):
  v = jnp.stack(srcs).astype(jnp.float32)
  return jax.nn.logsumexp(jnp.einsum("sbtd,d->sbt", rms_normalize(v), w), 0)


def test_mix_many_and_merge_match_reference_values_and_gradients(
    source_layout):
  """attn_res_mix_many (3 queries: mixtures and log-sum-exps) and
  attn_res_merge (one more source) against the plain form, with cotangents
  on every output: fp32 at 1e-5, bf16 at bf16 precision."""
  for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)):
    keys = jax.random.split(jax.random.PRNGKey(11), 6)
    srcs = tuple(s.astype(dtype) * (1 + i)
                 for i, s in enumerate(_sources(keys[0], 3, (2, 7, 16))))
    part = (2 * jax.random.normal(keys[1], (2, 7, 16))).astype(dtype)
    ws = jax.random.normal(keys[2], (3, 16))
    gs = jax.random.normal(keys[3], (3, 2, 7, 16))
    g_lse = jax.random.normal(keys[4], (3, 2, 7))

    def many(srcs, ws):
      outs, lse = attn_res_mix_many(srcs, ws)
      return (sum(jnp.sum(o.astype(jnp.float32) * g)
                  for o, g in zip(outs, gs)) + jnp.sum(lse * g_lse))

    def many_ref(srcs, ws):
      return sum(jnp.sum(attn_res_mix_reference(srcs, w).astype(jnp.float32)
                         * g) + jnp.sum(_lse_reference(srcs, w) * gl)
                 for w, g, gl in zip(ws, gs, g_lse))

    def merged(srcs, part, w):
      outs, lse = attn_res_mix_many(srcs, w[None])
      return jnp.sum(attn_res_merge(outs[0], lse[0], part, w)
                     .astype(jnp.float32) * gs[0])

    def merged_ref(srcs, part, w):
      return jnp.sum(attn_res_mix_reference(srcs + (part,), w)
                     .astype(jnp.float32) * gs[0])

    outs, lse = attn_res_mix_many(srcs, ws)
    for o, w in zip(outs, ws):
      assert o.dtype == dtype
      np.testing.assert_allclose(
          np.asarray(o, np.float32),
          np.asarray(attn_res_mix_reference(srcs, w), np.float32),
          rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, jnp.stack([_lse_reference(srcs, w)
                                               for w in ws]), rtol=1e-5)
    np.testing.assert_allclose(merged(srcs, part, ws[0]),
                               merged_ref(srcs, part, ws[0]), rtol=tol)
    _grads_close(jax.grad(many, (0, 1))(srcs, ws),
                 jax.grad(many_ref, (0, 1))(srcs, ws), tol)
    _grads_close(jax.grad(merged, (0, 1, 2))(srcs, part, ws[0]),
                 jax.grad(merged_ref, (0, 1, 2))(srcs, part, ws[0]), tol)


def test_mix_backward_keeps_no_per_source_activation():
  """What the backwards keep beyond their inputs is [L, S, B, T] statistics
  and the queries: no stacked or fp32 copy of the sources, which the plain
  autodiff form keeps."""
  srcs = tuple(_sources(jax.random.PRNGKey(9), 4, (2, 8, 64)))
  ws = jnp.ones((3, 64))

  def kept(fn, *args):
    _, vjp = jax.vjp(fn, *args)
    ids = {id(x) for x in jax.tree.leaves(args)}
    return sum(x.size for x in jax.tree.leaves(vjp) if id(x) not in ids)

  stats = 2 * 8                                            # B x T
  assert kept(attn_res_mix, srcs, ws[0]) <= 3 * 4 * stats + 64
  assert kept(attn_res_mix_many, srcs, ws) <= (2 * 3 + 1) * 4 * stats + 192
  mixed, lse = attn_res_mix_many(srcs, ws[:1])
  assert kept(attn_res_merge, mixed[0], lse[0], srcs[0], ws[0]) <= (
      3 * stats + 64)
  assert kept(attn_res_mix_reference, srcs, ws[0]) >= 4 * stats * 64  # fails


def test_model_two_phase_mixture_equals_one_mixture_per_sublayer(
    monkeypatch):
  """The whole model's logits (fp32) with the two-phase block mixture
  against each sublayer's plain mixture over its sources: blocks of 3 over
  4 sublayers, so two sublayers and the final mix merge a partial sum."""
  def one_shot(state, mixers, j):
    return attn_res_mix_reference(tuple(state.sources()), mixers[j].query,
                                  state.eps)

  config = load_config("default.py", "tiny,smoke")
  config.model.attn_res_layers_per_block = 3
  assert 2 * config.model.num_layers == 4
  model = build_model(config)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 32), 0, 256)
  variables = jax.jit(model.init)(jax.random.PRNGKey(2), tokens)
  variables = {**variables, "params": jax.tree_util.tree_map_with_path(
      lambda p, x: x + jax.random.normal(jax.random.PRNGKey(len(str(p))),
                                         x.shape) if "query" in str(p)
      else x, variables["params"])}
  logits = jax.jit(model.apply)(variables, tokens)
  with monkeypatch.context() as m:
    m.setattr(attn_res.BlockAttnResState, "mix", one_shot)
    ref = jax.jit(model.apply)(variables, tokens)
  assert np.all(np.isfinite(logits))
  np.testing.assert_allclose(logits, ref, rtol=1e-4, atol=1e-4)
