"""Config files load, variants apply, and bad values fail before compiling."""
import pytest

from conftest import assert_config_error, load_config
from moe_jax.config_validation import ConfigError, validate_config


@pytest.mark.parametrize("name", ["default.py", "gpu_small.py"])
def test_configs_validate(name):
  validate_config(load_config(name))


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
     r"'token_file'\]"),
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
