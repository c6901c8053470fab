"""The whole model: causality, collections, and the train step's contract."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_config
from moe_jax.model import build_model
from moe_jax.train.optimizer import make_optimizer
from moe_jax.train.step import init_train_state, make_train_step


@pytest.fixture(scope="module")
def tiny():
  config = load_config("default.py", "tiny,smoke")
  model = build_model(config)
  tx = make_optimizer(config.train)
  state = init_train_state(model, tx, jax.random.PRNGKey(0), 32)
  return config, model, tx, state


@pytest.mark.parametrize("variant", ["", "standard_residual"])
def test_perturbing_token_t_never_changes_outputs_before_t(variant):
  config = load_config("default.py", f"tiny,smoke,{variant}".rstrip(","))
  model = build_model(config)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 40), 0, 256)
  variables = jax.jit(model.init)(jax.random.PRNGKey(2), tokens)
  apply = jax.jit(lambda t: model.apply(
      {"params": variables["params"],
       "router_state": variables["router_state"]}, t))
  base = np.asarray(apply(tokens))
  assert np.all(np.isfinite(base))
  for t in (0, 17, 31, 39):  # chunk starts, middles and the last token
    perturbed = tokens.at[:, t].set((tokens[:, t] + 97) % 256)
    out = np.asarray(apply(perturbed))
    np.testing.assert_allclose(out[:, :t], base[:, :t], rtol=0, atol=1e-6)
    assert not np.allclose(out[:, t], base[:, t])  # the test can fail


def test_router_state_is_not_a_param_and_gets_no_gradient(tiny):
  _, model, _, state = tiny
  flat_params = jax.tree_util.tree_leaves_with_path(state.params)
  assert not any("bias" == getattr(p[-1], "key", None) and "router" in str(p)
                 for p, _ in flat_params)
  biases = jax.tree.leaves(state.router_state)
  assert len(biases) == 2 and all(b.shape == (8,) for b in biases)

  tokens = jnp.ones((2, 32), jnp.int32)

  def loss(params, router_state):
    logits, _ = model.apply({"params": params, "router_state": router_state},
                            tokens, mutable=["router_stats"])
    return logits.mean()

  # The router bias only enters through top-k selection (stop_gradient).
  g_state = jax.grad(loss, argnums=1)(state.params, state.router_state)
  assert all(not np.any(g) for g in jax.tree.leaves(g_state))


def test_train_step_updates_router_state_after_optimizer(tiny):
  config, model, tx, state = tiny
  step = jax.jit(make_train_step(model, tx, config.model.moe))
  rng = np.random.default_rng(0)
  batch = {"inputs": jnp.asarray(rng.integers(0, 256, (4, 32)), jnp.int32),
           "targets": jnp.asarray(rng.integers(0, 256, (4, 32)), jnp.int32)}
  new_state, metrics = step(state, batch)
  old_b, new_b = jax.tree.leaves(state.router_state), jax.tree.leaves(
      new_state.router_state)
  assert any(not np.allclose(o, n) for o, n in zip(old_b, new_b))
  for b in new_b:  # QB re-centres the bias
    assert abs(float(jnp.mean(b))) < 1e-5
  assert int(new_state.step) == 1
  assert set(metrics) >= {"loss", "bpb", "grad_norm", "maxvio/layer_0",
                          "maxvio/layer_1"}
  assert np.isfinite(float(metrics["loss"]))
  # The optimizer state never holds the router bias.
  n_opt = sum(x.size for x in jax.tree.leaves(new_state.opt_state))
  n_par = sum(x.size for x in jax.tree.leaves(new_state.params))
  assert n_opt < 3 * n_par + 10


def test_none_balancing_leaves_router_state_alone(tiny):
  config, model, tx, state = tiny
  moe_cfg = config.model.moe.copy_and_resolve_references()
  moe_cfg.balancing = "none"
  step = jax.jit(make_train_step(model, tx, moe_cfg))
  batch = {"inputs": jnp.ones((4, 32), jnp.int32),
           "targets": jnp.ones((4, 32), jnp.int32)}
  new_state, _ = step(state, batch)
  for o, n in zip(jax.tree.leaves(state.router_state),
                  jax.tree.leaves(new_state.router_state)):
    np.testing.assert_array_equal(o, n)


def test_weight_decay_mask_skips_gate_biases(tiny):
  from moe_jax.train.optimizer import decay_mask
  _, _, _, state = tiny
  mask = decay_mask(state.params)
  kda = [k for k in mask if k.endswith("_kda")][0]
  assert mask[kda]["dt_bias"] is False and mask[kda]["A_log"] is False
  assert mask[kda]["q_proj"]["kernel"] is True
  assert mask["final_norm"]["scale"] is False


def test_extreme_sparsity_trains_and_balances():
  """256 routed experts, top-8, tiny d_model: a few QB steps on CPU."""
  config = load_config("default.py", "tiny,smoke,extreme")
  assert config.model.moe.num_experts >= 256 and config.model.moe.top_k <= 8
  model = build_model(config)
  tx = make_optimizer(config.train)
  state = init_train_state(model, tx, jax.random.PRNGKey(0), 32)
  step = jax.jit(make_train_step(model, tx, config.model.moe))
  rng = np.random.default_rng(1)
  maxvio = []
  for _ in range(4):
    batch = {"inputs": jnp.asarray(rng.integers(0, 256, (4, 32)), jnp.int32),
             "targets": jnp.asarray(rng.integers(0, 256, (4, 32)), jnp.int32)}
    state, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"]))
    maxvio.append(float(metrics["maxvio/layer_0"]))
  assert all(b.shape == (256,) for b in jax.tree.leaves(state.router_state))
  assert all(np.isfinite(maxvio))


def test_remat_changes_neither_loss_nor_update(tiny):
  """model.remat recomputes activations; the step's results stay the same."""
  config, model, tx, state = tiny
  rng = np.random.default_rng(2)
  batch = {"inputs": jnp.asarray(rng.integers(0, 256, (4, 32)), jnp.int32),
           "targets": jnp.asarray(rng.integers(0, 256, (4, 32)), jnp.int32)}
  step = lambda m: jax.jit(make_train_step(m, tx, config.model.moe))  # noqa: E731
  s_ref, m_ref = step(model)(state, batch)
  dots = {}
  for remat in ("sublayer", "dots", "experts"):
    cfg = config.copy_and_resolve_references()
    cfg.model.remat = remat
    lowered = step(build_model(cfg)).lower(state, batch)
    dots[remat] = lowered.as_text().count("stablehlo.dot_general")
    s_remat, m_remat = lowered.compile()(state, batch)
    np.testing.assert_allclose(m_remat["loss"], m_ref["loss"], rtol=1e-6)
    np.testing.assert_allclose(m_remat["grad_norm"], m_ref["grad_norm"],
                               rtol=1e-5)
    for a, b in zip(jax.tree.leaves((s_remat.params, s_remat.router_state)),
                    jax.tree.leaves((s_ref.params, s_ref.router_state))):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # "experts" keeps the gate, up and down products of every MoE layer:
  # the backward recomputes three fewer matmuls per MoE layer.
  moe_layers = config.model.num_layers - config.model.moe.first_dense_layers
  assert dots["sublayer"] - dots["experts"] == 3 * moe_layers, dots
