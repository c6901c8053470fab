"""User data: a flat binary file of token ids, memory-mapped, never loaded.

The file is the raw native-endian (little-endian on every machine we run on)
array of ids written by e.g. `np.asarray(ids, np.uint16).tofile(path)`; there is
no header. Documents are separated by whatever ids the user's tokenizer uses;
we do not interpret them.

Ground floor: numpy and the standard library only.
"""
from __future__ import annotations

import os

import numpy as np

TOKEN_DTYPES = ("uint16", "uint32")


class TokenFileError(OSError):
  """A token file is missing or cannot be read; the message names the field."""


class TokenFileNotFoundError(TokenFileError, FileNotFoundError):
  """The token file does not exist."""


def load_token_file(path: str, dtype: str = "uint16", *,
                    field: str = "data.path") -> np.ndarray:
  """Memory-maps a flat binary file of token ids (read-only).

  Args:
    path: file of `dtype` ids, no header.
    dtype: 'uint16' or 'uint32'.
    field: config field named in error messages about `path`.

  Returns:
    np.memmap of shape [num_tokens] (pages are read lazily by the OS).

  Raises:
    ValueError: unknown dtype (names data.token_dtype), empty file, or a size
      that is not a multiple of the item size (names `field`).
    TokenFileNotFoundError (a FileNotFoundError): `path` does not exist.
    TokenFileError: `path` cannot be read (permissions, a directory, ...).
  """
  if dtype not in TOKEN_DTYPES:
    raise ValueError(
        f"data.token_dtype must be one of {list(TOKEN_DTYPES)}, got {dtype!r}")
  path = os.fspath(path)
  if not os.path.exists(path):
    raise TokenFileNotFoundError(f"{field}: token file not found: {path!r}")
  if not os.path.isfile(path):
    raise TokenFileError(f"{field}: token file {path!r} is not a regular "
                         "file")
  try:  # np.memmap's own error would not name the field.
    with open(path, "rb"):
      pass
  except OSError as e:
    raise TokenFileError(f"{field}: cannot read token file {path!r}: "
                         f"{e.strerror or e}") from e
  itemsize = np.dtype(dtype).itemsize
  size = os.path.getsize(path)
  if size == 0:  # np.memmap cannot map an empty file.
    raise ValueError(f"{field}: token file {path!r} is empty")
  if size % itemsize:
    raise ValueError(
        f"{field}: size of {path!r} ({size} bytes) is not a multiple of the "
        f"item size {itemsize} of data.token_dtype={dtype!r}; wrong dtype or "
        f"a truncated file?")
  return np.memmap(path, dtype=dtype, mode="r", shape=(size // itemsize,))


def load_token_file_splits(path: str, dtype: str = "uint16",
                           val_path: str | None = None,
                           val_fraction: float = 0.05) -> dict[str, np.ndarray]:
  """Train/val token streams from user files.

  With `val_path`, train is all of `path` and val all of `val_path`. Without
  it, val is the contiguous tail of `path`: `max(1, round(n * val_fraction))`
  tokens; train is the rest. Both are memmap views (no copy).

  Args:
    path: training token file.
    dtype: 'uint16' or 'uint32' (both files).
    val_path: optional validation token file ('' or None: split the tail).
    val_fraction: tail fraction in (0, 1), used only without `val_path`.

  Returns:
    dict(train=[n_train], val=[n_val]) memmaps of `dtype`.
  """
  train = load_token_file(path, dtype, field="data.path")
  if val_path:
    return {"train": train,
            "val": load_token_file(val_path, dtype, field="data.val_path")}
  if isinstance(val_fraction, bool) or not isinstance(
      val_fraction, (int, float)) or not 0.0 < val_fraction < 1.0:
    raise ValueError(
        f"data.val_fraction must be in (0, 1), got {val_fraction!r}")
  n = train.shape[0]
  n_val = max(1, int(round(n * val_fraction)))
  if n_val >= n:
    raise ValueError(
        f"data.path: {n} tokens are too few to split off a val tail with "
        f"data.val_fraction={val_fraction}")
  return {"train": train[:n - n_val], "val": train[n - n_val:]}
