"""The training loop, top to bottom: config -> data -> model -> steps.

train_and_evaluate(config, workdir) validates the config, builds the data
pipeline, model and optimizer, resumes from the latest checkpoint in workdir
if there is one, trains, evaluates periodically, checkpoints periodically, on
SIGTERM and at the end, and returns the last metrics.
"""
from __future__ import annotations

import math
import signal
import time

import jax
import ml_collections
import numpy as np
import tqdm
from absl import logging

from moe_jax import sharding
from moe_jax.config_validation import validate_config
from moe_jax.data import eval_batches, make_datasets, unigram_bits_per_byte
from moe_jax.eval.evaluate import evaluate
from moe_jax.eval.step import make_eval_step
from moe_jax.model import build_model
from moe_jax.train.checkpoint import Checkpointer, with_shardings
from moe_jax.train.metrics import MetricsWriter
from moe_jax.train.optimizer import make_optimizer, make_schedule
from moe_jax.train.step import (abstract_train_state, init_train_state,
                                make_train_step, train_state_shardings)


class NonFiniteError(FloatingPointError):
  """Loss or gradients became NaN/inf; the last good checkpoint is kept."""


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


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       stop_at_step: int | None = None) -> dict:
  """Trains config.train.steps steps (or up to stop_at_step) in workdir.

  Returns the metrics of the last train log and the last evaluation.
  """
  validate_config(config)
  tcfg, mcfg = config.train, config.model
  is_chief = jax.process_index() == 0

  # Data: deterministic and resumable (state = the step counter).
  train_iter, val_tokens, train_tokens, vocab = make_datasets(
      dict(config.data.to_dict(), seed=config.seed),
      process_index=jax.process_index(), process_count=jax.process_count())
  if vocab > mcfg.vocab_size:
    raise ValueError(f"model.vocab_size={mcfg.vocab_size} is smaller than the "
                     f"data's vocabulary ({vocab}); allowed: >= {vocab}")
  unigram_bpb = unigram_bits_per_byte(train_tokens, val_tokens, vocab)

  # One mesh over all devices of all processes (docs/design.md §8); on one device
  # every sharding below is trivial and the run is the unsharded one.
  mesh = sharding.make_mesh(config.mesh)
  rules = config.mesh.rules
  logging.info("Mesh %s on %d devices, %d processes", dict(mesh.shape),
               mesh.size, jax.process_count())
  model = build_model(config)
  schedule = make_schedule(tcfg)
  tx = make_optimizer(tcfg)
  rng = jax.random.PRNGKey(config.seed)
  abstract_state = abstract_train_state(model, tx, rng, config.data.seq_len)
  state_sh = train_state_shardings(abstract_state, tx, mesh, rules)
  batch_shape = (config.data.batch_size, config.data.seq_len)
  batch_sh = sharding.batch_sharding(mesh, rules, batch_shape)
  rep = sharding.replicated(mesh)
  train_step = sharding.jit_in_mesh(
      make_train_step(model, tx, mcfg.moe, schedule,
                      microbatches=tcfg.microbatches), mesh,
      in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, rep),
      donate_argnums=(0,))
  eval_step = sharding.jit_in_mesh(
      make_eval_step(model), mesh,
      in_shardings=(state_sh.params, state_sh.router_state, batch_sh),
      out_shardings=rep)

  def global_batch(local: dict) -> dict:
    return sharding.shard_batch(local, batch_sh, config.data.batch_size)

  ckpt = Checkpointer(workdir, keep=tcfg.keep_checkpoints)
  start = ckpt.latest_step()
  if start is not None:
    # Restored straight into this run's shardings, whatever mesh saved it
    # (no init first: at scale the state would not fit twice).
    state, data_state, _ = ckpt.restore(
        start, with_shardings(abstract_state, state_sh))
    train_iter.set_state(data_state)
    logging.info("Resumed from step %d in %s", start, ckpt.directory)
  else:
    state = init_train_state(model, tx, rng, config.data.seq_len,
                             shardings=state_sh)
  start = int(state.step)

  writer = MetricsWriter(workdir, enabled=is_chief)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
  if start == 0:
    writer.write(0, {"num_params": n_params, "unigram_bpb": unigram_bpb},
                 split="meta")
  last_step = min(tcfg.steps, stop_at_step or tcfg.steps)
  tokens_per_step = config.data.batch_size * config.data.seq_len
  result: dict = {"unigram_bpb": unigram_bpb, "num_params": n_params}

  def run_eval(step):
    batches = map(global_batch, eval_batches(
        val_tokens, config.data.seq_len, config.data.batch_size,
        max_batches=tcfg.eval_batches, process_index=jax.process_index(),
        process_count=jax.process_count()))
    ev = evaluate(eval_step, state.params, state.router_state, batches)
    loads = ev.pop("_loads")
    ev["unigram_bpb"] = unigram_bpb
    ev["val_bpb_over_unigram"] = ev["val_bpb"] / unigram_bpb
    writer.write(step, ev, split="eval")
    writer.write(step, {f"load/{layer}": [float(x) for x in load]
                        for layer, load in loads.items()}, split="load")
    for layer, load in loads.items():
      writer.write_histogram(step, f"expert_load/{layer}", load)
    return ev

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
    nonlocal train_time, t_mark
    host = jax.device_get([m for _, m in pending])
    train_time += time.perf_counter() - t_mark
    for (s, _), m in zip(pending, host):
      loss = float(m["loss"])
      if not (math.isfinite(loss) and math.isfinite(float(m["grad_norm"]))):
        raise NonFiniteError(
            f"non-finite loss ({loss}) or grad norm at step {s}; the last "
            f"good checkpoint in {ckpt.directory} was kept")
      # Router balance at every step (MaxVio_batch per layer).
      writer.write(s, {k: v for k, v in m.items()
                       if k.startswith("maxvio/")}, split="router")
    pending.clear()
    return host[-1]

  with _SigtermFlag() as sigterm:
    step = start
    while step < last_step:
      batch = global_batch(next(train_iter))
      state, metrics = train_step(state, batch)
      step += 1
      steps_timed += 1
      pending.append((step, metrics))
      bar.update(1)
      log_now = step % tcfg.log_every == 0 or step == last_step
      eval_now = step % tcfg.eval_every == 0 or step == last_step
      save_now = (step % tcfg.checkpoint_every == 0 or step == last_step
                  or sigterm.raised)
      if not (log_now or eval_now or save_now):
        continue
      metrics = fetch_pending()
      if log_now:
        metrics["tokens_per_sec"] = steps_timed * tokens_per_step / train_time
        train_time, steps_timed = 0.0, 0
        writer.write(step, metrics)
        bar.set_postfix(loss=f"{float(metrics['loss']):.3f}")
        result.update({k: float(v) for k, v in metrics.items()})
      if eval_now:
        result.update(run_eval(step))
      if save_now:
        ckpt.save(step, state, train_iter.get_state(), config.to_dict())
      t_mark = time.perf_counter()
      if sigterm.raised:
        logging.warning("SIGTERM: saved step %d and stopped", step)
        break
  bar.close()
  ckpt.close()
  writer.close()
  result["step"] = int(state.step)
  return result
