"""The RL run, top to bottom: warm-up on demonstrations, then GRPO.

run(config, workdir):
  1. Supervised warm-up: train.steps steps of the supervised train step
     (moe_jax/train/step.py) on the environments' worked solutions in the
     rollout layout (rollout.demo_batch), the loss masked to the model's own
     tokens. Checkpointed in <workdir>/warmup.
  2. Held-out evaluation of the warm-up model: pass@1 and best-of-N over
     rl.eval_samples sampled rollouts per held-out task.
  3. rl.steps GRPO steps: rl.prompts_per_step train tasks x rl.group_size
     rollouts, group-normalised advantages, one update per batch (so the
     ratio's old policy is the sampling one), the k3 KL to the frozen warm-up
     params. Checkpointed in <workdir>/rl; held-out evaluation every
     rl.eval_every steps and at the end.
Metrics go to <workdir>/metrics.jsonl (and TensorBoard) with split "warmup",
"rl" or "heldout". A workdir whose warm-up finished skips it (restored from
its checkpoint); an RL phase is not resumed mid-way.
"""
from __future__ import annotations

import json
import os
import time

import jax
import ml_collections
import numpy as np
import optax
from absl import logging

from moe_jax.config_validation import validate_config
from moe_jax.model import build_model
from moe_jax.rl import envs, grpo, rollout
from moe_jax.train.checkpoint import Checkpointer, abstract_like
from moe_jax.train.metrics import MetricsWriter
from moe_jax.train.optimizer import make_optimizer, make_schedule
from moe_jax.train.step import TrainState, init_train_state, make_train_step


class RLWorkdirError(ValueError):
  """The workdir holds an RL phase already; the message says what to do."""


def layout_of(rl_cfg) -> rollout.Layout:
  return rollout.Layout(prompt_len=rl_cfg.prompt_len, max_len=rl_cfg.max_len,
                        obs_len=rl_cfg.obs_len,
                        turn_tokens=rl_cfg.turn_tokens,
                        max_turns=rl_cfg.max_turns,
                        temperature=rl_cfg.temperature)


def task_kinds(rl_cfg) -> tuple[str, ...]:
  return tuple(k.strip() for k in rl_cfg.tasks.split(","))


def rl_optimizer(config) -> optax.GradientTransformation:
  """AdamW of config.train but at rl.learning_rate, constant, no warmup."""
  tcfg = ml_collections.ConfigDict(config.train.to_dict())
  tcfg.learning_rate = config.rl.learning_rate
  tcfg.schedule, tcfg.warmup_steps = "constant", 0
  return make_optimizer(tcfg)


def evaluate_tasks(model, params, router_state, tasks, rng, layout,
                   samples: int) -> dict:
  """pass@1 (mean reward over `samples` rollouts per task), best-of-N (a
  task counts when any of its N rollouts is right), mean length."""
  group = [t for t in tasks for _ in range(samples)]
  r = rollout.rollout(model, params, router_state, group, rng, layout)
  rewards = r.rewards.reshape(len(tasks), samples)
  return {"pass_at_1": float(rewards.mean()),
          f"best_of_{samples}": float(rewards.max(axis=1).mean()),
          "length": float(r.lengths.mean())}


def _checkpoint(ckpt: Checkpointer, step: int, state, config) -> None:
  ckpt.save(step, state, {"step": int(step)}, config.to_dict())


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Warm-up then GRPO in workdir; returns the last held-out evaluation
  of each phase ({"warmup": {...}, "rl": {...}})."""
  validate_config(config)
  rl_cfg, moe_cfg = config.rl, config.model.moe
  layout, kinds = layout_of(rl_cfg), task_kinds(rl_cfg)
  model = build_model(config)
  writer = MetricsWriter(workdir, enabled=jax.process_index() == 0)
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(config.to_dict(), f, indent=2, sort_keys=True)
  rng = jax.random.PRNGKey(config.seed)
  heldout = [envs.make_task(config.seed, "heldout", i, kinds)
             for i in range(rl_cfg.eval_tasks)]

  rl_ckpt = Checkpointer(os.path.join(workdir, "rl"), keep=2)
  if rl_ckpt.latest_step() is not None:
    raise RLWorkdirError(
        f"{workdir}/rl holds RL checkpoints (step {rl_ckpt.latest_step()}); "
        "an RL phase is not resumed: use a new --workdir (a finished "
        "warm-up can be reused by copying <workdir>/warmup)")

  # 1. Warm-up on demonstrations.
  tx = make_optimizer(config.train)
  state = init_train_state(model, tx, rng, layout.max_len - 1)
  warm_ckpt = Checkpointer(os.path.join(workdir, "warmup"), keep=1)
  if warm_ckpt.latest_step() == config.train.steps:
    state, _, _ = warm_ckpt.restore(config.train.steps, abstract_like(state))
    logging.info("Warm-up restored from step %d", config.train.steps)
  else:
    sft_step = jax.jit(make_train_step(model, tx, moe_cfg,
                                       make_schedule(config.train)))
    demo_rng = np.random.default_rng(config.seed)
    bsz = config.data.batch_size
    for step in range(config.train.steps):
      tasks = [envs.make_task(config.seed, "train", step * bsz + i, kinds)
               for i in range(bsz)]
      batch = rollout.demo_batch(tasks, layout, demo_rng,
                                 rl_cfg.demo_max_wait)
      state, metrics = sft_step(state, batch)
      if (step + 1) % config.train.log_every == 0 or \
          step + 1 == config.train.steps:
        writer.write(step + 1, jax.device_get(metrics), split="warmup")
    _checkpoint(warm_ckpt, config.train.steps, state, config)
  warm_ckpt.close()

  results = {}
  eval_rng = jax.random.fold_in(rng, 1)
  results["warmup"] = evaluate_tasks(model, state.params, state.router_state,
                                     heldout, eval_rng, layout,
                                     rl_cfg.eval_samples)
  writer.write(0, results["warmup"], split="heldout")
  logging.info("Warm-up held-out: %s", results["warmup"])

  # 2. GRPO from the warm-up params; they stay as the KL reference.
  tx = rl_optimizer(config)
  ref_params = state.params
  state = TrainState(step=jax.numpy.zeros((), jax.numpy.int32),
                     params=state.params, opt_state=tx.init(state.params),
                     router_state=state.router_state)
  grpo_step = jax.jit(grpo.make_grpo_step(
      model, tx, moe_cfg, clip_eps=rl_cfg.clip_eps, kl_beta=rl_cfg.kl_beta,
      router=rl_cfg.router))
  log_probs = jax.jit(grpo.make_log_prob_fn(model))
  g, p = rl_cfg.group_size, rl_cfg.prompts_per_step
  rl_rng = jax.random.fold_in(rng, 2)
  for step in range(rl_cfg.steps):
    t0 = time.time()
    tasks = [envs.make_task(config.seed, "train", 10**6 + step * p + i, kinds)
             for i in range(p)]
    r = rollout.rollout(model, state.params, state.router_state,
                        [t for t in tasks for _ in range(g)],
                        jax.random.fold_in(rl_rng, step), layout)
    batch = r.train_batch()
    batch["advantages"] = grpo.group_advantages(
        r.rewards.reshape(p, g)).reshape(-1)
    batch["old_log_probs"] = log_probs(state.params, state.router_state, batch)
    batch["ref_log_probs"] = log_probs(ref_params, state.router_state, batch)
    state, metrics = grpo_step(state, batch)
    metrics = dict(jax.device_get(metrics), reward=float(r.rewards.mean()),
                   success_rate=float((r.rewards == 1.0).mean()),
                   length=float(r.lengths.mean()),
                   turns=float(r.turns.mean()), step_time=time.time() - t0)
    writer.write(step + 1, metrics, split="rl")
    if (step + 1) % rl_cfg.eval_every == 0 or step + 1 == rl_cfg.steps:
      results["rl"] = evaluate_tasks(model, state.params, state.router_state,
                                     heldout, eval_rng, layout,
                                     rl_cfg.eval_samples)
      writer.write(step + 1, results["rl"], split="heldout")
      logging.info("RL step %d held-out: %s", step + 1, results["rl"])
    if (step + 1) % rl_cfg.checkpoint_every == 0 or step + 1 == rl_cfg.steps:
      _checkpoint(rl_ckpt, step + 1, state, config)
  rl_ckpt.close()
  writer.close()
  return results
