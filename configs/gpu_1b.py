"""gpu_1b: about 1B total parameters for one GPU (bf16 compute).

Hybrid 3 KDA : 1 MLA, 12 layers of d_model 1024, 64 routed experts of width
384 (top-8) plus one shared expert of width 1024, Block Attention Residuals
(8 blocks of 3 sublayers), Quantile Balancing. About 1.00B total and 0.21B
active parameters per token. 64K tokens per step: 8 x 8192 by default; the
throughput bench holds the tokens fixed when it changes the length.

Launch on a GPU machine (from the repo root):
  python -m experiments.train --config=configs/gpu_1b.py --workdir=runs/gpu_1b
  python -m experiments.bench_train_step --config=configs/gpu_1b.py \
      --seq_lens=8192,32768 --backends=pallas,xla
On a Hopper GPU the routed experts run on the Mosaic GPU grouped matmul
(TMA + wgmma; model.moe.grouped_matmul=auto); the Triton kernels instead:
  python -m experiments.train --config=configs/gpu_1b.py \
      --config.model.moe.grouped_matmul=pallas --workdir=runs/gpu_1b_triton
Each sublayer keeps only its input for the backward (model.remat="sublayer"):
without it the step's activations need about 133 GiB at 64K tokens.
Variants: standard_residual, no_remat, seq32k.
"""
from moe_jax.config_base import apply_variant, base_config, setter


VARIANTS = {
    "standard_residual": setter(**{"model.residual": "standard"}),
    "no_remat": setter(**{"model.remat": "none"}),
    "seq32k": setter(**{"data.seq_len": 32768, "data.batch_size": 2}),
}


def get_config(arg: str | None = None):
  c = base_config()
  m = c.model
  m.d_model = 1024
  m.num_layers = 12
  m.layer_pattern = "KKKM"
  m.dtype = "bfloat16"
  m.attn_res_layers_per_block = 3
  m.remat = "sublayer"
  m.kda.num_heads = 8            # head dim 128
  m.kda.decay_rank = 64
  m.kda.gate_rank = 64
  m.kda.chunk_size = 64
  m.mla.num_heads = 8
  m.mla.kv_lora_rank = 512
  m.mla.q_lora_rank = 0
  m.mla.qk_nope_head_dim = 128
  m.mla.v_head_dim = 128
  m.moe.num_experts = 64
  m.moe.top_k = 8
  m.moe.d_expert = 384
  m.moe.num_shared = 1
  m.moe.d_shared = 1024
  c.data.seq_len = 8192
  c.data.batch_size = 8
  c.train.steps = 2000
  c.train.learning_rate = 1e-3
  c.train.warmup_steps = 100
  c.train.schedule = "wsd"
  c.train.log_every = 20
  c.train.eval_every = 500
  c.train.eval_batches = 4
  c.train.checkpoint_every = 500
  return apply_variant(c, arg, VARIANTS)
