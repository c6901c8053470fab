"""Metrics sinks: JSON lines (metrics.jsonl) and TensorBoard event files.

Only the writer of process 0 is enabled on multi-host runs; a disabled writer
accepts calls and writes nothing.
"""
from __future__ import annotations

import json
import math
import os
from typing import Mapping

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
