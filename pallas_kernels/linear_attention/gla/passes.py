"""GLA's sequential passes over chunks: the state pass and its reverse,
as Triton or Mosaic GPU kernels."""
from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention.common import mosaic
from pallas_kernels.linear_attention.common.tiles import (
    CHUNK, F32, TN, mm_dot, shape_of)


def _state_kernel(kg_ref, v_ref, ec_ref, s0_ref, states_ref, sfin_ref, *,
                  n_chunks, mm):
  # kg_ref (k exp(b_C - b)) [Tp, BK]; v_ref [Tp, BV]; ec_ref (exp(b_C))
  # [N, BK]; s0_ref, sfin_ref [BK, BV]; states_ref [N, BK, BV] (the state
  # entering each chunk).
  def body(n, s):
    states_ref[n] = s.astype(states_ref.dtype)
    rows = pl.ds(n * CHUNK, CHUNK)
    return ec_ref[n][:, None] * s + mm_dot(kg_ref[rows, :], v_ref[rows, :],
                                           TN, mm)

  sfin_ref[...] = jax.lax.fori_loop(0, n_chunks, body,
                                    s0_ref[...].astype(F32))


def _dstate_kernel(qg_ref, do_ref, ec_ref, dsfin_ref, dstates_ref, ds0_ref,
                   *, n_chunks, scale, mm):
  # qg_ref (q exp(b)) [Tp, BK]; do_ref [Tp, BV]; ec_ref [N, BK]; dsfin_ref,
  # ds0_ref [BK, BV]; dstates_ref [N, BK, BV] (grad wrt the state LEAVING
  # each chunk).
  def body(r, dh):
    n = n_chunks - 1 - r
    dstates_ref[n] = dh.astype(dstates_ref.dtype)
    rows = pl.ds(n * CHUNK, CHUNK)
    return (ec_ref[n][:, None] * dh
            + scale * mm_dot(qg_ref[rows, :], do_ref[rows, :], TN, mm))

  ds0_ref[...] = jax.lax.fori_loop(0, n_chunks, body,
                                   dsfin_ref[...].astype(F32))


def _pass_call(kernel, x_k, x_v, ec, state, lay, tune, interpret, name):
  """A sequential pass over chunks (the state pass and its reverse), grid
  (B, H, K blocks, V blocks): x_k [B, Tp, H, Kp] and x_v [B, Tp, H, V] whole
  in T, ec [B, H, N, Kp], state [B, H, Kp, V] fp32. Returns the per-chunk
  states [B, H, N, Kp, V] in the matmul dtype and the state left at the
  end [B, H, Kp, V] fp32."""
  tp, n, bk, bv = lay["tp"], lay["n_chunks"], lay["bk_pass"], lay["bv_pass"]
  seq_k = pl.BlockSpec((None, tp, None, bk), lambda b, h, i, j: (b, 0, h, i))
  seq_v = pl.BlockSpec((None, tp, None, bv), lambda b, h, i, j: (b, 0, h, j))
  ec_spec = pl.BlockSpec((None, None, n, bk), lambda b, h, i, j: (b, h, 0, i))
  blk = pl.BlockSpec((None, None, bk, bv), lambda b, h, i, j: (b, h, i, j))
  return pl.pallas_call(
      kernel,
      grid=(lay["bsz"], lay["h"], lay["nk_pass"], lay["nv_pass"]),
      in_specs=[seq_k, seq_v, ec_spec, blk],
      out_specs=[pl.BlockSpec((None, None, n, bk, bv),
                              lambda b, h, i, j: (b, h, 0, i, j)), blk],
      out_shape=[
          shape_of(lay, "bsz", "h", "n_chunks", "kp", "dv", dtype=lay["mm"]),
          shape_of(lay, "bsz", "h", "kp", "dv"),
      ],
      compiler_params=tune.params("pass"),
      interpret=interpret,
      name=name,
  )(x_k, x_v, ec, state)


def state_call(kg, vp, ec, s0p, lay, tune, interpret):
  """Kernel 2: the states entering each chunk and the final state."""
  return _pass_call(
      functools.partial(_state_kernel, n_chunks=lay["n_chunks"], mm=lay["mm"]),
      kg, vp, ec, s0p, lay, tune, interpret, "gla_state_pass")


def run_state_pass(kg, vp, ec, s0p, lay, tune, interpret):
  """Kernel 2 as Triton or Mosaic GPU kernels (tune.state_pass)."""
  if tune.state_pass == "mosaic":
    layout = mosaic.default_layout(interpret)
    return mosaic.state_pass(
        mosaic.as_layout(kg, layout), vp, ec, s0p, bk=lay["bk_pass"],
        bv=lay["bv_pass"], layout=layout, interpret=interpret)
  return state_call(kg, vp, ec, s0p, lay, tune, interpret)


def dstate_call(qg, dop, ec, dsfp, lay, scale, tune, interpret):
  """Kernel 4: dH_n (grad wrt the state leaving chunk n) and dS_0."""
  return _pass_call(
      functools.partial(_dstate_kernel, n_chunks=lay["n_chunks"], scale=scale,
                        mm=lay["mm"]),
      qg, dop, ec, dsfp, lay, tune, interpret, "gla_dstate_pass")


def run_dstate_pass(qg, dop, ec, dsfp, lay, scale, tune, interpret):
  """Kernel 4 as Triton or Mosaic GPU kernels (tune.state_pass)."""
  if tune.state_pass == "mosaic":
    layout = mosaic.default_layout(interpret)
    return mosaic.gla_dstate_pass(
        mosaic.as_layout(qg, layout), dop, ec, dsfp, scale=scale,
        bk=lay["bk_pass"], bv=lay["bv_pass"], layout=layout,
        interpret=interpret)
  return dstate_call(qg, dop, ec, dsfp, lay, scale, tune, interpret)
