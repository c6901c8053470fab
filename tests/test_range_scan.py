"""Numerical range scan of the dense-dot decay tile (docs/design.md §3)."""
import math
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, execute_notebook
from pallas_kernels.linear_attention.common import numerics


def _row(rows, **kw):
  (r,) = [r for r in rows if all(r[k] == v for k, v in kw.items())]
  return r


@pytest.fixture(scope="module")
def bounded_rows():
  return numerics.scan([-3, -5, -8, -12], [16, 32], ["float32", "bfloat16"],
                       ["first", "middle"], gate="bounded", trials=4, seed=0)


def test_default_bound_is_safe_for_16_row_tiles(bounded_rows):
  # g_min=-5, L=16: worst exponent 75 < 88.7, so fp32 and bf16 both hold.
  for dt in ("float32", "bfloat16"):
    r = _row(bounded_rows, g_min=-5.0, tile_len=16, dtype=dt, anchor="first")
    assert r["worst_exponent"] == 75.0
    assert r["safe"], r
    assert r["rel_error"] <= numerics.TOLERANCES[dt]


def test_large_bound_overflows_in_fp32(bounded_rows):
  r = _row(bounded_rows, g_min=-12.0, tile_len=16, dtype="float32",
           anchor="first")
  assert r["worst_exponent"] == 180.0 > numerics.MAX_EXPONENT["float32"]
  assert not r["safe"]
  assert not math.isfinite(r["rel_error"]) or r["rel_error"] > 1.0


def test_middle_anchor_doubles_the_usable_range(bounded_rows):
  # -8 with 16 rows: 120 nats from the first row, 64 from the middle one.
  assert not _row(bounded_rows, g_min=-8.0, tile_len=16, dtype="float32",
                  anchor="first")["safe"]
  assert _row(bounded_rows, g_min=-8.0, tile_len=16, dtype="float32",
              anchor="middle")["safe"]
  assert numerics.recommend_bound(bounded_rows, "float32", 16, "first") == -5.0
  assert numerics.recommend_bound(bounded_rows, "bfloat16", 16, "middle") == -8.0
  # Nothing in this grid fits a 32-row tile from the first row (93+ nats).
  assert numerics.recommend_bound(bounded_rows, "float32", 32, "first") is None


def test_unbounded_softplus_gate_is_unsafe():
  rows = numerics.scan([-5], [16], ["float32", "bfloat16"], ["first"],
                       gate="unbounded", trials=4, seed=0)
  assert len(rows) == 2
  for r in rows:
    assert r["g_min"] is None
    assert r["worst_exponent"] > numerics.MAX_EXPONENT["float32"]
    assert not r["safe"], r


def test_worst_exponent_closed_form():
  for g_min in (-1.0, -5.0, -12.0):
    for tile_len in (16, 32, 64):
      s = (tile_len - 1) * abs(g_min)
      assert numerics.worst_exponent(g_min, tile_len, "first") == s
      assert numerics.worst_exponent(g_min, tile_len, "last") == s
      mid = numerics.worst_exponent(g_min, tile_len, "middle")
      assert s / 2 <= mid <= s / 2 + abs(g_min)
  assert numerics.worst_exponent(-5, 16, "first") == 75.0


def test_worst_exponent_is_reached_by_the_drawn_worst_case():
  rng = np.random.default_rng(0)
  _, _, b = numerics.draw_tile(rng, 2, 16, 8, "bounded", -5.0)
  for anchor in numerics.ANCHORS:
    np.testing.assert_allclose(numerics.realised_exponent(b, anchor),
                               numerics.worst_exponent(-5.0, 16, anchor),
                               rtol=1e-5)


@pytest.mark.parametrize("anchor", numerics.ANCHORS)
def test_dense_tile_matches_f64_reference_for_mild_decay(anchor):
  rng = np.random.default_rng(1)
  q = rng.standard_normal((3, 16, 32)).astype(np.float32)
  k = rng.standard_normal((3, 16, 32)).astype(np.float32)
  g = rng.uniform(-0.5, 0.0, (3, 16, 32)).astype(np.float32)
  b = np.cumsum(g, axis=-2)
  a = numerics.dense_tile_scores(q, k, b, anchor, "float32")
  ref = numerics.pairwise_tile_scores_f64(q, k, b)
  assert a.shape == ref.shape == (3, 16, 16)
  assert np.all(np.triu(a, 1) == 0)
  np.testing.assert_allclose(a, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_pairwise_reference_matches_a_loop():
  rng = np.random.default_rng(2)
  q, k = rng.standard_normal((2, 5, 3))
  b = np.cumsum(-rng.uniform(0, 30, (5, 3)), axis=0)  # exponents far past fp32
  ref = numerics.pairwise_tile_scores_f64(q, k, b)
  for i in range(5):
    for j in range(5):
      want = sum(q[i, d] * k[j, d] * math.exp(b[i, d] - b[j, d])
                 for d in range(3)) if j <= i else 0.0
      assert ref[i, j] == pytest.approx(want, rel=1e-12, abs=1e-300)


def test_range_scan_cli_prints_a_table(tmp_path):
  out_json = tmp_path / "rows.json"
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.range_scan", "--g_mins=-5",
       "--tile_lens=16", "--dtypes=float32", "--anchors=first", "--trials=2",
       f"--out_json={out_json}"],
      cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  out = proc.stdout
  assert "| gate | g_min | tile | dtype | anchor | worst exponent | rel error | safe |" in out
  assert "| bounded | -5 | 16 | float32 | first | 75.0 |" in out
  assert "| float32 | 16 | first | -5 |" in out  # the recommendation
  assert "| unbounded | none | 16 | float32 | first |" in out
  assert out_json.exists()


def test_notebook_executes():
  nb, outputs = execute_notebook("01_decay_numerics.ipynb")
  assert "recommended bound" in outputs
  assert "float32   L= 16: -5.0" in outputs
  assert any("image/png" in o.get("data", {}) for c in nb.cells
             if c.cell_type == "code" for o in c.get("outputs", []))
