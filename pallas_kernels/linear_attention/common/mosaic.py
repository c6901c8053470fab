"""The sequential state passes of chunked GLA and KDA on Mosaic GPU (wgmma).

docs/design.md §4. The Triton passes (kda/passes.py, gla/passes.py) are the
reference these kernels are tested against; Tuning.state_pass="auto" (the
default of both ops) runs these on a GPU wherever they apply, where they
are faster (results/kernels.md); Tuning.output_kernel="mosaic" runs
`output` instead of the Triton output kernel.

One program per (batch, head, K block of bk, V block of bv), sequential
over the chunks (S [bk, bv] fp32 held in registers as a wgmma accumulator;
rows = the C = 64 rows of chunk n; every product below is ONE warpgroup
MMA, M = C or M = bk, so bk is a multiple of 64):
  forward (`state_pass`), n = 0 .. N-1, S = the state entering chunk n:
    states[n] = S                                   (matmul dtype)
    KDA: X = U - W S,  v_new[rows] = X              (X in the matmul dtype)
    GLA: X = v
    S <- diag(exp(b_C)) S + (k exp(b_C - b))^T X
  GLA reverse (`gla_dstate_pass`), n = N-1 .. 0, dH = grad wrt the state
  leaving chunk n:
    dstates[n] = dH;  dH <- diag(exp(b_C)) dH + scale (q exp(b))^T dO
  KDA reverse (`kda_dstate_pass`):
    dstates[n] = dH;  dV' = dV'_intra + (k exp(b_C - b)) dH
    dH <- diag(exp(b_C)) dH + scale (q exp(b))^T dO - W^T dV'
KDA needs all of K in one program (W S and kg dH sum over K): bk = Kp.
The inputs of the next chunk are fetched by TMA into the other of two
shared-memory slots while this one computes; the outputs leave by TMA
stores from shared memory, overlapped with the next chunk.

The operands used transposed (kg in the forward; qg and W in the reverse
passes) come in one of two layouts (`layout`):
  * "rows": as the intra kernel stores them, [B, Tp, H, Kp]; each chunk is
    loaded as [C, bk] and fed to wgmma transposed (the hardware reads a
    16-bit operand either way). JAX 0.10's GPU interpreter cannot run a
    transposed operand (0.11's can), so on 0.10 this layout is checked by
    lowering only.
  * "cols": their transposes [B, H, Kp, Tp], made by XLA before the call
    (one extra pass each); runs in every interpreter.

bf16 operands only: wgmma on fp32 operands is TF32, which would break the
fp32 path's IEEE contract (Precision.HIGHEST); fp32 callers keep Triton.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - every supported jax has it
  plgpu = None

from pallas_kernels.linear_attention.common.tiles import CHUNK

_F32 = jnp.float32
LAYOUTS = ("rows", "cols")
STAGE_KERNELS = ("triton", "mosaic")   # output_kernel choices
STATE_PASS_CHOICES = ("auto",) + STAGE_KERNELS   # state_pass choices
BLOCK_V = 16        # V block per program: B1 H16 V128 -> 128 programs
_SLOTS = 2          # double-buffered inputs and outputs
SMEM_LIMIT = 227 * 1024   # bytes of shared memory per block on sm_90


def gpu_interpreter(**options):
  """The GPU interpreter's parameters (e.g. detect_races=True), to pass as
  `interpret` to any kernel here."""
  cls = getattr(plgpu, "InterpretGPUParams", None)
  if cls is None:  # jax 0.10: not yet exported
    from jax._src.pallas.mosaic_gpu.interpret import params  # pylint: disable=g-import-not-at-top
    cls = params.InterpretGPUParams
  return cls(**options)


def _interpret_params(interpret):
  """plgpu.kernel's `interpret`: None (compile), the GPU interpreter for
  True (the generic HLO one has no rule for TMA copies), or the caller's
  gpu_interpreter(...) as is."""
  if interpret is None or interpret is False:
    return None
  return gpu_interpreter() if interpret is True else interpret


def default_layout(interpret):
  """"rows" (wgmma reads the operand transposed), except in a GPU
  interpreter that cannot (jax 0.10): "cols"."""
  return "cols" if interpret and not interpreter_transposes() else "rows"


def as_layout(x, layout):
  """A transposed operand [B, Tp, H, Kp] in `layout`: itself ("rows") or
  [B, H, Kp, Tp] ("cols", an XLA transpose)."""
  return x if layout == "rows" else jnp.transpose(x, (0, 2, 3, 1))


def interpreter_transposes():
  """Whether this jax's GPU interpreter runs transposed wgmma operands
  (kg_layout="rows"): 0.11 and later."""
  return hasattr(plgpu, "InterpretGPUParams")


def _mma_transforms(swizzle, dtype):
  """Tiling and swizzle of a 16-bit wgmma operand in shared memory: rows of
  8 x (swizzle / 2) elements. Both operands of one wgmma need the same
  swizzle, so every operand here takes the one the narrowest (the [., bv]
  block) allows."""
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(swizzle))


def _load(ref, layout, interpret):
  """All of a shared-memory ref, in `layout` (the wgmma accumulator's, or
  its row vector's, so that it combines with the accumulator). A plain load
  cast to the layout (the cast is the lowering's layout hint for the load).
  jax 0.10's GPU interpreter runs neither plgpu.load(..., layout=) on a
  tiled ref nor layout_cast, and models no layouts: there, the plain load
  alone; 0.11's runs the cast."""
  x = ref[...]
  if interpret and not interpreter_transposes():
    return x
  return plgpu.layout_cast(x, layout)


def check_state_pass(kp, dv, dtype, bk, bv, layout, whole_k,
                     what="state_pass"):
  """Limits of the Mosaic kernels (ValueError names the option `what` and
  the field)."""
  me = f"{what}='mosaic'"
  if plgpu is None:
    raise ValueError(f"{me} needs jax.experimental.pallas.mosaic_gpu, "
                     "absent from this jax")
  if jnp.dtype(dtype) != jnp.bfloat16:
    raise ValueError(f"{me} takes bfloat16 inputs only (wgmma on float32 is "
                     f"TF32), got {jnp.dtype(dtype).name}; use "
                     f"{what}='triton'")
  if kp % 64:
    raise ValueError(f"{me} needs K (padded to a power of two) a multiple of "
                     f"64, got {kp}; use {what}='triton'")
  if bk not in (64, 128, 256) or kp % bk or (whole_k and bk != kp):
    allowed = f"K={kp}" if whole_k else f"64, 128 or 256 dividing K={kp}"
    raise ValueError(f"{me} block_k must be {allowed} (the wgmma M dim), got "
                     f"block_k={bk!r}")
  if bv not in (16, 32, 64) or dv % bv:
    raise ValueError(f"{me} block_v must be 16, 32 or 64 and divide V={dv}, "
                     f"got block_v={bv!r}")
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _transposed_if(ref, layout):
  """The [bk, C] view of a transposed operand's slot."""
  return ref.transpose((1, 0)) if layout == "rows" else ref


def _keys_rows(ref, b, h, keys, rows, layout):
  """Chunk `rows`, K block `keys` of a transposed operand in GMEM: [C, bk]
  of [B, Tp, H, Kp] ("rows") or [bk, C] of [B, H, Kp, Tp] ("cols")."""
  return ref.at[b, rows, h, keys] if layout == "rows" else ref.at[
      b, h, keys, rows]


def _smem(shape, dtype, swizzle=None):
  """Two slots of a [shape] buffer; wgmma operands (swizzle given) tiled
  and swizzled."""
  transforms = () if swizzle is None else _mma_transforms(swizzle, dtype)
  return plgpu.SMEM((_SLOTS,) + shape, dtype, transforms=transforms)


def _state_smem(bk, bv):
  """The fp32 state buffer (initial state in, final state out), swizzled so
  that moving the accumulator's fragments needs no bank-conflicted
  transfer."""
  return plgpu.SMEM((bk, bv), _F32,
                    transforms=_mma_transforms(min(128, bv * 4), _F32))


def _mma(a, b, shape):
  """a @ b (refs in shared memory) into a fresh fp32 accumulator. Zero-
  initialised plus an add by the caller, not ACC.init: the GPU interpreter
  has no rule for an initialised accumulator; the add costs shape / 128
  registers per lane."""
  def body(acc):
    plgpu.wgmma(acc, a, b)
    return acc[...]
  return pl.run_scoped(body, plgpu.ACC(shape, _F32))


def _release_slot():
  """Before a TMA write into a slot that chunk r - 1 read: by wgmma
  (awaited) and by plain loads (ec, U, dV'_intra). A plain load is a
  generic-proxy access and the TMA write an async-proxy one; the proxy fence
  (and warpgroup barrier) of commit_smem orders the two. Without it, jax
  0.11's race detector reports the write racing those loads."""
  plgpu.commit_smem()


def _run_pass(streams, bars, *, n_chunks, reverse, stores, step, carry,
              first=0):
  """The chunk loop shared by every pass.

  streams: (gmem_slice(n) -> GMEM ref view, smem slots) per input; chunk
  r's inputs are fetched into slot r % 2 (barrier i * 2 + slot) while chunk
  r - 1 computes. step(n, slot, carry) -> carry runs chunk n = first + r
  (or first + N - 1 - r with reverse) once its inputs are in; before it,
  the TMA stores of chunk r - 2 (`stores` per chunk) have finished reading
  the output slot it reuses.
  """
  def chunk(r):
    return first + (n_chunks - 1 - r if reverse else r)

  def fetch(r, slot):
    n = chunk(r)
    for i, (src, dst) in enumerate(streams):
      plgpu.copy_gmem_to_smem(src(n), dst.at[slot], bars.at[i * _SLOTS + slot])

  fetch(0, 0)

  def body(r, carry):
    slot = jax.lax.rem(r, _SLOTS)

    @pl.when(r + 1 < n_chunks)
    def _prefetch():
      _release_slot()
      fetch(r + 1, 1 - slot)

    for i in range(len(streams)):
      plgpu.barrier_wait(bars.at[i * _SLOTS + slot])
    plgpu.wait_smem_to_gmem(stores, wait_read_only=True)
    return step(chunk(r), slot, carry)

  return jax.lax.fori_loop(0, n_chunks, body, carry)


def _program_ids(bk, bv):
  b, h = jax.lax.axis_index("b"), jax.lax.axis_index("h")
  keys = pl.ds(jax.lax.axis_index("i") * bk, bk)     # this program's K block
  cols = pl.ds(jax.lax.axis_index("j") * bv, bv)     # and V block
  return b, h, keys, cols


def _load_state(s0_g, f32_s, bar, b, h, keys, cols, interpret):
  plgpu.copy_gmem_to_smem(s0_g.at[b, h, keys, cols], f32_s, bar)
  plgpu.barrier_wait(bar)
  return _load(f32_s, plgpu.Layout.WGMMA, interpret)


def _store_state(s, f32_s, sfin_g, b, h, keys, cols):
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  f32_s[...] = s
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(f32_s, sfin_g.at[b, h, keys, cols])
  plgpu.wait_smem_to_gmem(0)


def _to_gmem(value, slot_ref, dst):
  """value -> a shared-memory slot -> dst by TMA (not awaited here)."""
  slot_ref[...] = value
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(slot_ref, dst)


def _decay(ec_ref, s, interpret):
  """diag(ec) s: ec [bk] from shared memory as the accumulator's rows."""
  ec = _load(ec_ref, plgpu.Layout.WGMMA.reduce(1), interpret)
  return jax.lax.broadcast_in_dim(ec, s.shape, (0,)) * s


def _state_kernel(*refs, n_chunks, bk, bv, has_w, reverse, scale, layout,
                  mm, interpret):
  """The forward pass (GLA, KDA with W) and GLA's reverse pass (reverse,
  scale; kg -> qg, x -> dO)."""
  if has_w:
    (kg_g, x_g, w_g, ec_g, s0_g, states_g, vnew_g, sfin_g,
     kg_s, x_s, w_s, ec_s, s_s, xo_s, f32_s, bars, s0_bar) = refs
  else:
    (kg_g, x_g, ec_g, s0_g, states_g, sfin_g,
     kg_s, x_s, ec_s, s_s, f32_s, bars, s0_bar) = refs
  b, h, keys, cols = _program_ids(bk, bv)
  rows = lambda n: pl.ds(n * CHUNK, CHUNK)  # noqa: E731
  streams = [
      (lambda n: _keys_rows(kg_g, b, h, keys, rows(n), layout), kg_s),
      (lambda n: x_g.at[b, rows(n), h, cols], x_s),
      (lambda n: ec_g.at[b, h, n, keys], ec_s)]
  if has_w:
    streams.append((lambda n: w_g.at[b, rows(n), h], w_s))

  def step(n, slot, s):
    _to_gmem(s.astype(mm), s_s.at[slot], states_g.at[b, h, n, keys, cols])
    x_ref = x_s.at[slot]
    if has_w:   # V' = U - W S, stored, and the operand of the update
      u = _load(x_ref, plgpu.Layout.WGMMA, interpret).astype(_F32)
      v_new = u - _mma(w_s.at[slot], s_s.at[slot], (CHUNK, bv))
      x_ref = xo_s.at[slot]
      _to_gmem(v_new.astype(mm), x_ref, vnew_g.at[b, rows(n), h, cols])
    upd = _mma(_transposed_if(kg_s.at[slot], layout), x_ref, (bk, bv))
    return _decay(ec_s.at[slot], s, interpret) + (
        upd if scale == 1.0 else scale * upd)

  s0 = _load_state(s0_g, f32_s, s0_bar, b, h, keys, cols, interpret)
  s = _run_pass(streams, bars, n_chunks=n_chunks, reverse=reverse,
                stores=2 if has_w else 1, step=step, carry=s0)
  _store_state(s, f32_s, sfin_g, b, h, keys, cols)


def _kda_dstate_kernel(qg_g, kg_g, w_g, ec_g, do_g, dvi_g, dsf_g,
                       dstates_g, dvnew_g, ds0_g,
                       qg_s, kg_s, w_s, ec_s, do_s, dvi_s, dh_s, dvn_s, f32_s,
                       bars, s0_bar, *, n_chunks, kp, bv, scale, layout, mm,
                       interpret):
  b, h, keys, cols = _program_ids(kp, bv)
  rows = lambda n: pl.ds(n * CHUNK, CHUNK)  # noqa: E731
  streams = [
      (lambda n: _keys_rows(qg_g, b, h, keys, rows(n), layout), qg_s),
      (lambda n: kg_g.at[b, rows(n), h], kg_s),
      (lambda n: _keys_rows(w_g, b, h, keys, rows(n), layout), w_s),
      (lambda n: ec_g.at[b, h, n], ec_s),
      (lambda n: do_g.at[b, rows(n), h, cols], do_s),
      (lambda n: dvi_g.at[b, rows(n), h, cols], dvi_s)]

  def step(n, slot, dh):
    _to_gmem(dh.astype(mm), dh_s.at[slot], dstates_g.at[b, h, n, :, cols])
    dvi = _load(dvi_s.at[slot], plgpu.Layout.WGMMA, interpret)
    dv_new = dvi + _mma(kg_s.at[slot], dh_s.at[slot], (CHUNK, bv))
    _to_gmem(dv_new.astype(mm), dvn_s.at[slot],
             dvnew_g.at[b, rows(n), h, cols])
    q_do = _mma(_transposed_if(qg_s.at[slot], layout), do_s.at[slot],
                (kp, bv))
    w_dv = _mma(_transposed_if(w_s.at[slot], layout), dvn_s.at[slot],
                (kp, bv))
    return _decay(ec_s.at[slot], dh, interpret) + scale * q_do - w_dv

  dh = _load_state(dsf_g, f32_s, s0_bar, b, h, keys, cols, interpret)
  dh = _run_pass(streams, bars, n_chunks=n_chunks, reverse=True, stores=2,
                 step=step, carry=dh)
  _store_state(dh, f32_s, ds0_g, b, h, keys, cols)


def _smem_bytes(scratch):
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
             for x in scratch if hasattr(x, "shape"))


def _launch(kernel, args, out_type, scratch, *, grid, interpret, name,
            grid_names=("b", "h", "i", "j"), what="state_pass"):
  """Runs one Mosaic kernel after checking its shared memory (the error
  names the option `what`)."""
  nbytes = _smem_bytes(scratch)
  if nbytes > SMEM_LIMIT:
    raise ValueError(
        f"{what}='mosaic' needs {nbytes} bytes of shared memory per block at "
        f"these sizes (limit {SMEM_LIMIT}); use a smaller block_v or "
        f"{what}='triton'")
  call = plgpu.kernel(
      kernel, out_type=out_type, scratch_types=scratch, grid=grid,
      grid_names=grid_names, kernel_name=name,
      interpret=_interpret_params(interpret))
  return call(*args)


def _sizes(x, s0, bk, bv, layout, whole_k):
  bsz, tp, h, dv = x.shape
  kp = s0.shape[2]
  bk = kp if bk is None else bk
  check_state_pass(kp, dv, x.dtype, bk, bv, layout, whole_k)
  return bsz, tp, h, dv, kp, bk, tp // CHUNK


def _gla_like_scratch(kp, bk, bv, has_w, layout, mm):
  """Shared memory of `_state_kernel`, in its order."""
  swz = bv * jnp.dtype(mm).itemsize            # one swizzle for all operands
  scratch = [_smem((CHUNK, bk) if layout == "rows" else (bk, CHUNK), mm, swz),
             _smem((CHUNK, bv), mm, swz)]
  if has_w:
    scratch.append(_smem((CHUNK, kp), mm, swz))
  scratch += [_smem((bk,), _F32), _smem((bk, bv), mm, swz)]
  if has_w:
    scratch.append(_smem((CHUNK, bv), mm, swz))
  return scratch + [_state_smem(bk, bv),
                    plgpu.Barrier(num_barriers=(4 if has_w else 3) * _SLOTS),
                    plgpu.Barrier()]


def _kda_dstate_scratch(kp, bv, layout, mm):
  """Shared memory of `_kda_dstate_kernel`, in its order."""
  swz = bv * jnp.dtype(mm).itemsize
  t_block = (CHUNK, kp) if layout == "rows" else (kp, CHUNK)
  return [_smem(t_block, mm, swz), _smem((CHUNK, kp), mm, swz),
          _smem(t_block, mm, swz), _smem((kp,), _F32),
          _smem((CHUNK, bv), mm, swz),
          _smem((CHUNK, bv), _F32, min(128, bv * 4)),
          _smem((kp, bv), mm, swz), _smem((CHUNK, bv), mm, swz),
          _state_smem(kp, bv),
          plgpu.Barrier(num_barriers=6 * _SLOTS), plgpu.Barrier()]


def resolve_state_pass(choice, kp, dv, dtype, bk, bv, interpret, kda):
  """The state passes a call runs: choice "triton" or "mosaic" as given;
  "auto" is "mosaic" on a GPU wherever the Mosaic passes apply (bf16, Kp a
  multiple of 64, blocks valid, shared memory within the limit for every
  pass of the op) and "triton" elsewhere, interpret mode included (the
  Mosaic passes are tested explicitly there: tests/test_state_mosaic.py).
  The Mosaic passes are faster for both ops on an H200 at B1 T32768 and
  B8 T8192 (results/kernels.md, 2026-12-05)."""
  if choice != "auto":
    return choice
  if interpret or plgpu is None:
    return "triton"
  layout = default_layout(False)
  try:
    check_state_pass(kp, dv, dtype, bk, bv, layout, whole_k=kda)
  except ValueError:
    return "triton"
  mm = jnp.dtype(dtype)
  passes = [_gla_like_scratch(kp, bk, bv, kda, layout, mm)]
  passes.append(_kda_dstate_scratch(kp, bv, layout, mm) if kda else
                _gla_like_scratch(kp, bk, bv, False, layout, mm))
  fits = all(_smem_bytes(s) <= SMEM_LIMIT for s in passes)
  return "mosaic" if fits else "triton"


def _gla_like_pass(kg, x, ec, s0, w, *, bk, bv, layout, reverse, scale,
                   interpret, name):
  bsz, tp, h, dv, kp, bk, n_chunks = _sizes(x, s0, bk, bv, layout,
                                            whole_k=w is not None)
  mm, has_w = x.dtype, w is not None
  scratch = _gla_like_scratch(kp, bk, bv, has_w, layout, mm)
  out_type = [jax.ShapeDtypeStruct((bsz, h, n_chunks, kp, dv), mm)]
  if has_w:
    out_type.append(jax.ShapeDtypeStruct((bsz, tp, h, dv), mm))
  out_type.append(jax.ShapeDtypeStruct((bsz, h, kp, dv), _F32))
  kernel = functools.partial(
      _state_kernel, n_chunks=n_chunks, bk=bk, bv=bv, has_w=has_w,
      reverse=reverse, scale=float(scale), layout=layout, mm=mm,
      interpret=bool(interpret))
  args = (kg, x) + ((w,) if has_w else ()) + (ec, s0)
  return tuple(_launch(kernel, args, out_type, scratch,
                       grid=(bsz, h, kp // bk, dv // bv), interpret=interpret,
                       name=name))


def state_pass(kg, x, ec, s0, w=None, *, bk=None, bv=BLOCK_V, layout="rows",
               interpret=False):
  """The forward state pass (GLA; KDA with w).

  Args:
    kg: k exp(b_C - b) in bf16, [B, Tp, H, Kp] (layout "rows") or its
      transpose [B, H, Kp, Tp] ("cols"); Tp a multiple of 64, Kp of 64.
    x: [B, Tp, H, V] bf16: U (KDA, with w) or v (GLA).
    ec: exp(b_C) [B, H, N, Kp] fp32, N = Tp / 64.
    s0: the initial state [B, H, Kp, V] fp32.
    w: KDA's W [B, Tp, H, Kp] bf16 (always "rows"), or None (GLA).
    bk: K block per program (None: all of Kp, which KDA needs). 64, 128 or
      256.
    bv: V block per program (16, 32 or 64).
    interpret: run in the GPU interpreter (CPU): True, or gpu_interpreter(
      ...) for its options.
  Returns:
    states [B, H, N, Kp, V] bf16 (the state entering each chunk), then
    v_new [B, Tp, H, V] bf16 (KDA only: U - W S per chunk), then the final
    state [B, H, Kp, V] fp32.
  """
  return _gla_like_pass(
      kg, x, ec, s0, w, bk=bk, bv=bv, layout=layout, reverse=False, scale=1.0,
      interpret=interpret,
      name="kda_state_pass_mosaic" if w is not None else
      "gla_state_pass_mosaic")


def gla_dstate_pass(qg, do, ec, ds_final, *, scale, bk=None, bv=BLOCK_V,
                    layout="rows", interpret=False):
  """GLA's reverse pass: qg = q exp(b) (layout as kg in state_pass), do
  [B, Tp, H, V] bf16, ec [B, H, N, Kp], ds_final [B, H, Kp, V] fp32.
  Returns dstates [B, H, N, Kp, V] bf16 (grad wrt the state leaving each
  chunk) and dS_0 [B, H, Kp, V] fp32."""
  return _gla_like_pass(qg, do, ec, ds_final, None, bk=bk, bv=bv,
                        layout=layout, reverse=True, scale=scale,
                        interpret=interpret, name="gla_dstate_pass_mosaic")


def kda_dstate_pass(qg, kg, w, ec, do, dv_intra, ds_final, *, scale,
                    bv=BLOCK_V, layout="rows", interpret=False):
  """KDA's reverse pass.

  Args:
    qg, w: q exp(b) and W, bf16, [B, Tp, H, Kp] ("rows") or their
      transposes [B, H, Kp, Tp] ("cols").
    kg: k exp(b_C - b) [B, Tp, H, Kp] bf16 (used untransposed).
    ec: exp(b_C) [B, H, N, Kp] fp32.
    do: [B, Tp, H, V] bf16; dv_intra: scale Aqk^T dO [B, Tp, H, V] fp32.
    ds_final: [B, H, Kp, V] fp32.
  Returns:
    dstates [B, H, N, Kp, V] bf16, dV' [B, Tp, H, V] bf16, dS_0 [B, H, Kp,
    V] fp32.
  """
  bsz, tp, h, dv, kp, _, n_chunks = _sizes(do, ds_final, None, bv, layout,
                                           whole_k=True)
  mm = do.dtype
  scratch = _kda_dstate_scratch(kp, bv, layout, mm)
  out_type = [jax.ShapeDtypeStruct((bsz, h, n_chunks, kp, dv), mm),
              jax.ShapeDtypeStruct((bsz, tp, h, dv), mm),
              jax.ShapeDtypeStruct((bsz, h, kp, dv), _F32)]
  kernel = functools.partial(
      _kda_dstate_kernel, n_chunks=n_chunks, kp=kp, bv=bv, scale=float(scale),
      layout=layout, mm=mm, interpret=bool(interpret))
  return tuple(_launch(kernel, (qg, kg, w, ec, do, dv_intra, ds_final),
                       out_type, scratch, grid=(bsz, h, 1, dv // bv),
                       interpret=interpret, name="kda_dstate_pass_mosaic"))


def _output_kernel(qg_g, aqk_g, x_g, states_g, o_g,
                   qg_s, aqk_s, x_s, st_s, o_s, bars, *, per_program, bv,
                   scale, out_dtype):
  b, h = jax.lax.axis_index("b"), jax.lax.axis_index("h")
  cols = pl.ds(jax.lax.axis_index("j") * bv, bv)
  rows = lambda n: pl.ds(n * CHUNK, CHUNK)  # noqa: E731
  streams = [
      (lambda n: qg_g.at[b, rows(n), h], qg_s),
      (lambda n: aqk_g.at[b, h, rows(n)], aqk_s),
      (lambda n: x_g.at[b, rows(n), h, cols], x_s),
      (lambda n: states_g.at[b, h, n, :, cols], st_s)]

  def step(n, slot, carry):
    def both(acc):   # (q exp(b)) S_n + Aqk X, one accumulator
      plgpu.wgmma(acc, qg_s.at[slot], st_s.at[slot])
      plgpu.wgmma(acc, aqk_s.at[slot], x_s.at[slot])
      return acc[...]
    out = pl.run_scoped(both, plgpu.ACC((CHUNK, bv), _F32))
    _to_gmem((scale * out).astype(out_dtype), o_s.at[slot],
             o_g.at[b, rows(n), h, cols])
    return carry

  _run_pass(streams, bars, n_chunks=per_program, reverse=False, stores=1,
            step=step, carry=(), first=jax.lax.axis_index("c") * per_program)
  plgpu.wait_smem_to_gmem(0)


def output(qg, aqk, x, states, *, scale, out_dtype, bv=64, per_program=None,
           interpret=False):
  """O = scale ((q exp(b)) S_n + Aqk X) on Mosaic GPU (the counterpart of
  common/output.output_call): both products into one accumulator, M = C.

  Args:
    qg: q exp(b) [B, Tp, H, Kp] bf16; aqk: [B, H, Tp, C] bf16; x: [B, Tp, H,
      V] bf16 (GLA: v; KDA: V'); states: [B, H, N, Kp, V] bf16.
    scale: the query scale; out_dtype: o's dtype.
    bv: V block per program (16, 32 or 64).
    per_program: consecutive chunks per program, walked with the next
      chunk's inputs prefetched (None: the largest of 8, 4, 2, 1 dividing N).
  Returns:
    o [B, Tp, H, V] in out_dtype.
  """
  bsz, tp, h, dv = x.shape
  kp = qg.shape[-1]
  check_state_pass(kp, dv, x.dtype, kp, bv, "rows", whole_k=True,
                   what="output_kernel")
  n_chunks = tp // CHUNK
  if per_program is None:
    per_program = next(p for p in (8, 4, 2, 1) if n_chunks % p == 0)
  if n_chunks % per_program:
    raise ValueError(f"per_program={per_program} must divide the {n_chunks} "
                     "chunks")
  mm = x.dtype
  swz = bv * jnp.dtype(mm).itemsize
  scratch = [_smem((CHUNK, kp), mm, swz), _smem((CHUNK, CHUNK), mm, swz),
             _smem((CHUNK, bv), mm, swz), _smem((kp, bv), mm, swz),
             _smem((CHUNK, bv), out_dtype),
             plgpu.Barrier(num_barriers=4 * _SLOTS)]
  kernel = functools.partial(_output_kernel, per_program=per_program, bv=bv,
                             scale=float(scale), out_dtype=out_dtype)
  return _launch(kernel, (qg, aqk, x, states),
                 jax.ShapeDtypeStruct((bsz, tp, h, dv), out_dtype), scratch,
                 grid=(bsz, h, dv // bv, n_chunks // per_program),
                 grid_names=("b", "h", "j", "c"), interpret=interpret,
                 name="chunk_output_mosaic", what="output_kernel")
