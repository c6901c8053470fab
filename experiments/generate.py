r"""Continues a prompt with a trained model from its checkpoint workdir.

  python -m experiments.generate --workdir=runs/default --prompt="def main("
  python -m experiments.generate --workdir=runs/default \
      --prompt_file=prompt.py --max_new_tokens=256 --temperature=0.8 \
      --top_p=0.95

Reads the model config saved with the checkpoint (the latest one, or
--step), restores params and router_state, prefills the prompt and decodes
token by token in one jitted loop (moe_jax/decode.py). Byte-level models
(data.source = "stdlib"): the prompt is BOS + its UTF-8 bytes, the
continuation is printed up to the first EOS. Prints tokens/s of a second,
compiled run (the first one includes compilation).
"""
from __future__ import annotations

import os
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import app, flags, logging

from moe_jax import decode
from moe_jax.data import BOS, EOS, NUM_BYTES
from moe_jax.model import build_model
from moe_jax.train.checkpoint import (Checkpointer, verify_checksums,
                                     with_shardings)
from moe_jax.train.optimizer import make_optimizer
from moe_jax.train.step import abstract_train_state


def define_flags():
  """Defines the command's flags; only when it runs as a command, so
  that tests import this module beside other experiments without
  their flags clashing."""
  global _WORKDIR, _STEP, _PROMPT, _PROMPT_FILE, _MAX_NEW, _TEMPERATURE, \
      _TOP_K, _TOP_P, _SEED, _CACHE_SIZE
  _WORKDIR = flags.DEFINE_string("workdir", "runs/default",
                                 "Training workdir (with checkpoints/).")
  _STEP = flags.DEFINE_integer("step", None,
                               "Checkpoint step; default the latest.")
  _PROMPT = flags.DEFINE_string("prompt", None, "Prompt text.")
  _PROMPT_FILE = flags.DEFINE_string("prompt_file", None,
                                     "File whose text is the prompt.")
  _MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate.")
  _TEMPERATURE = flags.DEFINE_float("temperature", 0.0,
                                    "0 = greedy; > 0 samples.")
  _TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the k most likely "
                                "tokens (0 = all).")
  _TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (1 = all).")
  _SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
  _CACHE_SIZE = flags.DEFINE_integer(
      "cache_size", None, "T_max of the cache; default prompt + new tokens.")


def load_checkpoint(workdir: str, step: int | None = None):
  """(config, model, params, router_state, step) of a training workdir.

  The model is built from the config saved with the checkpoint, so its
  shapes match the checkpoint's. Restores onto the first local device.
  """
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    raise ValueError(f"--workdir={workdir} has no checkpoints/ folder")
  ckpt = Checkpointer(workdir)
  try:
    steps = ckpt.manager.all_steps()
    if step is None:
      step = ckpt.latest_step()
    if step is None or step not in steps:
      raise ValueError(f"no checkpoint of step {step} in {directory}; "
                       f"saved steps: {sorted(steps)}")
    damage = verify_checksums(ckpt.step_dir(step))
    if damage:
      raise ValueError(f"checkpoint {ckpt.step_dir(step)} is damaged: "
                       f"{damage}; pick another with --step (saved steps: "
                       f"{sorted(steps)})")
    config = ml_collections.ConfigDict(ckpt.saved_config(step))
    model = build_model(config)
    abstract = abstract_train_state(model, make_optimizer(config.train),
                                    jax.random.PRNGKey(0),
                                    config.data.seq_len)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = with_shardings(abstract, jax.tree.map(
        lambda _: device, nn.meta.unbox(abstract)))
    state, _, _ = ckpt.restore(step, target)
  finally:
    ckpt.close()
  return config, model, state.params, state.router_state, step


def encode(text: str) -> np.ndarray:
  """BOS + the UTF-8 bytes of text: int32 [1, P]."""
  return np.asarray([[BOS, *text.encode("utf-8")]], np.int32)


def decode_bytes(tokens) -> str:
  """Text of byte tokens, up to the first EOS (other specials dropped)."""
  out = bytearray()
  for t in np.asarray(tokens).tolist():
    if t == EOS:
      break
    if t < NUM_BYTES:
      out.append(t)
  return out.decode("utf-8", errors="replace")


def continue_prompt(workdir: str, prompt: str, max_new_tokens: int, *,
                    step: int | None = None, temperature: float = 0.0,
                    top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                    cache_size: int | None = None) -> dict:
  """Generates from a checkpoint: {"text", "tokens", "step",
  "tokens_per_sec", "first_call_sec"}."""
  config, model, params, router_state, step = load_checkpoint(workdir, step)
  if config.data.source != "stdlib":
    raise ValueError("experiments/generate.py reads byte-level models "
                     f"(data.source='stdlib'), got data.source="
                     f"{config.data.source!r}")
  tokens = jnp.asarray(encode(prompt))
  run = lambda: decode.generate(  # noqa: E731
      model, params, router_state, tokens, max_new_tokens,
      jax.random.PRNGKey(seed), temperature=temperature, top_k=top_k,
      top_p=top_p, cache_size=cache_size).block_until_ready()
  start = time.perf_counter()
  run()
  first = time.perf_counter() - start
  start = time.perf_counter()
  out = np.asarray(run())[0]
  seconds = time.perf_counter() - start
  return {"text": decode_bytes(out), "tokens": out, "step": step,
          "tokens_per_sec": max_new_tokens / seconds,
          "first_call_sec": first}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # orbax logs every file at INFO
  if (_PROMPT.value is None) == (_PROMPT_FILE.value is None):
    raise app.UsageError("give exactly one of --prompt and --prompt_file")
  prompt = _PROMPT.value
  if prompt is None:
    with open(_PROMPT_FILE.value, encoding="utf-8") as f:
      prompt = f.read()
  try:
    res = continue_prompt(
        _WORKDIR.value, prompt, _MAX_NEW.value, step=_STEP.value,
        temperature=_TEMPERATURE.value, top_k=_TOP_K.value,
        top_p=_TOP_P.value, seed=_SEED.value, cache_size=_CACHE_SIZE.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  print(prompt + res["text"])
  print(f"--- step {res['step']}: {_MAX_NEW.value} tokens, "
        f"{res['tokens_per_sec']:.1f} tokens/s (compiled; the first call "
        f"took {res['first_call_sec']:.1f} s with compilation)")


if __name__ == "__main__":
  define_flags()
  app.run(main)
