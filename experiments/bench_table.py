"""The bench_kernels table (flag-free, so that tests can import it: the
absl-flag experiment modules cannot share a process)."""


def peer_name(row):
  """The peer each of our rows is compared with (docs/design.md §4)."""
  if row["op"] == "gla":
    return "fla chunk_gla"
  if row["impl"] == "ours unbounded":
    return "fla chunk_kda"
  return "fla chunk_kda safe_gate"


def markdown_table(rows, title):
  """The bench table: one line per row, with each of our rows' ratios.

  "peer / ours" is the fla row of the same op and shape over ours (the
  >= 1.0 target); "xla / ours" is the XLA reference's over ours (the >= 5
  target), both as fwd / fwd+bwd, empty where that row was not timed.
  Returns the lines.
  """
  def ratio(r, impl):
    ref = [p for p in rows if (p["op"], p["B"], p["T"], p["impl"])
           == (r["op"], r["B"], r["T"], impl)]
    if not ref or not r["impl"].startswith("ours"):
      return ""
    return (f"{ref[0]['fwd_ms'] / r['fwd_ms']:.2f}x / "
            f"{ref[0]['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x")

  md = [title, "", "| op | B | T | impl | fwd ms | fwd+bwd ms | fwd+bwd GB/s "
        "(floor) | peer / ours (fwd / fwd+bwd) | xla / ours (fwd / fwd+bwd) |",
        "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    md.append(f"| {r['op']} | {r['B']} | {r['T']} | {r['impl']} | "
              f"{r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | "
              f"{r['fwd_bwd_gbps']:.0f} | {ratio(r, peer_name(r))} | "
              f"{ratio(r, 'xla reference')} |")
  return md
