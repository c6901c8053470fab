"""Agentic RL post-training: supervised warm-up on tool-use demonstrations,
then GRPO on the tool environments (moe_jax/rl, docs/design.md "Agentic RL").

The warm-up uses the train.* fields (train.steps steps of data.batch_size
demonstrations); RL uses the rl.* fields. The model is the tiny hybrid of
configs/default.py at d_model 64.

Launch (from the repo root):
  python -m experiments.rl --config=configs/rl.py --workdir=runs/rl
Variants:
  python -m experiments.rl --config=configs/rl.py:tiny --workdir=runs/rl_tiny
  python -m experiments.rl --config=configs/rl.py:frozen_router --workdir=runs/rl_frozen
The CPU run of results/rl.md (easy tasks, a two-layer model; ~25 min on
2 cores):
  python -m experiments.rl --config=configs/rl.py:easy,cpu --workdir=runs/rl_easy
An interrupted run resumes from <workdir>/rl's newest checkpoint when rerun
with the same command.
Overrides:
  python -m experiments.rl --config=configs/rl.py --config.rl.group_size=16 \
      --config.rl.steps=200 --workdir=runs/rl_g16
"""
import ml_collections

from moe_jax.config_base import apply_variant, base_config, setter


def rl_fields() -> ml_collections.ConfigDict:
  """The rl section: environments, buffer layout, GRPO, evaluation."""
  r = ml_collections.ConfigDict()
  r.tasks = "calc,lookup"       # comma-separated moe_jax.rl.envs.KINDS
  r.difficulty = "standard"     # standard | easy (moe_jax.rl.envs)
  r.prompt_len = 96             # prompt block, tokens (BOS included)
  r.max_len = 320               # whole trajectory buffer, tokens
  r.obs_len = 32                # one tool output block, tokens
  r.turn_tokens = 32            # most tokens per model turn
  r.max_turns = 5               # most model turns per trajectory
  r.temperature = 1.0           # rollout sampling temperature
  r.steps = 100                 # GRPO steps
  r.prompts_per_step = 4        # distinct tasks per step
  r.group_size = 8              # G rollouts per task
  r.learning_rate = 3e-4        # constant, AdamW with train.* betas and decay
  r.clip_eps = 0.2              # clip(rho, 1 - e, 1 + e)
  r.kl_beta = 0.02              # weight of the k3 KL to the warm-up model
  r.router = "qb"               # qb (bias keeps updating) | frozen
  r.demo_max_wait = 4           # warm-up: 0..n PADs before a tool output
  r.eval_every = 25             # RL steps between held-out evaluations
  r.eval_tasks = 32             # held-out tasks per evaluation
  r.eval_samples = 4            # N: pass@1 over N samples and best-of-N
  r.checkpoint_every = 50
  return r


VARIANTS = {
    "frozen_router": setter(**{"rl.router": "frozen"}),
    "calc_only": setter(**{"rl.tasks": "calc"}),
    "lookup_only": setter(**{"rl.tasks": "lookup"}),
    # One-call tasks with short prompts and a buffer to match: a warm-up
    # that fits a CPU reaches a pass@1 between 0 and 1, so GRPO has signal.
    "easy": setter(**{
        "rl.difficulty": "easy", "rl.prompt_len": 20, "rl.obs_len": 20,
        "rl.turn_tokens": 24, "rl.max_turns": 2, "rl.max_len": 96}),
    # The model and schedule of the CPU run (results/rl.md): two layers
    # (KDA, MLA), four experts; a warm-up that leaves the easy tasks' train
    # pass@1 between 0 and 1.
    "cpu": setter(**{
        "model.num_layers": 2, "model.layer_pattern": "KM",
        "model.moe.num_experts": 4, "train.steps": 250,
        "train.log_every": 50, "train.progress_bar": False,
        "rl.steps": 400, "rl.prompts_per_step": 8, "rl.eval_every": 50,
        "rl.eval_tasks": 64, "rl.eval_samples": 8,
        "rl.checkpoint_every": 50}),
    # Small and short, for tests and a CPU smoke run (turns too short to
    # finish a task: it exercises the machinery, it does not learn).
    "tiny": setter(**{
        "model.d_model": 32, "model.num_layers": 2, "model.layer_pattern": "KM",
        "model.kda.chunk_size": 16, "model.kda.decay_rank": 8,
        "model.kda.gate_rank": 8, "model.mla.kv_lora_rank": 16,
        "model.mla.qk_nope_head_dim": 16, "model.mla.v_head_dim": 16,
        "model.moe.num_experts": 8, "model.moe.d_expert": 32,
        "model.moe.d_shared": 32, "train.steps": 2, "train.warmup_steps": 1,
        "train.progress_bar": False, "data.batch_size": 4,
        "rl.max_len": 160, "rl.turn_tokens": 8, "rl.max_turns": 2,
        "rl.steps": 2, "rl.prompts_per_step": 2, "rl.group_size": 2,
        "rl.eval_every": 2, "rl.eval_tasks": 2, "rl.eval_samples": 2,
        "rl.checkpoint_every": 2}),
}


def get_config(arg: str | None = None):
  """RL config; `arg` names variants to apply, e.g. 'tiny,frozen_router'."""
  c = base_config()
  c.rl = rl_fields()
  c.train.steps = 300            # warm-up steps
  c.train.learning_rate = 3e-3
  c.data.batch_size = 16
  return apply_variant(c, arg, VARIANTS)
