"""experiments/bench_table.markdown_table (bench_kernels's table): each of our
rows carries its ratios to the fla peer the targets name and to the XLA
reference."""
from experiments import bench_table


def _row(op, impl, fwd, fb, b=1, t=8192):
  return dict(op=op, B=b, T=t, impl=impl, fwd_ms=fwd, fwd_bwd_ms=fb,
              fwd_gbps=1.0, fwd_bwd_gbps=1.0)


def _cells(line):
  return [c.strip() for c in line.strip("|").split("|")]


def test_ratios_name_the_right_peer_and_the_xla_reference():
  rows = [_row("kda", "fla chunk_kda safe_gate", 3.0, 12.0),
          _row("kda", "fla chunk_kda", 6.0, 30.0),
          _row("kda", "ours bounded", 2.0, 8.0),
          _row("kda", "ours unbounded", 4.0, 20.0),
          _row("kda", "xla reference", 10.0, 80.0),
          _row("gla", "fla chunk_gla", 1.0, 6.0),
          _row("gla", "ours bounded", 2.0, 4.0),
          # another shape: no peer and no reference there
          _row("gla", "ours bounded", 5.0, 9.0, b=8)]
  md = bench_table.markdown_table(rows, "title")
  assert md[0] == "title"
  body = {(c[0], c[1], c[3]): c for c in map(_cells, md[4:])}
  assert len(body) == len(rows)
  assert body["kda", "1", "ours bounded"][7:] == ["1.50x / 1.50x",
                                                  "5.00x / 10.00x"]
  assert body["kda", "1", "ours unbounded"][7:] == ["1.50x / 1.50x",
                                                    "2.50x / 4.00x"]
  assert body["gla", "1", "ours bounded"][7:] == ["0.50x / 1.50x", ""]
  assert body["gla", "8", "ours bounded"][7:] == ["", ""]
  # peers and the reference carry no ratio of their own
  assert body["kda", "1", "xla reference"][7:] == ["", ""]
  assert body["kda", "1", "fla chunk_kda"][7:] == ["", ""]
