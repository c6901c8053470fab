"""The training loop, top to bottom: config -> data -> model -> steps.

train_and_evaluate(config, workdir) validates the config, builds the data
pipeline, model and optimizer, resumes from the newest checkpoint in workdir
that verifies and restores (after comparing its config with this one),
trains the stages of the context curriculum in order (moe_jax/curriculum.py;
one stage without one), evaluates periodically and at each stage's end,
checkpoints periodically, at each stage's end, on SIGTERM and at the end,
and returns the last metrics.

Each stage continues from the previous one's state (params, optimizer,
router_state, step); only the jitted step and the batches change shape. The
training batches are a pure function of the global step, so a stage
continues the data stream where the previous one stopped, and a resumed
ladder finds its stage from the restored step.
"""
from __future__ import annotations

import json
import math
import os
import signal
import time
from typing import Any, Callable, NamedTuple

import jax
import ml_collections
import numpy as np
import tqdm
from absl import logging

from moe_jax import sharding
from moe_jax.config_validation import (ConfigError, check_resume_config,
                                       validate_config)
from moe_jax.curriculum import (Stage, stage_end_eval_due, stages_of,
                                warmup_restarts)
from moe_jax.data import (TokenBatcher, eval_batches, make_datasets,
                          unigram_bits_per_byte)
from moe_jax.data.pipeline import batcher_kwargs, packing_kwargs
from moe_jax.data.vision import VisionData
from moe_jax.eval import long_context
from moe_jax.eval.evaluate import evaluate
from moe_jax.eval.step import make_eval_step
from moe_jax.eval.vision import answer_accuracy, make_answer_step
from moe_jax.model import build_model
from moe_jax.train.checkpoint import Checkpointer, with_shardings
from moe_jax.train.metrics import MetricsWriter
from moe_jax.train.optimizer import make_optimizer, make_schedule
from moe_jax.train.step import (abstract_train_state, init_train_state,
                                make_train_step, train_state_shardings)


# Exit status of a run stopped by SIGTERM after saving: EX_TEMPFAIL of
# sysexits.h, "temporary failure, rerun" (a finished run exits 0).
EXIT_PREEMPTED = 75


class NonFiniteError(FloatingPointError):
  """Loss or gradients became NaN/inf; the message names the last checkpoint."""


class WorkdirError(NotADirectoryError):
  """--workdir exists and is not a directory."""


def _check_workdir(workdir: str) -> None:
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise WorkdirError(
        f"workdir {workdir!r} is a file; give a directory (it is created if "
        "missing)")


def _non_finite_error(loss: float, step: int,
                      ckpt: Checkpointer) -> NonFiniteError:
  """The error for a non-finite loss or grad norm at `step`."""
  last = ckpt.latest_step()
  kept = (f"the last checkpoint is step {last} in {ckpt.directory}; a rerun "
          "resumes from it" if last is not None else
          f"no checkpoint was written yet in {ckpt.directory}")
  return NonFiniteError(
      f"non-finite loss ({loss}) or grad norm at step {step}; {kept}")


def _restore(ckpt: Checkpointer, abstract_state, config, strict: bool):
  """Restores the newest good checkpoint into abstract_state's layout.

  Its saved config is compared with `config` first (ResumeConfigError for
  changed shapes, or any non-placement change when `strict`); allowed
  changes are logged. Returns (state, data iterator step), or None for an
  empty workdir.
  """
  new = config.to_dict()

  def check(step, saved):
    changed = check_resume_config(saved, new, strict=strict,
                                  where=f"step {step} in {ckpt.directory}")
    if changed:
      logging.warning("Resuming with a config that differs from step %d's "
                      "(--strict_resume refuses this): %s", step,
                      "; ".join(changed))

  try:
    restored = ckpt.restore_latest(abstract_state, check_config=check)
  except BaseException:
    ckpt.close()  # Stops orbax's threads; they would log at exit otherwise.
    raise
  if restored is None:
    return None
  step, state, data_state, _ = restored
  logging.info("Resumed from step %d in %s", step, ckpt.directory)
  return state, int(np.asarray(data_state["step"]))


def _write_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  """This run's config as JSON in the workdir, instead of in the log."""
  path = os.path.join(workdir, "config.json")
  with open(path + ".tmp", "w") as f:
    json.dump(config.to_dict(), f, indent=2, sort_keys=True)
  os.replace(path + ".tmp", path)
  logging.info("Config written to %s", path)


class _SigtermFlag:
  """Turns SIGTERM into a flag the loop checks between steps."""

  def __init__(self):
    self.raised = False
    self._old = None

  def __enter__(self):
    try:
      self._old = signal.signal(signal.SIGTERM, self._handle)
    except ValueError:  # Not the main thread (e.g. a notebook worker).
      self._old = None
    return self

  def _handle(self, signum, frame):  # pylint: disable=unused-argument
    self.raised = True

  def __exit__(self, *exc):
    if self._old is not None:
      signal.signal(signal.SIGTERM, self._old)


class TrainSetup(NamedTuple):
  """What a run's jitted train step is built from (`build_train_step`)."""
  mesh: Any
  model: Any
  tx: Any
  rng: jax.Array
  abstract_state: Any      # TrainState of ShapeDtypeStructs
  state_shardings: Any     # TrainState of NamedShardings
  batch_sharding: Any
  train_step: Callable     # (state, batch) -> (state, metrics); donates state


def build_train_step(config: ml_collections.ConfigDict,
                     stage: Stage | None = None) -> TrainSetup:
  """The mesh, model, optimizer, state layout and jitted train step of a
  (validated) config: what `train_and_evaluate` runs, and what
  experiments/bench_train_step.py times.

  stage: the curriculum stage whose batches [batch_size, seq_len] the step
  takes (default data.batch_size, data.seq_len); the state's layout and the
  learning-rate schedule (over the whole ladder) do not depend on it.
  One mesh over all devices of all processes (docs/design.md §8); on one
  device every sharding is trivial and the step is the unsharded one.
  """
  seq_len, batch_size = ((stage.seq_len, stage.batch_size) if stage else
                         (config.data.seq_len, config.data.batch_size))
  mesh = sharding.make_mesh(config.mesh)
  rules = config.mesh.rules
  model = build_model(config)
  schedule = make_schedule(config.train, *warmup_restarts(config))
  tx = make_optimizer(config.train, schedule)
  rng = jax.random.PRNGKey(config.seed)
  abstract_state = abstract_train_state(model, tx, rng, seq_len)
  state_sh = train_state_shardings(abstract_state, tx, mesh, rules)
  batch_sh = sharding.batch_sharding(mesh, rules, (batch_size, seq_len))
  train_step = sharding.jit_in_mesh(
      make_train_step(model, tx, config.model.moe, schedule,
                      microbatches=config.train.microbatches), mesh,
      in_shardings=(state_sh, batch_sh),
      out_shardings=(state_sh, sharding.replicated(mesh)),
      donate_argnums=(0,))
  return TrainSetup(mesh, model, tx, rng, abstract_state, state_sh, batch_sh,
                    train_step)


def _check_stages_fit(config, stages: list[Stage], train_tokens, val_tokens,
                      process: dict) -> None:
  """Every stage's training windows, one eval batch and its stage-end
  evaluation fit the splits; checked before anything compiles, not when the
  stage is reached."""
  factor = config.curriculum.stage_end_factor
  for stage in stages:
    where = (f"curriculum.stages[{stage.index}] (seq_len {stage.seq_len}, "
             f"batch {stage.batch_size})" if config.curriculum.stages.strip()
             else f"data.seq_len={stage.seq_len}")
    try:
      TokenBatcher(train_tokens, stage.seq_len, stage.batch_size, config.seed,
                   **process, **batcher_kwargs(config.data))
      eval_batches(val_tokens, stage.seq_len, stage.batch_size,
                   max_batches=1, **process)
    except ValueError as e:
      raise ConfigError(f"{where}: {e}") from None
    need = factor * stage.seq_len + config.train.eval_batches
    if factor and val_tokens.shape[0] < need:
      raise ConfigError(
          f"{where}: curriculum.stage_end_factor={factor} needs "
          f"{config.train.eval_batches} (train.eval_batches) held-out windows"
          f" of {factor * stage.seq_len + 1} tokens, the validation split has "
          f"{val_tokens.shape[0]}; lower the factor or use more data")


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       stop_at_step: int | None = None,
                       strict_resume: bool = False) -> dict:
  """Trains config.train.steps steps (or up to stop_at_step) in workdir.

  The steps run as the stages of config.curriculum (moe_jax/curriculum.py):
  each stage's batches have its seq_len and batch size; its train rows,
  eval rows and checkpoints' data state carry "stage" and "seq_len"; its
  last step is evaluated (at its seq_len) and checkpointed.

  Args:
    config: the run's config (validated here).
    workdir: checkpoints, metrics.jsonl, config.json and tensorboard/ go
      here; a workdir with checkpoints is resumed.
    stop_at_step: stop (after saving) at this step, keeping the schedule of
      config.train.steps.
    strict_resume: refuse to resume with any change of the config other
      than placement fields (config_validation.PLACEMENT_FIELDS); without
      it only fields that change the state's shapes are refused.

  Returns:
    The metrics of the last train log and the last evaluation, with "step"
    (the step the run stopped at), "train_step" / "eval_step" (the steps
    those metrics are from) and "preempted" (stopped by SIGTERM before the
    last step; the CLI exits with EXIT_PREEMPTED).
  """
  validate_config(config)
  stages = stages_of(config)
  _check_workdir(workdir)
  tcfg, mcfg = config.train, config.model
  is_chief = jax.process_index() == 0
  process = dict(process_index=jax.process_index(),
                 process_count=jax.process_count())

  # Data: deterministic and resumable (state = the step counter).
  vision = None
  if config.data.source == "vision":   # one stage (config_validation)
    vision = VisionData(config.data, mcfg.vision.image_size,
                        mcfg.vision.patch_size, config.seed,
                        jax.process_index(), jax.process_count())
    unigram_bpb = vision.unigram_bpb()
  else:
    _, val_tokens, train_tokens, vocab = make_datasets(
        dict(config.data.to_dict(), seed=config.seed), **process)
    if vocab > mcfg.vocab_size:
      raise ValueError(f"model.vocab_size={mcfg.vocab_size} is smaller than "
                       f"the data's vocabulary ({vocab}); allowed: >= {vocab}")
    unigram_bpb = unigram_bits_per_byte(train_tokens, val_tokens, vocab)
    _check_stages_fit(config, stages, train_tokens, val_tokens, process)

  # The state's layout is the same in every stage; the first stage's setup
  # restores or initialises it.
  setup = build_train_step(config, stages[0])
  mesh, model, tx, rng = setup.mesh, setup.model, setup.tx, setup.rng
  state_sh = setup.state_shardings
  logging.info("Mesh %s on %d devices, %d processes", dict(mesh.shape),
               mesh.size, jax.process_count())
  rep = sharding.replicated(mesh)

  ckpt = Checkpointer(workdir, keep=tcfg.keep_checkpoints)
  # Restored straight into this run's shardings, whatever mesh saved it
  # (no init first: at scale the state would not fit twice).
  restored = _restore(ckpt, with_shardings(setup.abstract_state, state_sh),
                      config, strict_resume)
  if restored is None:
    state = init_train_state(model, tx, rng, stages[0].seq_len,
                             shardings=state_sh)
    data_step = 0
  else:
    state, data_step = restored
  start = int(state.step)

  writer = MetricsWriter(workdir, enabled=is_chief)
  # Rows a killed run wrote past the restored step are written again below
  # (a fresh start rewrites everything, the meta row included).
  dropped = writer.drop_rows_after(start if start else -1)
  if dropped:
    logging.info("Dropped %d rows of %s past step %d", dropped, writer.path,
                 start)
  if is_chief:
    _write_config(config, workdir)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
  if start == 0:
    writer.write(0, {"num_params": n_params, "unigram_bpb": unigram_bpb,
                     "stages": [s._asdict() for s in stages]}, split="meta")
  last_step = min(tcfg.steps, stop_at_step or tcfg.steps)
  result: dict = {"unigram_bpb": unigram_bpb, "num_params": n_params}

  def run_eval(step, stage: Stage, eval_step, global_batch, answer_step):
    def batches(examples=None):
      if vision is None:
        local = eval_batches(
            val_tokens, stage.seq_len, stage.batch_size,
            max_batches=tcfg.eval_batches, **process,
            document_start_token=packing_kwargs(config.data).get(
                "document_start_token"))
      else:
        local = vision.eval_batches(tcfg.eval_batches, **process,
                                    examples=examples)
      return map(global_batch, local)
    ev = evaluate(eval_step, state.params, state.router_state, batches())
    if vision is not None:  # answer accuracy per question type
      ev.update(answer_accuracy(answer_step, state.params,
                                state.router_state, batches()))
      ev.update(answer_accuracy(answer_step, state.params,
                                state.router_state,
                                batches(vision.seen_examples()),
                                prefix="acc_seen"))
    loads = ev.pop("_loads")
    ev["unigram_bpb"] = unigram_bpb
    ev["val_bpb_over_unigram"] = ev["val_bpb"] / unigram_bpb
    ev.update(stage=stage.index, seq_len=stage.seq_len)
    writer.write(step, ev, split="eval")
    writer.write(step, {f"load/{layer}": [float(x) for x in load]
                        for layer, load in loads.items()}, split="load")
    for layer, load in loads.items():
      writer.write_histogram(step, f"expert_load/{layer}", load)
    return ev

  def run_stage_end_eval(step, stage: Stage):
    """Length extrapolation of the stage's final state (one process)."""
    if jax.process_count() > 1:
      logging.warning("curriculum.stage_end_factor: skipped on %d processes",
                      jax.process_count())
      return
    # One sequence per forward: at factor x the longest stage a batch of
    # them would not fit where the training batch does.
    scorer = long_context.batched(long_context.make_scorer(
        model, state.params, state.router_state), 1)
    metrics = long_context.stage_end_metrics(
        scorer, val_tokens, stage.seq_len, config.curriculum.stage_end_factor,
        tcfg.eval_batches, config.seed)
    writer.write(step, dict(metrics, stage=stage.index,
                            seq_len=stage.seq_len), split="long_context")

  bar = tqdm.tqdm(total=last_step, initial=start, disable=not (
      is_chief and tcfg.progress_bar), desc="train", dynamic_ncols=True)
  # Steps are dispatched without waiting for them: the host prepares the
  # next batch while the device runs. Their metrics stay on the device until
  # a log, eval or checkpoint step fetches them all (`fetch_pending`), which
  # is also where non-finite steps are caught: before any checkpoint.
  pending: list[tuple[int, dict]] = []
  train_time, steps_timed = 0.0, 0   # since the last train log
  t_mark = time.perf_counter()       # eval and saves are not train time

  def fetch_pending() -> dict:
    """Waits for the pending steps; checks them in order; router rows."""
    nonlocal train_time
    host = jax.device_get([m for _, m in pending])
    train_time += time.perf_counter() - t_mark
    for (s, _), m in zip(pending, host):
      loss = float(m["loss"])
      if not (math.isfinite(loss) and math.isfinite(float(m["grad_norm"]))):
        raise _non_finite_error(loss, s, ckpt)
      # Router balance at every step (MaxVio_batch per layer).
      writer.write(s, {k: v for k, v in m.items()
                       if k.startswith("maxvio/")}, split="router")
    pending.clear()
    return host[-1]

  with _SigtermFlag() as sigterm:
    step = start
    for stage in stages:
      stop = min(stage.end, last_step)
      if step >= stop:
        continue
      # New shapes: the step, the batches and the eval step of this stage.
      if stage.index:
        setup = build_train_step(config, stage)
      logging.info("Stage %d: seq_len %d, batch %d, steps %d..%d",
                   stage.index, stage.seq_len, stage.batch_size, step + 1,
                   stage.end)
      train_step, batch_sh = setup.train_step, setup.batch_sharding
      # Per-row leaves (the question types of vision eval batches) by rows.
      row_sh = jax.sharding.NamedSharding(
          mesh, jax.sharding.PartitionSpec(*batch_sh.spec[:1]))
      eval_sh = batch_sh if vision is None else {
          "inputs": batch_sh, "targets": batch_sh, "loss_mask": batch_sh,
          "images": batch_sh, "qtype": row_sh}
      eval_step = sharding.jit_in_mesh(
          make_eval_step(model), mesh,
          in_shardings=(state_sh.params, state_sh.router_state, eval_sh),
          out_shardings=rep)
      answer_step = sharding.jit_in_mesh(
          make_answer_step(model), mesh,
          in_shardings=(state_sh.params, state_sh.router_state, eval_sh),
          out_shardings=rep) if vision is not None else None

      def global_batch(local: dict, batch_sh=batch_sh, row_sh=row_sh,
                       stage=stage) -> dict:
        out = {}
        for key, x in local.items():
          out.update(sharding.shard_batch(
              {key: x}, row_sh if np.ndim(x) == 1 else batch_sh,
              stage.batch_size))
        return out

      train_iter = (vision.train if vision is not None else
                    TokenBatcher(train_tokens, stage.seq_len,
                                 stage.batch_size, config.seed, **process,
                                 **batcher_kwargs(config.data)))
      train_iter.set_state({"step": data_step})
      stage_rows = {"stage": stage.index, "seq_len": stage.seq_len}
      while step < stop:
        batch = global_batch(next(train_iter))
        state, metrics = train_step(state, batch)
        step += 1
        steps_timed += 1
        pending.append((step, metrics))
        bar.update(1)
        log_now = step % tcfg.log_every == 0 or step == stop
        eval_now = step % tcfg.eval_every == 0 or step == stop
        save_now = (step % tcfg.checkpoint_every == 0 or step == stop
                    or sigterm.raised)
        if not (log_now or eval_now or save_now):
          continue
        metrics = fetch_pending()
        if log_now:
          metrics["tokens_per_sec"] = (steps_timed * stage.tokens_per_step
                                       / train_time)
          train_time, steps_timed = 0.0, 0
          metrics.update(stage_rows)
          writer.write(step, metrics)
          bar.set_postfix(loss=f"{float(metrics['loss']):.3f}")
          result.update({k: float(v) for k, v in metrics.items()})
        if eval_now:
          result.update(run_eval(step, stage, eval_step, global_batch,
                                  answer_step))
        if step == stage.end and stage_end_eval_due(config, stages, stage):
          run_stage_end_eval(step, stage)
        if save_now:
          ckpt.save(step, state, dict(train_iter.get_state(), **stage_rows),
                    config.to_dict())
        t_mark = time.perf_counter()
        if sigterm.raised:
          logging.warning("SIGTERM: saved step %d and stopped", step)
          break
      data_step = train_iter.get_state()["step"]
      if sigterm.raised:
        break
  bar.close()
  ckpt.close()
  writer.close()
  result["step"] = int(state.step)
  result["preempted"] = sigterm.raised and result["step"] < last_step
  result["train_step"] = writer.last_step.get("train")
  result["eval_step"] = writer.last_step.get("eval")
  return result
