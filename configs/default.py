"""Default: a tiny hybrid KDA/MLA sparse-MoE model that trains on CPU.

Trains byte-level on the embedded corpus (the Python standard library's own
source) in a few minutes on 2 CPU cores, compile included.

Launch (from the repo root):
  python -m experiments.train --config=configs/default.py --workdir=runs/default
Variants (comma-separated after a colon):
  python -m experiments.train --config=configs/default.py:standard_residual --workdir=runs/std
  python -m experiments.train --config=configs/default.py:unbounded_decay --workdir=runs/unb
  python -m experiments.train --config=configs/default.py:sign --workdir=runs/sign
Context curriculum 256 -> 1K -> 4K (one command runs the ladder; rerun to
resume mid-stage), then the length-extrapolation evaluation:
  python -m experiments.train --config=configs/default.py:curriculum --workdir=runs/curriculum
  python -m experiments.evaluate_long --workdir=runs/curriculum
  python -m experiments.train --config=configs/default.py:curriculum \
      --config.curriculum.stages=256:100,2048:20 --config.train.steps=120 \
      --workdir=runs/curriculum2
Passkey retrieval with and without retrieval documents in the training
data (a tiny model, about 3 minutes each on 2 CPU cores), then its accuracy
at 1x, 2x and 4x the training length of 128:
  python -m experiments.train --config=configs/default.py:tiny,retrieval_demo --workdir=runs/rd
  python -m experiments.train --config=configs/default.py:tiny,retrieval_demo \
      --config.data.retrieval_fraction=0 --workdir=runs/rd0
  python -m experiments.evaluate_long --workdir=runs/rd --tasks=passkey \
      --factors=1,2,4 --samples=16 --batch_size=0
Overrides:
  python -m experiments.train --config=configs/default.py \
      --config.model.moe.num_experts=32 --config.train.steps=500 --workdir=runs/e32
"""
from moe_jax.config_base import apply_variant, base_config, setter


VARIANTS = {
    # Ablations of the architecture.
    "standard_residual": setter(**{"model.residual": "standard"}),
    "full_attn_res": setter(**{"model.attn_res_layers_per_block": 1}),
    "unbounded_decay": setter(**{"model.kda.decay": "unbounded"}),
    "all_kda": setter(**{"model.layer_pattern": "K"}),
    "all_mla": setter(**{"model.layer_pattern": "M"}),
    # Load balancing baselines.
    "qb": setter(**{"model.moe.balancing": "qb"}),
    "qb_histogram": setter(**{"model.moe.balancing": "qb",
                              "model.moe.qb_estimator": "histogram"}),
    "sign": setter(**{"model.moe.balancing": "sign"}),
    "aux": setter(**{"model.moe.balancing": "aux"}),
    "no_balancing": setter(**{"model.moe.balancing": "none"}),
    # Extreme sparsity: 256 routed experts, top-8 (1/32 of experts active).
    "extreme": setter(**{"model.moe.num_experts": 256, "model.moe.top_k": 8,
                         "model.moe.d_expert": 16}),
    "latent_experts": setter(**{"model.moe.expert_latent_dim": 32}),
    # 32 sequences per batch (the load-balancing comparison in
    # results/load_balancing.md: halves the per-batch MaxVio noise floor).
    "batch32": setter(**{"data.batch_size": 32}),
    # The context curriculum 256 -> 1K -> 4K, 4096 tokens per step
    # (batches 16, 4, 1); the LR ramps up again over 10 steps per stage;
    # each stage ends with loss against position and passkey up to 4x.
    # A tenth of the rows are passkey documents (a needle in corpus text),
    # the skill whose length extrapolation the stage ends measure.
    "curriculum": setter(**{"data.seq_len": 256, "data.batch_size": 16,
                            "data.retrieval_fraction": 0.1,
                            "curriculum.stages": "256:120,1024:40,4096:20",
                            "curriculum.stage_warmup_steps": 10,
                            "curriculum.stage_end_factor": 4,
                            "train.steps": 180, "train.eval_every": 60,
                            "train.checkpoint_every": 60,
                            "train.keep_checkpoints": 4}),
    # Passkey retrieval learnt from data.retrieval_fraction, on CPU: with
    # `tiny`, 600 steps of 16 x 128 tokens, half the rows passkey documents
    # (the module docstring's commands; results/long_context.md).
    "retrieval_demo": setter(**{"data.seq_len": 128, "data.batch_size": 16,
                                "data.retrieval_fraction": 0.5,
                                "train.steps": 600, "train.eval_every": 300,
                                "train.checkpoint_every": 600,
                                "train.progress_bar": False}),
    # Smaller and shorter, for tests and notebooks.
    "tiny": setter(**{"model.d_model": 32, "model.num_layers": 2,
                      "model.layer_pattern": "KM", "model.kda.chunk_size": 16,
                      "model.kda.decay_rank": 8, "model.kda.gate_rank": 8,
                      "model.mla.kv_lora_rank": 16,
                      "model.mla.qk_nope_head_dim": 16,
                      "model.mla.v_head_dim": 16, "model.moe.num_experts": 8,
                      "model.moe.d_expert": 32, "model.moe.d_shared": 32}),
    "smoke": setter(**{"train.steps": 6, "train.warmup_steps": 2,
                     "train.log_every": 2, "train.eval_every": 3,
                     "train.checkpoint_every": 3, "train.eval_batches": 2,
                     "data.seq_len": 32, "data.batch_size": 4,
                     "data.max_bytes": 400_000, "train.progress_bar": False}),
}


def get_config(arg: str | None = None):
  """Default config; `arg` names variants to apply, e.g. 'sign,smoke'."""
  return apply_variant(base_config(), arg, VARIANTS)
