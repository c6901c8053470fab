r"""trillion: the full-scale model, about 1.0T total / 36B active parameters.

For planning (experiments/plan.py) and for a multi-host launch; nothing here
fits one machine. Shape (docs/design.md §1, §5, §9):
  - 88 layers, d_model 7168, hybrid 3 KDA : 1 MLA ("KKKM": 66 KDA, 22 MLA).
  - KDA: 56 heads of K = V = 128, chunk 64, bounded decay (g_min = -5),
    rank-128 decay and output-gate projections.
  - Gated MLA, NoPE: 64 heads, q_lora_rank 1536, kv_lora_rank 512,
    qk_nope_head_dim = v_head_dim = 128 (the DeepSeek-V3 / Kimi K2 latent
    sizes; no rotary part: the KDA layers carry position).
  - MoE in layers 1..87 (layer 0 is a dense SwiGLU of width 18432): 896
    routed SwiGLU experts of width 2048, top-8 (1/112 of the experts per
    token), plus 1 shared expert of width 2048, sigmoid router balanced by
    Quantile Balancing (histogram estimator: exact under any data sharding).
  - Latent experts: tokens are projected 7168 -> 2048 before the routed
    experts and back after. Why: 896 experts of width 2048 acting on
    d_model = 7168 would be ~3.5T parameters at this depth; in the 2048-wide
    latent they are 11.3B per layer (~0.99T in all), and the expert
    all-to-all payload shrinks 3.5x. The router and shared expert see the
    full 7168-wide token.
  - Block Attention Residuals over 176 sublayers in 8 blocks of 22.
  - bf16 compute, fp32 parameters (the optimizer's master weights).
  - Vocabulary 163840 (a BPE tokenizer's ids in a uint32 token file).
  - Context 1M (the last stage of the 8K -> 64K -> 256K -> 1M curriculum),
    16 sequences (16.8M tokens) per step.

Plan on 2048 GPUs (256 hosts of 8): mesh data=1, fsdp=1, expert=16,
context=128, tensor=1. Each device holds 8192 tokens of one sequence; the 16
sequences of a step spread over the expert axis (which is also a batch axis
outside the MoE), each sequence over 128 context devices. Parameters and
optimizer state are sharded ZeRO-3 style over fsdp x context (dense) and
expert x fsdp x context (experts):
  python -m experiments.plan --config=configs/trillion.py \
      --mesh=data=1,fsdp=1,expert=16,context=128,tensor=1 \
      --fsdp_axes=fsdp,context --seq_len=1048576 --micro_batch=1
At 1M the step is compute-bound (MLA attention is 84% of the forward FLOPs;
~41 s of compute at 40% of peak vs ~15 s of communication). The 8K first stage
on the same machines (2048 sequences of 8K, the same 16.8M tokens per step)
wants a wide expert axis and FSDP inside a node instead, so expert weights are
gathered over NVLink only (~6 s compute vs ~4 s communication; with
expert=16, fsdp=128 the expert gathers cross the network and take ~13 s):
  python -m experiments.plan --config=configs/trillion.py:short_context \
      --mesh=data=2,expert=128,fsdp=8,context=1,tensor=1

Launch (from the repo root; --config.data.path names your tokenised corpus,
a flat uint32 file of token ids):
  python -m experiments.train --config=configs/trillion.py \
      --config.data.path=/data/corpus.u32 --workdir=runs/trillion
Every host of a multi-host job runs that same command under JAX's
multi-controller runtime; the mesh (above) is chosen by the planner and set by
the sharding code. Variants:
  short_context       data.seq_len 8192, 2048 sequences per step (the same
                      16.8M tokens): the curriculum's first stage.
  curriculum          the whole ladder 8K -> 64K -> 256K -> 1M in one run
                      (16.8M tokens per step in every stage; the mesh of
                      each stage is the one above for its length).
  full_width_experts  no latent projection: 896 experts of width 576 acting
                      on the 7168-wide token (0.99T total, 33B active).
"""
from moe_jax.config_base import apply_variant, base_config, setter


VARIANTS = {
    "short_context": setter(**{"data.seq_len": 8192,
                               "data.batch_size": 2048}),
    # The full context curriculum 8K -> 64K -> 256K -> 1M at 16.8M tokens
    # per step (2048, 256, 64 and 16 sequences); the 1M stage is the
    # default config's 2000 steps.
    "curriculum": setter(**{
        "data.seq_len": 8192, "data.batch_size": 2048,
        "curriculum.stages": "8192:20000,65536:4000,262144:2000,1048576:2000",
        "curriculum.stage_warmup_steps": 100, "train.steps": 28000,
        "train.warmup_steps": 2000}),
    "full_width_experts": setter(**{"model.moe.expert_latent_dim": 0,
                                    "model.moe.d_expert": 576}),
}


def get_config(arg: str | None = None):
  """The full-scale config; `arg` names variants (see VARIANTS)."""
  c = base_config()
  m = c.model
  m.vocab_size = 163840
  m.d_model = 7168
  m.num_layers = 88
  m.layer_pattern = "KKKM"
  m.dtype = "bfloat16"
  m.param_dtype = "float32"
  m.residual = "block_attn_res"
  m.attn_res_layers_per_block = 22   # 176 sublayers -> 8 blocks

  m.kda.num_heads = 56                # head dim 128
  m.kda.decay = "bounded"
  m.kda.g_min = -5.0
  m.kda.decay_rank = 128
  m.kda.gate_rank = 128
  m.kda.conv_size = 4
  m.kda.chunk_size = 64
  m.kda.backend = "auto"

  m.mla.num_heads = 64
  m.mla.q_lora_rank = 1536
  m.mla.kv_lora_rank = 512
  m.mla.qk_nope_head_dim = 128
  m.mla.qk_rope_head_dim = 0
  m.mla.v_head_dim = 128

  e = m.moe
  e.num_experts = 896
  e.top_k = 8
  e.d_expert = 2048
  e.expert_latent_dim = 2048
  e.num_shared = 1
  e.d_shared = 2048
  e.route_scale = 2.5                 # sigmoid weights of 8 of 896 are small
  e.first_dense_layers = 1
  e.d_dense = 18432
  e.dispatch = "ragged"
  e.balancing = "qb"
  e.qb_estimator = "histogram"
  e.qb_bins = 1024
  e.qb_ema = 0.0

  d = c.data
  d.source = "token_file"
  d.path = "data/corpus.u32"          # override: --config.data.path=...
  d.token_dtype = "uint32"
  d.seq_len = 1048576
  d.batch_size = 16                    # 16.8M tokens per step

  t = c.train
  t.steps = 2000                       # the 1M stage of the curriculum
  t.learning_rate = 2e-4
  t.warmup_steps = 0                   # continues from the 256K stage
  t.schedule = "wsd"
  t.min_lr_ratio = 0.1
  t.weight_decay = 0.1
  t.b1 = 0.9
  t.b2 = 0.95
  t.grad_clip = 1.0
  t.log_every = 1
  t.eval_every = 250
  t.eval_batches = 4
  t.checkpoint_every = 100
  t.keep_checkpoints = 3
  t.progress_bar = False
  return apply_variant(c, arg, VARIANTS)
