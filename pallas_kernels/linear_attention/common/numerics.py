"""Numerical range scan for the dense-dot intra-tile decay scores. docs/design.md §3.

In a chunk, b_r is the running sum of the log decay g (g <= 0) up to row r
(non-increasing along r). The intra-tile score of a diagonal tile

    A_ij = sum_d q_id k_jd exp(b_id - b_jd),   j <= i,

is one dense matmul (q * exp(b - c)) @ (k * exp(c - b))^T around an anchor row
c of the tile. Both exponents are bounded by the tile's decay span:

  anchor 'first'  (c = b_0):      q exponent in [-S, 0]  (can underflow),
                                  k exponent in [0,  S]  (can overflow);
  anchor 'last'   (c = b_{L-1}):  q exponent in [0,  S]  (can overflow),
                                  k exponent in [-S, 0];
  anchor 'middle' (c = b_{L//2}): both within about S/2 either way.

With g >= g_min the span of an L-row tile is S <= (L-1)|g_min| nats. fp32 and
bf16 overflow past ~88.7 nats, fp16 past ~11.1. The unbounded softplus gate
g = -softplus(x) has no lower bound, so S is unbounded and no tile is safe.

Note: a 'middle' anchor in a partly filled last tile can read a row past the
last valid query (a causality hazard in kernels, docs/design.md §3); this module only
measures numerics on full tiles.

Everything here is pure: numpy for drawing and the float64 reference, jnp for
the dense dot (low-precision factors, fp32 accumulation as in a kernel).
"""
from __future__ import annotations

import itertools
import math
from typing import Dict, Iterable, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

ANCHORS = ("first", "middle", "last")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16,
          "float16": jnp.float16}
# Relative-error tolerance per factor dtype: fp32 keeps ~7 digits, the 16-bit
# types ~2-3 (bf16 unit roundoff 2^-9, fp16 2^-12 but with a narrow range).
TOLERANCES = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 1e-2}
# log of the largest finite value: where exp(x) overflows.
MAX_EXPONENT = {name: float(np.log(float(jnp.finfo(dt).max)))
                for name, dt in DTYPES.items()}
GATES = ("bounded", "unbounded")


def anchor_index(tile_len: int, anchor: str) -> int:
  """Row of the tile whose decay sum is the anchor c."""
  if anchor == "first":
    return 0
  if anchor == "middle":
    return tile_len // 2
  if anchor == "last":
    return tile_len - 1
  raise ValueError(f"anchor must be one of {ANCHORS}, got {anchor!r}")


def _mask(tile_len: int) -> np.ndarray:
  """[L, L] bool, True where j <= i (causal, diagonal included)."""
  return np.tril(np.ones((tile_len, tile_len), dtype=bool))


def dense_tile_scores(q, k, b, anchor: str = "first",
                      dtype: str = "float32") -> np.ndarray:
  """Dense-dot intra-tile scores, as a tensor-core kernel would form them.

  Args:
    q, k: [..., L, K] queries and keys of one tile (any float dtype).
    b: [..., L, K] running sum of the log decay within the tile (fp32).
    anchor: 'first' | 'middle' | 'last', the anchor row c.
    dtype: 'float32' | 'bfloat16' | 'float16', the dtype of the two factors.

  Returns:
    [..., L, L] float32 scores A_ij for j <= i, 0 above the diagonal.
    Overflowed factors show up as inf/NaN on purpose.
  """
  q = np.asarray(q, np.float32)
  k = np.asarray(k, np.float32)
  b = np.asarray(b, np.float32)
  tile_len = b.shape[-2]
  c = b[..., anchor_index(tile_len, anchor):anchor_index(tile_len, anchor) + 1, :]
  # Factors are formed in fp32 then rounded to dtype, like a kernel that
  # computes exp in fp32 and feeds the MMA in the storage dtype.
  with np.errstate(over="ignore", under="ignore", invalid="ignore"):
    qf = q * np.exp(b - c)
    kf = k * np.exp(c - b)
  dt = DTYPES[dtype]
  qf = jnp.asarray(qf).astype(dt)
  kf = jnp.asarray(kf).astype(dt)
  a = jnp.einsum("...ik,...jk->...ij", qf, kf,
                 preferred_element_type=jnp.float32,
                 precision=jax.lax.Precision.HIGHEST)
  # where, not multiply: inf * 0 above the diagonal would make NaN that the
  # kernel never produces (it masks after the dot).
  return np.where(_mask(tile_len), np.asarray(a, np.float32), np.float32(0))


def pairwise_tile_scores_f64(q, k, b) -> np.ndarray:
  """Float64 reference: A_ij = sum_d q_id k_jd exp(b_id - b_jd), j <= i.

  Args:
    q, k, b: [..., L, K] (b the running log-decay sum within the tile).

  Returns:
    [..., L, L] float64, 0 above the diagonal. Exponents are masked to <= 0
    before the exp, so this never overflows.
  """
  q = np.asarray(q, np.float64)
  k = np.asarray(k, np.float64)
  b = np.asarray(b, np.float64)
  tile_len = b.shape[-2]
  diff = b[..., :, None, :] - b[..., None, :, :]           # [..., L, L, K]
  mask = _mask(tile_len)
  diff = np.where(mask[:, :, None], diff, -np.inf)
  a = np.einsum("...ik,...jk,...ijk->...ij", q, k, np.exp(diff))
  return np.where(mask, a, 0.0)


def worst_exponent(g_min: float, tile_len: int, anchor: str = "first") -> float:
  """Largest |exponent| of either factor with g in [g_min, 0] (closed form).

  The tile spans at most S = (L-1)|g_min| nats. An anchor at row m sees
  exponents up to m|g_min| before it and (L-1-m)|g_min| after it:
  'first'/'last' give S, 'middle' (m = L//2) gives (L//2)|g_min|, about S/2.
  """
  m = anchor_index(tile_len, anchor)
  return float(max(m, tile_len - 1 - m) * abs(g_min))


def realised_exponent(b, anchor: str = "first") -> float:
  """Largest |exponent| either factor actually reaches for given b [..., L, K]."""
  b = np.asarray(b, np.float64)
  m = anchor_index(b.shape[-2], anchor)
  return float(np.max(np.abs(b - b[..., m:m + 1, :])))


def _unit_rows(x: np.ndarray) -> np.ndarray:
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def draw_tile(rng: np.random.Generator, trials: int, tile_len: int,
              head_dim: int, gate: str, g_min: Optional[float] = None,
              softplus_scale: float = 8.0):
  """Random tiles for the scan.

  Returns q, k, b, each [trials, L, K] fp32. q and k rows are l2-normalised.
  'bounded': the worst case of the bound: channel 0 always at g_min (so the
  closed-form span is reached exactly), half the rest at g_min, the others
  uniform in [g_min, 0]. 'unbounded': g = -softplus(x) with heavy-tailed
  x = s * t_3 (x of 10-20 per step is common), no lower bound.
  """
  shape = (trials, tile_len, head_dim)
  q = _unit_rows(rng.standard_normal(shape)).astype(np.float32)
  k = _unit_rows(rng.standard_normal(shape)).astype(np.float32)
  if gate == "bounded":
    if g_min is None or g_min >= 0:
      raise ValueError(f"bounded gate needs g_min < 0, got {g_min}")
    g = rng.uniform(g_min, 0.0, shape)
    g = np.where(rng.random(shape) < 0.5, g_min, g)
    g[..., 0] = g_min
  elif gate == "unbounded":
    x = softplus_scale * rng.standard_t(3, shape)
    g = -np.logaddexp(0.0, x)
  else:
    raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
  b = np.cumsum(g.astype(np.float32), axis=-2, dtype=np.float32)
  return q, k, b


def relative_error(a, a_ref) -> float:
  """max|A - A_ref| / max|A_ref| for one tile [L, L]; inf if A is not finite."""
  a = np.asarray(a, np.float64)
  if not np.all(np.isfinite(a)):
    return math.inf
  return float(np.max(np.abs(a - a_ref)) / np.max(np.abs(a_ref)))


def scan(g_mins: Sequence[float] = (-1, -2, -3, -5, -8, -12, -20),
         tile_lens: Sequence[int] = (16, 32, 64),
         dtypes: Sequence[str] = ("float32", "bfloat16", "float16"),
         anchors: Sequence[str] = ANCHORS,
         gate: str = "bounded", trials: int = 8, seed: int = 0,
         head_dim: int = 32, softplus_scale: float = 8.0) -> List[Dict]:
  """Sweeps the dense-dot tile against the float64 reference.

  Every (g_min, tile_len) draws one batch of `trials` tiles, shared by all
  dtypes and anchors so their errors are comparable. For gate='unbounded'
  g_mins is ignored (one draw per tile_len, g_min reported as None).

  Returns:
    list of dicts: gate, g_min, tile_len, dtype, anchor, worst_exponent
    (closed form for 'bounded', realised for 'unbounded'), span (largest
    realised b_0 - b_{L-1}), rel_error (max over trials, inf when non-finite),
    tolerance, safe (finite and rel_error <= tolerance).
  """
  for dt in dtypes:
    if dt not in DTYPES:
      raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dt!r}")
  grid = list(g_mins) if gate == "bounded" else [None]
  rows = []
  for g_min, tile_len in itertools.product(grid, tile_lens):
    # A seed per cell: adding a cell to the grid does not reshuffle the others.
    g_key = 0 if g_min is None else int(round(abs(g_min) * 1000))
    rng = np.random.default_rng([seed, g_key, int(tile_len), GATES.index(gate)])
    q, k, b = draw_tile(rng, trials, tile_len, head_dim, gate,
                        None if g_min is None else float(g_min), softplus_scale)
    a_ref = pairwise_tile_scores_f64(q, k, b)
    span = float(np.max(b[:, 0, :] - b[:, -1, :]))
    for dtype, anchor in itertools.product(dtypes, anchors):
      a = dense_tile_scores(q, k, b, anchor, dtype)
      err = max(relative_error(a[t], a_ref[t]) for t in range(trials))
      tol = TOLERANCES[dtype]
      rows.append(dict(
          gate=gate, g_min=None if g_min is None else float(g_min),
          tile_len=int(tile_len), dtype=dtype, anchor=anchor,
          worst_exponent=(worst_exponent(g_min, tile_len, anchor)
                          if gate == "bounded" else realised_exponent(b, anchor)),
          span=span, rel_error=err, tolerance=tol,
          safe=bool(math.isfinite(err) and err <= tol)))
  return rows


def recommend_bound(rows: Iterable[Dict], dtype: str, tile_len: int,
                    anchor: str = "first") -> Optional[float]:
  """The most negative g_min that is safe (the widest usable decay range).

  Walks the bounded rows of this (dtype, tile_len, anchor) from the mildest
  g_min outward and stops at the first unsafe one, so the answer is a bound
  whose every milder setting was safe too. None if even the mildest fails.
  """
  cands = sorted((r for r in rows if r["gate"] == "bounded"
                  and r["dtype"] == dtype and r["tile_len"] == tile_len
                  and r["anchor"] == anchor), key=lambda r: -r["g_min"])
  best = None
  for r in cands:
    if not r["safe"]:
      break
    best = r["g_min"]
  return best
