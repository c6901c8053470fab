"""Our bounded GLA / KDA in bf16 against a float64 per-token recurrence.

No flags (importable from tests and from bench_kernels, which runs it at
T=131072 on a GPU with --check_t). Inputs are bench_kernels' dict: q, k, v
[B, T, H, D] bf16, g [B, T, H, D] fp32 log decay, beta [B, T, H].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.linear_attention import ops


def float64_recurrence(op, x, heads):
  """Outputs [T, heads, V] and final states [heads, K, V] of the per-token
  recurrence in float64 (numpy), on batch 0 and the first `heads` heads of
  x (bf16 values taken exactly)."""
  f64 = lambda n: np.asarray(  # noqa: E731
      jax.device_get(x[n][0, :, :heads].astype(jnp.float32)), np.float64)
  q, k, v, eg = f64("q"), f64("k"), f64("v"), np.exp(f64("g"))
  beta = f64("beta") if op == "kda" else None
  t, dk, dv = q.shape[0], q.shape[-1], v.shape[-1]
  s = np.zeros((heads, dk, dv))
  want = np.empty((t, heads, dv))
  for i in range(t):
    s = eg[i][:, :, None] * s
    if op == "kda":   # delta rule on the decayed state
      err = v[i] - np.einsum("hk,hkv->hv", k[i], s)
      s = s + (beta[i][:, None, None] * k[i][:, :, None]) * err[:, None, :]
    else:
      s = s + k[i][:, :, None] * v[i][:, None, :]
    want[i] = np.einsum("hk,hkv->hv", q[i], s) * dk ** -0.5
  return want, s


def relative_errors(op, x, g_min, heads=2, backend="pallas"):
  """(output, final state) relative Frobenius errors of ops.<op> with g_min
  against float64_recurrence, on batch 0 and the first `heads` heads."""
  x = {n: a[:1, :, :heads] for n, a in x.items()}
  args = [x[n] for n in ("q", "k", "v", "g")]
  if op == "kda":
    args.append(x["beta"])
  o, state = getattr(ops, op)(*args, backend=backend, g_min=g_min)
  want_o, want_s = float64_recurrence(op, x, heads)
  o = np.asarray(jax.device_get(o[0]), np.float64)
  state = np.asarray(jax.device_get(state[0]), np.float64)
  rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))  # noqa: E731
  return rel(o, want_o), rel(state, want_s)
