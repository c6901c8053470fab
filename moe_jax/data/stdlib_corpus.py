"""The embedded default corpus: the Python standard library's own source.

Every machine that runs this code has Python, so its standard library is a
corpus that needs no download, ever (docs/design.md §9). We read the `*.py` files
under the directory of the `os` module as raw bytes and tokenize byte-level.

Tokens (vocab 259):
  0..255  the bytes themselves
  PAD=256 padding (never emitted by this corpus)
  BOS=257 starts every document
  EOS=258 ends every document

A document is one source file: `[BOS] + file bytes + [EOS]`. A split is the
concatenation of its documents in sorted relative-path order, so a stream looks
like `BOS f0 ... EOS BOS f1 ... EOS ...`.

The train/val split is by file and deterministic across machines and processes:
a file goes to val when the first 8 bytes of sha256(relative posix path), read
as a fraction in [0, 1), are below `val_fraction` (so the val set of a smaller
fraction is a subset of the val set of a larger one). If no file falls in val
the file with the smallest hash is moved there, and symmetrically for train, so
both splits are never empty.

`max_bytes` bounds memory and time: it caps the total number of tokens (bytes
plus BOS/EOS markers) of both splits together. Val gets
`round(max_bytes * val_fraction)` (at least 1) tokens and train the rest; each
split is filled with its own files in order and cut at exactly its budget (the
last document may be cut short, without its EOS). A capped split is therefore a
prefix of the uncapped one.

Ground floor: numpy and the standard library only.
"""
from __future__ import annotations

import functools
import hashlib
import os
import sysconfig

import numpy as np

NUM_BYTES = 256
PAD = 256
BOS = 257
EOS = 258
VOCAB_SIZE = 259

# Directory names skipped anywhere in the tree: third-party code, the test
# suites (huge, full of deliberately odd files), IDLE and 2to3 (bulky, atypical),
# and caches.
EXCLUDED_DIRS = frozenset({
    "site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3",
    "__pycache__",
})
# Build-specific files whose content differs between machines with the same
# Python version; skipping them keeps the corpus identical across machines.
_EXCLUDED_FILE_PREFIXES = ("_sysconfigdata",)
_EXCLUDED_DIR_PREFIXES = ("config-",)  # config-3.11-x86_64-linux-gnu, ...


def stdlib_root() -> str:
  """The directory of the standard library (where the `os` module lives)."""
  root = os.path.dirname(os.path.abspath(os.__file__))
  if not os.path.isdir(root):  # Frozen/zipped interpreters: ask sysconfig.
    root = sysconfig.get_paths()["stdlib"]
  return root


def _excluded_dir(name: str) -> bool:
  return name in EXCLUDED_DIRS or name.startswith(_EXCLUDED_DIR_PREFIXES)


def list_stdlib_files(root: str | None = None) -> list[str]:
  """Relative posix paths of the corpus files under `root`, sorted.

  Args:
    root: directory to scan; defaults to `stdlib_root()`.

  Returns:
    Sorted list of relative paths ('/'-separated) of the `*.py` files, skipping
    `EXCLUDED_DIRS`, build-specific files and symlinked directories.
  """
  root = root or stdlib_root()
  paths = []
  for dirpath, dirnames, filenames in os.walk(root):  # followlinks=False
    dirnames[:] = [d for d in dirnames if not _excluded_dir(d)]
    rel_dir = os.path.relpath(dirpath, root)
    for name in filenames:
      if not name.endswith(".py") or name.startswith(_EXCLUDED_FILE_PREFIXES):
        continue
      rel = name if rel_dir == "." else os.path.join(rel_dir, name)
      paths.append(rel.replace(os.sep, "/"))
  return sorted(paths)


def file_hash_fraction(relpath: str) -> float:
  """Deterministic fraction in [0, 1) from sha256 of the relative path."""
  digest = hashlib.sha256(relpath.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") / 2.0**64


def split_files(relpaths: list[str], val_fraction: float
                ) -> tuple[list[str], list[str]]:
  """Splits files into (train, val) by path hash; both keep the input order.

  Raises:
    ValueError: val_fraction outside (0, 1) or fewer than two files.
  """
  if not 0.0 < val_fraction < 1.0:
    raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
  if len(relpaths) < 2:
    raise ValueError(
        f"need at least 2 files to split by file, got {len(relpaths)}")
  frac = {p: file_hash_fraction(p) for p in relpaths}
  val = {p for p in relpaths if frac[p] < val_fraction}
  # Never leave a split empty (tiny corpora, extreme fractions).
  if not val:
    val = {min(relpaths, key=frac.__getitem__)}
  if len(val) == len(relpaths):
    val.discard(max(relpaths, key=frac.__getitem__))
  train = [p for p in relpaths if p not in val]
  return train, [p for p in relpaths if p in val]


def _read_documents(root: str, relpaths: list[str], budget: int | None
                    ) -> tuple[np.ndarray, list[str], int]:
  """Concatenates BOS + bytes + EOS of each file, cut at `budget` tokens.

  Returns:
    (tokens uint16 [n], the relative paths that contributed, number of file
    bytes in the tokens, i.e. excluding BOS/EOS and anything cut off).
  """
  chunks, used, n, raw = [], [], 0, 0
  for rel in relpaths:
    if budget is not None and n >= budget:
      break
    with open(os.path.join(root, *rel.split("/")), "rb") as f:
      data = f.read()
    doc = np.empty(len(data) + 2, dtype=np.uint16)
    doc[0] = BOS
    doc[1:-1] = np.frombuffer(data, dtype=np.uint8)
    doc[-1] = EOS
    if budget is not None and n + doc.size > budget:
      doc = doc[:budget - n]  # Exact cap: the last document may be cut.
    chunks.append(doc)
    used.append(rel)
    n += doc.size
    raw += doc.size - int(doc[0] == BOS) - int(doc[-1] == EOS)
  tokens = np.concatenate(chunks) if chunks else np.empty(0, np.uint16)
  return tokens, used, raw


@functools.lru_cache(maxsize=8)
def _build(root: str, val_fraction: float, max_bytes: int | None) -> dict:
  """Builds both splits once per process per argument set (cached)."""
  train_files, val_files = split_files(list_stdlib_files(root), val_fraction)
  if max_bytes is None:
    train_budget = val_budget = None
  else:
    val_budget = max(1, int(round(max_bytes * val_fraction)))
    train_budget = max_bytes - val_budget
  out = {"root": root, "val_fraction": val_fraction, "max_bytes": max_bytes}
  for name, files, budget in (("train", train_files, train_budget),
                              ("val", val_files, val_budget)):
    tokens, used, raw = _read_documents(root, files, budget)
    tokens.setflags(write=False)  # Shared by every caller through the cache.
    out[name] = tokens
    out[f"{name}_files"] = tuple(used)
    out[f"{name}_bytes"] = raw
  return out


def _normalize_args(val_fraction, max_bytes, root):
  if isinstance(val_fraction, bool) or not isinstance(
      val_fraction, (int, float)) or not 0.0 < val_fraction < 1.0:
    raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
  if max_bytes is not None:
    if isinstance(max_bytes, bool) or not isinstance(
        max_bytes, (int, np.integer)) or max_bytes < 0:
      raise ValueError(
          f"max_bytes must be None, 0 (no cap) or a positive integer, got "
          f"{max_bytes!r}")
    max_bytes = int(max_bytes) or None  # 0 means no cap, as in the config.
    if max_bytes is not None and max_bytes < 2:
      raise ValueError(
          f"max_bytes must be >= 2 (one token per split), got {max_bytes}")
  root = os.path.abspath(root or stdlib_root())
  return root, float(val_fraction), max_bytes


def load_stdlib_splits(val_fraction: float = 0.05,
                       max_bytes: int | None = None,
                       root: str | None = None) -> dict[str, np.ndarray]:
  """The stdlib corpus as token streams, split by file.

  Args:
    val_fraction: expected fraction of files in val, in (0, 1).
    max_bytes: cap on the total tokens of both splits (None or 0: no cap); see
      the module docstring for how it is shared between the splits.
    root: directory to read instead of the standard library (tests).

  Returns:
    dict(train=uint16 [n_train], val=uint16 [n_val]), read-only arrays cached
    per process (copy before mutating).
  """
  built = _build(*_normalize_args(val_fraction, max_bytes, root))
  return {"train": built["train"], "val": built["val"]}


def stdlib_split_info(val_fraction: float = 0.05,
                      max_bytes: int | None = None,
                      root: str | None = None) -> dict:
  """Metadata of `load_stdlib_splits` with the same arguments.

  Returns:
    dict with root, val_fraction, max_bytes, and per split ('train', 'val'):
    `{split}_files` (tuple of relative paths that contributed, in order),
    `{split}_num_files`, `{split}_bytes` (file bytes in the stream) and
    `{split}_tokens` (length of the token stream, incl. BOS/EOS).
  """
  built = _build(*_normalize_args(val_fraction, max_bytes, root))
  info = {k: built[k] for k in ("root", "val_fraction", "max_bytes")}
  for name in ("train", "val"):
    info[f"{name}_files"] = built[f"{name}_files"]
    info[f"{name}_num_files"] = len(built[f"{name}_files"])
    info[f"{name}_bytes"] = built[f"{name}_bytes"]
    info[f"{name}_tokens"] = int(built[name].size)
  return info
