"""Statistics over seeds: hand-computed means, spreads, significance, verdicts."""
import math

import pytest

from moe_jax.eval import sweep_stats


def test_seed_stats_by_hand():
  s = sweep_stats.seed_stats([1.0, 2.0, 4.0])
  assert s["mean"] == pytest.approx(7 / 3)
  # Sample std: squared deviations 16/9 + 1/9 + 25/9 = 42/9, over n - 1 = 2.
  assert s["std"] == pytest.approx(math.sqrt(21 / 9))
  assert s["spread"] == 3.0 and s["n"] == 3
  one = sweep_stats.seed_stats([5.0])
  assert one == {"mean": 5.0, "std": 0.0, "spread": 0.0, "n": 1,
                 "values": [5.0]}


def test_seed_stats_rejects_nan_and_empty():
  with pytest.raises(ValueError, match="non-finite"):
    sweep_stats.seed_stats([1.0, float("nan")])
  with pytest.raises(ValueError, match="at least one"):
    sweep_stats.seed_stats([])


def test_significance_needs_both_spreads_exceeded():
  base = sweep_stats.seed_stats([2.00, 2.02, 2.04])    # spread 0.04
  tight = sweep_stats.seed_stats([1.90, 1.91, 1.92])   # spread 0.02
  wide = sweep_stats.seed_stats([1.80, 1.92, 2.00])    # spread 0.20
  d = sweep_stats.difference(tight, base)
  assert d["diff"] == pytest.approx(-0.11) and d["significant"]
  # The same kind of gap, but the candidate's own seeds spread wider.
  d = sweep_stats.difference(wide, base)
  assert d["diff"] == pytest.approx(-0.1133, abs=1e-4)
  assert not d["significant"]
  # A gap beyond the candidate's spread but not the baseline's.
  noisy_base = sweep_stats.seed_stats([1.8, 2.0, 2.2])  # spread 0.4
  assert not sweep_stats.difference(tight, noisy_base)["significant"]
  # One seed: no spread to judge by, never significant.
  assert not sweep_stats.difference(sweep_stats.seed_stats([1.0]),
                                    base)["significant"]


def test_verdicts():
  base, better, worse = [2.00, 2.02, 2.04], [1.90, 1.91, 1.92], [2.2, 2.21]
  close = [2.01, 2.03, 2.05]
  v = sweep_stats.verdict
  assert v(better, base, "lower") == "reproduced"
  assert v(worse, base, "lower") == "not reproduced"
  assert v(close, base, "lower") == "within noise"
  assert v(worse, base, "higher") == "reproduced"
  # "Costs nothing" claims: a tie or a gain reproduces, a loss does not.
  assert v(close, base, "no_higher") == "reproduced"
  assert v(better, base, "no_higher") == "reproduced"
  assert v(worse, base, "no_higher") == "not reproduced"
  assert v(better, base, "no_lower") == "not reproduced"
  with pytest.raises(ValueError, match=r"allowed: \['lower', 'higher', "
                     r"'no_higher', 'no_lower'\]"):
    v(better, base, "smaller")


def test_verdict_line_and_tables():
  line = sweep_stats.verdict_line(
      "Block AttnRes lowers val loss", "val_loss", "block-2",
      [1.90, 1.91, 1.92], "standard", [2.00, 2.02, 2.04], "lower")
  assert line.startswith("Block AttnRes lowers val loss: reproduced (val_loss:"
                         " block-2 1.91 +- 0.01 (spread 0.02) vs standard "
                         "2.02 +- 0.02 (spread 0.04), diff -0.11, n=3/3")
  runs = [{"name": n, "seed": s, "x": x} for n, s, x in [
      ("a", 0, 1.0), ("a", 1, 1.2), ("b", 0, 2.0), ("b", 1, 2.1),
      ("c", 0, 1.1)]]
  entries = sweep_stats.aggregate(runs, ["x"])
  assert [(e["name"], e["n"], e["seeds"]) for e in entries] == [
      ("a", 2, [0, 1]), ("b", 2, [0, 1]), ("c", 1, [0])]
  assert entries[0]["x"]["mean"] == pytest.approx(1.1)
  comps = sweep_stats.compare(entries, ["x"], {"a": "a", "b": "a", "c": "a"})
  assert [(r["name"], r["baseline"]) for r in comps] == [("b", "a"),
                                                        ("c", "a")]
  assert comps[0]["x"]["significant"] and not comps[1]["x"]["significant"]
  table = sweep_stats.to_markdown(entries, comps, ["x"])
  assert "| b | 2 | 2.05 +- 0.0707 |" in table
  assert "| b | a | +0.95* |" in table and "| c | a | +0 |" in table
  assert "max-min over seeds" in table


def test_scaled_claims_and_claim_verdicts():
  sign, qb = [2.0, 2.2, 2.4], [0.9, 1.0, 1.05]
  v = sweep_stats.verdict
  # 0.5 x sign = [1.0, 1.1, 1.2] (spread 0.2): qb is at most half of it.
  assert v(qb, sign, "no_higher", scale=0.5) == "reproduced"
  assert v([1.5, 1.6, 1.55], sign, "no_higher", scale=0.5) == "not reproduced"
  runs = [{"name": n, "m": x} for n, xs in (("qb", qb), ("sign", sign))
          for x in xs]
  lines = sweep_stats.claim_verdicts(runs, [
      {"text": "QB halves MaxVio", "column": "m", "candidate": "qb",
       "baseline": "sign", "claim": "no_higher", "scale": 0.5},
      {"text": "aux", "column": "m", "candidate": "aux", "baseline": "sign",
       "claim": "lower"}])
  assert lines[0].startswith("QB halves MaxVio: reproduced (m: qb 0.9833 +- "
                             "0.0764 (spread 0.15) vs 0.5 x sign 1.1 +- 0.1 "
                             "(spread 0.2)")
  assert lines[1] == "aux: not run (aux missing)"
