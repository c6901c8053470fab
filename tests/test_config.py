"""Config files load, variants apply, and bad values fail before compiling."""
import pytest

from conftest import assert_config_error, load_config, set_field
from moe_jax.config_validation import ConfigError, validate_config


@pytest.mark.parametrize("name", ["default.py", "gpu_small.py"])
def test_configs_validate(name):
  validate_config(load_config(name))


@pytest.mark.parametrize("name,variant", [
    ("gpu_small.py", "curriculum"), ("gpu_small.py", "ladder_short"),
    ("gpu_1b.py", None), ("gpu_1b.py", "seq32k")])
def test_gpu_config_variants_validate(name, variant):
  validate_config(load_config(name, variant))


@pytest.mark.parametrize("variant", [
    "standard_residual", "full_attn_res", "unbounded_decay", "all_kda",
    "all_mla", "qb", "qb_histogram", "extreme", "latent_experts", "sign", "aux", "no_balancing", "smoke", "sign,smoke"])
def test_default_variants_validate(variant):
  validate_config(load_config("default.py", variant))


def test_unknown_variant_names_allowed_ones():
  with pytest.raises(ValueError, match=r"variant 'nope'.*allowed variants.*"
                     r"standard_residual"):
    load_config("default.py", "nope")


@pytest.mark.parametrize("field,value,pattern", [
    ("model.kda.g_min", 0.0, r"model\.kda\.g_min must be in \(-inf, 0.*"
     r"bounded Pallas kernels accept g_min in \[-5\.5, 0\)"),
    ("model.kda.g_min", 1.5, r"model\.kda\.g_min"),
    ("model.moe.top_k", 17, r"model\.moe\.top_k must be in \[1, "
     r"model\.moe\.num_experts=16\]"),
    ("model.kda.num_heads", 5, r"model\.kda\.num_heads=5 must divide "
     r"model\.d_model=64.*allowed values.*\[1, 2, 4, 8, 16, 32, 64\]"),
    ("model.mla.num_heads", 3, r"model\.mla\.num_heads=3 must divide"),
    ("model.residual", "dense", r"model\.residual must be one of "
     r"\['block_attn_res', 'standard'\]"),
    ("model.moe.balancing", "magic", r"model\.moe\.balancing must be one of"),
    ("model.layer_pattern", "KXM", r"model\.layer_pattern"),
    ("model.kda.chunk_size", 48, r"model\.kda\.chunk_size must be one of"),
    ("model.kda.pallas_stages", "cuda", r"model\.kda\.pallas_stages must be "
     r"one of \['auto', 'triton', 'mosaic'\]"),
    ("model.moe.expert_latent_dim", 65, r"model\.moe\.expert_latent_dim must "
     r"be in \[0, 64\]"),
    ("data.source", "web", r"data\.source must be one of \['stdlib', "
     r"'token_file', 'vision'\]"),
    ("train.warmup_steps", 10_000, r"train\.warmup_steps must be in"),
])
def test_bad_values_name_field_and_allowed(field, value, pattern):
  assert_config_error(field, value, pattern, variant=None)


def test_qb_needs_top_k_below_num_experts():
  config = load_config("default.py")
  config.model.moe.top_k = config.model.moe.num_experts
  with pytest.raises(ConfigError, match=r"model\.moe\.top_k must be < "):
    validate_config(config)


def test_mosaic_stages_need_bf16_and_wide_heads():
  config = load_config("default.py")       # float32, head dim 64 / 2 = 32
  config.model.kda.pallas_stages = "mosaic"
  with pytest.raises(ConfigError, match=r"pallas_stages='mosaic' needs "
                     r"model\.dtype='bfloat16'.*head dim 32"):
    validate_config(config)
  config.model.dtype = "bfloat16"
  config.model.kda.num_heads = 1           # head dim 64
  validate_config(config)


@pytest.mark.parametrize("backend", ["pallas", "interpret"])
def test_bounded_kernel_backends_need_g_min_in_kernel_range(backend):
  config = load_config("default.py")
  config.model.kda.backend = backend
  config.model.kda.g_min = -8.0
  with pytest.raises(ConfigError, match=r"model\.kda\.g_min=-8\.0 with "
                     r"model\.kda\.backend=.*accept g_min in \[-5\.5, 0\)"):
    validate_config(config)
  config.model.kda.backend = "auto"  # falls back (and logs), so allowed
  validate_config(config)


def test_kernel_g_min_range_matches_the_ops():
  from moe_jax import config_validation
  from pallas_kernels.linear_attention import ops
  assert config_validation.KERNEL_G_MIN_LOWEST == ops.KERNEL_G_MIN_LOWEST


# ----- resuming with another config -----

# A value for every model field other than the base's (tiny,smoke), with
# base overrides where the field matters only under another setting.
_OTHER_VALUES = {
    "model.vocab_size": (300, {}), "model.d_model": (64, {}),
    "model.num_layers": (3, {}), "model.layer_pattern": ("MK", {}),
    "model.dtype": ("bfloat16", {}), "model.param_dtype": ("bfloat16", {}),
    "model.norm_eps": (1e-5, {}), "model.residual": ("standard", {}),
    "model.attn_res_layers_per_block": (1, {}),
    "model.kda.num_heads": (4, {}), "model.kda.decay": ("unbounded", {}),
    "model.kda.g_min": (-3.0, {}), "model.kda.decay_rank": (4, {}),
    "model.kda.gate_rank": (4, {}), "model.kda.conv_size": (3, {}),
    "model.kda.chunk_size": (32, {}), "model.kda.backend": ("xla", {}),
    "model.kda.pallas_stages": ("triton", {}),
    "model.mla.num_heads": (4, {}), "model.mla.kv_lora_rank": (8, {}),
    "model.mla.q_lora_rank": (8, {}), "model.mla.qk_nope_head_dim": (8, {}),
    "model.mla.qk_rope_head_dim": (4, {}), "model.mla.v_head_dim": (8, {}),
    "model.mla.rope_theta": (500.0, {"model.mla.qk_rope_head_dim": 4}),
    "model.mla.logn_scale_len": (64, {}),
    "model.mla.attention_impl": ("xla", {}),
    "model.moe.num_experts": (4, {}), "model.moe.top_k": (3, {}),
    "model.moe.d_expert": (16, {}), "model.moe.num_shared": (2, {}),
    "model.moe.d_shared": (16, {}), "model.moe.route_scale": (2.0, {}),
    "model.moe.expert_latent_dim": (8, {}),
    "model.moe.first_dense_layers": (1, {}),
    "model.moe.d_dense": (64, {"model.moe.first_dense_layers": 1}),
    "model.moe.dispatch": ("loop", {}), "model.moe.balancing": ("sign", {}),
    "model.moe.grouped_matmul": ("ragged_dot", {}),
    "model.moe.qb_update_every": (2, {"model.moe.qb_estimator": "histogram"}),
    "model.moe.qb_window_steps": (2, {"model.moe.qb_estimator": "histogram",
                                      "model.moe.qb_update_every": 2}),
    "model.remat": ("sublayer", {}),
    "model.vision.encoder": ("linear", {}),
    "model.vision.image_size": (16, {"model.vision.encoder": "linear"}),
    "model.vision.patch_size": (4, {"model.vision.encoder": "linear"}),
    "model.vision.width": (32, {"model.vision.encoder": "linear"}),
    "model.vision.num_layers": (1, {"model.vision.encoder": "vit"}),
    "model.vision.num_heads": (4, {"model.vision.encoder": "vit"}),
    "model.vision.mlp_dim": (64, {"model.vision.encoder": "vit"}),
    "model.moe.qb_ema": (0.5, {}), "model.moe.qb_estimator": (
        "histogram", {}), "model.moe.qb_bins": (64, {}),
    "model.moe.qb_range": (2.0, {}), "model.moe.sign_rate": (1e-2, {}),
    "model.moe.qb_hist_scale": (1e-2, {}),
    "model.moe.aux_loss_coef": (0.1, {}),
    "train.grad_clip": (0.0, {}), "train.weight_decay": (0.0, {}),
}


def _state_shapes(config):
  import jax
  from moe_jax.model import build_model
  from moe_jax.train.optimizer import make_optimizer
  from moe_jax.train.step import abstract_train_state
  state = abstract_train_state(build_model(config), make_optimizer(
      config.train), jax.random.PRNGKey(0), config.data.seq_len)
  return jax.tree_util.tree_structure(state), [
      (x.shape, x.dtype) for x in jax.tree.leaves(state)]


def test_resume_field_classes_match_the_state_shapes():
  """STATE_SHAPE_FIELDS are exactly the model fields that change the state."""
  from moe_jax import config_validation as cv
  from moe_jax.config_validation import _flatten
  base = load_config("default.py", "tiny,smoke")
  fields = {f for f in _flatten(base.to_dict()) if f.startswith("model.")}
  assert fields == {f for f in _OTHER_VALUES if f.startswith("model.")}
  assert cv.STATE_SHAPE_FIELDS <= fields
  assert cv.PLACEMENT_FIELDS <= set(_flatten(base.to_dict()))
  old_shapes = {}  # overrides -> state shapes of the base with them
  for field, (value, overrides) in _OTHER_VALUES.items():
    old = base.copy_and_resolve_references()
    for f, v in overrides.items():
      set_field(old, f, v)
    new = old.copy_and_resolve_references()
    set_field(new, field, value)
    key = tuple(sorted(overrides.items()))
    if key not in old_shapes:
      old_shapes[key] = _state_shapes(old)
    changed = old_shapes[key] != _state_shapes(new)
    assert changed == (field in cv.STATE_SHAPE_FIELDS), field


def test_check_resume_config_refuses_shapes_and_lists_the_rest():
  from moe_jax.config_validation import (ResumeConfigError,
                                         check_resume_config)
  saved = load_config("default.py", "tiny,smoke")
  new = saved.copy_and_resolve_references()
  new.mesh.data, new.model.kda.backend = 1, "xla"        # placement: silent
  assert check_resume_config(saved.to_dict(), new.to_dict()) == []
  new.train.steps, new.data.seq_len = 60, 64            # warned
  assert check_resume_config(saved.to_dict(), new.to_dict()) == [
      "data.seq_len: 32 -> 64", "train.steps: 6 -> 60"]
  with pytest.raises(ResumeConfigError, match="--strict_resume.*\n  "
                     "data.seq_len: 32 -> 64\n  train.steps: 6 -> 60\n"):
    check_resume_config(saved.to_dict(), new.to_dict(), strict=True)
  new.model.d_model, new.model.layer_pattern = 64, "KKM"
  with pytest.raises(ResumeConfigError, match="shapes of the saved state:\n"
                     "  model.d_model: 32 -> 64\n  model.layer_pattern: "
                     "'KM' -> 'KKM'\nUse"):
    check_resume_config(saved.to_dict(), new.to_dict())
