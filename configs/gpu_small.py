"""gpu_small: about 100M total parameters for one GPU (bf16 compute).

Hybrid 3 KDA : 1 MLA, 8 layers of d_model 512, 64 routed experts of width 96
(top-4; about 98M total, 27M active parameters) plus
one shared expert, Block Attention Residuals, Quantile Balancing.

Launch on a GPU machine (from the repo root):
  python -m experiments.train --config=configs/gpu_small.py --workdir=runs/gpu_small
Variants: standard_residual, unbounded_decay, sign, aux, no_balancing, extreme,
short, curriculum, ladder_short.
  python -m experiments.train --config=configs/gpu_small.py:sign --workdir=runs/gs_sign
The context curriculum 4K -> 16K -> 64K -> 256K (rerun to resume mid-stage),
its contrasts (RoPE in MLA, unbounded decay), and the length-extrapolation
evaluation of the final stage up to 4x (1M; the embedded corpus's validation
split holds about 1.2M tokens):
  python -m experiments.train --config=configs/gpu_small.py:curriculum --workdir=runs/gs_ladder
  python -m experiments.train --config=configs/gpu_small.py:curriculum,unbounded_decay --workdir=runs/gs_ladder_unb
  python -m experiments.train --config=configs/gpu_small.py:curriculum \
      --config.model.mla.qk_rope_head_dim=64 --workdir=runs/gs_ladder_rope
  python -m experiments.evaluate_long --workdir=runs/gs_ladder --factors=1,2,4
The shortened ladder (2K -> 8K -> 32K, about 8 minutes on an H100):
  python -m experiments.train --config=configs/gpu_small.py:ladder_short --workdir=runs/gs_short
"""
from moe_jax.config_base import apply_variant, base_config, setter


VARIANTS = {
    "standard_residual": setter(**{"model.residual": "standard"}),
    "unbounded_decay": setter(**{"model.kda.decay": "unbounded"}),
    "sign": setter(**{"model.moe.balancing": "sign"}),
    "aux": setter(**{"model.moe.balancing": "aux"}),
    "no_balancing": setter(**{"model.moe.balancing": "none"}),
    # Extreme sparsity: 256 routed experts of width 32, top-8 (~124M total).
    "extreme": setter(**{"model.moe.num_experts": 256, "model.moe.top_k": 8,
                         "model.moe.d_expert": 32}),
    # The one-GPU context curriculum 4K -> 16K -> 64K -> 256K at 256K tokens
    # per step (batches 64, 16, 4, 1); each stage ends with loss against
    # position and passkey accuracy up to 4x its length. A tenth of the rows
    # are passkey documents (needle at a uniform depth in corpus text):
    # about 12.8K at 4K, 800 at 16K, 80 at 64K, 10 at 256K, so the skill is
    # learnt at the first stage and kept at each longer one, for 10% of the
    # corpus tokens.
    "curriculum": setter(**{
        "data.seq_len": 4096, "data.batch_size": 64,
        "data.retrieval_fraction": 0.1,
        "curriculum.stages": "4096:2000,16384:500,65536:200,262144:100",
        "curriculum.stage_warmup_steps": 50, "curriculum.stage_end_factor": 4,
        "model.mla.logn_scale_len": 262144,
        "train.steps": 2800,
        "train.eval_every": 250, "train.checkpoint_every": 500,
        "train.keep_checkpoints": 8}),  # every stage's end is kept
    # The same ladder shortened to fit one 10-minute call on an H100:
    # 2K -> 8K -> 32K at 64K tokens per step (batches 32, 8, 2; 1200, 300
    # and 100 steps), a quarter of the rows passkey documents (about 9.6K
    # at 2K, 600 at 8K, 50 at 32K), passkey accuracy up to 4x the last
    # stage's length (128K) at its end only. Moving steps from the first
    # stage to the long ones (800, 500, 300) lost retrieval altogether: no
    # whole key at any length, 4 of 5 digits right (results/long_context.md).
    # About 470k tokens/s at 2K and 370k at 32K on an H100.
    # In both ladders MLA scales its queries by log-n past the last stage's
    # length (no change inside it): 0.80 passkey accuracy at 4x against 0.28
    # without (results/long_context.md).
    "ladder_short": setter(**{
        "data.seq_len": 2048, "data.batch_size": 32,
        "data.retrieval_fraction": 0.25,
        "curriculum.stages": "2048:1200,8192:300,32768:100",
        "curriculum.stage_warmup_steps": 30, "curriculum.stage_end_factor": 4,
        "curriculum.stage_end_stages": "last",
        "model.mla.logn_scale_len": 32768,
        "train.steps": 1600, "train.warmup_steps": 100,
        "train.eval_every": 800, "train.eval_batches": 4,
        "train.checkpoint_every": 1600, "train.progress_bar": False}),
    "short": setter(**{"train.steps": 200, "train.warmup_steps": 20,
                     "train.eval_every": 100, "train.checkpoint_every": 100}),
}


def get_config(arg: str | None = None):
  c = base_config()
  m = c.model
  m.d_model = 512
  m.num_layers = 8
  m.layer_pattern = "KKKM"
  m.dtype = "bfloat16"
  m.attn_res_layers_per_block = 2
  m.kda.num_heads = 4            # head dim 128
  m.kda.decay_rank = 64
  m.kda.gate_rank = 64
  m.kda.chunk_size = 64
  m.mla.num_heads = 8
  m.mla.kv_lora_rank = 256
  m.mla.q_lora_rank = 0
  m.mla.qk_nope_head_dim = 64
  m.mla.v_head_dim = 64
  m.moe.num_experts = 64
  m.moe.top_k = 4
  m.moe.d_expert = 96
  m.moe.num_shared = 1
  m.moe.d_shared = 1024
  c.data.seq_len = 1024
  c.data.batch_size = 32
  c.train.steps = 5000
  c.train.learning_rate = 1.5e-3
  c.train.warmup_steps = 200
  c.train.schedule = "wsd"
  c.train.log_every = 20
  c.train.eval_every = 500
  c.train.eval_batches = 16
  c.train.checkpoint_every = 500
  return apply_variant(c, arg, VARIANTS)
