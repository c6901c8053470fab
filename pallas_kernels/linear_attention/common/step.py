"""The one-token GLA and KDA step (decoding) as one Pallas kernel (Triton).

gla/step.py and kda/step.py wrap it; they are registered as the "pallas"
(GPU) and "interpret" (CPU) backends of `ops.gla_step` / `ops.kda_step`, and
`recurrent_step_gla/kda` (gla/naive.py, kda/naive.py) are the oracles. Per (batch, head, V block), with the state block S [K, BV] fp32:
    GLA: S' = diag(exp(g)) S + k v^T
    KDA: S~ = diag(exp(g)) S;  S' = S~ + (beta k) (v - S~^T k)^T
    o   = scale S'^T q
Decoding is memory bound (the state is read and written once per token), so
the kernel is elementwise products and column sums on the [K, BV] block, no
dots: a [1, K] x [K, BV] product would waste a 16-row tensor-core tile. The
new state is aliased to the state input (input_output_aliases): inside a
jitted decode loop that donates the state (and K a power of two, so no pad
copy), XLA can update it in place. K is padded to a power of two
with zero channels (g = 0, q = k = 0: the padded state rows stay zero).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention.common.tiles import (
    block_v, compiler_params)


F32 = jnp.float32


MAX_DIM = 256


def _step_kernel(q_ref, k_ref, g_ref, bk_ref, v_ref, s_ref, o_ref, snew_ref, *,
                 scale, delta):
  # q_ref, k_ref, g_ref, bk_ref (beta k; unused for GLA) [Kp]; v_ref,
  # o_ref [BV]; s_ref, snew_ref [Kp, BV] fp32.
  s = jnp.exp(g_ref[...].astype(F32))[:, None] * s_ref[...]
  v = v_ref[...].astype(F32)
  if delta:   # the delta rule on the decayed state
    k = k_ref[...].astype(F32)
    pred = jnp.sum(k[:, None] * s, axis=0)                     # S~^T k [BV]
    s = s + bk_ref[...][:, None] * (v - pred)[None, :]
  else:
    s = s + k_ref[...].astype(F32)[:, None] * v[None, :]
  snew_ref[...] = s
  o_ref[...] = (scale * jnp.sum(q_ref[...].astype(F32)[:, None] * s,
                                axis=0)).astype(o_ref.dtype)


def check_step(q, k, v, g, beta, state, what):
  shape = lambda x: tuple(getattr(x, "shape", ()))  # noqa: E731
  if len(shape(q)) != 3:
    raise ValueError(f"q must have rank 3 [B, H, K], got shape {shape(q)}")
  bsz, h, dk = shape(q)
  for name, x in (("k", k), ("g", g)):
    if shape(x) != shape(q):
      raise ValueError(f"{name} must have the same shape as q [B, H, K]="
                       f"{shape(q)}, got {shape(x)}")
  if len(shape(v)) != 3 or shape(v)[:2] != (bsz, h):
    raise ValueError(f"v must have shape [B, H, V] with [B, H]={(bsz, h)}, "
                     f"got {shape(v)}")
  dv = shape(v)[2]
  if beta is not None and shape(beta) != (bsz, h):
    raise ValueError(f"beta must have shape [B, H]={(bsz, h)}, got "
                     f"{shape(beta)}")
  if shape(state) != (bsz, h, dk, dv):
    raise ValueError(f"state must have shape [B, H, K, V]={(bsz, h, dk, dv)},"
                     f" got {shape(state)}")
  for name, d in (("K", dk), ("V", dv)):
    if d % 16 or not 16 <= d <= MAX_DIM:
      raise ValueError(f"the Pallas {what} step needs {name} a multiple of 16"
                       f" in [16, {MAX_DIM}], got {name}={d}")
  return bsz, h, dk, dv


@functools.partial(jax.jit, static_argnames=("scale", "delta", "interpret"))
def run_step(q, k, v, g, bk, state, *, scale, delta, interpret):
  bsz, h, dk = q.shape
  dv = v.shape[-1]
  kp = 1 << (dk - 1).bit_length()
  pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, kp - dk)))  # noqa: E731
  q, k, g, bk = (pad(x) for x in (q, k, g.astype(F32), bk))
  state = jnp.pad(state.astype(F32), ((0, 0), (0, 0), (0, kp - dk), (0, 0)))
  bv = block_v(dv)
  vec_k = pl.BlockSpec((None, None, kp), lambda b, hh, j: (b, hh, 0))
  vec_v = pl.BlockSpec((None, None, bv), lambda b, hh, j: (b, hh, j))
  blk = pl.BlockSpec((None, None, kp, bv), lambda b, hh, j: (b, hh, 0, j))
  o, s = pl.pallas_call(
      functools.partial(_step_kernel, scale=scale, delta=delta),
      grid=(bsz, h, dv // bv),
      in_specs=[vec_k, vec_k, vec_k, vec_k, vec_v, blk],
      out_specs=[vec_v, blk],
      out_shape=[jax.ShapeDtypeStruct((bsz, h, dv), v.dtype),
                 jax.ShapeDtypeStruct((bsz, h, kp, dv), F32)],
      input_output_aliases={5: 1},
      compiler_params=compiler_params(num_warps=4, num_stages=1),
      interpret=interpret,
      name="kda_step" if delta else "gla_step",
  )(q, k, g, bk, v, state)
  return o, s[:, :, :dk]


def step_scale(scale, dk):
  return float(dk) ** -0.5 if scale is None else float(scale)
