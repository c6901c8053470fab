"""The planner: exact parameter counts, sharded sizes, scaling of its terms."""
import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

from conftest import ROOT, load_config, set_field
from moe_jax import planning
from moe_jax.config_validation import validate_config
from moe_jax.model import build_model


def closed_form(config):
  """Parameters by component from the config fields alone (not the model)."""
  m = config.model
  d, vocab, n_layers = m.d_model, m.vocab_size, m.num_layers
  kinds = [m.layer_pattern[i % len(m.layer_pattern)] for i in range(n_layers)]
  k = m.kda
  kda = (3 * (d * d + k.conv_size * d)           # q, k, v projections + convs
         + d * k.num_heads                        # beta
         + d * k.decay_rank + k.decay_rank * d    # low-rank decay
         + d + k.num_heads                        # dt_bias [H, K], A_log [H]
         + d // k.num_heads                       # per-head output norm scale
         + d * k.gate_rank + k.gate_rank * d      # low-rank output gate
         + d * d)                                 # o_proj
  a = m.mla
  h, dqk = a.num_heads, a.qk_nope_head_dim + a.qk_rope_head_dim
  if a.q_lora_rank:
    q = d * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * h * dqk
  else:
    q = d * h * dqk
  mla = (q + d * a.kv_lora_rank + a.kv_lora_rank          # kv_down + norm
         + a.kv_lora_rank * h * (a.qk_nope_head_dim + a.v_head_dim)
         + d * a.qk_rope_head_dim                         # shared rotary key
         + d * h * a.v_head_dim + h * a.v_head_dim * d)   # gate, o_proj
  e = m.moe
  n_dense = min(e.first_dense_layers, n_layers)
  n_moe = n_layers - n_dense
  d_in = e.expert_latent_dim or d
  routed = n_moe * e.num_experts * 3 * d_in * e.d_expert
  per_token_routed = n_moe * e.top_k * 3 * d_in * e.d_expert
  comps = {
      "embed": vocab * d, "head": d * vocab,
      "KDA": kinds.count("K") * kda, "MLA": kinds.count("M") * mla,
      "dense FFN": n_dense * 3 * d * e.d_dense,
      "router": n_moe * d * e.num_experts,
      "MoE routed": routed,
      "MoE latent proj": n_moe * 2 * d * e.expert_latent_dim,
      "MoE shared": n_moe * 3 * d * e.num_shared * e.d_shared,
      # Pre-norms of both sublayers + final norm; one AttnRes query per
      # sublayer + the final mix.
      "norms/AttnRes": (2 * n_layers + 1) * d + (
          (2 * n_layers + 1) * d if m.residual == "block_attn_res" else 0),
  }
  total = sum(comps.values())
  return comps, total, total - routed + per_token_routed


def _tiny(extra=None):
  config = load_config("default.py", "tiny")
  for path, value in (extra or {}).items():
    set_field(config, path, value)
  validate_config(config)
  return config


# Every optional branch: q LoRA, rotary key, latent experts, a dense first
# layer, 3 layers of "KKM", standard residuals.
_BRANCHY = {"model.num_layers": 3, "model.layer_pattern": "KKM",
            "model.mla.q_lora_rank": 8, "model.mla.qk_rope_head_dim": 4,
            "model.moe.expert_latent_dim": 16,
            "model.moe.first_dense_layers": 1, "model.moe.d_dense": 48,
            "model.residual": "standard", "model.moe.num_shared": 2}


@pytest.fixture(scope="module")
def tiny_init():
  """(config, real variables of model.init) for the tiny default model."""
  config = _tiny()
  model = build_model(config)
  tokens = jnp.zeros((1, config.model.kda.chunk_size), jnp.int32)
  # Only the sizes matter: compile without the expensive XLA passes.
  init = jax.jit(model.init).lower(jax.random.PRNGKey(0), tokens).compile(
      {"xla_backend_optimization_level": 0,
       "xla_llvm_disable_expensive_passes": True})
  return config, init(jax.random.PRNGKey(0), tokens)


def test_total_and_active_equal_init_and_closed_form(tiny_init):
  config, variables = tiny_init
  p = planning.plan(config, {}, 64, 1, global_batch=1)
  initialised = sum(int(x.size) for x in jax.tree.leaves(variables["params"]))
  comps, total, active = closed_form(config)
  assert p["params"]["total"] == initialised == total
  assert p["params"]["active"] == active
  assert active < total  # top_k < num_experts: some params are inactive
  got = {c: v["total"] for c, v in p["params"]["by_component"].items() if
         v["total"]}
  assert got == {c: n for c, n in comps.items() if n}


def test_closed_form_covers_every_branch():
  config = _tiny(_BRANCHY)
  p = planning.plan(config, {}, 64, 1, global_batch=1)
  comps, total, active = closed_form(config)
  assert p["params"]["total"] == total
  assert p["params"]["active"] == active
  assert all(p["params"]["by_component"][c]["total"] == n
             for c, n in comps.items())
  assert comps["dense FFN"] and comps["MoE latent proj"]


def test_sharded_param_bytes_match_real_devices(tiny_init):
  """Shards on 8 (fake CPU) devices are the sizes the abstract mesh predicts."""
  config, variables = tiny_init
  shape = {"data": 1, "fsdp": 4, "expert": 2, "context": 1, "tensor": 1}
  p = planning.plan(config, shape, 64, 1, global_batch=8,
                    variables=variables)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(tuple(shape.values())),
              tuple(shape))
  flat = jax.tree_util.tree_flatten_with_path(variables["params"])[0]
  leaves = planning.param_leaves(variables["params"], config.model)
  per_device = np.zeros(8)
  for (_, x), leaf in zip(flat, leaves):
    spec = planning.leaf_spec(leaf, shape, ("fsdp",))
    y = jax.device_put(x, NamedSharding(mesh, spec))
    for s in y.addressable_shards:
      per_device[s.device.id] += s.data.size * s.data.dtype.itemsize
  assert np.all(per_device == per_device[0])
  assert p["memory_per_device"]["items"]["params"] == per_device[0]
  # Sharding actually happened: well below the replicated size.
  full = sum(int(x.size) * x.dtype.itemsize
             for x in jax.tree.leaves(variables["params"]))
  assert per_device[0] < full / 3


def test_attention_terms_scale_as_derived():
  config = _tiny()
  variables = planning.abstract_variables(config)
  f = {t: planning.plan(config, {}, t, 1, global_batch=1,
                        variables=variables)["flops_per_token"]
       for t in (64, 256)}
  a = config.model.mla
  mla = 2 * a.num_heads * (a.qk_nope_head_dim + a.v_head_dim) * (256 + 1) / 2
  assert f[256]["forward"]["MLA attention"] == pytest.approx(mla)  # 1 MLA layer
  # Causal attention per token grows with T; the chunked KDA does not.
  assert (f[256]["forward"]["MLA attention"] /
          f[64]["forward"]["MLA attention"]) == pytest.approx(257 / 65)
  assert f[256]["forward"]["KDA chunked"] == f[64]["forward"]["KDA chunked"]
  c, kk = config.model.kda.chunk_size, config.model.d_model // 2
  assert f[64]["forward"]["KDA chunked"] == pytest.approx(
      2 * (10 * c * kk + c * c / 3 + 6 * kk * kk))
  for fl in f.values():
    assert fl["train_model"] == pytest.approx(3 * fl["forward_total"])
    # Matmul FLOPs are 2 per active matrix param: 6N_active minus the
    # embedding lookup and 1-D params, in training.
    matmul = sum(v for k, v in fl["forward"].items() if k.endswith("matmuls"))
    assert matmul < 2 * planning.plan(
        config, {}, 64, 1, global_batch=1,
        variables=variables)["params"]["active"]


def test_comm_and_memory_respond_to_the_mesh():
  config = _tiny()
  variables = planning.abstract_variables(config)
  run = lambda mesh, mb, **kw: planning.plan(  # noqa: E731
      config, mesh, 64, mb, global_batch=16, variables=variables, **kw)
  p1 = run({"fsdp": 2, "expert": 4}, 1)
  p2 = run({"fsdp": 2, "expert": 4}, 2)
  assert (p1["run"]["accum_steps"], p2["run"]["accum_steps"]) == (2, 1)
  c1 = p1["comm_per_step"]["collectives"]
  c2 = p2["comm_per_step"]["collectives"]
  # Same tokens per step: the all-to-all volume does not change; FSDP gathers
  # once per micro-step, so half as many micro-steps gather half the bytes.
  assert c1["expert all-to-all"]["bytes"] == pytest.approx(
      c2["expert all-to-all"]["bytes"])
  assert c1["fsdp all-gather"]["bytes"] == pytest.approx(
      2 * c2["fsdp all-gather"]["bytes"])
  # 2 MoE layers x 6 transfers x 128 local tokens (2 sequences of 64) x top-2
  # x d_model fp32, 3/4 of it leaving the device (4 expert shards).
  e = config.model.moe
  assert p2["run"]["tokens_per_device_micro"] == 128
  assert c2["expert all-to-all"]["bytes"] == pytest.approx(
      2 * 6 * 128 * e.top_k * config.model.d_model * 4 * 3 / 4)
  # No expert axis, no all-to-all; context parallelism adds its exchanges.
  p3 = run({"fsdp": 2, "context": 4}, 1)
  c3 = p3["comm_per_step"]["collectives"]
  assert "expert all-to-all" not in c3
  assert {"KDA context state", "MLA latent gather"} <= set(c3)
  assert p3["run"]["tokens_per_device_micro"] == 16
  # More FSDP shards: smaller param shards per device.
  m2 = run({"fsdp": 2}, 1)["memory_per_device"]["items"]["params"]
  m8 = run({"fsdp": 8}, 1)["memory_per_device"]["items"]["params"]
  assert m8 < m2 / 2
  # Residual checkpoints: 2L + 1 = 5 tensors of [64, 32] fp32 per sublayer
  # remat; blocks + 1 + layers_per_block = 2 + 1 + 2 for block remat.
  r_sub = p1["memory_per_device"]["items"]["residual checkpoints"]
  r_blk = run({"fsdp": 2, "expert": 4}, 1, remat="block")[
      "memory_per_device"]["items"]["residual checkpoints"]
  assert r_sub == r_blk == 5 * 64 * 32 * 4


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(mesh_shape={"pipeline": 2}), r"'pipeline'.*allowed axes"),
    (dict(mesh_shape={"fsdp": 0}), r"mesh axis sizes must be >= 1"),
    (dict(mesh_shape={}, fsdp_axes=("expert",)),
     r"fsdp_axes entry 'expert' must be one of"),
    (dict(mesh_shape={"fsdp": 3}, global_batch=16),
     r"global batch 16 sequences must be a multiple of micro_batch=1"),
    (dict(mesh_shape={"context": 4}, seq_len=96),
     r"24 tokens per device must be a multiple of model.kda.chunk_size=16"),
    (dict(mesh_shape={"expert": 3}, global_batch=3),
     r"expert=3 must divide model.moe.num_experts=8"),
])
def test_bad_plans_say_why(kwargs, pattern):
  config = _tiny()
  kwargs = {"seq_len": 64, "global_batch": 1, **kwargs}
  with pytest.raises(ValueError, match=pattern):
    planning.plan(config, **kwargs)


def test_parse_mesh():
  assert list(planning.parse_mesh("expert=8,data=2").items()) == [
      ("expert", 8), ("data", 2), ("fsdp", 1), ("context", 1), ("tensor", 1)]
  with pytest.raises(ValueError, match=r"'model'.*allowed axes"):
    planning.parse_mesh("model=2")
  with pytest.raises(ValueError, match=r"integer size"):
    planning.parse_mesh("data=two")


@pytest.fixture(scope="module")
def trillion():
  config = load_config("trillion.py")
  validate_config(config)
  return config, planning.abstract_variables(config)


def test_trillion_is_a_trillion_with_896_experts(trillion):
  config, variables = trillion
  leaves = planning.param_leaves(variables["params"], config.model)
  routed = [lf for lf in leaves if lf.component == "MoE routed"]
  assert routed and all(lf.shape[0] == 896 for lf in routed)
  p = planning.plan(config, {"data": 1, "fsdp": 1, "expert": 16,
                             "context": 128, "tensor": 1},
                    fsdp_axes=("fsdp", "context"), variables=variables)
  total, active = p["params"]["total"], p["params"]["active"]
  assert 0.9e12 <= total <= 1.2e12
  assert 1e10 <= active <= 1e11            # tens of billions active
  assert total == closed_form(config)[1]
  assert active == closed_form(config)[2]
  assert config.data.seq_len == 2**20
  assert p["memory_per_device"]["total"] < p["memory_per_device"]["hbm"]
  assert not p["run"]["params_not_fsdp_sharded"]
  # 176 sublayers in 8 AttnRes blocks of 22: block remat keeps 8 + 1 + 22
  # residual tensors instead of 177.
  blk = planning.plan(config, {"expert": 16, "context": 128},
                      fsdp_axes=("fsdp", "context"), remat="block",
                      variables=variables)
  items = lambda q: q["memory_per_device"]["items"]  # noqa: E731
  assert (items(blk)["residual checkpoints"] * 177 ==
          pytest.approx(items(p)["residual checkpoints"] * 31))


def test_cli_prints_tables_and_writes_json(tmp_path):
  out = tmp_path / "plan.json"
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.plan",
       "--config=configs/default.py:tiny", "--mesh=data=2,fsdp=2,expert=2",
       "--seq_len=64", "--global_batch=8", f"--out={out}"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  plan = json.loads(out.read_text())
  _, total, active = closed_form(_tiny())
  assert plan["params"]["total"] == total
  total_row = next(line for line in proc.stdout.splitlines()
                   if line.startswith("TOTAL") and f"{total:,}" in line)
  assert f"{active:,}" in total_row
  for title in ("Parameters", "FLOPs per token", "Memory per device",
                "Communication per step"):
    assert title in proc.stdout
  assert math.isfinite(plan["time_per_step"]["compute_seconds"])
