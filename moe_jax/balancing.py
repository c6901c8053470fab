"""Load balancing of the MoE router, as pure functions (docs/design.md §6).

The router (moe_jax/layers/router.py) routes with a balancing bias b [E]
that only picks experts and never sees a gradient; its forward pass emits
per-batch statistics, and the train step (moe_jax/train/step.py) turns them
into the next bias after the optimizer step. Everything that computes with
those statistics lives here:

* Quantile Balancing (QB), exact estimator: the per-token thresholds
  r = alpha - s (`qb_thresholds`), their order statistic
  (`qb_exact_target`, `qb_target_from_smallest`), and the running q+1
  smallest per expert that gradient accumulation merges over microbatches
  (`init_smallest`, `merge_smallest`, `set_exact_targets`).
* QB, histogram estimator: `qb_histogram` in the forward pass (asinh bins
  centred on the bias, finest where the target lands), and
  `qb_target_from_histogram` in the update; `warn_few_qb_tokens` below
  `qb_min_tokens` per update.
* QB over a time window: `init_qb_window`, `split_qb_window`,
  `qb_window_update` (histogram counts summed over steps, the bias updated
  once per period).
* The bias rules: `qb_bias_update`, `sign_bias_update`; the Switch loss
  (`switch_aux_loss`); MaxVio (`max_violation`).
* Tree utilities over the variable collections below, which mirror the
  module tree: `update_router_state`, `accumulate_router_stats`,
  `reduce_router_stats`, `collect_loads`, `collect_max_violation`,
  `sum_aux_losses`.

Collections (names shared with the Router):
  router_state / bias [E] fp32: the balancing bias; with a time window,
    router_state / qb_window (WINDOW_KEY) holds the summed router_stats of
    the current window (written by the train step, never by the Router).
  router_stats: `load` [E]; `qb_target` [E] (QB exact); `qb_hist` [E, bins]
    and `qb_tokens` [] (QB histogram); `aux_loss` [] (Switch loss).
  router_qb_thresholds / r [N, E] (QB exact, gradient accumulation only).
Leaves may carry leading axes (e.g. a scanned layer axis); reductions are
over the last (expert) axis. All functions are jit-friendly.

Ground floor: imports nothing of ours.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from absl import logging
from flax.core import FrozenDict, freeze, unfreeze

BALANCING_METHODS = ("qb", "sign", "aux", "none")
QB_ESTIMATORS = ("exact", "histogram")

STATE_COLLECTION = "router_state"
STATS_COLLECTION = "router_stats"
THRESHOLDS_COLLECTION = "router_qb_thresholds"

# c of the asinh histogram bins (`qb_histogram`): bins ~1e-4 wide at the
# bias, ~7% of |r - b| beyond; 0 gives the old uniform bins.
QB_HIST_SCALE = 1e-3

PyTree = Any


# ----------------------------------------------------------------------------
# Per-batch quantities.
# ----------------------------------------------------------------------------


def expert_load(expert_index: jax.Array, num_experts: int) -> jax.Array:
  """Assignments per expert.

  Args:
    expert_index: [N, k] int, chosen experts per token.
    num_experts: E.

  Returns:
    [E] fp32 counts (sum = N * k).
  """
  return id_counts(expert_index, num_experts).astype(jnp.float32)


def id_counts(ids: jax.Array, n: int) -> jax.Array:
  """How many of ids (any shape, any order) equal each of 0..n-1; ids
  outside [0, n) are not counted. int32 [n].

  One compare-and-sum over [n, ids.size], a single fused reduction on the
  GPU. Not bincount: its scatter-add of ones onto n bins serialises there.
  Not searchsorted on sorted ids: its binary search is a while loop, and
  on the GPU every iteration waits for the host to read the loop's
  predicate (a training step profiled ~1000 such round trips).
  """
  flat = ids.reshape(-1)
  return jnp.sum(flat[None, :] == jnp.arange(n, dtype=flat.dtype)[:, None],
                 axis=1, dtype=jnp.int32)


def qb_quantile(num_tokens: int, top_k: int, num_experts: int) -> int:
  """q = floor(m k / n), the balanced load, clamped to [0, m - 1] (static)."""
  return min(max((num_tokens * top_k) // num_experts, 0), num_tokens - 1)


def qb_thresholds(scores: jax.Array, bias: jax.Array,
                  top_k: int) -> jax.Array:
  """The QB thresholds r = alpha - s, alpha = (k+1)-th largest of s + b.

  Token i picks expert j iff b_j > r_ij (for the bias in use).

  Args:
    scores: [m, n] unbiased router scores s.
    bias: [n] current bias b.
    top_k: k, 1 <= k < n (static).

  Returns:
    [m, n] fp32, no gradient.
  """
  s = jax.lax.stop_gradient(scores.astype(jnp.float32))
  b = jax.lax.stop_gradient(bias.astype(jnp.float32))
  v, _ = jax.lax.top_k(s + b, top_k + 1)            # [m, k+1] descending
  # Without the barrier XLA:CPU turns this top_k into a full sort of each
  # row (36x slower at n = 896: 0.55 s vs 0.015 s for 4096 tokens).
  v = jax.lax.optimization_barrier(v)
  return v[:, top_k:top_k + 1] - s                  # [m, n]


def qb_exact_target(scores: jax.Array, bias: jax.Array, top_k: int, *,
                    per_expert_threshold: bool = False) -> jax.Array:
  """Exact Quantile-Balancing target bias (docs/design.md §6).

  With the current bias, token i picks expert j iff s_ij + b_j beats the
  token's (k+1)-th largest biased score alpha_i, i.e. iff b_j > r_ij with
  r_ij = alpha_i - s_ij. For the bias in use, #{i : r_ij < b_j} is exactly the
  current load of j. To give expert j q = floor(m k / n) tokens, b_j must lie
  in (r_(q), r_(q+1)] over the sorted r_(1) <= ... <= r_(m) of column j: the
  (q+1)-th smallest is the right order statistic (exactly q values lie strictly
  below it; the q-th smallest admits only q-1). But at b_j = r_(q+1) the
  (q+1)-th token sits exactly on its decision boundary, and in floating point
  the tie often goes to j (measured: q+1 for most experts). We therefore take
  the midpoint (r_(q) + r_(q+1)) / 2, which comes out of the same
  top_k(q+1) call and gives exactly q when one expert moves alone (checked in
  tests/test_router.py). For q = 0 it falls back to r_(1).

  Caveat of the shared threshold alpha_i: for a token that does *not* pick j,
  the bias j really needs is v[k-1] - s_ij (beat the k-th largest), not
  alpha_i - s_ij; in particular the token whose (k+1)-th expert is j has
  r_ij == b_j exactly. So targets of underloaded experts are too low for one
  step and the update relies on iteration (MaxVio 4.5 -> 0.68 -> 0.23 -> ...
  on the skewed test scores). `per_expert_threshold=True` uses the exact
  per-expert threshold (v[k] - s for tokens that picked j, v[k-1] - s
  otherwise): 4.5 -> 0.15 -> 0.07 -> ..., same fixed point. The default
  (False) is the shared threshold, which the histogram estimator and
  gradient accumulation use too.

  Args:
    scores: [m, n] fp32 unbiased router scores s (m tokens, n experts).
    bias: [n] current bias b.
    top_k: k, 1 <= k < n (static).
    per_expert_threshold: see above.

  Returns:
    [n] fp32 target bias, mean zero. No gradient (stop_gradient inside).
  """
  m, n = scores.shape
  if not 1 <= top_k < n:
    raise ValueError(
        f"qb_exact_target needs 1 <= top_k < n={n}, got top_k={top_k}")
  if per_expert_threshold:
    s = jax.lax.stop_gradient(scores.astype(jnp.float32))
    b = jax.lax.stop_gradient(bias.astype(jnp.float32))
    v, top_idx = jax.lax.top_k(s + b, top_k + 1)    # [m, k+1] descending
    picked = jnp.any(
        top_idx[:, :top_k, None] == jnp.arange(n)[None, None, :], axis=1)
    alpha = jnp.where(picked, v[:, top_k:top_k + 1],
                      v[:, top_k - 1:top_k])        # [m, n]
    r = alpha - s
  else:
    r = qb_thresholds(scores, bias, top_k)          # [m, n]
  q = qb_quantile(m, top_k, n)
  # (q+1)-th smallest along tokens == (q+1)-th largest of -r; top_k, not sort.
  neg_small, _ = jax.lax.top_k(-r.T, q + 1)         # [n, q+1]
  return qb_target_from_smallest(-neg_small, q)


def qb_target_from_smallest(smallest: jax.Array, q: int) -> jax.Array:
  """The exact QB target from the q+1 smallest thresholds of each expert.

  The order-statistic rule of `qb_exact_target`, split out so that gradient
  accumulation can merge the smallest thresholds of several microbatches
  (`merge_smallest`) and apply the rule once to the whole batch.

  Args:
    smallest: [..., n, q+1] the q+1 smallest r[:, j] per expert, ascending.
    q: the balanced load floor(m k / n) of the whole batch (static).

  Returns:
    [..., n] fp32 target bias, mean zero over the expert axis.
  """
  b_new = smallest[..., q]                          # (q+1)-th smallest
  if q > 0:  # off the boundary token's tie: midpoint with the q-th smallest
    b_new = 0.5 * (b_new + smallest[..., q - 1])
  return b_new - jnp.mean(b_new, axis=-1, keepdims=True)


def init_smallest(thresholds_shape: Any, microbatches: int,
                  top_k: int) -> jax.Array:
  """Empty running q+1 smallest for one microbatch's thresholds r.

  Args:
    thresholds_shape: shape (or ShapeDtypeStruct) of one microbatch's r,
      [..., N_mb, E].
    microbatches: M; the whole batch has m = M * N_mb tokens.
    top_k: k.

  Returns:
    [..., E, q+1] fp32 of +inf, q = `qb_quantile` of the whole batch.
  """
  shape = tuple(getattr(thresholds_shape, "shape", thresholds_shape))
  m, n = microbatches * shape[-2], shape[-1]
  q = qb_quantile(m, top_k, n)
  return jnp.full(shape[:-2] + (n, q + 1), jnp.inf, jnp.float32)


def merge_smallest(smallest: jax.Array, r: jax.Array) -> jax.Array:
  """Running q+1 smallest thresholds after one more microbatch.

  Args:
    smallest: [..., E, q+1] ascending, from `init_smallest` or earlier merges.
    r: [..., N, E] this microbatch's thresholds (`qb_thresholds`).

  Returns:
    [..., E, q+1] ascending.
  """
  both = jnp.concatenate([smallest, jnp.swapaxes(r, -1, -2)], axis=-1)
  neg, _ = jax.lax.top_k(-both, smallest.shape[-1])   # ascending after -
  return -neg


def set_exact_targets(stats: Mapping, smallest: Mapping) -> dict:
  """router_stats with `qb_target` set from each merged `r` buffer.

  Args:
    stats: a `router_stats` tree (plain dicts).
    smallest: the tree of the thresholds collection, each `r` leaf replaced
      by its merged q+1 smallest [..., E, q+1].

  Returns:
    A copy of `stats` whose `qb_target` leaves are the exact targets of the
    whole batch (`qb_target_from_smallest`).
  """
  out = dict(stats)
  for key, val in smallest.items():
    if key == "r":
      out["qb_target"] = qb_target_from_smallest(val, val.shape[-1] - 1)
    else:
      out[key] = set_exact_targets(stats[key], val)
  return out


def _qb_bin_lower_edge(t, bins: int, qb_range, qb_scale: float):
  """x = r - b_j at the lower edge of bin t (t may be fractional / traced)."""
  if qb_scale > 0:
    u_max = jnp.arcsinh(jnp.asarray(qb_range, jnp.float32) / qb_scale)
    return qb_scale * jnp.sinh(-u_max + (2.0 * u_max / bins) * t)
  return -qb_range + (2.0 * qb_range / bins) * t


def qb_histogram(scores: jax.Array, bias: jax.Array, top_k: int, *,
                 bins: int = 256, qb_range: float = 4.0,
                 qb_scale: float = QB_HIST_SCALE) -> jax.Array:
  """Histogram of the QB thresholds r[:, j] - b_j per expert.

  The window is centred on the current bias of each expert and covers
  x = r - b_j in [-R, R], R = qb_range, i.e. r in [b_j - R, b_j + R]. Values
  outside are clipped into the edge bins, so the estimate is then clamped to
  the window. Since s is in (0, 1), |r - b_j| <= 1 + max b - min b, so the
  default R = 4 covers every token unless the biases spread over > 3.

  Bin placement (qb_scale = c):
    c > 0 (default): asinh bins, uniform in u = asinh(x / c). Bins are about
      2 c asinh(R / c) / bins wide near the bias and grow like |x| away from
      it (a constant relative resolution, ~7% of |x| at the defaults). Once
      balanced the target sits near the bias, where the bins are finest; at
      extreme sparsity (q = m k / n of a few dozen tokens, saturated sigmoid
      scores) the (q+1)-th smallest r lies within a few 1e-3 of the bias,
      below the 0.03 width of 256 uniform bins over +-4, and uniform bins
      there swing MaxVio between 2 and 50 (tests/test_router_histogram.py).
    c = 0: uniform bins, bin t covers x in [-R + t w, -R + (t+1) w),
      w = 2R / bins.
  The bins depend only on (b_j, R, c, bins), never on the data, so counts
  stay additive over shards, microbatches and steps that share the bias.

  O(m n) work: one top_k(k+1) per token plus a segment_sum (scatter-add) of
  m n ones into n * bins segments; no sort. Under jax.jit with the token axis
  sharded the sum is a global reduction (counts identical to one device).
  Counts are fp32: exact while a bin holds < 2**24 tokens.

  Args:
    scores: [m, n] unbiased router scores s.
    bias: [n] current bias b (the one used for routing).
    top_k: k, 1 <= k < n (static).
    bins: number of bins (static).
    qb_range: R > 0, window half-width (static).
    qb_scale: c >= 0, the asinh bins' linear scale; 0 = uniform (static).

  Returns:
    [n, bins] fp32 counts (each row sums to m). No gradient.
  """
  m, n = scores.shape
  if not 1 <= top_k < n:
    raise ValueError(
        f"qb_histogram needs 1 <= top_k < n={n}, got top_k={top_k}")
  if qb_scale < 0:
    raise ValueError(f"qb_scale must be >= 0, got {qb_scale}")
  b = jax.lax.stop_gradient(bias.astype(jnp.float32))
  x = qb_thresholds(scores, b, top_k) - b                         # [m, n]
  if qb_scale > 0:
    u_max = math.asinh(qb_range / qb_scale)
    t = jnp.floor((jnp.arcsinh(x / qb_scale) + u_max)
                  * (bins / (2.0 * u_max)))
  else:
    t = jnp.floor((x + qb_range) / (2.0 * qb_range / bins))
  t = jnp.clip(t, 0, bins - 1).astype(jnp.int32)                  # [m, n]
  seg = t + jnp.arange(n, dtype=jnp.int32)[None, :] * bins        # [m, n]
  counts = jax.ops.segment_sum(
      jnp.ones((m * n,), jnp.float32), seg.reshape(-1),
      num_segments=n * bins)
  return counts.reshape(n, bins)


def qb_target_from_histogram(hist: jax.Array, num_tokens, top_k,
                             num_experts: int, lo, hi, *,
                             qb_scale: float = QB_HIST_SCALE) -> jax.Array:
  """QB target bias from per-expert threshold histograms.

  q = floor(m k / n) (clamped to [0, m-1]). The exact estimator takes the
  midpoint of the q-th and (q+1)-th smallest r. Here: the bin holding the
  (q+1)-th smallest (first bin whose inclusive cumulative count reaches
  q+1), C tokens below it and c in it; treating the c values as evenly spread
  over the bin (the i-th at (i - 1/2)/c of it), the midpoint of the q-th and
  (q+1)-th sits at fraction (q - C) / c of the bin. Hence: when both order
  statistics lie in the window, the estimate is within one width of the bin
  it falls in of the exact target's raw value, or inside the same
  (r_(q), r_(q+1)] gap, where every bias gives the same load. After
  subtracting the mean, differences are bounded by 2 such widths (measured:
  well under one, see tests/test_router_histogram.py).

  Warns once (absl logging) when num_tokens is concrete and below
  `qb_min_tokens`.

  Args:
    hist: [..., E, bins] counts (from `qb_histogram`, summed over shards /
      microbatches / steps that routed with the same bias).
    num_tokens: m, tokens counted in each row (scalar or [...]; may be traced).
    top_k: k (int or traced scalar).
    num_experts: E (static).
    lo, hi: window edges, scalars or broadcastable to [..., E]
      (qb_histogram's window: bias -/+ qb_range).
    qb_scale: the bin placement `qb_histogram` used (static).

  Returns:
    [..., E] fp32 target bias, mean zero over E.
  """
  hist = jnp.asarray(hist, jnp.float32)
  bins = hist.shape[-1]
  if hist.shape[-2] != num_experts:
    raise ValueError(
        f"hist must be [..., E={num_experts}, bins], got {hist.shape}")
  warn_few_qb_tokens(num_tokens, num_experts, top_k)
  m = jnp.round(jnp.asarray(num_tokens, jnp.float32)).astype(jnp.int32)
  k = jnp.round(jnp.asarray(top_k, jnp.float32)).astype(jnp.int32)
  # floor(m k / n) in int32 without forming m * k.
  q = (m // num_experts) * k + ((m % num_experts) * k) // num_experts
  q = jnp.clip(q, 0, jnp.maximum(m - 1, 0)).astype(jnp.float32)
  q = q[..., None, None]                                           # [...,1,1]
  cum = jnp.cumsum(hist, axis=-1)                                  # [...,E,B]
  t = jnp.sum((cum <= q).astype(jnp.int32), axis=-1)               # [..., E]
  t = jnp.minimum(t, bins - 1)
  c = jnp.take_along_axis(hist, t[..., None], axis=-1)[..., 0]
  below = jnp.take_along_axis(cum, t[..., None], axis=-1)[..., 0] - c
  frac = jnp.clip((q[..., 0] - below) / jnp.maximum(c, 1.0), 0.0, 1.0)
  lo = jnp.asarray(lo, jnp.float32)
  hi = jnp.asarray(hi, jnp.float32)
  half = 0.5 * (hi - lo)
  t = t.astype(jnp.float32)
  x0 = _qb_bin_lower_edge(t, bins, half, qb_scale)
  x1 = _qb_bin_lower_edge(t + 1.0, bins, half, qb_scale)
  target = 0.5 * (lo + hi) + x0 + frac * (x1 - x0)
  return target - jnp.mean(target, axis=-1, keepdims=True)


def qb_min_tokens(num_experts: int, top_k) -> int:
  """Tokens per QB update below which the quantile gets noisy: 8 n / k.

  The target is the (q+1)-th smallest of m thresholds, q = m k / n: below
  q = 8 tokens per expert its sampling noise alone leaves MaxVio > 1.
  """
  return int(math.ceil(8 * num_experts / max(float(top_k), 1.0)))


_WARNED: set = set()


def warn_few_qb_tokens(num_tokens, num_experts: int, top_k) -> bool:
  """Logs a warning once per setting when m < `qb_min_tokens`.

  num_tokens / top_k that are traced (inside jit) are skipped: the train
  step checks its static batch size itself. Returns whether it warned.
  """
  try:
    m, k = float(num_tokens), float(top_k)
  except (TypeError, jax.errors.ConcretizationTypeError):
    return False
  need = qb_min_tokens(num_experts, k)
  if m >= need or (m, num_experts, k) in _WARNED:
    return False
  _WARNED.add((m, num_experts, k))
  logging.warning(
      "Quantile Balancing: %d tokens per bias update give only %.1f tokens "
      "per expert (num_experts=%d, top_k=%g); the quantile is then too noisy "
      "for a stable balance (MaxVio stays high). Use at least %d tokens per "
      "update (about 8 * num_experts / top_k): a larger batch, or "
      "model.moe.qb_window_steps > 1 to pool the histogram over steps.",
      int(m), m * k / num_experts, num_experts, k, need)
  return True


def switch_aux_loss(load: jax.Array, scores: jax.Array,
                    coef: float) -> jax.Array:
  """coef * E * sum_j f_j P_j, the Switch Transformer balancing loss.

  Args:
    load: [E] assignments per expert (no gradient): f = load / sum(load).
    scores: [N, E] router scores s (with gradient): P = mean over tokens of
      s / sum_j s.
    coef: the loss coefficient.

  Returns:
    [] fp32.
  """
  e = load.shape[-1]
  f = load / jnp.maximum(jnp.sum(load), 1.0)                      # [E]
  p = scores / (jnp.sum(scores, axis=-1, keepdims=True) + 1e-20)  # [N, E]
  p_mean = jnp.mean(p, axis=0)                                    # [E]
  return coef * e * jnp.sum(f * p_mean)


def max_violation(load: jax.Array) -> jax.Array:
  """MaxVio = max_j load_j / mean_j load_j - 1.

  Args:
    load: [..., E] per-expert load (counts or fractions).

  Returns:
    [...] fp32; 0 for perfect balance (and for an all-zero load).
  """
  load = jnp.asarray(load, jnp.float32)
  mean = jnp.mean(load, axis=-1)
  safe = jnp.where(mean > 0, mean, 1.0)
  return jnp.where(mean > 0, jnp.max(load, axis=-1) / safe - 1.0, 0.0)


# ----------------------------------------------------------------------------
# Bias rules.
# ----------------------------------------------------------------------------


def qb_bias_update(bias: jax.Array, target: jax.Array,
                   ema: float) -> jax.Array:
  """b <- ema * b + (1 - ema) * target, then mean zero. [..., E] fp32."""
  b = ema * bias + (1.0 - ema) * target
  return b - jnp.mean(b, axis=-1, keepdims=True)


def sign_bias_update(bias: jax.Array, load: jax.Array,
                     rate: float) -> jax.Array:
  """b <- b + rate * sign(mean(load) - load). [..., E] fp32."""
  return bias + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)


# ----------------------------------------------------------------------------
# Trees of router variables.
# ----------------------------------------------------------------------------


def _is_mapping(x: Any) -> bool:
  return isinstance(x, (Mapping, FrozenDict))


def _map_stats(leaf_fn, tree: Mapping, path: tuple = ()) -> dict:
  """A router_stats-shaped tree of plain dicts: leaf_fn(key, leaf, path) at
  every stat, `path` the keys of the modules above it."""
  return {key: (_map_stats(leaf_fn, val, path + (key,)) if _is_mapping(val)
                else leaf_fn(key, val, path))
          for key, val in tree.items()}


def _qb_hist_target(b: jax.Array, stats: Mapping, qb_range, top_k,
                    qb_scale: float) -> jax.Array:
  """Target from 'qb_hist'/'qb_tokens' next to a bias b [..., E]."""
  if "qb_tokens" not in stats:
    raise ValueError("a 'qb_hist' router stat needs a 'qb_tokens' leaf; found "
                     f"{sorted(stats)}")
  if qb_range is None:
    raise ValueError(
        "update_router_state got histogram QB stats ('qb_hist') but no "
        "qb_range; pass qb_range=config.model.moe.qb_range (the window "
        "half-width the forward binned with)")
  hist = jnp.asarray(stats["qb_hist"], jnp.float32)
  tokens = jnp.asarray(stats["qb_tokens"], jnp.float32)
  if top_k is None:
    if "load" not in stats:
      raise ValueError("update_router_state needs top_k or a 'load' leaf "
                       "(sum(load) = tokens * top_k) for histogram QB")
    # sum(load) = m * k exactly, also after summing over microbatches.
    top_k = jnp.sum(jnp.asarray(stats["load"], jnp.float32), axis=-1) / (
        jnp.maximum(tokens, 1.0))
  return qb_target_from_histogram(hist, tokens, top_k, hist.shape[-2],
                                  b - qb_range, b + qb_range,
                                  qb_scale=qb_scale)


def _update_tree(state: Mapping, stats: Mapping | None, method: str,
                 ema: float, sign_rate: float, qb_range, top_k,
                 qb_scale: float) -> dict:
  out = {}
  for key, val in state.items():
    sub_stats = stats.get(key) if _is_mapping(stats) else None
    if _is_mapping(val):
      out[key] = _update_tree(val, sub_stats, method, ema, sign_rate,
                              qb_range, top_k, qb_scale)
      continue
    out[key] = val
    if key != "bias" or not _is_mapping(stats):
      continue
    # Broadcasting over a leading layer axis (nn.scan) works: reduce over -1.
    if method == "qb":
      ok = "qb_target" in stats or "qb_hist" in stats
      need = "qb_target' or 'qb_hist"
    else:
      ok, need = "load" in stats, "load"
    if not ok:
      # Stats exist but were made under another balancing: fail loudly.
      raise ValueError(
          f"update_router_state(method={method!r}) needs a '{need}' leaf next "
          f"to the router bias; found {sorted(stats)}")
    b = jnp.asarray(val, jnp.float32)
    if method == "qb":
      if "qb_hist" in stats:
        target = _qb_hist_target(b, stats, qb_range, top_k, qb_scale)
      else:
        target = jnp.asarray(stats["qb_target"], jnp.float32)
      b = qb_bias_update(b, target, ema)
    else:  # sign
      b = sign_bias_update(b, jnp.asarray(stats["load"], jnp.float32),
                           sign_rate)
    out[key] = b.astype(jnp.asarray(val).dtype)
  return out


def update_router_state(router_state: Mapping, router_stats: Mapping, *,
                        method: str, ema: float = 0.0,
                        sign_rate: float = 1e-3,
                        qb_range: float | None = None,
                        top_k: int | None = None,
                        qb_scale: float = QB_HIST_SCALE) -> Mapping:
  """Applies the balancing rule to every router bias in a variable tree.

  `router_state` and `router_stats` mirror the module tree: a dict holding a
  `bias` leaf in the state corresponds to the dict at the same path in the
  stats holding `load` (and `qb_target`, or `qb_hist` + `qb_tokens`, for
  "qb"). Biases without matching stats are returned unchanged; stats lacking
  the leaf the method needs (e.g. neither `qb_target` nor `qb_hist` for "qb")
  raise ValueError. Leaves may carry leading axes (e.g. a scanned layer axis:
  bias [L, E], load [L, E], qb_hist [L, E, bins]); reductions are over the
  expert axis. Jit-friendly (pure dict traversal).

  Rules (per bias b [E]):
    "qb":   target = qb_target (exact estimator) or, when the stats carry
            `qb_hist`, qb_target_from_histogram over the window
            [b - qb_range, b + qb_range] (b = this bias, the one the forward
            routed and binned with); then `qb_bias_update`.
    "sign": `sign_bias_update` with sign_rate.
    "aux", "none": unchanged.

  Args:
    router_state: the `router_state` collection (dict or FrozenDict).
    router_stats: the `router_stats` collection from the same forward pass
      (or several, summed with `accumulate_router_stats`).
    method: "qb" | "sign" | "aux" | "none".
    ema: QB smoothing; 0 = jump to the target.
    sign_rate: sign-rule step u.
    qb_range: histogram window half-width; required when stats hold
      `qb_hist` (must equal the Router's qb_range).
    top_k: k for the histogram quantile q = floor(m k / n); None derives it
      from the stats as sum(load) / qb_tokens (exact).
    qb_scale: the histogram's bin placement (`qb_histogram`; must equal the
      Router's).

  Returns:
    New router_state, same container kind (FrozenDict in -> FrozenDict out).
  """
  if method not in BALANCING_METHODS:
    raise ValueError(
        f"method must be one of {BALANCING_METHODS}, got {method!r}")
  frozen = isinstance(router_state, FrozenDict)
  state = unfreeze(router_state) if frozen else router_state
  stats = unfreeze(router_stats) if isinstance(router_stats,
                                               FrozenDict) else router_stats
  if method in ("aux", "none"):
    new = jax.tree_util.tree_map(lambda x: x, state)
  else:
    new = _update_tree(state, stats, method, ema, sign_rate, qb_range, top_k,
                       qb_scale)
  return freeze(new) if frozen else new


# ----------------------------------------------------------------------------
# QB over a time window (model.moe.qb_window_steps, model.moe.qb_update_every).
# ----------------------------------------------------------------------------

# router_state[WINDOW_KEY]: the router_stats summed over the current window,
# a tree like router_stats (load, qb_hist, qb_tokens). It sits next to the
# routers' biases so that checkpoints carry it; the Router never reads it.
WINDOW_KEY = "qb_window"


def init_qb_window(stats_shapes: Mapping) -> dict:
  """An empty window: zeros shaped like a `router_stats` tree.

  Args:
    stats_shapes: router_stats (arrays or ShapeDtypeStructs) of one step;
      only the summed stats (`load`, `qb_hist`, `qb_tokens`) are allowed.

  Returns:
    The same tree of fp32 zeros (plain dicts).
  """
  def zeros(key, val, path):
    if key not in _SUMMED_STATS:
      raise ValueError(
          f"a QB window sums router stats over steps; {key!r} at "
          f"{'/'.join(path)} cannot be summed (use qb_estimator="
          "'histogram')")
    return jnp.zeros(val.shape, jnp.float32)
  return _map_stats(zeros, stats_shapes)


def split_qb_window(router_state: Mapping) -> tuple[Mapping, Mapping | None]:
  """(the routers' state without the window, the window or None)."""
  if WINDOW_KEY not in router_state:
    return router_state, None
  rest = {k: v for k, v in router_state.items() if k != WINDOW_KEY}
  if isinstance(router_state, FrozenDict):
    rest = freeze(rest)
  return rest, router_state[WINDOW_KEY]


def qb_window_update(router_state: Mapping, router_stats: Mapping,
                     step: jax.Array, *, window_steps: int,
                     update_every: int, **update_kwargs) -> Mapping:
  """One step of Quantile Balancing over a time window.

  The bias is updated once per period of P = update_every steps, at the
  period's last step (step % P == P - 1), from the stats summed over the
  period's last W = window_steps steps (W <= P; the other steps' stats are
  dropped). Within a period every step routes and bins with the same bias,
  so the summed histogram is exactly the histogram of all the window's
  tokens: as if they had come in one batch. The window restarts empty after
  each update. Steps of the window are counted from `step`, so a resume from
  a checkpoint (which carries step and the window) continues exactly.

  Args:
    router_state: `router_state` holding the routers' biases and the window
      under WINDOW_KEY (`init_qb_window`).
    router_stats: this step's `router_stats` (summed over shards and
      microbatches already).
    step: [] int, this step's index (TrainState.step before the increment).
    window_steps: W >= 1 (static).
    update_every: P >= W (static).
    **update_kwargs: for `update_router_state` (method, ema, qb_range, ...).

  Returns:
    The new router_state, same structure and container kind.
  """
  if not 1 <= window_steps <= update_every:
    raise ValueError(
        f"qb_window_update needs 1 <= window_steps <= update_every, got "
        f"window_steps={window_steps}, update_every={update_every}")
  rest, window = split_qb_window(router_state)
  if window is None:
    raise ValueError(f"router_state has no {WINDOW_KEY!r} entry; build it "
                     "with init_qb_window (train.step does when "
                     "model.moe.qb_update_every > 1)")
  stats = unfreeze(router_stats) if isinstance(router_stats,
                                               FrozenDict) else router_stats
  win = unfreeze(window) if isinstance(window, FrozenDict) else window
  phase = jnp.asarray(step, jnp.int32) % update_every
  collect = phase >= update_every - window_steps
  summed = jax.tree.map(
      lambda a, x: a + jnp.where(collect, x.astype(jnp.float32), 0.0),
      win, stats)
  updated = update_router_state(rest, summed, **update_kwargs)
  done = phase == update_every - 1
  # Routing keeps the old bias until the period ends.
  new = jax.tree.map(lambda n, o: jnp.where(done, n, o), updated, rest)
  new = unfreeze(new) if isinstance(new, FrozenDict) else dict(new)
  new[WINDOW_KEY] = jax.tree.map(lambda a: jnp.where(done, 0.0, a), summed)
  return freeze(new) if isinstance(router_state, FrozenDict) else new


_SUMMED_STATS = ("load", "qb_hist", "qb_tokens")
_AVERAGED_STATS = ("qb_target", "aux_loss")


def accumulate_router_stats(a: Mapping | None, b: Mapping) -> Mapping:
  """Combines the router_stats of two microbatches (or update windows).

  Summed (exact: equal to the stats of the concatenated batch): `load`,
  `qb_hist`, `qb_tokens`. Averaged: `qb_target` (the exact estimator's
  per-batch target; the mean of per-microbatch quantiles is NOT the quantile
  of the union, so this is an approximation -- use qb_estimator="histogram"
  when accumulating) and `aux_loss`. The average is a running pairwise one,
  (a + b) / 2: fold microbatches in as a balanced tree, or weight it
  yourself, when there are more than two. `a=None` returns `b`.

  Args:
    a, b: `router_stats` trees of the same structure (dict or FrozenDict).

  Returns:
    The combined tree (same container kind as `b`).
  """
  if a is None:
    return b
  frozen = isinstance(b, FrozenDict)
  a = unfreeze(a) if isinstance(a, FrozenDict) else a
  bb = unfreeze(b) if frozen else b

  def merge(x, y, path):
    out = {}
    for key, yv in y.items():
      if key not in x:
        raise ValueError(f"accumulate_router_stats: {'/'.join(path + (key,))}"
                         " is missing from the first tree")
      xv = x[key]
      if _is_mapping(yv):
        out[key] = merge(xv, yv, path + (key,))
      elif key in _SUMMED_STATS:
        out[key] = xv + yv
      elif key in _AVERAGED_STATS:
        out[key] = 0.5 * (xv + yv)
      else:
        raise ValueError(
            f"accumulate_router_stats: unknown router stat {key!r} at "
            f"{'/'.join(path)}")
    return out

  out = merge(a, bb, ())
  return freeze(out) if frozen else out


def reduce_router_stats(stacked: Mapping) -> Mapping:
  """Combines router_stats stacked along a leading microbatch axis.

  Like `accumulate_router_stats` over M equal-size microbatches at once:
  `load`, `qb_hist`, `qb_tokens` are summed over axis 0 (exact), `qb_target`
  and `aux_loss` averaged with equal weights.

  Args:
    stacked: a `router_stats` tree whose leaves carry a leading axis [M, ...]
      (e.g. the stacked outputs of a jax.lax.scan over microbatches).

  Returns:
    The combined tree, leaves [...] (same container kind as `stacked`).
  """
  frozen = isinstance(stacked, FrozenDict)

  def combine(key, val, path):
    if key in _SUMMED_STATS:
      return jnp.sum(val, axis=0)
    if key in _AVERAGED_STATS:
      return jnp.mean(val, axis=0)
    raise ValueError(f"reduce_router_stats: unknown router stat {key!r} at "
                     f"{'/'.join(path)}")

  out = _map_stats(combine, unfreeze(stacked) if frozen else stacked)
  return freeze(out) if frozen else out


def collect_loads(router_stats: Mapping) -> dict[str, jax.Array]:
  """{'/'-joined path of the module holding `load`: load [..., E]}."""
  out = {}

  def walk(node, path):
    for key, val in node.items():
      if _is_mapping(val):
        walk(val, path + (str(key),))
      elif key == "load":
        out["/".join(path)] = val

  walk(router_stats, ())
  return out


def collect_max_violation(router_stats: Mapping) -> dict[str, jax.Array]:
  """Per-layer MaxVio from a `router_stats` tree.

  Args:
    router_stats: nested dict/FrozenDict with `load` [..., E] leaves.

  Returns:
    {'/'-joined path of the module holding `load`: MaxVio [...] (scalar unless
    the load has leading axes, e.g. a scanned layer axis)}.
  """
  return {k: max_violation(v) for k, v in collect_loads(router_stats).items()}


def sum_aux_losses(router_stats: PyTree) -> jax.Array:
  """Sum of every 'aux_loss' leaf (already scaled by its coefficient)."""
  total = jnp.zeros((), jnp.float32)
  for path, leaf in jax.tree_util.tree_leaves_with_path(router_stats):
    if getattr(path[-1], "key", None) == "aux_loss":
      total = total + leaf
  return total
