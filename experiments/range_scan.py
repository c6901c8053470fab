r"""Numerical range scan of the dense-dot decay tile (docs/design.md §3).

  python -m experiments.range_scan
  python -m experiments.range_scan --g_mins=-3,-5,-8 --tile_lens=16 \
      --dtypes=float32,bfloat16 --anchors=first --out_md=results/range_scan.md

Sweeps g_min x tile length x dtype x anchor for the bounded gate, measures the
dense-dot tile against a float64 pairwise reference, prints a markdown table,
the recommended (most negative safe) bound per (dtype, tile, anchor), and the
same measurement for the unbounded softplus gate.
"""
import json
import math
from typing import Dict, List

from absl import app, flags

from pallas_kernels.linear_attention.common import numerics

_G_MINS = flags.DEFINE_string("g_mins", "-1,-2,-3,-5,-8,-12,-20",
                              "Comma list of decay lower bounds (< 0).")
_TILE_LENS = flags.DEFINE_string("tile_lens", "16,32,64",
                                 "Comma list of tile lengths (rows).")
_DTYPES = flags.DEFINE_string("dtypes", "float32,bfloat16,float16",
                              "Comma list of factor dtypes.")
_ANCHORS = flags.DEFINE_string("anchors", "first,middle,last",
                               "Comma list of anchors: first, middle, last.")
_TRIALS = flags.DEFINE_integer("trials", 8, "Random tiles per cell.")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")
_OUT_JSON = flags.DEFINE_string("out_json", None, "Optional: write rows here.")
_OUT_MD = flags.DEFINE_string("out_md", None, "Optional: write the report here.")


def _split(s: str) -> List[str]:
  return [x.strip() for x in s.split(",") if x.strip()]


def _fmt_err(e: float) -> str:
  return "inf/NaN" if not math.isfinite(e) else f"{e:.2e}"


def table(rows: List[Dict]) -> str:
  """Markdown table of scan rows."""
  lines = ["| gate | g_min | tile | dtype | anchor | worst exponent | rel error | safe |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    g = "none" if r["g_min"] is None else f"{r['g_min']:g}"
    lines.append(f"| {r['gate']} | {g} | {r['tile_len']} | {r['dtype']} | "
                 f"{r['anchor']} | {r['worst_exponent']:.1f} | "
                 f"{_fmt_err(r['rel_error'])} | {'yes' if r['safe'] else 'NO'} |")
  return "\n".join(lines)


def recommendations(rows: List[Dict], dtypes, tile_lens, anchors) -> str:
  """Markdown table of the recommended bound per (dtype, tile, anchor)."""
  lines = ["| dtype | tile | anchor | recommended g_min | max exponent |",
           "|---|---|---|---|---|"]
  for dt in dtypes:
    for tl in tile_lens:
      for an in anchors:
        g = numerics.recommend_bound(rows, dt, tl, an)
        lines.append(f"| {dt} | {tl} | {an} | "
                     f"{'none safe' if g is None else f'{g:g}'} | "
                     f"{numerics.MAX_EXPONENT[dt]:.1f} |")
  return "\n".join(lines)


def report(g_mins, tile_lens, dtypes, anchors, trials, seed):
  """Runs both scans; returns (markdown text, bounded rows, unbounded rows)."""
  bounded = numerics.scan(g_mins, tile_lens, dtypes, anchors, "bounded",
                          trials, seed)
  unbounded = numerics.scan(g_mins, tile_lens, dtypes, anchors, "unbounded",
                            trials, seed)
  tols = ", ".join(f"{k} {v:g}" for k, v in numerics.TOLERANCES.items())
  text = "\n\n".join([
      "## Bounded gate g = g_min * sigmoid(.), worst case of the bound",
      f"rel error = max|A - A_f64| / max|A_f64| over {trials} tiles; "
      f"safe = finite and within tolerance ({tols}).",
      table(bounded),
      "## Recommended bound (most negative safe g_min)",
      recommendations(bounded, dtypes, tile_lens, anchors),
      "## Unbounded gate g = -softplus(x), x = 8 * t_3 "
      "(worst exponent realised)",
      table(unbounded),
  ])
  return text, bounded, unbounded


def _json_safe(x):
  # Strict JSON has no inf/NaN.
  if isinstance(x, float) and not math.isfinite(x):
    return str(x)
  return x


def main(argv):
  del argv
  g_mins = [float(x) for x in _split(_G_MINS.value)]
  if any(g >= 0 for g in g_mins):
    raise app.UsageError(f"--g_mins must all be < 0, got {g_mins}")
  tile_lens = [int(x) for x in _split(_TILE_LENS.value)]
  dtypes = _split(_DTYPES.value)
  anchors = _split(_ANCHORS.value)
  for a in anchors:
    if a not in numerics.ANCHORS:
      raise app.UsageError(f"--anchors: unknown anchor {a!r}")
  for d in dtypes:
    if d not in numerics.DTYPES:
      raise app.UsageError(f"--dtypes: unknown dtype {d!r}")
  text, bounded, unbounded = report(g_mins, tile_lens, dtypes, anchors,
                                    _TRIALS.value, _SEED.value)
  print(text)
  if _OUT_MD.value:
    with open(_OUT_MD.value, "w") as f:
      f.write(text + "\n")
  if _OUT_JSON.value:
    with open(_OUT_JSON.value, "w") as f:
      json.dump([{k: _json_safe(v) for k, v in r.items()}
                 for r in bounded + unbounded], f, indent=1)


if __name__ == "__main__":
  app.run(main)
