"""notebooks/04_long_context.ipynb runs end to end on a tiny two-stage
ladder it trains itself, and shows real content: finite losses of both
stages, prefill + decode equal to the full forward, a KDA cache that does
not grow with the context."""
import re

import jax
import numpy as np

from conftest import execute_notebook
from moe_jax.train.metrics import read_metrics


def test_long_context_notebook(tmp_path, monkeypatch):
  workdir = str(tmp_path / "ladder")
  monkeypatch.setenv("MOE_JAX_LONG_DIR", workdir)
  # The kernel compiles through the tests' persistent cache.
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR",
                     jax.config.jax_compilation_cache_dir)
  monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
  nb, text = execute_notebook("04_long_context.ipynb")

  assert "training the tiny ladder there" in text
  train = [r for r in read_metrics(workdir) if r["split"] == "train"]
  assert {r["stage"] for r in train} == {0, 1}
  assert {(r["stage"], r["seq_len"]) for r in train} == {(0, 32), (1, 64)}
  losses = [float(x) for x in re.findall(r"stage \d  seq_len +\d+  loss (\S+)",
                                         text)]
  assert len(losses) == len(train) and np.all(np.isfinite(losses))
  assert "train losses finite: True" in text
  # Each stage ends with its extrapolation to 4x its length.
  ends = [r for r in read_metrics(workdir) if r["split"] == "long_context"]
  assert [(r["stage"], r["seq_len"]) for r in ends] == [(0, 32), (1, 64)]
  assert "stage-end losses finite: True" in text
  assert "passkey by length {128: " in text  # stage 0 reaches 4 x 32
  assert "loss by position up to 256: finite: True" in text
  assert "passkey grid (lengths x depths): (2, 3)" in text
  assert "MQAR grid (pairs x lengths): (2, 2)" in text

  diff = float(re.search(r"decode max abs difference: (\S+)", text)[1])
  assert 0 <= diff < 1e-4, diff  # NaN fails both
  assert float(re.search(r"logits up to (\S+)\)", text)[1]) > 0.5

  # Cache rows: layer, kind, bytes at 256, bytes at 1024.
  rows = re.findall(r"^(layer_\d+_\w+) +(KDA|MLA) +([\d,]+) +([\d,]+) ",
                    text, re.M)
  assert {kind for _, kind, _, _ in rows} == {"KDA", "MLA"}
  for _, kind, short, long in rows:
    short, long = int(short.replace(",", "")), int(long.replace(",", ""))
    if kind == "KDA":
      assert short == long > 0
    else:  # the latent grows with the context: 4x the positions
      assert long > 3 * short
  assert "KDA cache constant in context length: True" in text
  assert "MLA cache entries: ['c_kv', 'index', 'segment_ids']" in text
  images = [o for c in nb.cells if c.cell_type == "code"
            for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
  # stages, stage ends, loss by position, passkey, MQAR
  assert len(images) == 5
