"""Metrics sinks: JSON lines (metrics.jsonl) and TensorBoard event files.

Only the writer of process 0 is enabled on multi-host runs; a disabled writer
accepts calls and writes nothing. A resumed run first drops the rows past
its restored step (`drop_rows_after`), so every step appears once.
"""
from __future__ import annotations

import json
import math
import os
from typing import Collection, Mapping

import numpy as np


def to_python(value):
  """Scalars and 0-d arrays to float/int; NaN/inf become strings for JSON."""
  if isinstance(value, (np.ndarray, np.generic)) or hasattr(value, "dtype"):
    value = np.asarray(value).item()
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  return value


class MetricsWriter:
  """Appends {"step": s, "split": ..., **metrics} lines and TB scalars."""

  def __init__(self, workdir: str, enabled: bool = True,
               tensorboard: bool = True):
    self.enabled = enabled
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.last_step: dict[str, int] = {}  # split -> step of its last row
    self._tb = None
    if enabled:
      os.makedirs(workdir, exist_ok=True)
      if tensorboard:
        try:
          from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
          self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
        except ImportError:  # The JSON lines stay the source of truth.
          self._tb = None

  def write(self, step: int, metrics: Mapping[str, object],
            split: str = "train") -> None:
    self.last_step[split] = int(step)
    if not self.enabled:
      return
    row = {"step": int(step), "split": split}
    row.update({k: to_python(v) for k, v in metrics.items()})
    with open(self.path, "a") as f:
      f.write(json.dumps(row) + "\n")
    if self._tb is not None:
      for k, v in row.items():
        if k not in ("step", "split") and isinstance(v, (int, float)):
          self._tb.add_scalar(f"{split}/{k}", v, int(step))

  def drop_rows_after(self, step: int,
                      splits: Collection[str] | None = None) -> int:
    """Rewrites metrics.jsonl without rows past `step`; returns how many.

    A run killed after its last checkpoint wrote rows that the resumed run
    writes again. Unparsable lines (a write cut short) are dropped too. The
    file is replaced atomically. splits: only rows of these splits are
    dropped (None: all), for a file shared by phases with their own steps.
    """
    if not self.enabled or not os.path.exists(self.path):
      return 0
    with open(self.path) as f:
      lines = [line for line in f if line.strip()]
    keep = []
    for line in lines:
      try:
        row = json.loads(line)
        if row["step"] <= step or (splits is not None
                                   and row["split"] not in splits):
          keep.append(line if line.endswith("\n") else line + "\n")
      except (ValueError, KeyError, TypeError):
        pass
    if len(keep) == len(lines):
      return 0
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(keep)
    os.replace(tmp, self.path)
    return len(lines) - len(keep)

  def write_histogram(self, step: int, tag: str, values) -> None:
    if self.enabled and self._tb is not None:
      self._tb.add_histogram(tag, np.asarray(values), int(step))

  def flush(self) -> None:
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()


def read_metrics(workdir: str) -> list[dict]:
  """All rows of a run's metrics.jsonl (for notebooks and tests)."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]
