"""Multi-turn rollouts with the decoder, and the same layout for demonstrations.

A trajectory lives in a fixed buffer of max_len byte tokens (static shapes
for jit), laid out as

  [PAD.. BOS prompt] [model turn] [PAD..] [PAD.. <result>..</result>] [model turn] ...
   prompt_len                     (wait)   obs_len

All rows of a batch advance in lockstep (the MLA cache has one write index):
a row whose turn has closed (a closing tag of envs.STOP_TAGS, or EOS) feeds
PAD until every row's turn has closed or turn_tokens tokens have passed. Then
each row's turn is parsed and answered in Python (envs.parse_action,
envs.observe), and the tool outputs, left-padded to obs_len, are prefilled
into the cache in one call. An answer ends a row; a row without one after
max_turns turns, or when the buffer is full, gets reward 0.

own_mask marks the tokens the model sampled; prompts, tool outputs and PAD
carry no loss. `demo_batch` writes the environments' worked solutions in the
same layout (with a random number of waiting PADs) for supervised warm-up.
Sampling step at buffer position t uses fold_in(rng, t): a rollout is a
function of (params, tasks, rng).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import decode
from moe_jax.data import BOS, EOS, PAD
from moe_jax.rl import envs

PyTree = Any
_STOP_WIDTH = max(len(t) for t in envs.STOP_TAGS)


@dataclasses.dataclass(frozen=True)
class Layout:
  """Buffer sizes (tokens): prompt block, whole trajectory, one tool output,
  most tokens per model turn, most turns; temperature of sampling."""
  prompt_len: int = 96
  max_len: int = 320
  obs_len: int = 32
  turn_tokens: int = 32
  max_turns: int = 5
  temperature: float = 1.0


@dataclasses.dataclass
class Rollouts:
  """tokens, own_mask [B, max_len]; rewards, lengths, turns [B] (numpy)."""
  tokens: np.ndarray
  own_mask: np.ndarray
  rewards: np.ndarray
  lengths: np.ndarray
  turns: np.ndarray

  def train_batch(self) -> dict:
    """inputs / targets / loss_mask [B, max_len - 1] (next-token shift)."""
    return {"inputs": self.tokens[:, :-1], "targets": self.tokens[:, 1:],
            "loss_mask": self.own_mask[:, 1:].astype(np.float32)}


def encode(text: str) -> list[int]:
  return list(text.encode("utf-8"))


def decode_bytes(tokens) -> str:
  """Text of byte tokens; specials (PAD, BOS, EOS) are dropped."""
  return bytes(int(t) for t in tokens if int(t) < 256).decode(
      "utf-8", errors="replace")


def prompt_block(task: envs.Task, layout: Layout) -> list[int]:
  """[PAD.., BOS, prompt bytes] of exactly layout.prompt_len tokens."""
  ids = [BOS] + encode(task.prompt)
  if len(ids) > layout.prompt_len:
    raise ValueError(f"prompt of {len(ids)} tokens (BOS included) exceeds "
                     f"rl.prompt_len={layout.prompt_len}: {task.prompt!r}")
  return [PAD] * (layout.prompt_len - len(ids)) + ids


def observation_block(text: str, layout: Layout) -> list[int]:
  """A tool output left-padded with PAD to layout.obs_len tokens; a longer
  one keeps its start and its closing '</result>'."""
  ids = encode(text)
  if len(ids) > layout.obs_len:
    tail = encode("</result>")
    ids = ids[:layout.obs_len - len(tail)] + tail
  return [PAD] * (layout.obs_len - len(ids)) + ids


def demo_batch(tasks: Sequence[envs.Task], layout: Layout,
               rng: np.random.Generator, max_wait: int = 4) -> dict:
  """Worked solutions in the rollout layout: inputs / targets / loss_mask
  [B, max_len - 1], the loss on the solution's own segments only.

  Between a tool call and its output, 0..max_wait PADs stand for the rows
  a rollout waits on.
  """
  tokens = np.full((len(tasks), layout.max_len), PAD, np.int32)
  own = np.zeros((len(tasks), layout.max_len), np.float32)
  for b, task in enumerate(tasks):
    ids, mask = prompt_block(task, layout), [0] * layout.prompt_len
    for text, is_own in task.demo:
      if is_own:
        seg = encode(text)
        ids, mask = ids + seg, mask + [1] * len(seg)
      else:
        wait = int(rng.integers(0, max_wait + 1))
        seg = [PAD] * wait + observation_block(text, layout)
        ids, mask = ids + seg, mask + [0] * len(seg)
    if len(ids) > layout.max_len:
      raise ValueError(f"demonstration of {len(ids)} tokens exceeds "
                       f"rl.max_len={layout.max_len}")
    tokens[b, :len(ids)] = ids
    own[b, :len(mask)] = mask
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
          "loss_mask": own[:, 1:]}


def _stop_patterns() -> np.ndarray:
  """[n_tags, W] right-aligned closing tags, -1 = any token."""
  out = np.full((len(envs.STOP_TAGS), _STOP_WIDTH), -1, np.int32)
  for i, tag in enumerate(envs.STOP_TAGS):
    out[i, _STOP_WIDTH - len(tag):] = encode(tag)
  return out


@functools.partial(jax.jit, static_argnames=("model", "cache_size"))
def _start(model, params, router_state, prompts, *, cache_size):
  cache = decode.init_cache(model, params, router_state, prompts.shape[0],
                            cache_size)
  logits, cache = decode.prefill(model, params, router_state, cache, prompts,
                                 new_sequence=True)
  return logits[:, -1], cache


@functools.partial(jax.jit, static_argnames=("model",))
def _feed(model, params, router_state, cache, tokens):
  logits, cache = decode.prefill(model, params, router_state, cache, tokens)
  return logits[:, -1], cache


@functools.partial(jax.jit, static_argnames=("model", "turn_tokens"))
def _sample_turn(model, params, router_state, cache, logits, tokens, own, pos,
                 alive, rng, temperature, *, turn_tokens):
  """Samples one turn for the `alive` rows from buffer position pos.

  Returns (tokens, own, pos, cache, logits, open): open [B] marks rows whose
  turn did not close (no stop tag or EOS within turn_tokens or the buffer).
  """
  patterns = jnp.asarray(_stop_patterns())
  t_max = tokens.shape[1]
  window0 = jnp.full((tokens.shape[0], _STOP_WIDTH), -1, jnp.int32)

  def cond(c):
    _, _, pos, _, _, alive, _, n = c
    return jnp.any(alive) & (n < turn_tokens) & (pos < t_max)

  def body(c):
    tokens, own, pos, cache, logits, alive, window, n = c
    tok = decode.sample_logits(logits, jax.random.fold_in(rng, pos),
                               temperature=temperature)
    tok = jnp.where(alive, tok, PAD)
    tokens = jax.lax.dynamic_update_slice(tokens, tok[:, None], (0, pos))
    own = jax.lax.dynamic_update_slice(own, alive[:, None], (0, pos))
    window = jnp.concatenate([window[:, 1:], tok[:, None]], axis=1)
    hit = jnp.all((patterns[None] == -1) | (window[:, None] == patterns[None]),
                  axis=-1).any(axis=-1)
    alive = alive & ~hit & (tok != EOS)
    logits, cache = decode.decode_step(model, params, router_state, cache, tok)
    return tokens, own, pos + 1, cache, logits, alive, window, n + 1

  tokens, own, pos, cache, logits, alive, _, _ = jax.lax.while_loop(
      cond, body, (tokens, own, pos, cache, logits, alive, window0,
                   jnp.zeros((), jnp.int32)))
  return tokens, own, pos, cache, logits, alive


def rollout(model: nn.Module, params: PyTree, router_state: PyTree,
            tasks: Sequence[envs.Task], rng: jax.Array,
            layout: Layout) -> Rollouts:
  """Runs every task to an answer or the limits; see the module docstring.

  tasks: B tasks (a group of G rollouts = the same task G times).
  """
  b, t_max = len(tasks), layout.max_len
  if layout.prompt_len + layout.obs_len >= t_max:
    raise ValueError(f"rl.max_len={t_max} leaves no room after prompt_len="
                     f"{layout.prompt_len} and obs_len={layout.obs_len}")
  tokens = np.full((b, t_max), PAD, np.int32)
  tokens[:, :layout.prompt_len] = [prompt_block(t, layout) for t in tasks]
  own = np.zeros((b, t_max), bool)
  logits, cache = _start(model, params, router_state,
                         jnp.asarray(tokens[:, :layout.prompt_len]),
                         cache_size=t_max)
  pos = layout.prompt_len
  done = np.zeros(b, bool)
  rewards = np.zeros(b, np.float32)
  lengths = np.full(b, t_max, np.int32)
  turns = np.zeros(b, np.int32)
  temperature = jnp.float32(layout.temperature)
  for turn in range(layout.max_turns):
    if done.all() or pos >= t_max:
      break
    start = pos
    tokens_d, own_d, pos_d, cache, logits, _ = _sample_turn(
        model, params, router_state, cache, logits, jnp.asarray(tokens),
        jnp.asarray(own), jnp.int32(pos), jnp.asarray(~done), rng,
        temperature, turn_tokens=layout.turn_tokens)
    tokens, own, pos = np.array(tokens_d), np.array(own_d), int(pos_d)
    obs = [""] * b
    for i in np.flatnonzero(~done):
      turns[i] += 1
      text = decode_bytes(tokens[i, start:pos][own[i, start:pos]])
      action = envs.parse_action(text)
      if action.kind == "answer":
        done[i] = True
        rewards[i] = envs.reward(tasks[i], action.arg)
        lengths[i] = start + int(own[i, start:pos].sum())
      else:
        obs[i] = envs.observe(tasks[i], action)
    if (done.all() or turn + 1 == layout.max_turns
        or pos + layout.obs_len > t_max):
      break
    block = np.array([observation_block(o, layout) if o else
                      [PAD] * layout.obs_len for o in obs], np.int32)
    tokens[:, pos:pos + layout.obs_len] = block
    logits, cache = _feed(model, params, router_state, cache,
                          jnp.asarray(block))
    pos += layout.obs_len
  lengths[~done] = pos
  return Rollouts(tokens, own, rewards, lengths, turns)
