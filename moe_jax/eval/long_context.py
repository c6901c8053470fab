"""Length extrapolation: loss against position, passkey retrieval, MQAR.

Everything is scored from one teacher-forced forward per batch
(`make_scorer`): the per-token cross-entropy and the argmax prediction at
every position. The model is causal, so the loss at position p of a long
sequence is the loss at p of any sequence of length >= p: one forward at
the longest length gives the whole loss-against-position curve.

Retrieval answers are scored as the argmax at each answer token given the
true tokens before it (teacher forcing). An answer counts as correct when
every one of its tokens is the argmax; that is exactly when greedy decoding
from the prompt would produce it (each greedy step then sees the same
prefix as the teacher-forced one), so the accuracy is greedy decoding's.

The generators are deterministic functions of their seed and byte-level
(token = byte, BOS first; moe_jax.data's vocabulary):
  - passkey: a 5-digit number hidden at a chosen depth of repeated filler
    text, then a question whose answer is the number;
  - MQAR (multi-query associative recall): key-value pairs of single tokens,
    noise, then every key again, each to be followed by its value.

Ground floor above the model: jax and numpy, nothing of moe_jax.train.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.balancing import STATS_COLLECTION
# The needle, question and MQAR token ranges are those of the training
# retrieval documents (data.retrieval_fraction); the filler is not.
from moe_jax.data.retrieval import MQAR_KEYS
from moe_jax.data.retrieval import MQAR_NOISE
from moe_jax.data.retrieval import MQAR_VALUES
from moe_jax.data.retrieval import PASSKEY_DIGITS
from moe_jax.data.retrieval import PASSKEY_NEEDLE  # noqa: F401 (public here too)
from moe_jax.data.retrieval import PASSKEY_QUESTION  # noqa: F401
from moe_jax.data.retrieval import mqar_tokens
from moe_jax.data.retrieval import passkey_overhead
from moe_jax.data.retrieval import passkey_tokens
from moe_jax.eval.step import token_cross_entropy

# Held out: training's passkey documents hide the needle in corpus text.
PASSKEY_FILLER = ("The grass is green. The sky is blue. The sun is yellow. "
                  "Here we go. There and back again. ")

# Scorer: (inputs int [B, T], targets int [B, T]) -> (ce fp32 [B, T] nats,
# argmax int32 [B, T]).
Scorer = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def make_scorer(model: nn.Module, params, router_state) -> Scorer:
  """Teacher-forced per-token cross-entropy and argmax of a model (jitted;
  one compilation per batch shape)."""

  # Params are arguments, not constants folded into the program.
  @jax.jit
  def score(params, router_state, inputs, targets):
    logits, _ = model.apply({"params": params, "router_state": router_state},
                            inputs, mutable=[STATS_COLLECTION])
    return (token_cross_entropy(logits, targets),
            jnp.argmax(logits, -1).astype(jnp.int32))

  def scorer(inputs, targets):
    ce, pred = score(params, router_state, jnp.asarray(inputs, jnp.int32),
                     jnp.asarray(targets, jnp.int32))
    return np.asarray(ce), np.asarray(pred)
  return scorer


def batched(scorer: Scorer, batch_size: int) -> Scorer:
  """A scorer that runs at most batch_size rows per forward (<= 0: all)."""
  if batch_size <= 0:
    return scorer

  def run(inputs, targets):
    parts = [scorer(inputs[i:i + batch_size], targets[i:i + batch_size])
             for i in range(0, inputs.shape[0], batch_size)]
    return tuple(np.concatenate(p) for p in zip(*parts))
  return run


def _rng(seed: int, *keys: int) -> np.random.Generator:
  return np.random.Generator(np.random.PCG64(np.random.SeedSequence(
      [seed, *keys])))


def _check_lengths(lengths: Sequence[int], lo: int, what: str) -> list[int]:
  out = [int(n) for n in lengths]
  if not out or any(n < lo for n in out):
    raise ValueError(f"{what} lengths must be >= {lo}, got {out}")
  return out


# ----- loss against position -----

def position_buckets(train_len: int, max_len: int) -> list[tuple[int, int]]:
  """[lo, hi) position buckets: eighths of train_len doubling up to it, then
  doublings of train_len (2x, 4x, ...) up to max_len."""
  edges = {0, max_len}
  for k in range(-3, 64):
    edge = train_len * 2.0 ** k
    if edge >= max_len:
      break
    if edge >= 1 and edge == int(edge):
      edges.add(int(edge))
  edges = sorted(edges)
  return list(zip(edges[:-1], edges[1:]))


def loss_by_position(scorer: Scorer, tokens: np.ndarray, train_len: int,
                     max_len: int, num_sequences: int) -> list[dict]:
  """Mean loss per position bucket over held-out windows of max_len.

  Args:
    scorer: `make_scorer(...)`.
    tokens: [n] held-out token ids; num_sequences windows of max_len + 1
      tokens, evenly spaced over it (overlapping where it is short), are
      scored as one batch (`batched` splits it).
    train_len: the training sequence length (bucket edges, ratios).
    max_len: positions scored, e.g. 16 * train_len.
    num_sequences: windows (the batch).

  Returns:
    One row per bucket: lo, hi (positions [lo, hi)), hi_over_train_len,
    loss (nats), bpb, tokens.
  """
  tokens = np.asarray(tokens)
  if tokens.shape[0] < max_len + 1 + num_sequences - 1:
    raise ValueError(
        f"held-out split has {tokens.shape[0]} tokens, fewer than "
        f"{num_sequences} windows of max_len + 1 = {max_len + 1} need; lower "
        "the length factor or use a larger validation split")
  starts = np.linspace(0, tokens.shape[0] - max_len - 1, num_sequences
                       ).astype(np.int64)
  win = tokens[starts[:, None] + np.arange(max_len + 1)].astype(np.int32)
  ce, _ = scorer(win[:, :-1], win[:, 1:])
  rows = []
  for lo, hi in position_buckets(train_len, max_len):
    loss = float(ce[:, lo:hi].mean())
    rows.append({"lo": lo, "hi": hi, "hi_over_train_len": hi / train_len,
                 "loss": loss, "bpb": loss / math.log(2.0),
                 "tokens": int(ce[:, lo:hi].size)})
  return rows


# ----- passkey retrieval -----

def passkey_example(length: int, depth: float, seed: int, index: int = 0
                    ) -> dict:
  """One passkey sequence of exactly `length` tokens.

  BOS, filler with the needle inserted after round(depth * filler) of its
  bytes, the question, the PASSKEY_DIGITS answer digits (the last tokens).

  Returns:
    dict(tokens=int32 [length], key=str, needle_start=int (index of the
    needle's first token), answer_start=int (index of the first digit)).
  """
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f"passkey depth must be in [0, 1], got {depth}")
  rng = _rng(seed, length, int(round(depth * 1e6)), index)
  key = "".join(str(d) for d in rng.integers(0, 10, PASSKEY_DIGITS))
  n_filler = length - passkey_overhead()
  if n_filler < 1:
    raise ValueError(f"passkey length {length} is too short: the needle, "
                     f"question and answer take {passkey_overhead()} tokens; "
                     f"allowed: lengths >= {passkey_overhead() + 1}")
  reps = -(-n_filler // len(PASSKEY_FILLER))
  filler = np.frombuffer((PASSKEY_FILLER * reps).encode()[:n_filler],
                         np.uint8).astype(np.int32)
  cut = int(round(depth * n_filler))
  tokens = passkey_tokens(filler, cut, key)
  assert tokens.shape[0] == length, (tokens.shape, length)
  return {"tokens": tokens, "key": key, "needle_start": 1 + cut,
          "answer_start": length - PASSKEY_DIGITS}


def answer_accuracy(scorer: Scorer, sequences: np.ndarray,
                    answer_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Teacher-forced answers of a batch.

  Args:
    sequences: int [B, T] full sequences (answers included).
    answer_mask: bool [B, T] the answer tokens (never position 0).

  Returns:
    (correct bool [B]: every answer token of the row is the argmax,
     token_correct bool [B, T] per answer token, False elsewhere).
  """
  # The whole sequence is the input (one shape per length for every task);
  # the causal model's output at the last token predicts nothing here.
  targets = np.concatenate([sequences[:, 1:], sequences[:, -1:]], axis=1)
  _, pred = scorer(sequences, targets)
  hit = (pred[:, :-1] == sequences[:, 1:]) & answer_mask[:, 1:]
  token_correct = np.concatenate([np.zeros_like(hit[:, :1]), hit], axis=1)
  correct = (token_correct | ~answer_mask).all(axis=1)
  return correct, token_correct


def passkey_accuracy(scorer: Scorer, lengths: Sequence[int],
                     depths: Sequence[float], samples: int, seed: int = 0
                     ) -> dict:
  """Accuracy over context length x needle depth, `samples` keys each.

  Returns:
    dict(lengths, depths, accuracy float [len(lengths), len(depths)],
    digit_accuracy: same shape, the fraction of answer digits right).
  """
  lengths = _check_lengths(lengths, passkey_overhead() + 1, "passkey")
  acc = np.zeros((len(lengths), len(depths)))
  digits = np.zeros_like(acc)
  for i, length in enumerate(lengths):
    for j, depth in enumerate(depths):
      seqs = np.stack([passkey_example(length, depth, seed, s)["tokens"]
                       for s in range(samples)])
      mask = np.zeros(seqs.shape, bool)
      mask[:, length - PASSKEY_DIGITS:] = True
      correct, token_correct = answer_accuracy(scorer, seqs, mask)
      acc[i, j] = correct.mean()
      digits[i, j] = token_correct.sum() / mask.sum()
  return {"lengths": lengths, "depths": [float(d) for d in depths],
          "accuracy": acc, "digit_accuracy": digits}


# ----- multi-query associative recall -----

def mqar_example(length: int, num_pairs: int, seed: int, index: int = 0
                 ) -> dict:
  """One MQAR sequence of exactly `length` tokens.

  BOS, num_pairs (key, value) pairs (distinct keys), noise tokens, then
  every key again in a new random order, each followed by its value.

  Returns:
    dict(tokens=int32 [length], answer_mask=bool [length] (the queried
    values), pairs={key: value}).
  """
  if not 1 <= num_pairs <= len(MQAR_KEYS):
    raise ValueError(f"MQAR num_pairs must be in [1, {len(MQAR_KEYS)}], got "
                     f"{num_pairs}")
  n_noise = length - 1 - 4 * num_pairs
  if n_noise < 0:
    raise ValueError(f"MQAR length {length} is too short for {num_pairs} "
                     f"pairs; allowed: lengths >= {1 + 4 * num_pairs}")
  rng = _rng(seed, length, num_pairs, index)
  keys = rng.choice(np.asarray(MQAR_KEYS), num_pairs, replace=False)
  values = rng.choice(np.asarray(MQAR_VALUES), num_pairs)
  queries = rng.permutation(num_pairs)
  noise = rng.choice(np.asarray(MQAR_NOISE), n_noise)
  tokens, mask = mqar_tokens(keys, values, queries, noise)
  return {"tokens": tokens, "answer_mask": mask,
          "pairs": dict(zip(keys.tolist(), values.tolist()))}


def mqar_accuracy(scorer: Scorer, lengths: Sequence[int],
                  num_pairs: Sequence[int], samples: int, seed: int = 0
                  ) -> dict:
  """Accuracy (fraction of queried values predicted) over pairs x length.

  Returns:
    dict(num_pairs, lengths, accuracy float [len(num_pairs), len(lengths)];
    NaN where a length is too short for that many pairs).
  """
  lengths = _check_lengths(lengths, 5, "MQAR")
  acc = np.full((len(num_pairs), len(lengths)), np.nan)
  for i, pairs in enumerate(num_pairs):
    for j, length in enumerate(lengths):
      if length < 1 + 4 * pairs:
        continue
      ex = [mqar_example(length, pairs, seed, s) for s in range(samples)]
      seqs = np.stack([e["tokens"] for e in ex])
      mask = np.stack([e["answer_mask"] for e in ex])
      _, token_correct = answer_accuracy(scorer, seqs, mask)
      acc[i, j] = token_correct.sum() / mask.sum()
  return {"num_pairs": [int(p) for p in num_pairs], "lengths": lengths,
          "accuracy": acc}


# ----- at a curriculum stage's end -----

def stage_end_metrics(scorer: Scorer, val_tokens: np.ndarray, train_len: int,
                      factor: int, samples: int, seed: int = 0) -> dict:
  """Flat scalars of the extrapolation to factor x train_len: the loss per
  position bucket ("loss/pos_LO_HI") and the passkey accuracy per length
  (train_len x 1, 2, 4, ... up to the factor; "passkey/len_N", averaged over
  depths 0, 0.25, ..., 1; lengths shorter than a prompt are left out)."""
  max_len = factor * train_len
  out = {f"loss/pos_{r['lo']}_{r['hi']}": r["loss"] for r in
         loss_by_position(scorer, val_tokens, train_len, max_len, samples)}
  lengths = [n for n in (train_len * 2 ** k for k in range(64))
             if n <= max_len and n > passkey_overhead()]
  if lengths:
    res = passkey_accuracy(scorer, lengths, (0.0, 0.25, 0.5, 0.75, 1.0),
                           samples, seed)
    out.update({f"passkey/len_{n}": float(acc.mean())
                for n, acc in zip(lengths, res["accuracy"])})
  return out


# ----- tables and figures -----

def markdown_table(header: Sequence[str], rows: Iterable[Sequence]) -> str:
  def cell(x):
    if isinstance(x, float):
      return "n/a" if math.isnan(x) else f"{x:.3f}"
    return str(x)
  lines = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---" for _ in header) + "|"]
  lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
  return "\n".join(lines) + "\n"


def loss_table(rows: list[dict]) -> str:
  return markdown_table(
      ["positions", "x train length", "loss (nats)", "bits/byte", "tokens"],
      [(f"[{r['lo']}, {r['hi']})", f"{r['hi_over_train_len']:g}", r["loss"],
        r["bpb"], r["tokens"]) for r in rows])


def passkey_table(res: dict) -> str:
  return markdown_table(
      ["length \\ depth", *[f"{d:g}" for d in res["depths"]]],
      [(n, *map(float, row)) for n, row in zip(res["lengths"],
                                                res["accuracy"])])


def mqar_table(res: dict) -> str:
  return markdown_table(
      ["pairs \\ length", *map(str, res["lengths"])],
      [(p, *map(float, row)) for p, row in zip(res["num_pairs"],
                                                res["accuracy"])])


def _pyplot():
  """matplotlib.pyplot with a file backend, or None where not installed."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def _save(plt, fig, path: str) -> bool:
  """Writes fig to path and frees it; True (the plot functions' result)."""
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
  return True


def plot_loss(rows: list[dict], train_len: int, path: str) -> bool:
  """Loss against position (log x); False where matplotlib is missing."""
  plt = _pyplot()
  if plt is None:
    return False
  fig, ax = plt.subplots(figsize=(6, 4))
  mid = [max(1, (r["lo"] + r["hi"]) / 2) for r in rows]
  ax.plot(mid, [r["loss"] for r in rows], "o-")
  ax.axvline(train_len, color="gray", ls="--", label="training length")
  ax.set_xscale("log")
  ax.set_xlabel("position")
  ax.set_ylabel("loss (nats)")
  ax.set_title("loss against position")
  ax.legend()
  return _save(plt, fig, path)


def plot_passkey(res: dict, path: str) -> bool:
  """Heatmap of accuracy, depth x length; False where matplotlib is missing."""
  plt = _pyplot()
  if plt is None:
    return False
  acc = np.asarray(res["accuracy"]).T  # [depth, length]
  fig, ax = plt.subplots(figsize=(1.2 * len(res["lengths"]) + 2, 4))
  im = ax.imshow(acc, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto",
                 origin="lower")
  ax.set_xticks(range(len(res["lengths"])), [str(n) for n in res["lengths"]])
  ax.set_yticks(range(len(res["depths"])), [f"{d:g}" for d in res["depths"]])
  for (j, i), v in np.ndenumerate(acc):
    ax.text(i, j, f"{v:.2f}", ha="center", va="center", fontsize=8)
  ax.set_xlabel("context length")
  ax.set_ylabel("needle depth")
  ax.set_title("passkey retrieval accuracy")
  fig.colorbar(im)
  return _save(plt, fig, path)


def plot_mqar(res: dict, path: str) -> bool:
  """Accuracy against pairs, one line per length; False without matplotlib."""
  plt = _pyplot()
  if plt is None:
    return False
  fig, ax = plt.subplots(figsize=(6, 4))
  acc = np.asarray(res["accuracy"])
  for j, length in enumerate(res["lengths"]):
    ax.plot(res["num_pairs"], acc[:, j], "o-", label=f"length {length}")
  ax.set_xscale("log", base=2)
  ax.set_ylim(-0.02, 1.02)
  ax.set_xlabel("key-value pairs")
  ax.set_ylabel("accuracy")
  ax.set_title("MQAR")
  ax.legend()
  return _save(plt, fig, path)
