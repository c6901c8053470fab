"""Validates a run config before anything is built or compiled.

Every error names the field (its dotted path) and the allowed values, so a bad
sweep entry fails in milliseconds with a message a person can act on. Ground
floor: imports only moe_jax.config_error and moe_jax.curriculum (the stage
parser), which import nothing else of ours.
"""
from __future__ import annotations

import json

import ml_collections

from moe_jax.config_error import ConfigError
from moe_jax.curriculum import stages_of

# The g_min values the bounded Pallas kernels accept: [KERNEL_G_MIN_LOWEST, 0)
# (pallas_kernels.linear_attention.ops.KERNEL_G_MIN_LOWEST; a test keeps the
# two equal, so that validation does not have to import the kernels).
KERNEL_G_MIN_LOWEST = -5.5
_KERNEL_G_MIN = (f"the bounded Pallas kernels accept g_min in "
                 f"[{KERNEL_G_MIN_LOWEST}, 0); below that, backend 'auto' runs "
                 "the unbounded kernel and 'xla' the reference")


def _get(config, path: str):
  node = config
  for part in path.split("."):
    node = node[part]
  return node


def _one_of(config, path: str, allowed) -> None:
  value = _get(config, path)
  if value not in allowed:
    raise ConfigError(
        f"{path} must be one of {list(allowed)}, got {value!r}")


def _int_range(config, path: str, lo: int | None = None,
               hi: int | None = None) -> None:
  value = _get(config, path)
  if isinstance(value, bool) or not isinstance(value, int):
    raise ConfigError(f"{path} must be an integer, got {value!r}")
  if (lo is not None and value < lo) or (hi is not None and value > hi):
    raise ConfigError(
        f"{path} must be in [{lo if lo is not None else '-inf'}, "
        f"{hi if hi is not None else 'inf'}], got {value}")


def _float_range(config, path: str, lo: float | None = None,
                 hi: float | None = None, lo_open: bool = False,
                 hi_open: bool = False) -> None:
  value = _get(config, path)
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise ConfigError(f"{path} must be a number, got {value!r}")
  bad_lo = lo is not None and (value <= lo if lo_open else value < lo)
  bad_hi = hi is not None and (value >= hi if hi_open else value > hi)
  if bad_lo or bad_hi:
    left = "(" if lo_open or lo is None else "["
    right = ")" if hi_open or hi is None else "]"
    raise ConfigError(
        f"{path} must be in {left}{lo if lo is not None else '-inf'}, "
        f"{hi if hi is not None else 'inf'}{right}, got {value}")


def _divides(config, divisor_path: str, dividend_path: str) -> None:
  divisor, dividend = _get(config, divisor_path), _get(config, dividend_path)
  if divisor <= 0 or dividend % divisor:
    raise ConfigError(
        f"{divisor_path}={divisor} must divide {dividend_path}={dividend}; "
        f"allowed values: the divisors of {dividend} "
        f"({[n for n in range(1, dividend + 1) if dividend % n == 0]})")


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ConfigError (a ValueError) for the first invalid field."""
  _int_range(config, "seed", 0)

  # Model shape.
  _int_range(config, "model.vocab_size", 2)
  _int_range(config, "model.d_model", 8)
  _int_range(config, "model.num_layers", 1)
  pattern = config.model.layer_pattern
  if not pattern or set(pattern) - {"K", "M"}:
    raise ConfigError(
        "model.layer_pattern must be a non-empty string of 'K' (KDA) and "
        f"'M' (MLA), e.g. 'KKKM', got {pattern!r}")
  _one_of(config, "model.dtype", ("float32", "bfloat16"))
  _one_of(config, "model.param_dtype", ("float32", "bfloat16"))
  _float_range(config, "model.norm_eps", 0.0, 1e-2, lo_open=True)
  _one_of(config, "model.residual", ("block_attn_res", "standard"))
  _int_range(config, "model.attn_res_layers_per_block", 1,
             2 * config.model.num_layers)

  # KDA.
  _int_range(config, "model.kda.num_heads", 1)
  _divides(config, "model.kda.num_heads", "model.d_model")
  _one_of(config, "model.kda.decay", ("bounded", "unbounded"))
  try:
    _float_range(config, "model.kda.g_min", None, 0.0, hi_open=True)
  except ConfigError as e:
    raise ConfigError(f"{e} ({_KERNEL_G_MIN})") from None
  _int_range(config, "model.kda.decay_rank", 1)
  _int_range(config, "model.kda.gate_rank", 1)
  _int_range(config, "model.kda.conv_size", 1, 16)
  _one_of(config, "model.kda.chunk_size", (16, 32, 64, 128))
  _one_of(config, "model.kda.backend", ("auto", "xla", "pallas", "interpret"))
  kda = config.model.kda
  if (kda.decay == "bounded" and kda.backend in ("pallas", "interpret")
      and kda.g_min < KERNEL_G_MIN_LOWEST):
    raise ConfigError(
        f"model.kda.g_min={kda.g_min} with model.kda.backend={kda.backend!r} "
        f"and model.kda.decay='bounded': {_KERNEL_G_MIN}; allowed: g_min in "
        f"[{KERNEL_G_MIN_LOWEST}, 0), or backend 'auto' / 'xla'")
  _one_of(config, "model.kda.pallas_stages", ("auto", "triton", "mosaic"))
  if config.model.kda.pallas_stages == "mosaic":
    head_dim = config.model.d_model // config.model.kda.num_heads
    if config.model.dtype != "bfloat16" or head_dim <= 32:
      raise ConfigError(
          "model.kda.pallas_stages='mosaic' needs model.dtype='bfloat16' and "
          "a KDA head dim (model.d_model / model.kda.num_heads) above 32, got "
          f"model.dtype={config.model.dtype!r} and head dim {head_dim}; use "
          "pallas_stages='triton'")

  # MLA.
  _int_range(config, "model.mla.num_heads", 1)
  _divides(config, "model.mla.num_heads", "model.d_model")
  _int_range(config, "model.mla.kv_lora_rank", 1)
  _int_range(config, "model.mla.q_lora_rank", 0)
  _int_range(config, "model.mla.qk_nope_head_dim", 1)
  _int_range(config, "model.mla.qk_rope_head_dim", 0)
  if config.model.mla.qk_rope_head_dim % 2:
    raise ConfigError(
        "model.mla.qk_rope_head_dim must be even (rotary pairs) or 0 for NoPE, "
        f"got {config.model.mla.qk_rope_head_dim}")
  _int_range(config, "model.mla.v_head_dim", 1)
  _float_range(config, "model.mla.rope_theta", 1.0)
  _int_range(config, "model.mla.logn_scale_len", 0)
  if config.model.mla.get("logn_scale_len", 0) == 1:
    raise ConfigError("model.mla.logn_scale_len must be 0 (off) or >= 2 "
                      "(log(1) = 0 divides), got 1")
  _one_of(config, "model.mla.attention_impl",
          ("auto", "xla", "cudnn", "pallas", "interpret"))
  mla = config.model.mla
  if mla.attention_impl in ("pallas", "interpret"):
    # The flash kernel pads head dims to a power of two and takes up to 256
    # (pallas_kernels/flash_attention.py, MAX_HEAD_WIDTH).
    width = max(mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim)
    if width > 256:
      raise ConfigError(
          f"model.mla.attention_impl={mla.attention_impl!r} needs "
          "max(model.mla.qk_nope_head_dim + model.mla.qk_rope_head_dim, "
          f"model.mla.v_head_dim) <= 256 (the flash kernel's widest tile), "
          f"got {width}; allowed otherwise: attention_impl 'auto', 'xla' or "
          "'cudnn'")

  # MoE and its balancing.
  _int_range(config, "model.moe.num_experts", 1)
  n = config.model.moe.num_experts
  _int_range(config, "model.moe.top_k", 1)
  if config.model.moe.top_k > n:
    raise ConfigError(
        f"model.moe.top_k must be in [1, model.moe.num_experts={n}], got "
        f"{config.model.moe.top_k}")
  if config.model.moe.balancing == "qb" and config.model.moe.top_k >= n:
    raise ConfigError(
        "model.moe.top_k must be < model.moe.num_experts for Quantile "
        f"Balancing (it reads the (k+1)-th score); allowed: [1, {n - 1}], got "
        f"{config.model.moe.top_k}")
  _int_range(config, "model.moe.d_expert", 1)
  _int_range(config, "model.moe.num_shared", 0)
  _int_range(config, "model.moe.d_shared", 1)
  _int_range(config, "model.moe.expert_latent_dim", 0, config.model.d_model)
  _float_range(config, "model.moe.route_scale", 0.0, lo_open=True)
  _int_range(config, "model.moe.first_dense_layers", 0,
             config.model.num_layers)
  _int_range(config, "model.moe.d_dense", 1)
  _one_of(config, "model.remat", ("none", "sublayer", "dots", "experts"))
  _one_of(config, "model.moe.dispatch", ("ragged", "loop"))
  _one_of(config, "model.moe.grouped_matmul",
          ("auto", "ragged_dot", "pallas", "interpret", "mosaic"))
  matmul = config.model.moe.grouped_matmul
  if matmul in ("pallas", "interpret", "mosaic"):
    multiple = 64 if matmul == "mosaic" else 16
    d_in = config.model.moe.expert_latent_dim or config.model.d_model
    for name, dim in (("model.moe.d_expert", config.model.moe.d_expert),
                      ("the expert input width (model.moe.expert_latent_dim "
                       "or model.d_model)", d_in)):
      if dim % multiple:
        raise ConfigError(
            f"model.moe.grouped_matmul={matmul!r} needs {name} a multiple of "
            f"{multiple}, got {dim}; allowed otherwise: "
            "grouped_matmul='ragged_dot' or 'auto'")
  if matmul == "mosaic" and config.model.dtype != "bfloat16":
    raise ConfigError(
        "model.moe.grouped_matmul='mosaic' needs model.dtype='bfloat16' "
        f"(wgmma on float32 is TF32), got {config.model.dtype!r}; allowed "
        "otherwise: grouped_matmul='pallas', 'ragged_dot' or 'auto'")
  _one_of(config, "model.moe.balancing", ("qb", "sign", "aux", "none"))
  _float_range(config, "model.moe.qb_ema", 0.0, 1.0, hi_open=True)
  _one_of(config, "model.moe.qb_estimator", ("exact", "histogram"))
  _int_range(config, "model.moe.qb_bins", 8, 65536)
  _float_range(config, "model.moe.qb_range", 0.0, lo_open=True)
  _float_range(config, "model.moe.qb_hist_scale", 0.0, lo_open=True)
  _int_range(config, "model.moe.qb_update_every", 1)
  every = config.model.moe.qb_update_every
  # A window cannot span two updates: the histogram is binned around the
  # bias in use, and counts binned around different biases do not add up.
  _int_range(config, "model.moe.qb_window_steps", 1)
  if config.model.moe.qb_window_steps > every:
    raise ConfigError(
        "model.moe.qb_window_steps must be in [1, model.moe.qb_update_every="
        f"{every}] (a window cannot span two bias updates), got "
        f"{config.model.moe.qb_window_steps}")
  if every > 1 and (config.model.moe.balancing != "qb"
                    or config.model.moe.qb_estimator != "histogram"):
    raise ConfigError(
        "model.moe.qb_update_every > 1 (and qb_window_steps > 1) needs "
        "model.moe.balancing='qb' with model.moe.qb_estimator='histogram' "
        "(its counts add up exactly over steps), got balancing="
        f"{config.model.moe.balancing!r}, qb_estimator="
        f"{config.model.moe.qb_estimator!r}; allowed otherwise: "
        "qb_update_every=1")
  _float_range(config, "model.moe.sign_rate", 0.0)
  _float_range(config, "model.moe.aux_loss_coef", 0.0)

  # Data.
  _one_of(config, "data.source", ("stdlib", "token_file", "vision"))
  validate_vision_config(config)
  if "rl" in config:
    validate_rl_config(config)
  if config.data.source == "token_file" and not config.data.path:
    raise ConfigError(
        "data.path must name a flat binary file of token ids when "
        "data.source='token_file', got ''")
  _one_of(config, "data.token_dtype", ("uint16", "uint32"))
  _float_range(config, "data.val_fraction", 0.0, 1.0, lo_open=True,
               hi_open=True)
  _int_range(config, "data.max_bytes", 0)
  _int_range(config, "data.seq_len", 2)
  _int_range(config, "data.batch_size", 1)
  validate_packing_config(config)

  # Optimisation.
  _int_range(config, "train.steps", 1)
  _float_range(config, "train.learning_rate", 0.0, 1.0, lo_open=True)
  _int_range(config, "train.warmup_steps", 0, config.train.steps)
  _one_of(config, "train.schedule", ("cosine", "wsd", "constant"))
  _float_range(config, "train.decay_fraction", 0.0, 1.0)
  _float_range(config, "train.min_lr_ratio", 0.0, 1.0)
  _float_range(config, "train.weight_decay", 0.0)
  _float_range(config, "train.b1", 0.0, 1.0, hi_open=True)
  _float_range(config, "train.b2", 0.0, 1.0, hi_open=True)
  _float_range(config, "train.eps", 0.0, lo_open=True)
  _float_range(config, "train.grad_clip", 0.0)
  for field in ("log_every", "eval_every", "eval_batches", "checkpoint_every",
                "keep_checkpoints"):
    _int_range(config, f"train.{field}", 1)
  _int_range(config, "train.microbatches", 1)
  _divides(config, "train.microbatches", "data.batch_size")

  # Context curriculum (its stages against data.* and train.steps).
  _one_of(config, "curriculum.constant_tokens", (True, False))
  stages_of(config)
  validate_retrieval_config(config)

  # Device mesh (sizes against the device count: moe_jax.sharding.make_mesh).
  validate_mesh_config(config)


MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")


# moe_jax.data.vision's names (a test keeps them equal, so that validation
# does not import the data package).
VISION_VOCAB_SIZE = 262
VISION_QUESTION_TYPES = ("count", "colour", "position", "larger", "digit",
                         "caption")


def validate_packing_config(config: ml_collections.ConfigDict) -> None:
  """data.packing: 'documents' needs the stdlib corpus (documents are its
  files); any KDA backend and any mesh (the XLA reference, the Pallas
  kernels and the context-parallel ops all take segment ids)."""
  if "packing" not in config.data:
    return
  _one_of(config, "data.packing", ("concat", "documents"))
  if config.data.packing != "documents":
    return
  if config.data.source != "stdlib":
    raise ConfigError("data.packing='documents' needs data.source='stdlib' "
                      "(its documents are the corpus's files), got "
                      f"{config.data.source!r}")


# moe_jax.data.retrieval's kinds and the shortest data.seq_len of each (a
# test keeps them equal, so that validation does not import the data package).
RETRIEVAL_MIN_SEQ_LEN = {"passkey": 105, "mqar": 5}


def validate_retrieval_config(config: ml_collections.ConfigDict) -> None:
  """data.retrieval_fraction and data.retrieval_kinds, against every
  curriculum stage's length (configs saved without them pass)."""
  if "retrieval_fraction" not in config.data:
    return
  _float_range(config, "data.retrieval_fraction", 0.0, 1.0)
  kinds = config.data.get("retrieval_kinds", "passkey")
  parts = kinds.split(",") if isinstance(kinds, str) else []
  if (not parts or len(set(parts)) != len(parts)
      or any(k not in RETRIEVAL_MIN_SEQ_LEN for k in parts)):
    raise ConfigError(
        "data.retrieval_kinds must be a comma-separated list of distinct kinds "
        f"of {list(RETRIEVAL_MIN_SEQ_LEN)}, got {kinds!r}")
  if config.data.retrieval_fraction == 0:
    return
  if config.data.source != "stdlib":
    raise ConfigError("data.retrieval_fraction > 0 needs data.source='stdlib' "
                      f"(its documents are bytes), got {config.data.source!r}")
  staged = bool(config.curriculum.stages.strip())
  for stage in stages_of(config):
    for kind in parts:
      if stage.seq_len < RETRIEVAL_MIN_SEQ_LEN[kind]:
        where = (f"curriculum.stages[{stage.index}] (seq_len {stage.seq_len})"
                 if staged else f"data.seq_len={stage.seq_len}")
        raise ConfigError(
            f"{where} is too short for a {kind} retrieval document "
            f"(data.retrieval_kinds={kinds!r}); allowed: seq_len >= "
            f"{RETRIEVAL_MIN_SEQ_LEN[kind]} or data.retrieval_fraction=0")


def validate_vision_config(config: ml_collections.ConfigDict) -> None:
  """model.vision and, with data.source='vision', data.vision."""
  if "vision" not in config.model:
    return
  _one_of(config, "model.vision.encoder", ("none", "linear", "vit"))
  vision_data = config.data.source == "vision"
  if config.model.vision.encoder == "none":
    if vision_data:
      raise ConfigError(
          "data.source='vision' needs model.vision.encoder 'linear' or 'vit', "
          "got 'none'")
    return
  for field in ("image_size", "patch_size", "width", "num_layers",
                "num_heads", "mlp_dim"):
    _int_range(config, f"model.vision.{field}", 1)
  _divides(config, "model.vision.patch_size", "model.vision.image_size")
  _divides(config, "model.vision.num_heads", "model.vision.width")
  if config.model.vocab_size < VISION_VOCAB_SIZE:
    raise ConfigError(
        f"model.vocab_size must be >= {VISION_VOCAB_SIZE} (bytes, PAD, BOS, "
        "EOS and the image specials BOI, EOI, IMAGE) with model.vision."
        f"encoder={config.model.vision.encoder!r}, got "
        f"{config.model.vocab_size}")
  if not vision_data:
    return
  cu = config.get("curriculum")
  if cu is not None and (cu.stages.strip() or cu.stage_end_factor):
    raise ConfigError(
        "data.source='vision' trains at one length: curriculum.stages must "
        f"be '' and curriculum.stage_end_factor 0, got {cu.stages!r} and "
        f"{cu.stage_end_factor}")
  _one_of(config, "data.vision.source", ("shapes", "folder"))
  if config.data.vision.source == "folder" and not config.data.vision.folder:
    raise ConfigError("data.vision.folder must name a folder of images with a "
                      "captions.txt when data.vision.source='folder', got ''")
  types = config.data.vision.question_types.split(",")
  if not types or set(types) - set(VISION_QUESTION_TYPES):
    raise ConfigError(
        "data.vision.question_types must be a comma-separated list of "
        f"{list(VISION_QUESTION_TYPES)}, got "
        f"{config.data.vision.question_types!r}")
  if "colour_question" in config.data.vision:  # saved configs may lack it
    _one_of(config, "data.vision.colour_question", ("position", "kind"))
  _float_range(config, "data.vision.text_fraction", 0.0, 1.0, hi_open=True)
  _int_range(config, "data.vision.eval_examples", config.data.batch_size)
  if config.mesh.context != 1:
    raise ConfigError(
        "data.source='vision' needs mesh.context=1 (image batches are split "
        f"over rows only), got {config.mesh.context}")


# moe_jax.rl.envs.KINDS, DIFFICULTIES and moe_jax.rl.grpo.ROUTER_MODES (kept
# equal by a test, so that validation does not import jax).
RL_TASK_KINDS = ("calc", "lookup")
RL_ROUTER_MODES = ("qb", "frozen")
RL_DIFFICULTIES = ("standard", "easy")


def validate_rl_config(config: ml_collections.ConfigDict) -> None:
  """The rl section (configs/rl.py): environments, buffer layout, GRPO."""
  kinds = config.rl.tasks.split(",")
  if not kinds or set(kinds) - set(RL_TASK_KINDS):
    raise ConfigError(
        "rl.tasks must be a comma-separated list of "
        f"{list(RL_TASK_KINDS)}, got {config.rl.tasks!r}")
  for field in ("prompt_len", "obs_len", "turn_tokens", "max_turns", "steps",
                "prompts_per_step", "eval_every", "eval_tasks",
                "eval_samples", "checkpoint_every"):
    _int_range(config, f"rl.{field}", 1)
  _int_range(config, "rl.group_size", 2)
  _int_range(config, "rl.demo_max_wait", 0)
  _int_range(config, "rl.max_len",
             config.rl.prompt_len + config.rl.obs_len + 2)
  _float_range(config, "rl.temperature", 0.0, lo_open=True)
  _float_range(config, "rl.learning_rate", 0.0, lo_open=True)
  _float_range(config, "rl.clip_eps", 0.0, 1.0, lo_open=True, hi_open=True)
  _float_range(config, "rl.kl_beta", 0.0)
  _one_of(config, "rl.router", RL_ROUTER_MODES)
  _one_of(config, "rl.difficulty", RL_DIFFICULTIES)
  if config.data.source != "stdlib":
    raise ConfigError("an rl config trains on its environments; data.source "
                      f"must stay 'stdlib', got {config.data.source!r}")


def validate_mesh_config(config: ml_collections.ConfigDict) -> None:
  """Checks config.mesh without looking at devices.

  Sizes: integers >= 1, and mesh.data may be -1 (all devices the other axes
  leave). Rules: a sequence of (logical name, mesh axes) pairs, logical names
  unique strings, mesh axes None, one of MESH_AXES or a tuple of distinct ones.
  """
  n = config.mesh.get("num_devices", -1)
  if isinstance(n, bool) or not isinstance(n, int) or not (n == -1 or n >= 1):
    raise ConfigError("mesh.num_devices must be -1 (every device) or an "
                      f"integer >= 1, got {n!r}")
  for axis in MESH_AXES:
    path = f"mesh.{axis}"
    value = _get(config, path)
    if axis == "data":
      if isinstance(value, bool) or not isinstance(value, int) or not (
          value == -1 or value >= 1):
        raise ConfigError(
            "mesh.data must be -1 (all devices the other axes leave) or an "
            f"integer >= 1, got {value!r}")
      continue
    _int_range(config, path, 1)
  rules = config.mesh.rules
  if isinstance(rules, (str, bytes)) or not isinstance(rules, (tuple, list)):
    raise ConfigError(
        "mesh.rules must be a sequence of (logical_name, mesh_axes) pairs, "
        f"got {rules!r}")
  seen = set()
  for rule in rules:
    if (not isinstance(rule, (tuple, list)) or len(rule) != 2
        or not isinstance(rule[0], str) or not rule[0]):
      raise ConfigError(
          "mesh.rules entries must be (logical_name: str, mesh_axes) pairs, "
          f"got {rule!r}")
    name, axes = rule
    if name in seen:
      raise ConfigError(f"mesh.rules names logical axis {name!r} twice; "
                        "allowed: each logical name at most once")
    seen.add(name)
    axes = (() if axes is None else
            (axes,) if isinstance(axes, str) else axes)
    if (not isinstance(axes, (tuple, list))
        or any(a not in MESH_AXES for a in axes)
        or len(set(axes)) != len(axes)):
      raise ConfigError(
          f"mesh.rules[{name!r}] must be None, one of {list(MESH_AXES)} or a "
          f"tuple of distinct ones, got {rule[1]!r}")
    if name in ("sequence", "expert") and len(axes) > 1:
      # The context-parallel and expert-parallel layers split over one axis.
      raise ConfigError(
          f"mesh.rules[{name!r}] must be None or one mesh axis (the "
          f"shard_map layers split {name} over one), got {rule[1]!r}")


# ----- resuming a workdir with another config -----

# Fields that change the shapes, dtypes or tree of the saved params and
# state: a checkpoint cannot restore under a config that changes them.
STATE_SHAPE_FIELDS = frozenset({
    "model.vocab_size", "model.d_model", "model.num_layers",
    "model.layer_pattern", "model.param_dtype", "model.residual",
    "model.kda.num_heads", "model.kda.decay_rank", "model.kda.gate_rank",
    "model.kda.conv_size",
    "model.mla.num_heads", "model.mla.kv_lora_rank", "model.mla.q_lora_rank",
    "model.mla.qk_nope_head_dim", "model.mla.qk_rope_head_dim",
    "model.mla.v_head_dim",
    "model.moe.num_experts", "model.moe.d_expert", "model.moe.num_shared",
    "model.moe.d_shared", "model.moe.expert_latent_dim",
    "model.moe.first_dense_layers", "model.moe.d_dense",
    # > 1 adds the QB window's statistics to router_state.
    "model.moe.qb_update_every",
    "model.vision.encoder", "model.vision.image_size",
    "model.vision.patch_size", "model.vision.width",
    "model.vision.num_layers", "model.vision.mlp_dim",
})

# Fields that change only how or where the same state is computed, or what
# is logged: a run moves between a GPU and a CPU, or onto another mesh.
PLACEMENT_FIELDS = frozenset({
    "model.dtype", "model.kda.backend", "model.kda.pallas_stages",
    "model.kda.chunk_size", "model.mla.attention_impl", "model.moe.dispatch",
    "model.moe.grouped_matmul", "model.remat",
    "train.microbatches", "train.log_every", "train.eval_every",
    "train.eval_batches", "train.checkpoint_every", "train.keep_checkpoints",
    "train.progress_bar",
})
PLACEMENT_PREFIXES = ("mesh.",)

# Every other field (schedule, optimizer, data, balancing, ...) may change
# with a warning, or not at all under strict_resume.


class ResumeConfigError(ConfigError):
  """The config differs from the one a workdir's checkpoint was saved with."""


def _flatten(tree, prefix: str = "") -> dict:
  """{dotted path: leaf} of nested dicts; tuples become lists (as in JSON)."""
  out = {}
  for key, value in tree.items():
    path = f"{prefix}{key}"
    if isinstance(value, dict):
      out.update(_flatten(value, path + "."))
    else:
      out[path] = value
  return out


def _as_saved(config_dict: dict) -> dict:
  """A config dict as it reads back from a checkpoint (JSON round trip)."""
  return json.loads(json.dumps(config_dict))


def resume_config_changes(saved: dict, new: dict
                          ) -> tuple[list[str], list[str], list[str]]:
  """The fields that differ between a saved config dict and a new one.

  Args:
    saved: the config dict read back from a checkpoint.
    new: the config dict of this run (`config.to_dict()`).

  Returns:
    (shape, placement, other) lists of "field: old -> new" strings, sorted;
    a field missing on one side reads as <absent>.
  """
  old, cur = _flatten(saved), _flatten(_as_saved(new))
  shape, placement, other = [], [], []
  for path in sorted(set(old) | set(cur)):
    a, b = old.get(path, "<absent>"), cur.get(path, "<absent>")
    if a == b:
      continue
    line = f"{path}: {a!r} -> {b!r}" if (
        isinstance(a, str) or isinstance(b, str)) else f"{path}: {a} -> {b}"
    if path in STATE_SHAPE_FIELDS:
      shape.append(line)
    elif path in PLACEMENT_FIELDS or path.startswith(PLACEMENT_PREFIXES):
      placement.append(line)
    else:
      other.append(line)
  return shape, placement, other


def check_resume_config(saved: dict, new: dict, *, strict: bool = False,
                        where: str = "the checkpoint") -> list[str]:
  """Refuses a resume whose config changes the saved state; lists the rest.

  Args:
    saved: the config dict saved with the checkpoint.
    new: this run's config dict.
    strict: also refuse changes of schedule, optimizer, data and other
      fields that keep the state's shapes (placement fields stay allowed).
    where: names the checkpoint in the messages.

  Returns:
    The "field: old -> new" lines of allowed changes other than placement
    (the caller warns about them).

  Raises:
    ResumeConfigError: a shape field differs, or (strict) any non-placement
      field does; the message lists each with its old and new value.
  """
  shape, _, other = resume_config_changes(saved, new)
  if shape:
    raise ResumeConfigError(
        f"cannot resume {where}: these fields change the shapes of the saved "
        "state:\n  " + "\n  ".join(shape) + "\nUse the saved values or a new "
        "--workdir.")
  if strict and other:
    raise ResumeConfigError(
        f"--strict_resume: the config differs from the one saved with "
        f"{where}:\n  " + "\n  ".join(other) + "\nUse the saved values, "
        "drop --strict_resume to accept the changes, or use a new --workdir.")
  return other
