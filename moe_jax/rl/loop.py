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
     params. Evaluation (held-out tasks and unseen train-distribution
     tasks) every rl.eval_every steps and at the end.
Metrics go to <workdir>/metrics.jsonl (and TensorBoard) with split "warmup",
"rl", "heldout" or "train_tasks" (unseen tasks of the train distribution).

Resuming: a workdir whose warm-up finished skips it (restored from
<workdir>/warmup). The RL phase saves (params, optimizer state, router
state, RL step) every rl.checkpoint_every steps in <workdir>/rl, with the
RL rng and the warm-up's evaluations in the checkpoint's data item; a rerun
restores the newest good one and continues, drawing the same rollouts as an
uninterrupted run (rollout rng of step s: fold_in(rl rng, s)). Rows an
interrupted run wrote past that checkpoint are dropped from metrics.jsonl.
"""
from __future__ import annotations

import functools
import json
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging

from moe_jax.config_validation import check_resume_config, validate_config
from moe_jax.model import build_model
from moe_jax.rl import envs, grpo, rollout
from moe_jax.train.checkpoint import Checkpointer, abstract_like
from moe_jax.train.metrics import MetricsWriter
from moe_jax.train.optimizer import make_optimizer, make_schedule
from moe_jax.train.step import TrainState, init_train_state, make_train_step


class RLWorkdirError(ValueError):
  """The workdir's RL checkpoints do not match its warm-up; the message says
  what to do."""


def layout_of(rl_cfg) -> rollout.Layout:
  return rollout.Layout(prompt_len=rl_cfg.prompt_len, max_len=rl_cfg.max_len,
                        obs_len=rl_cfg.obs_len,
                        turn_tokens=rl_cfg.turn_tokens,
                        max_turns=rl_cfg.max_turns,
                        temperature=rl_cfg.temperature)


def task_kinds(rl_cfg) -> tuple[str, ...]:
  return tuple(k.strip() for k in rl_cfg.tasks.split(","))


def make_tasks(config, split: str, start: int, n: int) -> list[envs.Task]:
  """Tasks start .. start + n - 1 of a split, at config.rl's kinds and
  difficulty."""
  kinds = task_kinds(config.rl)
  return [envs.make_task(config.seed, split, i, kinds, config.rl.difficulty)
          for i in range(start, start + n)]


def rl_optimizer(config) -> optax.GradientTransformation:
  """AdamW of config.train but at rl.learning_rate, constant, no warmup."""
  tcfg = ml_collections.ConfigDict(config.train.to_dict())
  tcfg.learning_rate = config.rl.learning_rate
  tcfg.schedule, tcfg.warmup_steps = "constant", 0
  return make_optimizer(tcfg)


def rl_steps(model, config) -> tuple[Callable, Callable]:
  """(grpo_step, log_probs), jitted, for config's optimizer and GRPO fields.

  Cached on the model and those fields, so that runs in one process (a
  resumed run, tests) share the compiled programs.
  """
  rl_cfg = config.rl
  text = lambda c: json.dumps(c.to_dict(), sort_keys=True)
  return _rl_steps(model, text(config.train), text(config.model.moe),
                   rl_cfg.learning_rate, rl_cfg.clip_eps, rl_cfg.kl_beta,
                   rl_cfg.router)


@functools.lru_cache(maxsize=4)
def _rl_steps(model, train_json, moe_json, learning_rate, clip_eps, kl_beta,
              router) -> tuple[Callable, Callable]:
  config = ml_collections.ConfigDict({
      "train": json.loads(train_json), "rl": {"learning_rate": learning_rate}})
  moe_cfg = ml_collections.ConfigDict(json.loads(moe_json))
  grpo_step = jax.jit(grpo.make_grpo_step(
      model, rl_optimizer(config), moe_cfg, clip_eps=clip_eps,
      kl_beta=kl_beta, router=router))
  return grpo_step, jax.jit(grpo.make_log_prob_fn(model))


def evaluate_tasks(model, params, router_state, tasks, rng, layout,
                   samples: int) -> dict:
  """pass@1 (mean reward over `samples` rollouts per task), best-of-N (a
  task counts when any of its N rollouts is right), mean length; pass@1 of
  each task kind as pass_at_1/<kind> and best_of_N/<kind>."""
  group = [t for t in tasks for _ in range(samples)]
  r = rollout.rollout(model, params, router_state, group, rng, layout)
  rewards = r.rewards.reshape(len(tasks), samples)
  out = {"pass_at_1": float(rewards.mean()),
         f"best_of_{samples}": float(rewards.max(axis=1).mean()),
         "length": float(r.lengths.mean())}
  for kind in sorted({t.kind for t in tasks}):
    rows = [i for i, t in enumerate(tasks) if t.kind == kind]
    out[f"pass_at_1/{kind}"] = float(rewards[rows].mean())
    out[f"best_of_{samples}/{kind}"] = float(rewards[rows].max(axis=1).mean())
  return out


def _save(ckpt: Checkpointer, step: int, state, config,
          data: dict | None = None) -> None:
  ckpt.save(step, state, dict(data or {}, step=int(step)), config.to_dict())


def _check_config(where: str, config) -> Callable:
  """check_config for Checkpointer.restore_latest: refuses shape changes,
  logs the other changes."""
  def check(step, saved):
    changed = check_resume_config(saved, config.to_dict(),
                                  where=f"step {step} in {where}")
    if changed:
      logging.warning("Resuming with a config that differs from step %d's: "
                      "%s", step, "; ".join(changed))
  return check


def placed(tree):
  """tree committed to the first device, fresh or restored alike.

  Restored arrays come back committed to a device and fresh ones do not;
  jit compiles a program once for each, so the loop puts both in one place.
  """
  return jax.device_put(tree, jax.devices()[0])


def warmup(config, model, workdir: str, writer: MetricsWriter,
           rng: jax.Array, must_restore: bool = False) -> TrainState:
  """The supervised warm-up's final state, trained or restored.

  must_restore: RL checkpoints continue this workdir's warm-up, so it is
  restored or RLWorkdirError raised (it is never retrained over).
  """
  layout, bsz = layout_of(config.rl), config.data.batch_size
  tx = make_optimizer(config.train)
  init = lambda r: init_train_state(model, tx, r, layout.max_len - 1)
  ckpt = Checkpointer(os.path.join(workdir, "warmup"), keep=1)
  try:
    saved = ckpt.latest_step()
    if must_restore and saved != config.train.steps:
      raise RLWorkdirError(
          f"{workdir}/rl continues the warm-up in {workdir}/warmup, which "
          f"holds step {saved}; this config's train.steps is "
          f"{config.train.steps}: use the saved value or a new --workdir")
    if saved == config.train.steps:
      state, _, _ = ckpt.restore(config.train.steps, jax.eval_shape(init, rng))
      logging.info("Warm-up restored from step %d", config.train.steps)
      return placed(state)
    state = placed(init(rng))
    sft_step = jax.jit(make_train_step(model, tx, config.model.moe,
                                       make_schedule(config.train)))
    demo_rng = np.random.default_rng(config.seed)
    for step in range(config.train.steps):
      batch = rollout.demo_batch(make_tasks(config, "train", step * bsz, bsz),
                                 layout, demo_rng, config.rl.demo_max_wait)
      state, metrics = sft_step(state, batch)
      if (step + 1) % config.train.log_every == 0 or \
          step + 1 == config.train.steps:
        writer.write(step + 1, jax.device_get(metrics), split="warmup")
    _save(ckpt, config.train.steps, state, config)
    return state
  finally:
    ckpt.close()


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Warm-up then GRPO in workdir, resuming what a previous run left; returns
  the last evaluations of each phase: held-out ("warmup", "rl") and on
  unseen tasks of the train distribution ("warmup_train", "rl_train")."""
  validate_config(config)
  rl_cfg, moe_cfg = config.rl, config.model.moe
  layout = layout_of(rl_cfg)
  model = build_model(config)
  writer = MetricsWriter(workdir, enabled=jax.process_index() == 0)
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(config.to_dict(), f, indent=2, sort_keys=True)
  rng = jax.random.PRNGKey(config.seed)
  heldout = make_tasks(config, "heldout", 0, rl_cfg.eval_tasks)
  # Unseen tasks of the train distribution (GRPO draws from 10**6 on).
  train_eval = make_tasks(config, "train", 2 * 10**6, rl_cfg.eval_tasks)
  eval_rng = jax.random.fold_in(rng, 1)
  evaluate = lambda state, tasks: evaluate_tasks(
      model, state.params, state.router_state, tasks, eval_rng, layout,
      rl_cfg.eval_samples)

  rl_dir = os.path.join(workdir, "rl")
  rl_ckpt = Checkpointer(rl_dir, keep=2)
  try:
    warm = warmup(config, model, workdir, writer, rng,
                  must_restore=rl_ckpt.latest_step() is not None)
    # GRPO from the warm-up params; they stay as the KL reference.
    tx = rl_optimizer(config)
    ref_params = warm.params
    state = placed(TrainState(step=jnp.zeros((), jnp.int32),
                              params=warm.params,
                              opt_state=tx.init(warm.params),
                              router_state=warm.router_state))
    restored = rl_ckpt.restore_latest(abstract_like(state),
                                      _check_config(rl_dir, config))
    if restored is not None:
      start, state, data, _ = restored
      state = placed(state)
      rl_rng = jnp.asarray(data["rng"], jnp.uint32)
      results = data["results"]
      writer.drop_rows_after(start, splits=("rl", "heldout", "train_tasks"))
      logging.info("RL resumed from step %d in %s", start, rl_dir)
    else:
      start, rl_rng, results = 0, jax.random.fold_in(rng, 2), {}
      results["warmup"] = evaluate(warm, heldout)
      writer.write(0, results["warmup"], split="heldout")
      results["warmup_train"] = evaluate(warm, train_eval)
      writer.write(0, results["warmup_train"], split="train_tasks")
      logging.info("Warm-up held-out: %s; train tasks: %s",
                   results["warmup"], results["warmup_train"])
    ckpt_data = lambda: {"rng": [int(x) for x in np.asarray(rl_rng)],
                         "results": results}

    grpo_step, log_probs = rl_steps(model, config)
    g, p = rl_cfg.group_size, rl_cfg.prompts_per_step
    for step in range(start, rl_cfg.steps):
      t0 = time.time()
      tasks = make_tasks(config, "train", 10**6 + step * p, p)
      r = rollout.rollout(model, state.params, state.router_state,
                          [t for t in tasks for _ in range(g)],
                          jax.random.fold_in(rl_rng, step), layout)
      batch = r.train_batch()
      batch["advantages"] = grpo.group_advantages(
          r.rewards.reshape(p, g)).reshape(-1)
      batch["old_log_probs"] = log_probs(state.params, state.router_state,
                                         batch)
      batch["ref_log_probs"] = log_probs(ref_params, state.router_state,
                                         batch)
      state, metrics = grpo_step(state, batch)
      metrics = dict(jax.device_get(metrics), reward=float(r.rewards.mean()),
                     success_rate=float((r.rewards == 1.0).mean()),
                     length=float(r.lengths.mean()),
                     turns=float(r.turns.mean()), step_time=time.time() - t0)
      writer.write(step + 1, metrics, split="rl")
      if (step + 1) % rl_cfg.eval_every == 0 or step + 1 == rl_cfg.steps:
        results["rl"] = evaluate(state, heldout)
        writer.write(step + 1, results["rl"], split="heldout")
        results["rl_train"] = evaluate(state, train_eval)
        writer.write(step + 1, results["rl_train"], split="train_tasks")
        logging.info("RL step %d held-out: %s; train tasks: %s", step + 1,
                     results["rl"], results["rl_train"])
      if (step + 1) % rl_cfg.checkpoint_every == 0 or \
          step + 1 == rl_cfg.steps:
        _save(rl_ckpt, step + 1, state, config, ckpt_data())
  finally:
    rl_ckpt.close()
    writer.close()
  return results
