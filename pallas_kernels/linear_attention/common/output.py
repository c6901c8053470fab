"""The output kernel of both chunked ops: O = scale ((q exp(b)) S_n + A X).

GLA: A = Aqk, X = v; KDA: X = V'. Two dense dots per chunk and V block
(Triton), or both products into one wgmma accumulator (`mosaic.output`).
"""
from __future__ import annotations

import functools

from jax.experimental import pallas as pl

from pallas_kernels.linear_attention.common import mosaic
from pallas_kernels.linear_attention.common.tiles import (
    chunk_spec, compiler_params, mm_dot, shape_of, square_spec, state_spec)


def _output_kernel(qg_ref, aqk_ref, vnew_ref, s_ref, o_ref, *, scale, mm):
  # qg_ref (q exp(b), exp(b) <= 1) [C, Kp]; aqk_ref [C, C]; vnew_ref, o_ref
  # [C, BV]; s_ref [Kp, BV]. O = scale ((q exp(b)) S + Aqk V').
  out = mm_dot(qg_ref[...], s_ref[...], mm=mm) + mm_dot(aqk_ref[...],
                                                        vnew_ref[...], mm=mm)
  o_ref[...] = (scale * out).astype(o_ref.dtype)


def output_call(qg, aqk, v_new, states, lay, scale, dtype, interpret,
                num_warps, name, kernel="triton"):
  """O = scale ((q exp(b)) S_n + Aqk X) [B, Tp, H, V] in dtype: qg [B, Tp,
  H, Kp], Aqk [B, H, Tp, C], X [B, Tp, H, V] (GLA: v; KDA: V'), states
  [B, H, N, Kp, V]. Grid (B, H, N, V/bv), parallel. kernel "mosaic": the
  Mosaic GPU kernel (mosaic.output, wgmma; bf16, K >= 64) instead of
  the Triton one."""
  kp, bv = lay["kp"], lay["bv"]
  if kernel == "mosaic":
    return mosaic.output(qg, aqk, v_new, states, scale=scale,
                         out_dtype=dtype, bv=bv, interpret=interpret)
  return pl.pallas_call(
      functools.partial(_output_kernel, scale=scale, mm=lay["mm"]),
      grid=(lay["bsz"], lay["h"], lay["n_chunks"], lay["nv"]),
      in_specs=[chunk_spec(kp), square_spec(), chunk_spec(bv, True),
                state_spec(kp, bv)],
      out_specs=chunk_spec(bv, True),
      out_shape=shape_of(lay, "bsz", "tp", "h", "dv", dtype=dtype),
      compiler_params=compiler_params(num_warps, 2),
      interpret=interpret,
      name=name,
  )(qg, aqk, v_new, states)
