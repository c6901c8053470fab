r"""Benchmark of the chunked linear-attention kernels (GPU), with peers in the same call.

Times forward and forward+backward (median ms) of, per op (GLA, KDA):
  ours bounded   (Pallas, dense diagonal tiles, g_min=-5)
  ours unbounded (Pallas, position-pair diagonal tiles)
  xla            (the pure-JAX chunked oracle; only up to --xla_max_tokens)
  fla ...        (flash-linear-attention, when torch + fla-core import:
                  chunk_kda with safe_gate on and off, chunk_gla)
at the anchor shapes (B, T, H, D) = (1, 32768, 16, 128) and (8, 8192, 16, 128)
and a T sweep (B=1, H=16, D=128) up to 131072, all bf16 (g fp32). For each
row it prints the achieved bandwidth against the memory floor (the bytes every
implementation must move: q, k, v, do, o, dq, dk, dv in bf16, g and dg in
fp32) and the ratios against the peer and the XLA reference. At T=131072
(--check_t) it also checks the relative error of our bounded output and final
state, per op, against a float64 recurrence (2 heads).

  PYTHONPATH=. python -m experiments.bench_kernels --out=/tmp/bench
  PYTHONPATH=. python -m experiments.bench_kernels --ops=gla --shapes=1x32768 \
      --t_sweep= --tune_grid   # also sweeps the GLA kernel's block sizes

Writes OUT/bench.json and OUT/bench.md. Results worth keeping go to
results/kernels.md with the card name and the date.
"""
from __future__ import annotations

import dataclasses
import json
import os

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import bench_table
from experiments import float64_check
from experiments.timing import median_ms
from pallas_kernels.linear_attention import ops
from pallas_kernels.linear_attention.gla import chunk as gla_pallas

_OUT = flags.DEFINE_string("out", "/tmp/bench_kernels", "Output folder.")
_OPS = flags.DEFINE_list("ops", ["gla", "kda"], "Ops to time: gla, kda.")
_SHAPES = flags.DEFINE_list("shapes", ["1x32768", "8x8192"],
                            "Anchor shapes BxT (H=16, D=128).")
_T_SWEEP = flags.DEFINE_list("t_sweep", ["2048", "8192", "65536", "131072"],
                             "Extra T values at B=1 (32768 is an anchor).")
_ITERS = flags.DEFINE_integer("iters", 20, "Timed iterations (median).")
# Both references compile in seconds and run at B1 T8192 (times in
# results/kernels.md), GLA's once its pair decays are stored rather than
# fused into its score reduce (that compile ran for minutes).
_XLA_MAX = flags.DEFINE_list(
    "xla_max_tokens", ["kda:8192", "gla:8192"],
    "Per op, op:N: time the XLA oracle only at shapes of up to N = B*T tokens "
    "(its [B,H,N,C,C,K] intermediate is O(T*C*K)); an op left out gets none.")
_CHECK_T = flags.DEFINE_integer("check_t", 131072,
                                "T of the float64 accuracy check (0: off).")
_TUNE_GRID = flags.DEFINE_bool("tune_grid", False,
                               "Also sweep GLA block sizes at the first shape.")
_CHECK_GRADS = flags.DEFINE_bool("check_grads", True,
                                 "Check values and gradients of the Pallas "
                                 "GLA/KDA against the XLA oracle (small T).")
_FWD_ONLY = flags.DEFINE_list("fwd_only", [],
                              "Ops timed forward only (e.g. while their "
                              "backward is still the XLA oracle's VJP).")
_OURS = flags.DEFINE_list("ours", ["bounded", "unbounded"],
                          "Which of our paths to time: bounded, unbounded.")
_SKIP_PEERS = flags.DEFINE_bool("skip_peers", False, "Do not run fla.")
_PEERS_ONLY = flags.DEFINE_bool(
    "peers_only", False, "Time only fla, in a process whose JAX stays on the "
    "CPU (so torch has the whole GPU; run ours with --skip_peers after).")

_FLA = flags.DEFINE_list(
    "fla", ["chunk_kda_safe_gate", "chunk_kda", "chunk_gla"],
    "Which fla peers to time (each autotunes for minutes on first use): "
    "chunk_kda_safe_gate, chunk_kda, chunk_gla.")
_FLA_NAMES = {"chunk_kda_safe_gate": "fla chunk_kda safe_gate",
              "chunk_kda": "fla chunk_kda", "chunk_gla": "fla chunk_gla"}

_PEER_ROWS = flags.DEFINE_string(
    "peer_rows", "", "rows.jsonl of an earlier --peers_only run on the same "
    "card: its rows join this table and its ratio column.")

_HEADS = flags.DEFINE_integer("heads", 16, "H.")
_DIM = flags.DEFINE_integer("dim", 128, "K = V.")

H, D, G_MIN = 16, 128, -5.0  # set from --heads/--dim in main()


def make_inputs(bsz, t, seed=0):
  """bf16 q, k (l2-normalised), v; fp32 g = -5 sigmoid(.) in [-5, 0); beta."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 6)
  q = jax.random.normal(keys[0], (bsz, t, H, D), jnp.float32)
  k = jax.random.normal(keys[1], (bsz, t, H, D), jnp.float32)
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  v = jax.random.normal(keys[2], (bsz, t, H, D), jnp.float32)
  g = G_MIN * jax.nn.sigmoid(
      2.0 * jax.random.normal(keys[3], (bsz, t, H, D), jnp.float32) - 1.0)
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], (bsz, t, H), jnp.float32))
  do = jax.random.normal(keys[5], (bsz, t, H, D), jnp.float32)
  bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
  return dict(q=bf(q), k=bf(k), v=bf(v), g=g, beta=bf(beta), do=bf(do))


def floor_bytes(bsz, t, op):
  """Bytes every implementation must move (fwd, fwd+bwd)."""
  n = bsz * t * H * D
  fwd = n * (3 * 2 + 4 + 2)            # q k v bf16, g fp32, o bf16
  bwd = n * (4 * 2 + 4 + 3 * 2 + 4)    # q k v do, g; dq dk dv, dg
  if op == "kda":
    fwd += bsz * t * H * 2
    bwd += bsz * t * H * 4
  return fwd, fwd + bwd


# ---------------------------------------------------------------------------
# Ours (JAX).
# ---------------------------------------------------------------------------


def _jax_fns(op, backend, g_min, **kw):
  def fwd(x):
    if op == "gla":
      return ops.gla(x["q"], x["k"], x["v"], x["g"], backend=backend,
                     g_min=g_min, **kw)[0]
    return ops.kda(x["q"], x["k"], x["v"], x["g"], x["beta"],
                   backend=backend, g_min=g_min, **kw)[0]

  def fwd_bwd(x):
    diff = {n: x[n] for n in ("q", "k", "v", "g", "beta")}
    o, vjp = jax.vjp(lambda d: fwd(dict(x, **d)), diff)
    return o, vjp(x["do"])

  return jax.jit(fwd), jax.jit(fwd_bwd)


def time_jax(op, backend, g_min, x, iters, fwd_only=False, **kw):
  fwd, fwd_bwd = _jax_fns(op, backend, g_min, **kw)
  run = lambda f: (lambda: jax.block_until_ready(f(x)))  # noqa: E731
  fb = float("nan") if fwd_only else median_ms(run(fwd_bwd), iters)
  return median_ms(run(fwd), iters), fb


def time_gla_tuned(x, tune, bounded, iters):
  kw = dict(scale=None, initial_state=None, chunk_size=64,
            g_min=G_MIN if bounded else None, tune=tune)
  fwd = jax.jit(lambda x: gla_pallas.gla_pallas(
      x["q"], x["k"], x["v"], x["g"], **kw)[0])

  def fb(x):
    d = {n: x[n] for n in ("q", "k", "v", "g")}
    o, vjp = jax.vjp(lambda d: gla_pallas.gla_pallas(
        d["q"], d["k"], d["v"], d["g"], **kw)[0], d)
    return o, vjp(x["do"])

  fwd_bwd = jax.jit(fb)
  run = lambda f: (lambda: jax.block_until_ready(f(x)))  # noqa: E731
  return median_ms(run(fwd), iters), median_ms(run(fwd_bwd), iters)


# ---------------------------------------------------------------------------
# Peers (torch + fla-core), optional.
# ---------------------------------------------------------------------------


def _peer_fns():
  try:
    import torch  # pylint: disable=import-outside-toplevel
    from fla.ops.gla import chunk_gla  # pylint: disable=import-outside-toplevel
    from fla.ops.kda import chunk_kda  # pylint: disable=import-outside-toplevel
  except Exception as e:  # pylint: disable=broad-except
    print(f"peers skipped: {type(e).__name__}: {e}")
    return None
  return torch, chunk_gla, chunk_kda


def peer_inputs(peer, x):
  """The benchmark inputs as CUDA torch tensors (once per shape)."""
  torch = peer[0]
  to = lambda a, dt: torch.from_numpy(  # noqa: E731
      np.asarray(jax.device_get(a), np.float32)).to("cuda", dt)
  bf, f32 = torch.bfloat16, torch.float32
  out = {n: to(x[n], bf) for n in ("q", "k", "v", "do", "beta")}
  out["g"] = to(x["g"], f32)
  return out


def time_peer(peer, name, xt, iters):
  """(fwd ms, fwd+bwd ms) of one fla op on peer_inputs' tensors xt."""
  torch, chunk_gla, chunk_kda = peer
  # Fresh leaves per op, so that no autograd state is shared between rows.
  q, k, v, g, beta = (xt[n].detach().clone()
                      for n in ("q", "k", "v", "g", "beta"))
  do = xt["do"]
  leaves = [q, k, v, g, beta]
  for t in leaves:
    t.requires_grad_(True)

  def call():
    if name == "fla chunk_gla":
      return chunk_gla(q, k, v, g)[0]
    safe = name.endswith("safe_gate")
    return chunk_kda(q, k, v, g, beta, safe_gate=safe,
                     lower_bound=G_MIN if safe else None)[0]

  def fwd():
    with torch.no_grad():
      call()
    torch.cuda.synchronize()

  def fwd_bwd():
    o = call()
    o.backward(do)
    for t in leaves:
      t.grad = None
    torch.cuda.synchronize()

  return median_ms(fwd, iters), median_ms(fwd_bwd, iters)


# ---------------------------------------------------------------------------
# Accuracy at long T against a float64 recurrence.
# ---------------------------------------------------------------------------


def check_accuracy(op, t, heads=2):
  """(output, final state) relative errors of our bounded op in bf16 against
  a float64 recurrence, on the first `heads` heads (float64_check)."""
  return float64_check.relative_errors(op, make_inputs(1, t, seed=1), G_MIN,
                                       heads=heads)


def check_gradients(op, t=1000, bsz=2, heads=4):
  """Relative errors of o and every gradient: Pallas vs the fp32 XLA oracle."""
  out = []
  x32 = make_inputs(bsz, t, seed=2)
  x32 = {n: a[:, :, :heads] if a.ndim == 4 else a[:, :, :heads]
         for n, a in x32.items()}
  x32 = {n: a.astype(jnp.float32) for n, a in x32.items()}
  for dtype in (jnp.float32, jnp.bfloat16):
    x = {n: (a if n == "g" else a.astype(dtype)) for n, a in x32.items()}
    for impl, g_min in (("bounded", G_MIN), ("unbounded", None)):
      _, fb = _jax_fns(op, "pallas", g_min)
      _, fb_ref = _jax_fns(op, "xla", None)
      try:
        o, grads = jax.device_get(fb(x))
      except Exception as e:  # pylint: disable=broad-except
        print(f"check {op} {impl} failed: {type(e).__name__}: {e}"[:1000])
        continue
      o_r, grads_r = jax.device_get(fb_ref(x32))
      errs = {"o": (o, o_r)}
      errs.update({f"d{n}": (grads[0][n], grads_r[0][n]) for n in grads[0]
                   if n in ("q", "k", "v", "g") or op == "kda"})
      row = dict(op=op, dtype=jnp.dtype(dtype).name, impl=impl)
      for name, (a, b) in errs.items():
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        row[name] = float(np.linalg.norm(a - b) / np.linalg.norm(b))
        row[name + "_finite"] = bool(np.all(np.isfinite(a)))
      out.append(row)
      print("check", row, flush=True)
  return out


# ---------------------------------------------------------------------------


def _shape_list():
  shapes = [tuple(int(a) for a in s.split("x")) for s in _SHAPES.value]
  for t in _T_SWEEP.value:
    if t and (1, int(t)) not in shapes:
      shapes.append((1, int(t)))
  return shapes


def _xla_max_tokens(items):
  """--xla_max_tokens ["kda:8192", ...] -> {op: tokens}."""
  out = {}
  for item in items:
    op, _, n = item.partition(":")
    if op not in ops.OPS or not n.isdigit():
      raise app.UsageError(f"--xla_max_tokens: bad item {item!r}; expected "
                           f"op:N with op one of {', '.join(ops.OPS)} and N "
                           "an integer")
    out[op] = int(n)
  return out


def main(argv):
  del argv
  global H, D
  H, D = _HEADS.value, _DIM.value
  bad = sorted(set(_OURS.value) - {"bounded", "unbounded"})
  if bad:
    raise app.UsageError(f"--ours: unknown path(s) {bad}; allowed values: "
                         "bounded, unbounded")
  bad = sorted(set(_FLA.value) - set(_FLA_NAMES))
  if bad:
    raise app.UsageError(f"--fla: unknown peer(s) {bad}; allowed values: "
                         f"{', '.join(_FLA_NAMES)}")
  xla_max = _xla_max_tokens(_XLA_MAX.value)
  os.makedirs(_OUT.value, exist_ok=True)
  if _PEERS_ONLY.value:
    jax.config.update("jax_platforms", "cpu")  # inputs only; GPU for torch
  dev = jax.devices()[0]
  print(f"device: {dev.device_kind}  jax {jax.__version__}")
  peer = None if _SKIP_PEERS.value else _peer_fns()
  if _PEERS_ONLY.value:
    if peer is None:
      raise SystemExit("--peers_only: torch + fla-core did not import")
    dev = type("Dev", (), {"device_kind": peer[0].cuda.get_device_name()})
  rows = []
  if _PEER_ROWS.value:
    with open(_PEER_ROWS.value) as f:
      rows = [json.loads(line) for line in f if line.strip()]
  checks = []
  if _CHECK_GRADS.value and not _PEERS_ONLY.value:
    for op in _OPS.value:
      if "pallas" in ops.available_backends(op):
        checks += check_gradients(op)

  def record(op, shape, impl, ms):
    fwd_b, all_b = floor_bytes(*shape, op)
    row = dict(op=op, B=shape[0], T=shape[1], impl=impl, fwd_ms=ms[0],
               fwd_bwd_ms=ms[1], fwd_gbps=fwd_b / ms[0] / 1e6,
               fwd_bwd_gbps=all_b / ms[1] / 1e6)
    rows.append(row)
    with open(os.path.join(_OUT.value, "rows.jsonl"), "a") as f:
      f.write(json.dumps(row) + "\n")  # partial results survive a timeout
    print(f"{op} B={shape[0]} T={shape[1]:>6} {impl:<28} fwd {ms[0]:8.3f} ms"
          f"  fwd+bwd {ms[1]:8.3f} ms  ({row['fwd_bwd_gbps']:.0f} GB/s floor)",
          flush=True)

  for shape in _shape_list():
    x = make_inputs(*shape)
    xt = None  # torch copies of x, made once for the peer rows
    for op in _OPS.value:
      if "pallas" not in ops.available_backends(op) or _PEERS_ONLY.value:
        if not _PEERS_ONLY.value:
          print(f"{op}: no Pallas kernel registered; skipped")
        ours = ()
      else:
        ours = tuple((f"ours {path}", G_MIN if path == "bounded" else None)
                     for path in _OURS.value)
      for impl, g_min in ours:
        try:
          record(op, shape, impl, time_jax(
              op, "pallas", g_min, x, _ITERS.value,
              fwd_only=op in _FWD_ONLY.value))
        except Exception as e:  # pylint: disable=broad-except
          print(f"{op} {impl} failed: {type(e).__name__}: {e}"[:2000])
      if shape[0] * shape[1] <= xla_max.get(op, 0) and ours:
        record(op, shape, "xla reference",
               time_jax(op, "xla", None, x, max(3, _ITERS.value // 4),
                        fwd_only=op in _FWD_ONLY.value))
      if peer is not None:
        if xt is None:
          xt = peer_inputs(peer, x)
        names = (["fla chunk_gla"] if op == "gla" else
                 ["fla chunk_kda safe_gate", "fla chunk_kda"])
        wanted = {_FLA_NAMES[f] for f in _FLA.value}
        for name in (n for n in names if n in wanted):
          try:
            record(op, shape, name, time_peer(peer, name, xt, _ITERS.value))
          except Exception as e:  # pylint: disable=broad-except
            print(f"{name} failed: {type(e).__name__}: {e}"[:2000])
    del x, xt

  acc = {}
  if _CHECK_T.value and not _PEERS_ONLY.value:
    for op in _OPS.value:
      acc[op] = check_accuracy(op, _CHECK_T.value)
      print(f"{op} bounded bf16 vs float64 recurrence at T={_CHECK_T.value}: "
            f"rel err output {acc[op][0]:.3e}, final state {acc[op][1]:.3e}",
            flush=True)

  tune_rows = []
  if _TUNE_GRID.value:
    shape = _shape_list()[0]
    x = make_inputs(*shape)
    base = gla_pallas.DEFAULT_TUNING
    # One knob at a time around the defaults (KDA's measured choices).
    knobs = (("block_k", 16), ("block_k", 64), ("pass_bv", 32),
             ("pass_bk", 32), ("pass_bk", 128), ("grad_bv", 64),
             ("intra_warps", 2), ("pass_warps", 8), ("dv_warps", 8),
             ("grad_k_warps", 8), ("grad_k_warps", 2))
    grid = [base] + [dataclasses.replace(base, **{name: value})
                     for name, value in knobs]
    for tune in grid:
      try:
        ms = time_gla_tuned(x, tune, True, _ITERS.value)
      except Exception as e:  # pylint: disable=broad-except
        print(f"tune {tune} failed: {type(e).__name__}: {str(e)[:300]}")
        continue
      tune_rows.append(dict(dataclasses.asdict(tune), fwd_ms=ms[0],
                            fwd_bwd_ms=ms[1]))
      print(f"tune {tune}: fwd {ms[0]:.3f} fwd+bwd {ms[1]:.3f}", flush=True)

  md = bench_table.markdown_table(
      rows, f"device: {dev.device_kind}, jax {jax.__version__}, H={H} D={D} "
      "bf16")
  for op, (err_o, err_s) in acc.items():
    md += ["", f"{op} bounded, bf16, T={_CHECK_T.value}: relative error vs a "
           f"float64 recurrence (2 heads): output {err_o:.3e}, final state "
           f"{err_s:.3e}"]
  text = "\n".join(md)
  print(text)
  with open(os.path.join(_OUT.value, "bench.md"), "w") as f:
    f.write(text + "\n")
  with open(os.path.join(_OUT.value, "bench.json"), "w") as f:
    json.dump(dict(device=dev.device_kind, jax=jax.__version__, rows=rows,
                   tune=tune_rows, checks=checks, accuracy_t=_CHECK_T.value,
                   accuracy_rel_err={op: dict(output=e[0], final_state=e[1])
                                     for op, e in acc.items()}), f, indent=1)


if __name__ == "__main__":
  app.run(main)
