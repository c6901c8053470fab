"""Statistics over seeds for sweeps: mean, std, spread, significance, verdicts.

Each sweep entry is trained with several seeds (init and data order). Per
entry and column the summary reports the mean, the standard deviation
(sample std, ddof=1; 0 for one seed), n, and the *spread*: max - min over
the seeds.

A difference between two entries is *significant* only when the absolute
difference of their means exceeds the spread (max - min over seeds) of
each of the two entries, and both have at least two seeds: with one seed
there is no spread to measure, so nothing is significant. Max - min rather
than a multiple of the std because with the 2-3 seeds a sweep can afford,
the range is what one actually sees, and it needs no distributional
assumption.

A claim is checked by `verdict`: "reproduced", "not reproduced" or "within
noise", and `verdict_line` writes it as the one line a results table uses.
Flag-free (no absl), so tests and notebooks import it.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

SPREAD = "max-min over seeds"
SIGNIFICANCE_RULE = ("significant (*) when |mean difference| exceeds both "
                     f"entries' spread ({SPREAD}), each with n >= 2 seeds")

# The claims `verdict` checks, candidate against baseline:
#   lower / higher: the candidate's mean is below / above the baseline's;
#   no_higher / no_lower: the candidate costs nothing: its mean is not
#     significantly above / below the baseline's.
CLAIMS = ("lower", "higher", "no_higher", "no_lower")
VERDICTS = ("reproduced", "not reproduced", "within noise")


def seed_stats(values: Sequence[float]) -> dict:
  """{'mean', 'std', 'spread', 'n', 'values'} of one column over seeds.

  std is the sample standard deviation (ddof=1), 0.0 for a single seed;
  spread is max - min. Raises ValueError on no values or a non-finite one
  (a diverged seed must not hide in a mean).
  """
  v = np.asarray([float(x) for x in values], dtype=np.float64)
  if v.size == 0:
    raise ValueError("seed_stats needs at least one value")
  if not np.all(np.isfinite(v)):
    raise ValueError(f"seed_stats got a non-finite value: {v.tolist()}")
  return {"mean": float(v.mean()),
          "std": float(v.std(ddof=1)) if v.size > 1 else 0.0,
          "spread": float(v.max() - v.min()),
          "n": int(v.size),
          "values": v.tolist()}


def difference(candidate: dict, baseline: dict) -> dict:
  """{'diff', 'significant'}: candidate mean - baseline mean, and whether
  |diff| exceeds both spreads (False when either entry has one seed).

  candidate, baseline: seed_stats() results.
  """
  diff = candidate["mean"] - baseline["mean"]
  significant = (candidate["n"] >= 2 and baseline["n"] >= 2
                 and abs(diff) > candidate["spread"]
                 and abs(diff) > baseline["spread"])
  return {"diff": diff, "significant": bool(significant)}


def verdict(candidate: Sequence[float], baseline: Sequence[float],
            claim: str, scale: float = 1.0) -> str:
  """Whether per-seed `candidate` values bear out `claim` against `baseline`.

  scale: the claim is against scale x baseline (every seed's value scaled,
    so its spread too): e.g. claim "no_higher", scale 0.5 = "at most half
    the baseline".
  claim: one of CLAIMS.
    lower / higher: "reproduced" when the difference is significant in the
      claimed direction, "not reproduced" when significant the other way,
      else "within noise".
    no_higher / no_lower: "not reproduced" when significantly above / below
      the baseline, else "reproduced" (a tie is what the claim says).
  Returns one of VERDICTS.
  """
  if claim not in CLAIMS:
    raise ValueError(f"claim={claim!r} is unknown; allowed: {list(CLAIMS)}")
  d = difference(seed_stats(candidate),
                 seed_stats([scale * float(v) for v in baseline]))
  if claim in ("no_higher", "no_lower"):
    worse = d["diff"] > 0 if claim == "no_higher" else d["diff"] < 0
    return "not reproduced" if d["significant"] and worse else "reproduced"
  if not d["significant"]:
    return "within noise"
  right_way = d["diff"] < 0 if claim == "lower" else d["diff"] > 0
  return "reproduced" if right_way else "not reproduced"


def format_stat(s: dict) -> str:
  """'mean +- std' with 4 significant digits, e.g. '2.345 +- 0.0123'."""
  return f"{s['mean']:.4g} +- {s['std']:.3g}"


def verdict_line(claim_text: str, column: str, candidate_name: str,
                 candidate: Sequence[float], baseline_name: str,
                 baseline: Sequence[float], claim: str,
                 scale: float = 1.0) -> str:
  """One line for a results table, e.g.

  'Block AttnRes lowers val loss: reproduced (val_loss: block-2 2.31 +- 0.01
   (spread 0.02) vs standard 2.35 +- 0.01 (spread 0.02), diff -0.04, n=3/3,
   significance: |diff| > max-min over seeds of both)'.
  """
  c = seed_stats(candidate)
  b = seed_stats([scale * float(v) for v in baseline])
  d = difference(c, b)
  base = baseline_name if scale == 1.0 else f"{scale:g} x {baseline_name}"
  return (f"{claim_text}: {verdict(candidate, baseline, claim, scale)} "
          f"({column}: {candidate_name} {format_stat(c)} (spread "
          f"{c['spread']:.3g}) vs {base} {format_stat(b)} (spread "
          f"{b['spread']:.3g}), "
          f"diff {d['diff']:+.4g}, n={c['n']}/{b['n']}, significance: "
          f"|diff| > {SPREAD} of both)")


def claim_verdicts(runs: Sequence[dict], claims: Sequence[dict]) -> list[str]:
  """verdict_line of each claim whose two entries ran.

  runs: per-seed rows ('name' and the claims' columns). claims: dicts with
  'text', 'column', 'candidate', 'baseline' (entry names), 'claim' (one of
  CLAIMS) and optionally 'scale'. A claim whose entries did not both run
  gets 'TEXT: not run (ENTRY missing)'.
  """
  by_name = {}
  for r in runs:
    by_name.setdefault(r["name"], []).append(r)
  lines = []
  for c in claims:
    missing = [n for n in (c["candidate"], c["baseline"]) if n not in by_name]
    if missing:
      lines.append(f"{c['text']}: not run ({', '.join(missing)} missing)")
      continue
    lines.append(verdict_line(
        c["text"], c["column"], c["candidate"],
        [r[c["column"]] for r in by_name[c["candidate"]]], c["baseline"],
        [r[c["column"]] for r in by_name[c["baseline"]]], c["claim"],
        c.get("scale", 1.0)))
  return lines


def aggregate(runs: Sequence[dict], columns: Sequence[str]) -> list[dict]:
  """Per-entry statistics of per-seed rows, in first-seen entry order.

  runs: rows with 'name' and each of `columns` (one row per entry and seed).
  Returns one row per entry: {'name', 'n', 'seeds', column: seed_stats}.
  """
  order, by_name = [], {}
  for r in runs:
    if r["name"] not in by_name:
      order.append(r["name"])
      by_name[r["name"]] = []
    by_name[r["name"]].append(r)
  out = []
  for name in order:
    rows = by_name[name]
    entry = {"name": name, "n": len(rows),
             "seeds": [r.get("seed") for r in rows]}
    for col in columns:
      entry[col] = seed_stats([r[col] for r in rows])
    out.append(entry)
  return out


def compare(entries: Sequence[dict], columns: Sequence[str],
            baselines: dict[str, str]) -> list[dict]:
  """Each entry against its baseline: {'name', 'baseline', column: difference}.

  entries: aggregate() rows. baselines: entry name -> baseline entry name
  (an entry that is its own baseline, or whose baseline did not run, is
  left out).
  """
  by_name = {e["name"]: e for e in entries}
  out = []
  for e in entries:
    base = baselines.get(e["name"])
    if base is None or base == e["name"] or base not in by_name:
      continue
    row = {"name": e["name"], "baseline": base}
    for col in columns:
      row[col] = difference(e[col], by_name[base][col])
    out.append(row)
  return out


def to_markdown(entries: Sequence[dict], comparisons: Sequence[dict],
                columns: Sequence[str]) -> str:
  """Two tables: mean +- std (n) per entry, and differences to baselines."""
  lines = [f"Per entry: mean +- std over seeds (sample std; spread = {SPREAD} "
           "in summary.json).", "",
           "| name | n | " + " | ".join(columns) + " |",
           "|" + "---|" * (len(columns) + 2)]
  for e in entries:
    lines.append(f"| {e['name']} | {e['n']} | " + " | ".join(
        format_stat(e[c]) for c in columns) + " |")
  if comparisons:
    lines += ["", f"Against the baseline: mean difference (entry - baseline); "
              f"{SIGNIFICANCE_RULE}.", "",
              "| name | baseline | " + " | ".join(columns) + " |",
              "|" + "---|" * (len(columns) + 2)]
    for r in comparisons:
      lines.append(f"| {r['name']} | {r['baseline']} | " + " | ".join(
          f"{r[c]['diff']:+.4g}{'*' if r[c]['significant'] else ''}"
          for c in columns) + " |")
  return "\n".join(lines) + "\n"
