"""The full config schema with defaults, and the variant mechanism.

Config files under configs/ start from `base_config()` and change what they
need; every field that exists is listed here, so a typo in an override fails
loudly (ml_collections rejects unknown keys) and `validate_config` knows every
value it must check. Ground floor: imports nothing of ours.
"""
from __future__ import annotations

import importlib.util
import os
import types
from typing import Callable, Mapping

import ml_collections

# Logical-to-mesh rules (MaxText style). The batch is also split over
# 'expert': outside the MoE the expert axis is one more data-parallel axis
# (the expert all-to-all then moves distinct tokens). Logical names used by
# moe_jax.sharding: batch, sequence, act_embed (activations); vocab, embed,
# heads, mlp, expert (params).
DEFAULT_RULES = (
    ("batch", ("data", "fsdp", "expert")),
    ("sequence", "context"),
    ("act_embed", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("expert", "expert"),
)


def base_config() -> ml_collections.ConfigDict:
  """Every field of a run, with defaults suited to a small CPU model."""
  c = ml_collections.ConfigDict()
  c.seed = 0

  # ----- model -----
  m = c.model = ml_collections.ConfigDict()
  m.vocab_size = 259            # 256 bytes + PAD, BOS, EOS (moe_jax.data)
  m.d_model = 64
  m.num_layers = 4              # transformer layers; each = mixer + FFN sublayer
  m.layer_pattern = "KKKM"      # K = KDA, M = gated MLA; tiled over num_layers
  m.dtype = "float32"           # compute dtype: float32 | bfloat16
  m.param_dtype = "float32"
  m.norm_eps = 1e-6
  m.residual = "block_attn_res"  # block_attn_res | standard
  m.attn_res_layers_per_block = 2  # sublayers per AttnRes block (1 = full AttnRes)
  m.remat = "none"              # none | sublayer | dots | experts (moe_jax.model.REMAT_POLICIES)

  # Vision front end (moe_jax/layers/vision.py); 'none' = text only.
  vis = m.vision = ml_collections.ConfigDict()
  vis.encoder = "none"          # none | linear | vit
  vis.image_size = 32           # S: images are [S, S, 3]
  vis.patch_size = 8            # p, divides S; (S/p)^2 tokens per image
  vis.width = 64                # encoder width
  vis.num_layers = 2            # vit blocks
  vis.num_heads = 2             # vit heads, divide width
  vis.mlp_dim = 128             # vit MLP hidden width

  kda = m.kda = ml_collections.ConfigDict()
  kda.num_heads = 2             # head_dim = d_model // num_heads (K = V)
  kda.decay = "bounded"         # bounded: g = g_min*sigmoid(..); unbounded: -a*softplus(..)
  kda.g_min = -5.0
  kda.decay_rank = 16           # low-rank projection feeding the decay
  kda.gate_rank = 16            # low-rank output gate
  kda.conv_size = 4             # depthwise causal short conv width
  kda.chunk_size = 32
  kda.backend = "auto"          # auto | xla | pallas | interpret
  # auto (the kernel's defaults) | triton | mosaic: the Pallas kernel's state
  # passes and output as Triton or Mosaic GPU (wgmma) kernels; mosaic needs
  # model.dtype bfloat16 and a head dim > 32. Used when KDA runs on Pallas.
  kda.pallas_stages = "auto"

  mla = m.mla = ml_collections.ConfigDict()
  mla.num_heads = 2
  mla.kv_lora_rank = 32
  mla.q_lora_rank = 0           # 0 = full-rank query projection
  mla.qk_nope_head_dim = 32
  mla.qk_rope_head_dim = 0      # 0 = NoPE (the default: KDA layers carry position)
  mla.v_head_dim = 32
  mla.rope_theta = 10000.0
  # > 0: queries at position p (0-based, in the row) scaled by
  # max(1, log(p + 1) / log(L)), L this value (the training length): no
  # change up to L, sharper attention beyond it (length extrapolation). A
  # model trained without it can be evaluated with it. 0 = off.
  mla.logn_scale_len = 0
  # auto | xla | cudnn (jax.nn.dot_product_attention) | pallas | interpret
  # (the flash kernel with segment ids). "auto" on a GPU: cuDNN where it
  # takes the dtype (bf16/fp16) and head width, the flash kernel for packed
  # documents; XLA otherwise and on CPU.
  mla.attention_impl = "auto"

  moe = m.moe = ml_collections.ConfigDict()
  moe.num_experts = 16
  moe.top_k = 2
  moe.d_expert = 64             # hidden width of each routed SwiGLU expert
  moe.num_shared = 1            # shared experts (0 allowed)
  moe.d_shared = 64
  moe.route_scale = 1.0
  moe.expert_latent_dim = 0      # 0 = off; L < d_model = latent experts
  moe.first_dense_layers = 0    # leading layers with a dense SwiGLU instead of the MoE
  moe.d_dense = 128
  moe.dispatch = "ragged"       # ragged (sort + grouped matmul) | loop (reference)
  # auto (Pallas kernels on a GPU, ragged_dot elsewhere) | ragged_dot |
  # pallas | interpret: how the ragged dispatch runs its grouped products.
  moe.grouped_matmul = "auto"
  moe.balancing = "qb"          # qb | sign | aux | none
  moe.qb_ema = 0.0              # b <- ema*b + (1-ema)*b_new
  moe.qb_estimator = "exact"    # exact (top-k over tokens) | histogram (binned, shard-exact)
  moe.qb_bins = 256             # histogram bins, [8, 65536]
  moe.qb_range = 4.0            # histogram window: r in [b_j - qb_range, b_j + qb_range]
  moe.qb_hist_scale = 1e-3      # histogram asinh bins' scale c > 0 (balancing.QB_HIST_SCALE)
  # QB over a time window (histogram only): the bias is updated once every
  # qb_update_every steps from the histograms of the period's last
  # qb_window_steps steps, summed (1, 1: every step from its own batch).
  moe.qb_window_steps = 1       # [1, qb_update_every]
  moe.qb_update_every = 1       # >= 1
  moe.sign_rate = 1e-3          # sign-rule step u
  moe.aux_loss_coef = 1e-2      # Switch-style aux loss coefficient (balancing=aux)

  # ----- data -----
  d = c.data = ml_collections.ConfigDict()
  d.source = "stdlib"           # stdlib | token_file | vision
  d.path = ""                   # token_file: flat binary file of token ids
  d.val_path = ""               # token_file: optional separate validation file
  d.token_dtype = "uint16"      # uint16 | uint32
  d.val_fraction = 0.05
  d.max_bytes = 0               # 0 = the whole corpus
  d.seq_len = 128
  d.batch_size = 16             # global batch, sequences per step
  # concat: windows anywhere, documents unmasked (ablation) | documents:
  # windows from document starts with segment_ids; the model keeps documents
  # apart (stdlib only; any mesh).
  d.packing = "concat"
  # Probability that a training row is a synthetic retrieval document of the
  # row's length instead of a corpus window (moe_jax/data/retrieval.py;
  # stdlib only). 0: the corpus only, batches exactly as without the field.
  d.retrieval_fraction = 0.0
  d.retrieval_kinds = "passkey"  # comma-separated of: passkey, mqar
  # data.source='vision' (moe_jax/data/vision.py): image-text examples.
  dv = d.vision = ml_collections.ConfigDict()
  dv.source = "shapes"          # shapes (generated scenes) | folder
  dv.folder = ""                # folder: images + captions.txt
  dv.question_types = "count,colour,position,larger,digit,caption"
  dv.text_fraction = 0.25       # rows that are text-only corpus windows
  dv.blank_images = False       # True: every image zero (text-only baseline)
  dv.eval_examples = 512        # held-out examples evaluated
  # How colour questions name their object: position ("what colour is the
  # top left object?") | kind ("... the circle?", whose held-out answer is
  # the one colour training never pairs with that kind).
  dv.colour_question = "position"

  # ----- optimisation -----
  t = c.train = ml_collections.ConfigDict()
  t.steps = 300
  t.learning_rate = 3e-3
  t.warmup_steps = 30
  t.schedule = "cosine"         # cosine | wsd | constant
  t.decay_fraction = 0.2        # wsd: fraction of steps spent decaying
  t.min_lr_ratio = 0.1
  t.weight_decay = 0.1
  t.b1 = 0.9
  t.b2 = 0.95
  t.eps = 1e-8
  t.grad_clip = 1.0
  t.microbatches = 1            # grad accumulation passes; divides data.batch_size
  t.log_every = 10
  t.eval_every = 100
  t.eval_batches = 8
  t.checkpoint_every = 100
  t.keep_checkpoints = 2
  t.progress_bar = True

  # ----- context curriculum (moe_jax/curriculum.py) -----
  cu = c.curriculum = ml_collections.ConfigDict()
  # "seq_len:steps[:batch_size],...", seq_len strictly increasing; the steps
  # sum to train.steps. "" = one stage of (data.seq_len, train.steps).
  cu.stages = ""
  cu.constant_tokens = True     # stage batch * seq_len == data.batch_size * data.seq_len
  cu.stage_warmup_steps = 0     # LR ramp at each stage after the first (0 = none)
  # > 0: at each stage's end, loss against position and passkey accuracy up
  # to this many times the stage's seq_len ("long_context" metrics rows).
  cu.stage_end_factor = 0
  cu.stage_end_stages = "every"  # every | last: which stages end with it

  # ----- device mesh (docs/design.md §8; moe_jax.sharding) -----
  me = c.mesh = ml_collections.ConfigDict()
  me.num_devices = -1           # -1 = every device of every process; N =
                                # the first N (one process: a 1-device run
                                # on a many-device host)
  me.data = -1                  # -1 = all devices the other axes leave
  me.fsdp = 1                   # params (and batch) sharded on the 'embed' dim
  me.expert = 1                 # routed experts sharded on their leading dim
  me.context = 1                # sequence chunks
  me.tensor = 1                 # heads / mlp / vocab
  # Logical axis -> mesh axis (str), axes (tuple, major to minor) or None.
  me.rules = DEFAULT_RULES
  return c


VariantFn = Callable[[ml_collections.ConfigDict], None]


def setter(**updates) -> VariantFn:
  """A variant that sets dotted fields: setter(**{"model.residual": "standard"})."""
  def variant(config: ml_collections.ConfigDict) -> None:
    for path, value in updates.items():
      node = config
      *parents, leaf = path.split(".")
      for p in parents:
        node = node[p]
      node[leaf] = value
  return variant


def apply_variant(config: ml_collections.ConfigDict, arg: str | None,
                  variants: Mapping[str, VariantFn]) -> ml_collections.ConfigDict:
  """Applies the named variants in `arg` ("a,b") to `config` in order.

  Raises ValueError naming the allowed variants for an unknown name.
  """
  for name in [a.strip() for a in (arg or "").split(",") if a.strip()]:
    if name not in variants:
      raise ValueError(
          f"config variant {name!r} is unknown; allowed variants: "
          f"{sorted(variants)}")
    variants[name](config)
  return config


def load_config_file(path: str, beside: str | None = None) -> types.ModuleType:
  """The module of a config file (configs/ is a folder, not a package).

  beside: a file whose folder a relative `path` is taken from (a config
  loading its sibling passes its own __file__).
  """
  if beside is not None and not os.path.isabs(path):
    path = os.path.join(os.path.dirname(os.path.abspath(beside)), path)
  name = os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
