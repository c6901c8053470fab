"""Synthetic retrieval documents mixed into training batches.

A model trained only on source code has no reason to copy a number from
far back in its context, so passkey retrieval at the curriculum's stage ends
could not be expected at any length. `data.retrieval_fraction` replaces that
fraction of training rows (each row independently, by a coin drawn from
(seed, step, row)) with one retrieval document of the batch's length; the
rest of the batch is exactly the batch without retrieval.

Kinds (`data.retrieval_kinds`, comma-separated):
  - passkey: BOS, corpus filler with the needle (PASSKEY_NEEDLE, a
    PASSKEY_DIGITS-digit key) at a uniform random depth, the question
    (PASSKEY_QUESTION) and the key as the last tokens. The evaluation
    (moe_jax/eval/long_context.py) asks the same question about a needle in
    repeated sentences (its PASSKEY_FILLER), a filler training never sees.
  - mqar: BOS, key-value pairs of single tokens (MQAR_KEYS, MQAR_VALUES),
    corpus filler, then every key again in a new order, each followed by its
    value; the evaluation's MQAR puts MQAR_NOISE tokens where this puts
    corpus filler.

The filler is a window of the training split (never the validation split)
whose document markers (ids >= NUM_BYTES) are replaced by newlines, so a
retrieval document is one document: with data.packing='documents' its
segment ids are all 0.

Everything is a pure function of (seed, step, global row): a resumed run and
every process draw the same documents. Ground floor: numpy and this package.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from moe_jax.data.stdlib_corpus import BOS
from moe_jax.data.stdlib_corpus import NUM_BYTES

RETRIEVAL_KINDS = ("passkey", "mqar")

PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_QUESTION = " What is the pass key? The pass key is "
PASSKEY_DIGITS = 5

# MQAR token ranges (bytes): keys, values and noise are disjoint.
MQAR_KEYS = range(65, 65 + 58)      # 'A'..'z' and between: 58 keys
MQAR_VALUES = range(128, 256)       # 128 values
MQAR_NOISE = range(32, 65)          # space, punctuation, digits

# Separates the retrieval draws from the window starts' SeedSequence([seed,
# step]) (pipeline.TokenBatcher), which must stay as without retrieval.
_STREAM = 0x7E721E7A1
_NEWLINE = ord("\n")


def passkey_overhead() -> int:
  """Tokens of a passkey document besides the filler (BOS, needle, question,
  answer)."""
  key = "0" * PASSKEY_DIGITS
  return (1 + len(PASSKEY_NEEDLE.format(key=key)) + len(PASSKEY_QUESTION) +
          PASSKEY_DIGITS)


def min_seq_len(kind: str) -> int:
  """Shortest data.seq_len with room for one document of `kind` (the
  document is seq_len + 1 tokens: inputs and targets; at least one filler
  token, and for mqar one pair)."""
  if kind == "passkey":
    return passkey_overhead()
  if kind == "mqar":
    return 1 + 4
  raise ValueError(f"data.retrieval_kinds must name kinds of "
                   f"{list(RETRIEVAL_KINDS)}, got {kind!r}")


def parse_kinds(kinds: str | Sequence[str]) -> tuple[str, ...]:
  """data.retrieval_kinds ('passkey,mqar' or a sequence) as a tuple."""
  if isinstance(kinds, str):
    kinds = [k.strip() for k in kinds.split(",")]
  kinds = tuple(kinds)
  if (not kinds or len(set(kinds)) != len(kinds)
      or any(k not in RETRIEVAL_KINDS for k in kinds)):
    raise ValueError(
        f"data.retrieval_kinds must be a comma-separated list of distinct "
        f"kinds of {list(RETRIEVAL_KINDS)}, got {kinds!r}")
  return kinds


def _rng(*keys: int) -> np.random.Generator:
  return np.random.Generator(np.random.PCG64(np.random.SeedSequence(
      [*keys, _STREAM])))


def corpus_filler(tokens: np.ndarray, start: int, n: int) -> np.ndarray:
  """int32 [n]: tokens[start:start + n] with document markers as newlines."""
  filler = np.asarray(tokens[start:start + n]).astype(np.int32)
  filler[filler >= NUM_BYTES] = _NEWLINE
  return filler


def _filler(tokens: np.ndarray, n: int, rng: np.random.Generator
            ) -> tuple[np.ndarray, int]:
  if n > tokens.shape[0]:
    raise ValueError(f"retrieval filler needs {n} training tokens, the split "
                     f"has {tokens.shape[0]}")
  start = int(rng.integers(0, tokens.shape[0] - n + 1))
  return corpus_filler(tokens, start, n), start


def _ids(text: str) -> np.ndarray:
  return np.frombuffer(text.encode(), np.uint8).astype(np.int32)


def passkey_tokens(filler: np.ndarray, cut: int, key: str) -> np.ndarray:
  """int32: BOS, filler[:cut], the needle with `key`, filler[cut:], the
  question, the key's digits (the layout of every passkey sequence; training
  and evaluation differ only in their filler)."""
  return np.concatenate([[BOS], filler[:cut],
                         _ids(PASSKEY_NEEDLE.format(key=key)), filler[cut:],
                         _ids(PASSKEY_QUESTION), _ids(key)]).astype(np.int32)


def mqar_tokens(keys: np.ndarray, values: np.ndarray, order: np.ndarray,
                middle: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(int32 tokens, bool answer mask): BOS, each key followed by its value,
  `middle`, then the keys again in `order`, each followed by its value (the
  answers). The layout of every MQAR sequence; training and evaluation
  differ only in their middle."""
  kv = np.stack([keys, values], 1).ravel()
  qv = np.stack([keys[order], values[order]], 1).ravel()
  tokens = np.concatenate([[BOS], kv, middle, qv]).astype(np.int32)
  mask = np.zeros(tokens.shape[0], bool)
  mask[tokens.shape[0] - 2 * keys.shape[0] + 1::2] = True
  return tokens, mask


def passkey_document(tokens: np.ndarray, length: int,
                     rng: np.random.Generator) -> dict:
  """One passkey document of exactly `length` tokens.

  Args:
    tokens: [n] training-split token ids (the filler's source).
    length: tokens of the document (data.seq_len + 1 in a batch).
    rng: the document's generator (key, depth, filler window).

  Returns:
    dict(tokens=int32 [length], key=str, needle_start (index of the needle's
    first token), answer_start (index of the key's first digit, the last
    PASSKEY_DIGITS tokens), filler_start (the filler's first index in
    `tokens`; its first `cut` tokens come before the needle), cut).
  """
  n_filler = length - passkey_overhead()
  if n_filler < 1:
    raise ValueError(
        f"a passkey document of {length} tokens is too short: BOS, needle, "
        f"question and answer take {passkey_overhead()}; allowed: "
        f"data.seq_len >= {min_seq_len('passkey')}")
  key = "".join(str(d) for d in rng.integers(0, 10, PASSKEY_DIGITS))
  cut = int(rng.integers(0, n_filler + 1))  # uniform depth
  filler, start = _filler(tokens, n_filler, rng)
  doc = passkey_tokens(filler, cut, key)
  assert doc.shape[0] == length, (doc.shape, length)
  return {"tokens": doc, "key": key, "needle_start": 1 + cut,
          "answer_start": length - PASSKEY_DIGITS, "filler_start": start,
          "cut": cut}


def mqar_document(tokens: np.ndarray, length: int,
                  rng: np.random.Generator) -> dict:
  """One MQAR document of exactly `length` tokens.

  BOS, num_pairs (key, value) pairs (distinct keys; num_pairs uniform in
  [1, min(len(MQAR_KEYS), (length - 2) // 4)]), corpus filler, then every
  key again in a new order, each followed by its value.

  Returns:
    dict(tokens=int32 [length], answer_mask=bool [length] (the queried
    values), pairs={key: value}, filler_start).
  """
  most = min(len(MQAR_KEYS), (length - 2) // 4)
  if most < 1:
    raise ValueError(f"an MQAR document of {length} tokens is too short; "
                     f"allowed: data.seq_len >= {min_seq_len('mqar')}")
  num_pairs = int(rng.integers(1, most + 1))
  keys = rng.choice(np.asarray(MQAR_KEYS), num_pairs, replace=False)
  values = rng.choice(np.asarray(MQAR_VALUES), num_pairs)
  order = rng.permutation(num_pairs)
  filler, start = _filler(tokens, length - 1 - 4 * num_pairs, rng)
  doc, mask = mqar_tokens(keys, values, order, filler)
  return {"tokens": doc, "answer_mask": mask,
          "pairs": dict(zip(keys.tolist(), values.tolist())),
          "filler_start": start}


_DOCUMENTS = {"passkey": passkey_document, "mqar": mqar_document}


def retrieval_rows(seed: int, step: int, batch_size: int,
                   fraction: float) -> np.ndarray:
  """bool [batch_size]: the global rows of step's batch that are retrieval
  documents, each with probability `fraction` (none when it is 0)."""
  if fraction <= 0.0:
    return np.zeros(batch_size, bool)
  return _rng(seed, step).random(batch_size) < fraction


def retrieval_document(tokens: np.ndarray, length: int,
                       kinds: Sequence[str], seed: int, step: int,
                       row: int) -> dict:
  """The document of global row `row` at `step`: its kind is uniform over
  `kinds`; see passkey_document / mqar_document (plus kind=str)."""
  rng = _rng(seed, step, row)
  kind = kinds[int(rng.integers(0, len(kinds)))]
  return {"kind": kind, **_DOCUMENTS[kind](tokens, length, rng)}
