"""Block Attention Residuals: the mixture, and block size 1 == full AttnRes."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.layers.attn_res import AttnResMix, BlockAttnResState


def _sources(key, n, shape=(2, 5, 8)):
  return [jax.random.normal(k, shape) for k in jax.random.split(key, n)]


def test_zero_query_is_uniform_average():
  srcs = _sources(jax.random.PRNGKey(0), 4)
  mix = AttnResMix()
  params = nn.meta.unbox(mix.init(jax.random.PRNGKey(1), srcs))
  assert not np.any(params["params"]["query"])  # zero-initialised
  out = mix.apply(params, srcs)
  np.testing.assert_allclose(out, sum(srcs) / 4, rtol=1e-6, atol=1e-6)


def test_nonzero_query_weights_sources_by_softmax():
  srcs = _sources(jax.random.PRNGKey(2), 3)
  w = jax.random.normal(jax.random.PRNGKey(3), (8,))
  out = AttnResMix().apply({"params": {"query": w}}, srcs)
  v = jnp.stack(srcs)
  keys = v / jnp.sqrt(jnp.mean(v * v, -1, keepdims=True) + 1e-6)
  weights = jax.nn.softmax(jnp.einsum("sbtd,d->sbt", keys, w), axis=0)
  np.testing.assert_allclose(out, jnp.einsum("sbt,sbtd->btd", weights, v),
                             rtol=1e-5, atol=1e-6)
  assert not np.allclose(out, sum(srcs) / 3)
  # With 'intermediates' mutable, the mix sows its weights averaged over
  # batch and tokens [S], and its output is unchanged.
  sown_out, sown = AttnResMix().apply({"params": {"query": w}}, srcs,
                                      mutable=["intermediates"])
  np.testing.assert_array_equal(sown_out, out)
  (mean_weights,) = sown["intermediates"]["weights"]
  np.testing.assert_allclose(mean_weights, weights.mean(axis=(1, 2)),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(mean_weights.sum()), 1.0, rtol=1e-6)


def _run(layers_per_block, fns, emb, queries):
  """Runs sublayers fns with block AttnRes; returns the final mixture."""
  state = BlockAttnResState(emb, layers_per_block)
  for f, w in zip(fns, queries[:-1]):
    h = AttnResMix().apply({"params": {"query": w}}, state.sources())
    state.add(f(h))
  return AttnResMix().apply({"params": {"query": queries[-1]}},
                            state.sources())


def _full_attn_res(fns, emb, queries):
  """Reference: every earlier sublayer output is its own source."""
  outs = [emb]
  for f, w in zip(fns, queries[:-1]):
    h = AttnResMix().apply({"params": {"query": w}}, outs)
    outs.append(f(h))
  return AttnResMix().apply({"params": {"query": queries[-1]}}, outs)


def test_one_layer_per_block_equals_full_attn_res():
  key = jax.random.PRNGKey(4)
  emb = jax.random.normal(key, (2, 5, 8))
  mats = [jax.random.normal(k, (8, 8)) / 3 for k in
          jax.random.split(jax.random.PRNGKey(5), 6)]
  fns = [lambda h, m=m: jnp.tanh(h @ m) for m in mats]
  queries = list(jax.random.normal(jax.random.PRNGKey(6), (7, 8)))
  np.testing.assert_allclose(_run(1, fns, emb, queries),
                             _full_attn_res(fns, emb, queries), rtol=1e-6)
  # Larger blocks really are different (the test can fail).
  assert not np.allclose(_run(3, fns, emb, queries),
                         _full_attn_res(fns, emb, queries), atol=1e-3)


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
