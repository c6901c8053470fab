"""Sharding on 8 fake CPU devices: sharded results equal unsharded ones.

One train step of the tiny model on each mesh (data, fsdp, expert, context,
tensor) must give the loss, updated params and router bias of the
single-device step, up to fp32 reduction order (partial sums across devices).
MoE top-k routing could flip on a near-tie between the two; the fixed seeds
(params PRNGKey(0), batch default_rng(1)) keep the scores apart, and the
router-state check would show a flip. Layers run as plain GSPMD-partitioned
code here (no shard_map), so this is the reference the shard_map paths must
also meet.
"""
import logging
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import assert_config_error, load_config, set_field
from moe_jax import sharding
from moe_jax.config_validation import ConfigError, validate_config
from moe_jax.model import build_model
from moe_jax.train.checkpoint import Checkpointer, with_shardings
from moe_jax.train.metrics import read_metrics
from moe_jax.train.optimizer import make_optimizer, make_schedule
from moe_jax.train.step import (abstract_train_state, init_train_state,
                                make_train_step, train_state_shardings)

RTOL, ATOL = 1e-5, 1e-6
AXES = ("data", "fsdp", "expert", "context", "tensor")
MESHES = [(8, 1, 1, 1, 1), (2, 1, 4, 1, 1), (2, 1, 2, 2, 1),
          (1, 1, 1, 8, 1), (1, 2, 2, 2, 1)]


def _mesh_cfg(sizes, **extra) -> ml_collections.ConfigDict:
  cfg = load_config("default.py").mesh
  cfg.num_devices = -1
  for axis, size in zip(AXES, sizes):
    cfg[axis] = size
  for key, value in extra.items():
    cfg[key] = value
  return cfg


@pytest.fixture(scope="module")
def setup():
  """(config, model, tx, host initial state, host batch, reference outputs)."""
  config = load_config("default.py", "tiny,smoke")
  config.data.batch_size = 8   # divisible by data=8
  config.train.warmup_steps = 0  # lr > 0 at step 0, so params move
  # Adam's first update lr * g / (|g| + eps) has error lr * dg / eps for
  # small |g|; eps = 1e-4 keeps an fp32 reduction-order dg ~ 1e-9 under ATOL
  # (tests/test_grad_accum.py measures it).
  config.train.eps = 1e-4
  model = build_model(config)
  tx = make_optimizer(config.train)
  state = jax.device_get(init_train_state(model, tx, jax.random.PRNGKey(0),
                                          config.data.seq_len))
  rng = np.random.default_rng(1)
  shape = (config.data.batch_size, config.data.seq_len)
  batch = {"inputs": rng.integers(0, 256, shape).astype(np.int32),
           "targets": rng.integers(0, 256, shape).astype(np.int32)}
  step = jax.jit(make_train_step(model, tx, config.model.moe,
                                 make_schedule(config.train)))
  reference = jax.device_get(step(state, batch))  # no mesh, one device
  return config, model, tx, state, batch, reference


def _state_shardings(setup, mesh):
  """The train state's shardings on `mesh` under config.mesh.rules."""
  config, model, tx = setup[:3]
  return train_state_shardings(
      abstract_train_state(model, tx, jax.random.PRNGKey(0),
                           config.data.seq_len), tx, mesh, config.mesh.rules)


def _sharded_step(setup, mesh, microbatches=1, **jit_kwargs):
  """(state shardings, batch shardings, jitted train step) on `mesh`."""
  config, model, tx, _, batch, _ = setup
  state_sh = _state_shardings(setup, mesh)
  batch_sh = sharding.batch_sharding(mesh, config.mesh.rules,
                                     batch["inputs"].shape)
  train_step = make_train_step(model, tx, config.model.moe,
                               make_schedule(config.train),
                               microbatches=microbatches)
  step = sharding.jit_in_mesh(
      train_step, mesh, in_shardings=(state_sh, batch_sh),
      out_shardings=(state_sh, sharding.replicated(mesh)), **jit_kwargs)
  return state_sh, batch_sh, step


def _padded(spec, ndim):
  """A PartitionSpec as ndim entries (trailing Nones made explicit)."""
  return tuple(spec) + (None,) * (ndim - len(spec))


def _assert_tree_close(actual, desired, what):
  assert (jax.tree.structure(actual) == jax.tree.structure(desired)), what
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(actual),
                          jax.tree.leaves(desired)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=RTOL,
                               atol=ATOL,
                               err_msg=f"{what}{jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("sizes", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_train_step_on_mesh_matches_single_device(setup, sizes):
  _, _, _, state, batch, (ref_state, ref_metrics) = setup
  mesh = sharding.make_mesh(_mesh_cfg(sizes))
  assert dict(mesh.shape) == dict(zip(AXES, sizes))
  state_sh, batch_sh, step = _sharded_step(setup, mesh, donate_argnums=(0,))
  sharded_state = jax.device_put(state, state_sh)
  sharded_batch = sharding.shard_batch(batch, batch_sh,
                                       batch["inputs"].shape[0])
  lowered = step.lower(sharded_state, sharded_batch)
  # The model's activation constraints are in the program.
  text = lowered.as_text()
  assert "sharding_constraint" in text or "@Sharding" in text
  new_state, metrics = lowered.compile()(sharded_state, sharded_batch)

  # Layout: what the mesh asks for, and not trivially replicated.
  data, fsdp, expert, context, _ = sizes
  batch_axes = tuple(a for a, n in zip(("data", "fsdp", "expert"),
                                       (data, fsdp, expert)) if n > 1)
  assert _padded(sharded_batch["inputs"].sharding.spec, 2) == (
      (batch_axes[0] if len(batch_axes) == 1 else batch_axes) or None,
      "context" if context > 1 else None)
  w_up = new_state.params["layer_0_moe"]["w_up"]
  assert w_up.sharding == state_sh.params["layer_0_moe"]["w_up"]
  expected_w = ("expert" if expert > 1 else None,
                "fsdp" if fsdp > 1 else None, None)
  assert _padded(w_up.sharding.spec, 3) == expected_w
  mu_up = new_state.opt_state[1][0].mu["layer_0_moe"]["w_up"]
  assert _padded(mu_up.sharding.spec, 3) == expected_w  # mirrors the params

  new_state, metrics = jax.device_get((new_state, metrics))
  np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=RTOL)
  np.testing.assert_allclose(metrics["grad_norm"], ref_metrics["grad_norm"],
                             rtol=RTOL)
  _assert_tree_close(new_state.params, ref_state.params, "params")
  _assert_tree_close(new_state.router_state, ref_state.router_state,
                     "router_state")
  for key in ref_metrics:
    if key.startswith("maxvio/"):
      np.testing.assert_allclose(metrics[key], ref_metrics[key], rtol=1e-6)
  assert int(new_state.step) == 1


def test_microbatches_on_mesh_match_single_device(setup):
  """Gradient accumulation under sharding: the strided microbatch split keeps
  every device busy and the result is still the full-batch step."""
  _, _, _, state, batch, (ref_state, ref_metrics) = setup
  mesh = sharding.make_mesh(_mesh_cfg((2, 1, 2, 2, 1)))
  state_sh, batch_sh, step = _sharded_step(setup, mesh, microbatches=2)
  new_state, metrics = jax.device_get(step(
      jax.device_put(state, state_sh),
      sharding.shard_batch(batch, batch_sh, batch["inputs"].shape[0])))
  np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=RTOL)
  _assert_tree_close(new_state.params, ref_state.params, "params")
  _assert_tree_close(new_state.router_state, ref_state.router_state,
                     "router_state")


@pytest.mark.slow
def test_loop_resumes_on_another_mesh(tmp_path, caplog):
  """train_and_evaluate: 4 steps on one mesh (checkpoints at 2 and 4); the
  step-2 checkpoint resumed on another mesh ends like those 4 steps (loss,
  val loss)."""
  from moe_jax.train.loop import train_and_evaluate

  def config_on(sizes):
    config = load_config("default.py", "tiny,smoke")
    config.data.batch_size = 8
    config.train.steps = 4
    config.train.checkpoint_every = 2
    config.train.eval_every = 4
    config.train.eps = 1e-4  # see setup()
    config.mesh.num_devices = -1
    for axis, size in zip(AXES, sizes):
      config.mesh[axis] = size
    return config

  a, b = (2, 1, 2, 2, 1), (1, 2, 2, 2, 1)
  straight = train_and_evaluate(config_on(a), str(tmp_path / "s"))
  shutil.copytree(tmp_path / "s", tmp_path / "r")
  shutil.rmtree(tmp_path / "r" / "checkpoints" / "4")
  with caplog.at_level(logging.INFO):
    resumed = train_and_evaluate(config_on(b), str(tmp_path / "r"))
  assert any(r.getMessage().startswith("Resumed from step 2")
             for r in caplog.records)
  assert resumed["step"] == straight["step"] == 4
  rows = [r for r in read_metrics(str(tmp_path / "r"))
          if r["split"] == "router"]
  assert [r["step"] for r in rows] == [1, 2, 3, 4]  # 3 and 4 rerun once
  for key in ("loss", "val_loss"):
    np.testing.assert_allclose(resumed[key], straight[key], rtol=1e-5)


def test_sharded_init_equals_unsharded_init(setup):
  config, model, tx, state, _, _ = setup
  mesh = sharding.make_mesh(_mesh_cfg((1, 2, 2, 2, 1)))
  state_sh = _state_shardings(setup, mesh)
  sharded = init_train_state(model, tx, jax.random.PRNGKey(0),
                             config.data.seq_len, shardings=state_sh)
  assert _padded(sharded.params["embed"]["embedding"].sharding.spec, 2) == (
      None, "fsdp")
  np.testing.assert_array_equal(
      jax.device_get(sharded.params["layer_0_moe"]["w_gate"]),
      state.params["layer_0_moe"]["w_gate"])
  _assert_tree_close(jax.device_get(sharded), state, "init")


def test_checkpoint_restores_onto_another_mesh(setup, tmp_path):
  config, model, tx, state, _, _ = setup
  abstract = abstract_train_state(model, tx, jax.random.PRNGKey(0),
                                  config.data.seq_len)
  rules = config.mesh.rules

  def shardings(sizes):
    return train_state_shardings(abstract, tx, sharding.make_mesh(
        _mesh_cfg(sizes)), rules)

  src_sh, dst_sh = shardings((2, 1, 4, 1, 1)), shardings((1, 2, 2, 2, 1))
  assert (src_sh.params["layer_0_moe"]["w_down"].spec
          != dst_sh.params["layer_0_moe"]["w_down"].spec)
  ckpt = Checkpointer(str(tmp_path))
  ckpt.save(3, jax.device_put(state, src_sh), {"step": 3}, {"a": 1})
  ckpt.wait()
  restored, data_state, config_dict = ckpt.restore(
      3, with_shardings(abstract, dst_sh))
  ckpt.close()
  assert data_state == {"step": 3} and config_dict == {"a": 1}
  for (path, x), want in zip(jax.tree_util.tree_leaves_with_path(restored),
                             jax.tree.leaves(dst_sh)):
    assert x.sharding == want, jax.tree_util.keystr(path)
  for x, y in zip(jax.tree.leaves(jax.device_get(restored)),
                  jax.tree.leaves(state)):
    np.testing.assert_array_equal(x, y)


def test_logical_to_spec_drops_axes_that_do_not_divide():
  sizes = {"data": 2, "fsdp": 1, "expert": 4, "context": 1, "tensor": 2}
  rules = load_config("default.py").mesh.rules
  # batch -> (data, fsdp, expert): fsdp has size 1, expert 4 * 2 > 4 rows.
  assert sharding.logical_to_spec(("batch", "sequence"), (4, 32), rules,
                                  sizes) == P("data")
  assert sharding.logical_to_spec(("batch", "sequence"), (16, 32), rules,
                                  sizes) == P(("data", "expert"))
  # vocab 259 is odd: replicated; a mesh axis is used once per array.
  assert sharding.logical_to_spec(("vocab", "embed"), (259, 32), rules,
                                  sizes) == P()
  assert sharding.logical_to_spec(("heads", "mlp"), (4, 4), rules,
                                  sizes) == P("tensor")
  with pytest.raises(ValueError, match="2 logical axes"):
    sharding.logical_to_spec(("batch", "sequence"), (4,), rules, sizes)


def _declared_axes(config_name, variant=None, **fields):
  """sharding.param_logical_axes of the abstract init of a config's model."""
  config = load_config(config_name, variant)
  for field, value in fields.items():
    set_field(config, field, value)
  model = build_model(config)
  tokens = jax.ShapeDtypeStruct((1, config.model.kda.chunk_size), np.int32)
  variables = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)
  return sharding.param_logical_axes(variables["params"])


@pytest.mark.parametrize("config_name,variant,fields", [
    ("default.py", None, {}),
    ("gpu_small.py", None, {}),
    # Every optional parameter: latent experts, a dense first FFN, low-rank
    # MLA queries with a rotary key, plain residuals (no AttnRes queries).
    ("default.py", "latent_experts,standard_residual",
     {"model.moe.first_dense_layers": 1, "model.mla.q_lora_rank": 16,
      "model.mla.qk_rope_head_dim": 8}),
])
def test_every_param_declares_its_logical_axes(config_name, variant, fields):
  # param_logical_axes raises for a parameter created without names.
  axes = _declared_axes(config_name, variant, **fields)
  rules = dict(sharding.rules_dict(None))
  for path, a in jax.tree_util.tree_leaves_with_path(
      axes, is_leaf=lambda x: isinstance(x, tuple)):
    assert all(n is None or n in rules for n in a), (
        jax.tree_util.keystr(path), a)
    if len(a) >= 2:  # every matrix is split over some axis of the rules
      assert any(a), jax.tree_util.keystr(path)


def test_param_logical_axes_of_the_layers(setup):
  axes = _declared_axes("default.py", "tiny,smoke")
  assert axes["layer_0_moe"]["w_gate"] == ("expert", "embed", "mlp")
  assert axes["layer_0_moe"]["w_down"] == ("expert", "mlp", "embed")
  assert axes["layer_0_moe"]["shared"]["down"]["kernel"] == ("mlp", "embed")
  assert axes["layer_0_kda"]["gate_up"]["kernel"] == (None, "heads")
  assert axes["layer_1_mla"]["o_proj"]["kernel"] == ("heads", "embed")
  assert axes["embed"]["embedding"] == ("vocab", "embed")
  assert axes["final_norm"]["scale"] == (None,)
  # The train state itself holds plain arrays (checkpoints see no boxes).
  _, _, _, state, _, _ = setup
  assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(
      state.params, is_leaf=lambda x: isinstance(x, nn.Partitioned)))


def test_a_param_without_logical_axes_is_an_error():
  params = {"layer": {"kernel": nn.LogicallyPartitioned(
      np.zeros((4, 8)), ("embed", "mlp")), "bare": np.zeros((4, 8))}}
  with pytest.raises(ValueError, match=r"layer/bare \(4, 8\): no logical "
                     r"axes"):
    sharding.param_logical_axes(params)


def test_constrain_is_a_no_op_without_mesh():
  x = np.ones((4, 8, 2), np.float32)
  assert sharding.constrain(x, sharding.HIDDEN_AXES, None) is x


@pytest.mark.parametrize("field,value,match", [
    ("data", 3, r"mesh.data \* mesh.fsdp \* mesh.expert \* mesh.context \* "
                r"mesh.tensor = 3 \* 1 \* 1 \* 1 \* 1 = 3 must equal the "
                r"device count 8"),
    ("expert", 3, r"mesh.fsdp \* mesh.expert \* mesh.context \* mesh.tensor "
                  r"= 3 must divide the device count 8 when mesh.data=-1"),
    ("tensor", 0, r"mesh.tensor must be an integer >= 1, got 0"),
    ("data", -2, r"mesh.data must be -1 or an integer >= 1, got -2"),
])
def test_bad_mesh_sizes_error(field, value, match):
  with pytest.raises(ConfigError, match=match):
    sharding.make_mesh(_mesh_cfg((-1, 1, 1, 1, 1), **{field: value}))


@pytest.mark.parametrize("rules,match", [
    ((("batch", "dat"),), r"mesh.rules\['batch'\] must be None, one of "
                          r"\['data', 'fsdp', 'expert', 'context', 'tensor'\]"),
    ((("batch", ("data", "data")),), r"mesh.rules\['batch'\] .* distinct"),
    ((("batch", None), ("batch", "data")), r"mesh.rules names logical axis "
                                           r"'batch' twice"),
    ((("batch",),), r"mesh.rules entries must be \(logical_name: str, "
                    r"mesh_axes\) pairs"),
])
def test_bad_mesh_rules_error(rules, match):
  assert_config_error("mesh.rules", rules, match)


def test_bad_mesh_size_in_config_errors():
  assert_config_error("mesh.data", 0, r"mesh.data must be -1 \(all devices "
                      r"the other axes leave\) or an integer")


def test_multihost_settings():
  assert sharding.init_distributed(None, None, None) is False  # one process
  with pytest.raises(ValueError, match=r"--process_id must be in \[0, 2\)"):
    sharding.init_distributed("localhost:1234", 2, 2)
  with pytest.raises(ValueError, match="--num_processes must be >= 1"):
    sharding.init_distributed("localhost:1234", 0, 0)


def test_num_devices_takes_the_first_n_and_refuses_too_many():
  mesh = sharding.make_mesh(_mesh_cfg((-1, 1, 1, 1, 1), num_devices=2))
  assert mesh.size == 2 and dict(mesh.shape)["data"] == 2
  assert list(mesh.devices.flat) == jax.devices()[:2]
  with pytest.raises(ConfigError, match=r"mesh.num_devices = 16.*1\.\.8"):
    sharding.make_mesh(_mesh_cfg((-1, 1, 1, 1, 1), num_devices=16))
  config = load_config("default.py")
  config.mesh.num_devices = 0
  with pytest.raises(ConfigError, match="mesh.num_devices must be -1"):
    validate_config(config)


def test_mesh_axes_come_from_the_rules():
  from moe_jax.layers import mesh_utils
  default = mesh_utils.mesh_axes(None)
  assert default == mesh_utils.MeshAxes()
  assert (default.batch, default.context, default.expert) == (
      ("data", "fsdp", "expert"), "context", "expert")
  custom = mesh_utils.mesh_axes((("batch", "data"), ("sequence", None),
                                 ("heads", None), ("expert", "fsdp")))
  assert custom == mesh_utils.MeshAxes(batch=("data",), heads=(),
                                       context=None, expert="fsdp")
  config = load_config("default.py", "tiny")
  config.mesh.rules = (("sequence", ("context", "data")),)
  with pytest.raises(ConfigError, match=r"mesh.rules\['sequence'\] must be "
                     "None or one mesh axis"):
    validate_config(config)


@pytest.mark.parametrize("expert_rule,all_to_all", [("expert", True),
                                                    (None, False)])
def test_moe_splits_experts_over_the_rules_axis(expert_rule, all_to_all):
  """The MoE's all-to-all follows the rules table: ('expert', None) keeps the
  experts whole on a mesh that has an expert axis."""
  config = load_config("default.py", "tiny")
  config.mesh.rules = tuple(
      (name, expert_rule if name == "expert" else axes)
      for name, axes in config.mesh.rules)
  model = build_model(config)
  mesh = sharding.make_mesh(_mesh_cfg((2, 1, 4, 1, 1)))
  tokens = jnp.zeros((8, 32), jnp.int32)
  with sharding.use_mesh(mesh):
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)
    text = jax.jit(model.apply).lower(params, tokens).as_text()
  assert ("all_to_all" in text or "all-to-all" in text) == all_to_all
