"""Decoding: the cache, prefill, one-token steps, sampling, a jitted loop.

The model's decode mode (HybridLM(..., decode=True), docs/design.md
"Decoding") reads and updates a `cache` collection:

  KDA layer  state [B, H, K, V] fp32, per short conv (q, k, v) its last
             conv_size - 1 inputs [B, conv_size - 1, H * K] and the last
             token's segment id [B] int32: constant in the context length.
  MLA layer  the latent c_kv [B, T_max, r] (+ the rotary key [B, T_max, R]
             when qk_rope_head_dim > 0), the segment id of each position
             [B, T_max] int32 and the write position `index`; the attention
             is absorbed, so nothing is kept per head.

    cache = init_cache(model, params, router_state, batch, cache_size)
    logits, cache = prefill(model, params, router_state, cache, prompt)
    logits, cache = decode_step(model, params, router_state, cache, token)
    tokens = generate(model, params, router_state, prompt, n, rng, ...)

A prefill runs the chunked KDA op from the cached state (zeros for a new
sequence) and writes the prompt's latents; a step runs ops.kda_step and one
more latent. Router biases are read from router_state; the router's
training statistics are not emitted (router_stats is not mutable here).

Packed documents (segment_ids, as in training with data.packing='documents'):
prefill takes ids [B, P] and decode_step [B], and the rows' logits are the
packed full forward's. A token whose id differs from the previous token's
starts a document: KDA zeroes its state and conv inputs before it (a
prefill leaves in the cache the state and conv inputs of its last document
only), and MLA attends to cached positions of the token's own id. Each
layer keeps its own ids (4 bytes per position per MLA layer, beside r (+ R)
latent numbers), so a layer decodes alone. Without ids the tokens continue
the cached document; a new sequence is one document.
"""
from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any
CACHE = "cache"


def _variables(params: PyTree, router_state: PyTree, cache: PyTree) -> dict:
  return {"params": params, "router_state": router_state, CACHE: cache}


def init_cache(model: nn.Module, params: PyTree, router_state: PyTree,
               batch_size: int, cache_size: int) -> PyTree:
  """A fresh (all zeros) cache for `batch_size` sequences of up to
  `cache_size` tokens (T_max of the MLA latent caches).

  The shapes come from tracing a decode-mode apply on [batch_size,
  cache_size] tokens (nothing is computed).
  """
  tokens = jax.ShapeDtypeStruct((batch_size, cache_size), jnp.int32)
  _, shapes = jax.eval_shape(
      lambda p, s, t: model.apply({"params": p, "router_state": s}, t,
                                  decode=True, mutable=[CACHE]),
      params, router_state, tokens)
  return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes[CACHE])


def prefill(model: nn.Module, params: PyTree, router_state: PyTree,
            cache: PyTree, tokens: jax.Array, *, new_sequence: bool = False,
            images: jax.Array | None = None,
            segment_ids: jax.Array | None = None) -> tuple[jax.Array, PyTree]:
  """Runs tokens [B, T] from the cache; (logits fp32 [B, T, V], cache).

  new_sequence: the tokens start a new sequence (the cache's contents are
  ignored); its MLA layers then attend with the training path over the T
  tokens instead of scoring them against all T_max cache slots.
  images: [B, N, H, W, C] for the image placeholders among the tokens
  (a model with model.vision.encoder set; see HybridLM).
  segment_ids: int [B, T], the tokens' documents (see the module
  docstring); None: they continue the cached document.
  """
  kwargs = {} if images is None else {"images": images}
  if segment_ids is not None:
    if segment_ids.shape != tokens.shape:
      raise ValueError(f"segment_ids must have the tokens' shape "
                       f"{tuple(tokens.shape)}, got {tuple(segment_ids.shape)}")
    kwargs["segment_ids"] = segment_ids
  logits, mutated = model.apply(_variables(params, router_state, cache),
                                tokens, decode=True, new_sequence=new_sequence,
                                mutable=[CACHE], **kwargs)
  return logits, mutated[CACHE]


def decode_step(model: nn.Module, params: PyTree, router_state: PyTree,
                cache: PyTree, token: jax.Array,
                segment_ids: jax.Array | None = None
                ) -> tuple[jax.Array, PyTree]:
  """One token per sequence: token int [B] -> (logits fp32 [B, V], cache).

  segment_ids: int [B], the token's document (an id other than the
  previous token's starts a new one); None: the cached document goes on.
  """
  if segment_ids is not None:
    if segment_ids.shape != token.shape:
      raise ValueError(f"segment_ids must have the token's shape "
                       f"{tuple(token.shape)}, got {tuple(segment_ids.shape)}")
    segment_ids = segment_ids[:, None]
  logits, cache = prefill(model, params, router_state, cache, token[:, None],
                          segment_ids=segment_ids)
  return logits[:, 0], cache


def cache_report(cache: PyTree) -> list[dict]:
  """Per layer of a cache: its kind, entry shapes and bytes.

  Returns one dict per layer, in layer order: {"layer": "layer_3_mla",
  "kind": "KDA" | "MLA", "shapes": {entry: shape}, "bytes": int}.
  """
  rows = []
  def layer_index(name):
    return int(name.split("_")[1])
  for name in sorted(cache, key=layer_index):
    leaves = cache[name]
    rows.append({
        "layer": name,
        "kind": "KDA" if name.endswith("_kda") else "MLA",
        "shapes": {k: tuple(v.shape) for k, v in leaves.items()},
        "bytes": int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize
                         for v in leaves.values())),
    })
  return rows


def check_sampling(vocab_size: int, temperature: float, top_k: int,
                   top_p: float) -> None:
  """ValueError naming the setting out of its range."""
  if not temperature >= 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  if not 0 <= top_k <= vocab_size:
    raise ValueError(f"top_k must be in [0, vocab_size={vocab_size}], got "
                     f"{top_k}")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def sample_logits(logits: jax.Array, rng: jax.Array, *,
                  temperature: float | jax.Array = 0.0,
                  top_k: int | jax.Array = 0,
                  top_p: float | jax.Array = 1.0) -> jax.Array:
  """Next tokens int32 [B] from logits [B, V].

  temperature == 0: greedy (argmax). Otherwise sampling from
  softmax(logits / temperature), restricted to the top_k most likely tokens
  (0 = all) and then to the smallest set whose probability reaches top_p
  (1.0 = all; the most likely token is always kept). Ties at a cut are
  kept. The settings may be traced scalars: one compiled program serves
  them all (python numbers are range-checked here).
  """
  v = logits.shape[-1]
  if all(isinstance(a, (int, float)) for a in (temperature, top_k, top_p)):
    check_sampling(v, temperature, top_k, top_p)
  logits = logits.astype(jnp.float32)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  scaled = logits / jnp.maximum(temperature, 1e-6)
  desc = -jnp.sort(-scaled, axis=-1)                             # [B, V]
  k = jnp.where(top_k > 0, top_k, v)
  kth = jax.lax.dynamic_slice_in_dim(desc, k - 1, 1, axis=-1)    # [B, 1]
  desc = jnp.where(desc < kth, -jnp.inf, desc)
  probs = jax.nn.softmax(desc, axis=-1)
  # Keep a token while the mass before it is below top_p.
  keep = (jnp.cumsum(probs, axis=-1) - probs < top_p) | (top_p >= 1.0)
  cut = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
  scaled = jnp.where(scaled < jnp.maximum(cut, kth), -jnp.inf, scaled)
  sampled = jax.random.categorical(rng, scaled, axis=-1).astype(jnp.int32)
  return jnp.where(temperature > 0, sampled, greedy)


def check_cache_size(prompt_len: int, max_new_tokens: int,
                     cache_size: int) -> None:
  """ValueError naming the sizes when the prompt and the new tokens do not
  fit a cache of cache_size positions."""
  if prompt_len < 1:
    raise ValueError(f"the prompt must have at least 1 token, got {prompt_len}")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if prompt_len > cache_size:
    raise ValueError(f"prompt of {prompt_len} tokens is longer than the cache "
                     f"(cache_size={cache_size} positions)")
  # The last sampled token is never fed back, so it needs no position.
  if prompt_len + max_new_tokens - 1 > cache_size:
    raise ValueError(
        f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} "
        f"needs a cache of {prompt_len + max_new_tokens - 1} positions, "
        f"cache_size={cache_size}")


@functools.partial(jax.jit, static_argnames=(
    "model", "max_new_tokens", "cache_size"))
def _generate(model, params, router_state, prompt, rng, temperature, top_k,
              top_p, images, *, max_new_tokens, cache_size):
  sample = functools.partial(sample_logits, temperature=temperature,
                             top_k=top_k, top_p=top_p)
  cache = init_cache(model, params, router_state, prompt.shape[0],
                     cache_size)
  logits, cache = prefill(model, params, router_state, cache, prompt,
                          new_sequence=True, images=images)
  first = sample(logits[:, -1], jax.random.fold_in(rng, 0))
  out = jnp.zeros((prompt.shape[0], max_new_tokens), jnp.int32)
  out = out.at[:, 0].set(first)

  def body(i, carry):
    out, cache = carry
    logits, cache = decode_step(model, params, router_state, cache,
                                out[:, i - 1])
    token = sample(logits, jax.random.fold_in(rng, i))
    return out.at[:, i].set(token), cache

  out, _ = jax.lax.fori_loop(1, max_new_tokens, body, (out, cache))
  return out


def generate(model: nn.Module, params: PyTree, router_state: PyTree,
             prompt: jax.Array, max_new_tokens: int, rng: jax.Array, *,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             cache_size: int | None = None,
             images: jax.Array | None = None) -> jax.Array:
  """Continues each prompt by max_new_tokens tokens (one jitted program).

  Args:
    model: a HybridLM.
    params, router_state: the model's collections (e.g. a TrainState's).
    prompt: int [B, P] token ids.
    max_new_tokens: N >= 1 tokens to generate.
    rng: PRNG key; step i samples with fold_in(rng, i).
    temperature, top_k, top_p: see `sample_logits` (0.0 = greedy); traced,
      so new settings reuse the compiled program.
    cache_size: T_max of the fixed-size cache; default P + N - 1.
    images: [B, N_img, H, W, C] placed at the prompt's image placeholders
      (model.vision.encoder set); None for text.
  Returns:
    int32 [B, N]: the new tokens.
  """
  prompt = jnp.asarray(prompt, jnp.int32)
  if prompt.ndim != 2:
    raise ValueError(f"prompt must be [B, P] token ids, got shape "
                     f"{prompt.shape}")
  p = prompt.shape[1]
  if cache_size is None:
    cache_size = p + max_new_tokens - 1
  check_cache_size(p, max_new_tokens, cache_size)
  check_sampling(model.cfg.vocab_size, temperature, top_k, top_p)
  # Traced: changing the sampling settings does not recompile.
  return _generate(model, params, router_state, prompt, rng,
                   jnp.float32(temperature), jnp.int32(top_k),
                   jnp.float32(top_p), images, max_new_tokens=max_new_tokens,
                   cache_size=cache_size)
