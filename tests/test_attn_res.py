"""Block Attention Residuals: the mixture, and block size 1 == full AttnRes."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.layers.attn_res import (AttnResMix, BlockAttnResState,
                                     attn_res_mix, attn_res_mix_reference)


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


def _mix_loss(mix, srcs, w, g):
  return jnp.sum(mix(srcs, w).astype(jnp.float32) * g)


def test_mix_matches_reference_values_and_gradients():
  """The hand-written backward against autodiff of the plain form: fp32 at
  1e-5, bf16 at bf16 precision, one to five sources, a random query."""
  for n, dtype, tol in ((1, jnp.float32, 1e-5), (3, jnp.float32, 1e-5),
                        (5, jnp.bfloat16, 2e-2)):
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
    grads = jax.grad(_mix_loss, argnums=(1, 2))(attn_res_mix, srcs, w, g)
    ref_grads = jax.grad(_mix_loss, argnums=(1, 2))(
        attn_res_mix_reference, srcs, w, g)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
      a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
      assert np.all(np.isfinite(a))
      scale = np.abs(b).max()
      np.testing.assert_allclose(a, b, rtol=tol, atol=tol * scale)


def test_mix_backward_keeps_no_per_source_activation():
  """What the backward keeps beyond the sources themselves is [S, B, T]
  (weights, inverse RMS, products with the query) and the query: no stacked
  or fp32 copy of the sources, which the plain autodiff form keeps."""
  srcs = tuple(_sources(jax.random.PRNGKey(9), 4, (2, 8, 64)))
  w = jnp.ones((64,))

  def kept(mix):
    _, vjp = jax.vjp(mix, srcs, w)
    ids = {id(s) for s in srcs}
    return sum(x.size for x in jax.tree.leaves(vjp) if id(x) not in ids)

  assert kept(attn_res_mix) <= 3 * 4 * 2 * 8 + 64
  assert kept(attn_res_mix_reference) >= 4 * 2 * 8 * 64   # the test can fail
