"""Deterministic, resumable batching over a 1-D token stream.

Training batches are a pure function of (seed, step): the window starts of the
global batch at step s come from numpy's PCG64 seeded by SeedSequence([seed, s]).
The iterator state is therefore just `{'step': s}`, checkpointed with the model,
and a resume reproduces an uninterrupted run exactly (docs/design.md §9). Every
process draws the same global batch and keeps its own contiguous slice of rows,
so the processes together see exactly the global batch.

Packing (`data.packing`): "concat" draws windows anywhere in the stream
(documents run into each other unmasked, the ablation); "documents" starts
every window at a document start (or, inside a document longer than the
window, at a multiple of seq_len from its start, so such a document continues
window after window) and adds a per-token segment id: 0 at position 0, +1 at
each document start (BOS) after it. The model then keeps documents apart
(moe_jax/model.py); the window's last document may be cut at its end.

Retrieval (`data.retrieval_fraction`, `data.retrieval_kinds`): each row of a
batch is, with that probability, a synthetic retrieval document of the
batch's length instead of its corpus window (moe_jax/data/retrieval.py); the
other rows and the window starts are exactly those without retrieval.

Ground floor: numpy and the standard library only (no jax, nothing of ours
outside this package).
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping

import numpy as np

from moe_jax.data import retrieval
from moe_jax.data import stdlib_corpus
from moe_jax.data import token_file

SOURCES = ("stdlib", "token_file")
PACKINGS = ("concat", "documents")

Batch = dict[str, np.ndarray]


def _check_int(name: str, value: Any, lo: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
  if value < lo:
    raise ValueError(f"{name} must be an integer >= {lo}, got {value}")
  return int(value)


def _check_process(batch_size: int, process_index: Any,
                   process_count: Any) -> tuple[int, int]:
  process_count = _check_int("process_count", process_count, 1)
  process_index = _check_int("process_index", process_index, 0)
  if process_index >= process_count:
    raise ValueError(f"process_index must be in [0, {process_count}), got "
                     f"{process_index}")
  if batch_size % process_count:
    raise ValueError(
        f"data.batch_size (global, {batch_size}) must be divisible by "
        f"process_count ({process_count})")
  return process_index, process_count


def _check_tokens(tokens: Any, seq_len: int, name: str) -> np.ndarray:
  if not isinstance(tokens, np.ndarray):
    tokens = np.asarray(tokens)
  if tokens.ndim != 1:
    raise ValueError(f"{name} must be 1-D, got shape {tokens.shape}")
  if tokens.shape[0] < seq_len + 1:
    raise ValueError(
        f"{name} has {tokens.shape[0]} tokens, fewer than data.seq_len + 1 = "
        f"{seq_len + 1} needed for one (inputs, targets) window")
  return tokens


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> Batch:
  """Gathers windows of seq_len + 1 tokens and splits inputs/targets.

  Args:
    tokens: [n] token ids (memmaps are read only where indexed).
    starts: [b] window starts, each <= n - seq_len - 1.
    seq_len: model sequence length.

  Returns:
    dict(inputs=int32 [b, seq_len], targets=int32 [b, seq_len]).
  """
  idx = starts[:, None] + np.arange(seq_len + 1, dtype=np.int64)[None, :]
  win = np.asarray(tokens[idx]).astype(np.int32)
  return {"inputs": win[:, :-1], "targets": win[:, 1:]}


def check_retrieval_fraction(fraction: Any) -> float:
  if isinstance(fraction, bool) or not isinstance(
      fraction, (int, float, np.floating)) or not 0.0 <= fraction <= 1.0:
    raise ValueError(
        f"data.retrieval_fraction must be a number in [0, 1], got {fraction!r}")
  return float(fraction)


def check_packing(packing: Any) -> str:
  if packing not in PACKINGS:
    raise ValueError(
        f"data.packing must be one of {list(PACKINGS)}, got {packing!r}")
  return packing


def window_starts_of_documents(tokens: np.ndarray, seq_len: int,
                               document_start_token: int) -> np.ndarray:
  """Allowed window starts for data.packing='documents': int64 [m], sorted.

  Each document (from a `document_start_token` to the next, the stream's
  first token starting one too) contributes its start and, when longer than
  seq_len, every seq_len-th position after it; starts too late for a full
  window of seq_len + 1 tokens are dropped.
  """
  n = tokens.shape[0]
  chunk = 1 << 24
  starts = [np.flatnonzero(np.asarray(tokens[i:i + chunk]) ==
                           document_start_token) + i
            for i in range(0, n, chunk)]
  doc_starts = np.unique(np.concatenate([np.zeros(1, np.int64)] + starts))
  doc_ends = np.append(doc_starts[1:], n)
  pieces = -(-(doc_ends - doc_starts) // seq_len)
  offsets = np.arange(pieces.sum()) - np.repeat(np.cumsum(pieces) - pieces,
                                                pieces)
  out = np.repeat(doc_starts, pieces) + offsets * seq_len
  return out[out <= n - seq_len - 1].astype(np.int64)


def segment_ids_of(inputs: np.ndarray, document_start_token: int) -> np.ndarray:
  """int32 [b, T]: 0 at position 0, +1 at each document start after it."""
  is_start = inputs == document_start_token
  is_start[:, 0] = False
  return np.cumsum(is_start, axis=1, dtype=np.int32)


class TokenBatcher:
  """Infinite stream of random training windows; batch(step) is pure.

  Attributes:
    tokens: [n] token ids (ndarray or memmap).
    seq_len: positions per sequence.
    batch_size: GLOBAL sequences per step (all processes together).
    local_batch_size: batch_size // process_count, the rows this process gets.
    seed: non-negative integer.
    process_index, process_count: this process's slice of the global batch.
    packing: "concat" | "documents" (module docstring).
    document_start_token: the id that starts every document (stdlib BOS);
      required with packing "documents".
    retrieval_fraction: probability in [0, 1] that a row is a retrieval
      document (0: the corpus windows only).
    retrieval_kinds: kinds of retrieval.RETRIEVAL_KINDS drawn uniformly.
  """

  def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int,
               seed: int = 0, process_index: int = 0,
               process_count: int = 1, packing: str = "concat",
               document_start_token: int | None = None,
               retrieval_fraction: float = 0.0,
               retrieval_kinds: str | tuple[str, ...] = ("passkey",)):
    self.seq_len = _check_int("data.seq_len", seq_len, 1)
    self.batch_size = _check_int("data.batch_size", batch_size, 1)
    self.seed = _check_int("seed", seed, 0)
    self.process_index, self.process_count = _check_process(
        self.batch_size, process_index, process_count)
    self.tokens = _check_tokens(tokens, self.seq_len, "training tokens")
    self.local_batch_size = self.batch_size // self.process_count
    self.packing = check_packing(packing)
    self.document_start_token = document_start_token
    self._allowed_starts = None
    if packing == "documents":
      if document_start_token is None:
        raise ValueError("data.packing='documents' needs the token that "
                         "starts a document (document_start_token)")
      self._allowed_starts = window_starts_of_documents(
          self.tokens, self.seq_len, document_start_token)
      if not self._allowed_starts.size:
        raise ValueError(
            f"data.packing='documents': no document start leaves room for a "
            f"window of data.seq_len + 1 = {self.seq_len + 1} tokens")
    self.retrieval_fraction = check_retrieval_fraction(retrieval_fraction)
    self.retrieval_kinds = retrieval.parse_kinds(retrieval_kinds)
    if self.retrieval_fraction > 0:
      for kind in self.retrieval_kinds:
        if self.seq_len < retrieval.min_seq_len(kind):
          raise ValueError(
              f"data.seq_len={self.seq_len} is too short for a {kind} "
              f"retrieval document (data.retrieval_kinds); allowed: "
              f"data.seq_len >= {retrieval.min_seq_len(kind)} or "
              "data.retrieval_fraction=0")
    self._step = 0

  def global_starts(self, step: int) -> np.ndarray:
    """Window starts of the global batch at `step`: int64 [batch_size]."""
    step = _check_int("step", step, 0)
    rng = np.random.Generator(
        np.random.PCG64(np.random.SeedSequence([self.seed, step])))
    if self._allowed_starts is not None:
      return self._allowed_starts[rng.integers(
          0, self._allowed_starts.size, size=self.batch_size, dtype=np.int64)]
    # Window [start, start + seq_len] must fit: start <= n - seq_len - 1.
    high = self.tokens.shape[0] - self.seq_len
    return rng.integers(0, high, size=self.batch_size, dtype=np.int64)

  def batch_at(self, step: int) -> Batch:
    """This process's batch at `step` (pure; does not touch the state).

    Returns:
      dict(inputs=int32 [local_batch_size, seq_len],
           targets=int32 [local_batch_size, seq_len]); targets[:, t] is the
      token after inputs[:, t]. With packing "documents" also
      segment_ids=int32 [local_batch_size, seq_len].
    """
    lo = self.process_index * self.local_batch_size
    starts = self.global_starts(step)[lo:lo + self.local_batch_size]
    batch = _windows(self.tokens, starts, self.seq_len)
    if self.retrieval_fraction > 0:
      rows = retrieval.retrieval_rows(self.seed, step, self.batch_size,
                                      self.retrieval_fraction)
      for row in np.flatnonzero(rows[lo:lo + self.local_batch_size]):
        doc = retrieval.retrieval_document(
            self.tokens, self.seq_len + 1, self.retrieval_kinds, self.seed,
            step, lo + row)["tokens"]
        batch["inputs"][row], batch["targets"][row] = doc[:-1], doc[1:]
    if self.packing == "documents":
      batch["segment_ids"] = segment_ids_of(batch["inputs"],
                                            self.document_start_token)
    return batch

  def get_state(self) -> dict[str, int]:
    """{'step': next step to yield}; checkpoint this with the model."""
    return {"step": self._step}

  def set_state(self, state: Mapping[str, Any]) -> None:
    """Restores `get_state()` output (values may be numpy scalars/0-d)."""
    if "step" not in state:
      raise ValueError(f"data iterator state needs a 'step' key, got "
                       f"{sorted(state)}")
    step = state["step"]
    if isinstance(step, np.ndarray) and step.ndim == 0:
      step = step.item()
    self._step = _check_int("data iterator state['step']", step, 0)

  def __iter__(self) -> Iterator[Batch]:
    return self

  def __next__(self) -> Batch:
    batch = self.batch_at(self._step)
    self._step += 1
    return batch


def num_eval_batches(num_tokens: int, seq_len: int, batch_size: int) -> int:
  """Full batches of non-overlapping windows that fit in `num_tokens`."""
  return max(0, (num_tokens - 1) // seq_len) // batch_size


def eval_batches(tokens: np.ndarray, seq_len: int, batch_size: int,
                 max_batches: int | None = None, process_index: int = 0,
                 process_count: int = 1,
                 document_start_token: int | None = None) -> Iterator[Batch]:
  """Deterministic contiguous evaluation batches from the start of a split.

  Window w has inputs tokens[w*seq_len : (w+1)*seq_len] and targets shifted by
  one, so every token after the first is predicted at most once. Global batch
  b holds windows [b*batch_size, (b+1)*batch_size); a process gets its slice
  of rows as in `TokenBatcher`. The last incomplete batch is dropped.

  Args:
    tokens: [n] token ids.
    seq_len: positions per sequence.
    batch_size: global sequences per batch.
    max_batches: stop after this many batches (None: all full batches).
    process_index, process_count: this process's slice.
    document_start_token: with data.packing='documents', the token that
      starts a document: each batch also gets segment_ids (`segment_ids_of`;
      a window that starts inside a document continues it as id 0).

  Yields:
    dict(inputs=int32 [batch_size // process_count, seq_len], targets=same
    (, segment_ids=same)).

  Raises:
    ValueError (eagerly, at call time): bad arguments or not even one full
      batch in `tokens`.
  """
  seq_len = _check_int("data.seq_len", seq_len, 1)
  batch_size = _check_int("data.batch_size", batch_size, 1)
  if max_batches is not None:
    max_batches = _check_int("max_batches", max_batches, 1)
  process_index, process_count = _check_process(batch_size, process_index,
                                                process_count)
  tokens = _check_tokens(tokens, seq_len, "eval tokens")
  n_batches = num_eval_batches(tokens.shape[0], seq_len, batch_size)
  if n_batches == 0:
    raise ValueError(
        f"eval tokens ({tokens.shape[0]}) hold no full batch of data.batch_size"
        f"={batch_size} windows of data.seq_len={seq_len}; need at least "
        f"{batch_size * seq_len + 1} tokens")
  if max_batches is not None:
    n_batches = min(n_batches, max_batches)
  local = batch_size // process_count
  return _eval_gen(tokens, seq_len, batch_size, n_batches,
                   process_index * local, local, document_start_token)


def _eval_gen(tokens, seq_len, batch_size, n_batches, lo, local,
              document_start_token):
  for b in range(n_batches):
    windows = b * batch_size + lo + np.arange(local, dtype=np.int64)
    batch = _windows(tokens, windows * seq_len, seq_len)
    if document_start_token is not None:
      batch["segment_ids"] = segment_ids_of(batch["inputs"],
                                            document_start_token)
    yield batch


def _bincount(tokens: np.ndarray, vocab_size: int, name: str) -> np.ndarray:
  """Counts of each id in [0, vocab_size), chunked so memmaps stay small."""
  counts = np.zeros(vocab_size, dtype=np.int64)
  chunk = 1 << 24
  for i in range(0, tokens.shape[0], chunk):
    part = np.asarray(tokens[i:i + chunk]).astype(np.int64)
    if part.size and (part.min() < 0 or part.max() >= vocab_size):
      raise ValueError(f"{name} has ids outside [0, {vocab_size}): min "
                       f"{part.min()}, max {part.max()}")
    counts += np.bincount(part, minlength=vocab_size)
  return counts


def unigram_bits_per_byte(train_tokens: np.ndarray, eval_tokens: np.ndarray,
                          vocab_size: int, smoothing: float = 1.0) -> float:
  """Cross-entropy (bits/token) of eval tokens under a smoothed unigram model.

  p(v) = (count_train(v) + smoothing) / (n_train + smoothing * vocab_size);
  result = -mean over eval tokens of log2 p(token). This is the baseline a
  language model must beat. With the byte-level corpus one token is one byte,
  so bits/token = bits/byte; BOS/EOS markers count as tokens (on both sides),
  exactly as the model's loss counts them.

  Args:
    train_tokens: [n_train] ids in [0, vocab_size).
    eval_tokens: [n_eval] ids in [0, vocab_size), n_eval >= 1.
    vocab_size: size of the model's vocabulary (e.g. VOCAB_SIZE = 259).
    smoothing: add-k pseudo-count, >= 0 (0 may give inf for unseen ids).

  Returns:
    bits per token (float).
  """
  vocab_size = _check_int("vocab_size", vocab_size, 1)
  if isinstance(smoothing, bool) or not isinstance(
      smoothing, (int, float)) or smoothing < 0:
    raise ValueError(f"smoothing must be a number >= 0, got {smoothing!r}")
  train = _bincount(np.ravel(train_tokens), vocab_size, "train_tokens")
  evals = _bincount(np.ravel(eval_tokens), vocab_size, "eval_tokens")
  n_eval = evals.sum()
  if n_eval == 0:
    raise ValueError("eval_tokens is empty")
  denom = train.sum() + smoothing * vocab_size
  if denom == 0:
    raise ValueError("train_tokens is empty and smoothing is 0")
  seen = evals > 0  # Only ids that occur in eval contribute (avoids 0 * -inf).
  with np.errstate(divide="ignore"):
    log2p = np.log2((train[seen] + smoothing) / denom)
  return float(-(evals[seen] * log2p).sum() / n_eval)


def _get(config: Any, name: str, default: Any = None, required: bool = False):
  """Reads a field from a Mapping, ConfigDict or plain object."""
  try:
    return config[name]
  except (KeyError, TypeError, AttributeError, IndexError):
    pass
  if hasattr(config, name):
    return getattr(config, name)
  if required:
    raise ValueError(f"data.{name} is required")
  return default


def _max_token(tokens: np.ndarray) -> int:
  chunk = 1 << 24
  return max(int(np.max(tokens[i:i + chunk]))
             for i in range(0, tokens.shape[0], chunk))


def make_datasets(data_config: Any, process_index: int = 0,
                  process_count: int = 1
                  ) -> tuple[TokenBatcher, np.ndarray, np.ndarray, int]:
  """Builds the data of a run from the `data` section of a config.

  Fields (Mapping or attribute access; defaults in brackets):
    source ['stdlib']: 'stdlib' | 'token_file'.
    path: token file (token_file only). val_path ['']: optional val file.
    token_dtype ['uint16']: 'uint16' | 'uint32' (token_file only).
    val_fraction [0.05]: in (0, 1); stdlib: fraction of files; token_file
      without val_path: contiguous tail fraction.
    max_bytes [None]: stdlib token cap, None or 0 = whole corpus.
    seq_len, batch_size (global): required, >= 1.
    seed [0]: >= 0.
    packing ['concat']: 'concat' | 'documents' (stdlib only: documents are
      its files, each starting with BOS).
    retrieval_fraction [0.0]: in [0, 1] (stdlib only; the documents are
      bytes). retrieval_kinds ['passkey']: of retrieval.RETRIEVAL_KINDS.

  Args:
    data_config: the fields above.
    process_index, process_count: this process's slice of each global batch.

  Returns:
    (train TokenBatcher, val tokens [n_val], train tokens [n_train],
     vocab_size). vocab_size is stdlib_corpus.VOCAB_SIZE (259) for 'stdlib' and
    max id + 1 over both files for 'token_file' (one streaming pass).

  Raises:
    ValueError naming the field and its allowed values.
  """
  source = _get(data_config, "source", "stdlib")
  if source not in SOURCES:
    raise ValueError(
        f"data.source must be one of {list(SOURCES)}, got {source!r}")
  seq_len = _check_int("data.seq_len",
                       _get(data_config, "seq_len", required=True), 1)
  batch_size = _check_int("data.batch_size",
                          _get(data_config, "batch_size", required=True), 1)
  seed = _check_int("data.seed", _get(data_config, "seed", 0), 0)
  packing = check_packing(_get(data_config, "packing", "concat"))
  if packing == "documents" and source != "stdlib":
    raise ValueError(f"data.packing='documents' needs data.source='stdlib' "
                     f"(its documents are the corpus's files), got {source!r}")
  # Checked before the corpus loads; empty at retrieval_fraction 0.
  if retrieval_kwargs(data_config) and source != "stdlib":
    raise ValueError(f"data.retrieval_fraction > 0 needs data.source='stdlib' "
                     f"(its documents are bytes), got {source!r}")
  _check_process(batch_size, process_index, process_count)
  val_fraction = _get(data_config, "val_fraction", 0.05)
  val_path = _get(data_config, "val_path", "") or None
  if not (source == "token_file" and val_path):
    if isinstance(val_fraction, bool) or not isinstance(
        val_fraction, (int, float)) or not 0.0 < val_fraction < 1.0:
      raise ValueError(
          f"data.val_fraction must be in (0, 1), got {val_fraction!r}")

  if source == "stdlib":
    max_bytes = _get(data_config, "max_bytes", None)
    if max_bytes is not None:
      max_bytes = _check_int("data.max_bytes (None or 0 = no cap)",
                             max_bytes, 0) or None
      if max_bytes is not None and max_bytes < 2:
        raise ValueError(f"data.max_bytes must be 0 (no cap) or >= 2, got "
                         f"{max_bytes}")
    splits = stdlib_corpus.load_stdlib_splits(val_fraction, max_bytes)
    vocab_size = stdlib_corpus.VOCAB_SIZE
  else:
    path = _get(data_config, "path", "")
    if not path:
      raise ValueError("data.path must name a flat binary file of token ids "
                       "when data.source='token_file', got ''")
    dtype = _get(data_config, "token_dtype", "uint16")
    splits = token_file.load_token_file_splits(path, dtype, val_path,
                                               val_fraction)
    vocab_size = max(_max_token(splits["train"]), _max_token(splits["val"])) + 1

  for name in ("train", "val"):
    n = splits[name].shape[0]
    if n < seq_len + 1:
      hint = ("raise data.max_bytes / data.val_fraction" if source == "stdlib"
              else "use more data / a larger data.val_fraction")
      raise ValueError(
          f"{name} split has {n} tokens, fewer than data.seq_len + 1 = "
          f"{seq_len + 1}; lower data.seq_len or {hint}")
  train = TokenBatcher(splits["train"], seq_len, batch_size, seed,
                       process_index, process_count,
                       **batcher_kwargs(data_config))
  return train, splits["val"], splits["train"], vocab_size


def packing_kwargs(data_config: Any) -> dict:
  """TokenBatcher's packing keywords for the `data` section of a config."""
  packing = check_packing(_get(data_config, "packing", "concat"))
  if packing == "concat":
    return {}
  return {"packing": packing,
          "document_start_token": stdlib_corpus.BOS}


def retrieval_kwargs(data_config: Any) -> dict:
  """TokenBatcher's retrieval keywords for the `data` section of a config
  (empty at retrieval_fraction 0, also for configs saved without it)."""
  fraction = check_retrieval_fraction(
      _get(data_config, "retrieval_fraction", 0.0))
  kinds = retrieval.parse_kinds(_get(data_config, "retrieval_kinds",
                                     "passkey"))
  if fraction == 0.0:
    return {}
  return {"retrieval_fraction": fraction, "retrieval_kinds": kinds}


def batcher_kwargs(data_config: Any) -> dict:
  """All of TokenBatcher's keywords from a config: packing and retrieval."""
  return {**packing_kwargs(data_config), **retrieval_kwargs(data_config)}
