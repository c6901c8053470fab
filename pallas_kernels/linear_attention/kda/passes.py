"""KDA's sequential passes over chunks, grid (B, H, V/pass_bv).

  2. the state pass: per chunk V' = U - W S (all of K: the state block is
     [Kp, BV]) and S <- diag(exp(b_C)) S + (k exp(b_C - b))^T V'; stores the
     state entering each chunk (matmul dtype; carried in fp32), V' and the
     final state;
  5. its reverse: dV' = scale Aqk^T dO + (k exp(b_C - b)) dH and
     dH <- diag(exp(b_C)) dH + scale (q exp(b))^T dO - W^T dV'; stores dH_n
     (the gradient w.r.t. the state leaving chunk n), dV' and dS_0.
Both read the decayed operands the intra kernel stored: no exp on their
critical path. As Triton kernels here, or as Mosaic GPU kernels
(common/mosaic.py, Tuning.state_pass)."""
from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

from pallas_kernels.linear_attention.common import mosaic
from pallas_kernels.linear_attention.common.tiles import (
    CHUNK, F32, TN, mm_dot, shape_of)


def _state_kernel(w_ref, u_ref, kg_ref, ec_ref, s0_ref, states_ref, vnew_ref,
                  sfin_ref, *, n_chunks, mm):
  # w_ref, kg_ref (k exp(b_C - b)) [Tp, Kp]; ec_ref (exp(b_C)) [N, Kp];
  # u_ref, vnew_ref [Tp, BV]; s0_ref, sfin_ref [Kp, BV]; states_ref
  # [N, Kp, BV].
  def body(n, s):
    states_ref[n] = s.astype(states_ref.dtype)
    rows = pl.ds(n * CHUNK, CHUNK)
    # V' = U - W S needs all of K: the state block is [K, BV].
    v_new = u_ref[rows, :].astype(F32) - mm_dot(w_ref[rows, :], s, mm=mm)
    vnew_ref[rows, :] = v_new.astype(vnew_ref.dtype)
    return (ec_ref[n][:, None] * s
            + mm_dot(kg_ref[rows, :], v_new, TN, mm))

  s = jax.lax.fori_loop(0, n_chunks, body, s0_ref[...].astype(F32))
  sfin_ref[...] = s


def _dstate_kernel(qg_ref, kg_ref, ec_ref, w_ref, do_ref, dvi_ref, dsfin_ref,
                   dstates_ref, dvnew_ref, ds0_ref, *, n_chunks, scale, mm):
  # qg_ref (q exp(b)), kg_ref (k exp(b_C - b)), w_ref [Tp, Kp]; ec_ref
  # (exp(b_C)) [N, Kp]; do_ref, dvi_ref, dvnew_ref [Tp, BV]; dsfin_ref,
  # ds0_ref [Kp, BV]; dstates_ref [N, Kp, BV] (grad wrt the state LEAVING
  # each chunk).
  def body(r, dh):
    n = n_chunks - 1 - r
    dstates_ref[n] = dh.astype(dstates_ref.dtype)
    rows = pl.ds(n * CHUNK, CHUNK)
    dv_new = dvi_ref[rows, :] + mm_dot(kg_ref[rows, :], dh, mm=mm)  # dV'
    dvnew_ref[rows, :] = dv_new.astype(dvnew_ref.dtype)
    return (ec_ref[n][:, None] * dh
            + scale * mm_dot(qg_ref[rows, :], do_ref[rows, :], TN, mm)
            - mm_dot(w_ref[rows, :], dv_new, TN, mm))

  ds0_ref[...] = jax.lax.fori_loop(0, n_chunks, body,
                                   dsfin_ref[...].astype(F32))


def _pass_specs(lay):
  """Specs of the sequential passes, grid (B, H, V block j): all of T of a
  [B, Tp, H, Kp] array, all of T of a [B, Tp, H, V] array in block j, one
  [Kp, BV] state of [B, H, Kp, V], and the per-chunk states [B, H, N, Kp, V].
  """
  tp, kp, bv, n = lay["tp"], lay["kp"], lay["bv_pass"], lay["n_chunks"]
  seq_k = pl.BlockSpec((None, tp, None, kp), lambda b, h, j: (b, 0, h, 0))
  seq_v = pl.BlockSpec((None, tp, None, bv), lambda b, h, j: (b, 0, h, j))
  state = pl.BlockSpec((None, None, kp, bv), lambda b, h, j: (b, h, 0, j))
  states = pl.BlockSpec((None, None, n, kp, bv),
                        lambda b, h, j: (b, h, 0, 0, j))
  return seq_k, seq_v, state, states


def _pass_ec_spec(lay):
  """All of exp(b_C) [B, H, N, Kp] of (b, h); grid (B, H, V block j)."""
  return pl.BlockSpec((None, None, lay["n_chunks"], lay["kp"]),
                      lambda b, h, j: (b, h, 0, 0))


def state_call(w, u, kg, ec, s0p, lay, tune, interpret):
  """Kernel 2: states entering each chunk, V', the final state."""
  seq_k, seq_v, state, states = _pass_specs(lay)
  return pl.pallas_call(
      functools.partial(_state_kernel, n_chunks=lay["n_chunks"], mm=lay["mm"]),
      grid=(lay["bsz"], lay["h"], lay["nv_pass"]),
      in_specs=[seq_k, seq_v, seq_k, _pass_ec_spec(lay), state],
      out_specs=[states, seq_v, state],
      out_shape=[
          shape_of(lay, "bsz", "h", "n_chunks", "kp", "dv", dtype=lay["mm"]),
          shape_of(lay, "bsz", "tp", "h", "dv", dtype=lay["mm"]),
          shape_of(lay, "bsz", "h", "kp", "dv"),
      ],
      compiler_params=tune.params("state"),
      interpret=interpret,
      name="kda_state_pass",
  )(w, u, kg, ec, s0p)


def run_state_pass(w, u, kg, ec, s0p, lay, tune, interpret):
  """Kernel 2 as Triton or Mosaic GPU kernels (tune.state_pass)."""
  if tune.state_pass == "mosaic":
    layout = mosaic.default_layout(interpret)
    return mosaic.state_pass(
        mosaic.as_layout(kg, layout), u, ec, s0p, w=w,
        bv=lay["bv_pass"], layout=layout, interpret=interpret)
  return state_call(w, u, kg, ec, s0p, lay, tune, interpret)


def dstate_call(qg, kg, ec, w, dop, dv_intra, dsfp, lay, scale, tune,
                interpret):
  """Reverse pass over chunks: dH_n [B, H, N, Kp, V] and dV' [B, Tp, H, V]
  in the matmul dtype, dS_0 fp32."""
  seq_k, seq_v, state, states = _pass_specs(lay)
  return pl.pallas_call(
      functools.partial(_dstate_kernel, n_chunks=lay["n_chunks"], scale=scale,
                        mm=lay["mm"]),
      grid=(lay["bsz"], lay["h"], lay["nv_pass"]),
      in_specs=[seq_k, seq_k, _pass_ec_spec(lay), seq_k, seq_v, seq_v, state],
      out_specs=[states, seq_v, state],
      out_shape=[
          shape_of(lay, "bsz", "h", "n_chunks", "kp", "dv", dtype=lay["mm"]),
          shape_of(lay, "bsz", "tp", "h", "dv", dtype=lay["mm"]),
          shape_of(lay, "bsz", "h", "kp", "dv"),
      ],
      compiler_params=tune.params("dstate"),
      interpret=interpret,
      name="kda_dstate_pass",
  )(qg, kg, ec, w, dop, dv_intra, dsfp)


def run_dstate_pass(qg, kg, ec, w, dop, dv_intra, dsfp, lay, scale, tune,
                    interpret):
  """The reverse pass as Triton or Mosaic GPU kernels (tune.state_pass)."""
  if tune.state_pass == "mosaic":
    layout = mosaic.default_layout(interpret)
    return mosaic.kda_dstate_pass(
        mosaic.as_layout(qg, layout), kg,
        mosaic.as_layout(w, layout), ec, dop, dv_intra, dsfp,
        scale=scale, bv=lay["bv_pass"], layout=layout, interpret=interpret)
  return dstate_call(qg, kg, ec, w, dop, dv_intra, dsfp, lay, scale, tune,
                     interpret)
