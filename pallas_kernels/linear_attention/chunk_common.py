"""Tiles, checks and kernels shared by the chunked GLA and KDA Pallas ops.

DESIGN 3.1 / 3.2 / 4. A chunk is C = 64 rows in 4 tiles of 16; b is the
within-chunk inclusive cumsum of the log decay g and b_C its last row.
Both ops are built from the same pieces, so that a lesson measured on one
(results/kernels.md) carries to the other:
  * `_cumsum_tiles` / `_decay_tiles`: b tile by tile (computed once, by the
    intra kernel, and stored: every later kernel sees the same rounded b);
  * `_row_slice_scores`: one K slice of one row tile of a decayed score
    matrix P_ij = sum_d x_id y_jd exp(b_id - b_jd), j <= i; dense dots
    anchored at the query tile's first row on the bounded path, position
    pairs on the unbounded path's diagonal tile;
  * `_row_slice_operands`: the intra kernels' per-slice loads and the
    stores of b, q exp(b), k exp(b_C - b), exp(b_C);
  * `_store_row`: a row tile of a dense lower-triangular [C, C] matrix;
  * `_output_call`: O = scale ((q exp(b)) S_n + A X), two dense dots;
  * the key-side gradient pieces of grad_k (one K slice): the chunk-end
    terms (`_end_terms`), dL/db's within-chunk reverse cumsum and the
    stores (`_store_key_side_grads`), and the contractions over V, done
    inline (`_v_dot`) or first in a kernel of their own
    (`_state_side_kernel`, the split_grad_k knob);
  * the block specs of the [B, T, H, D] layout (no transposes) and of the
    [B, H, Tp, C] per-chunk matrices;
  * the input checks (`check_g_min`, `check_dims`).
`lay` is a dict of static sizes built by `_chunk_layout`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # Triton compiler params (jax 0.10 - 0.12); absent -> default params.
  from jax.experimental.pallas import triton as plgpu_triton
except ImportError:  # pragma: no cover
  plgpu_triton = None

CHUNK = 64
TILE = 16
N_TILES = CHUNK // TILE
G_MIN_LOWEST = -5.5  # (TILE - 1) * 5.5 = 82.5 nats < ~88.7 (fp32/bf16 max exp)
MAX_DIM = 256
_F32 = jnp.float32
_NN = ((1,), (0,))  # a @ b
_NT = ((1,), (1,))  # a @ b^T
_TN = ((0,), (0,))  # a^T @ b


class GMinError(ValueError):
  """g_min unusable by the bounded kernel (use g_min=None: unbounded path)."""


def check_g_min(g_min):
  """Raises GMinError (a ValueError) unless g_min is a float in [-5.5, 0)."""
  if g_min is None or isinstance(g_min, bool) or not (
      G_MIN_LOWEST <= float(g_min) < 0):
    raise GMinError(
        f"the bounded Pallas path needs g_min in [{G_MIN_LOWEST}, 0) (dense "
        f"16-row diagonal tiles span (16-1)*|g_min| nats), got "
        f"g_min={g_min!r}; pass g_min=None for the unbounded (position-pair) "
        "path")


def check_dims(q, v, chunk_size, what="GLA"):
  """Kernel limits on K, V, chunk size and dtypes (ValueError names them)."""
  if chunk_size != CHUNK:
    raise ValueError(f"the Pallas {what} kernel supports chunk_size={CHUNK} "
                     f"only, got chunk_size={chunk_size!r}")
  for name, d in (("K", q.shape[-1]), ("V", v.shape[-1])):
    if d % TILE or not 0 < d <= MAX_DIM:
      raise ValueError(f"the Pallas {what} kernel needs {name} a multiple of "
                       f"{TILE} in [16, {MAX_DIM}], got {name}={d}")
  for name, x in (("q", q), ("v", v)):
    if x.dtype not in (jnp.float32, jnp.bfloat16):
      raise ValueError(f"the Pallas {what} kernel takes {name} in float32 or "
                       f"bfloat16, got {x.dtype}")


def _compiler_params(num_warps=4, num_stages=2):
  if plgpu_triton is None:
    return None
  return plgpu_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _next_pow2(n):
  return 1 << (n - 1).bit_length()


def _block_v(dv, cap=64):
  """Largest power of two dividing dv, at most cap (dv is a multiple of 16)."""
  bv = cap
  while dv % bv:
    bv //= 2
  return bv


def _dot(a, b, dims=_NN, mm=_F32):
  """dot_general with operands cast to mm and fp32 accumulation.

  fp32 operands use Precision.HIGHEST (IEEE fp32, not TF32, on the GPU).
  """
  prec = jax.lax.Precision.HIGHEST if mm == _F32 else None
  return jax.lax.dot_general(a.astype(mm), b.astype(mm), (dims, ((), ())),
                             precision=prec, preferred_element_type=_F32)


def _rows(t):
  return pl.ds(t * TILE, TILE)


def _decay_tiles(b_ref, cols):
  """Within-chunk decays of one chunk, tile by tile, for the columns `cols`.

  b_ref holds b, the within-chunk inclusive cumsum of g, as the intra
  kernel stored it (so that every kernel sees the same rounded b and
  exponent differences such as b_C - b_j are consistent across kernels).
  Returns b_tiles (4 x [16, w] fp32), anchors (4 x [1, w]: b at the first
  row of each tile) and b_C [w] (the chunk's last row, taken as a masked
  sum: exact).
  """
  b_tiles = [b_ref[_rows(t), cols].astype(_F32) for t in range(N_TILES)]
  anchors = [b_ref[pl.ds(t * TILE, 1), cols].astype(_F32)
             for t in range(N_TILES)]
  last = jax.lax.broadcasted_iota(jnp.int32, b_tiles[-1].shape, 0) == TILE - 1
  b_last = jnp.sum(jnp.where(last, b_tiles[-1], 0.0), axis=0)
  return b_tiles, anchors, b_last


def _cumsum_tiles(g_ref, cols, n_tiles=N_TILES, g_min=None):
  """b, the within-chunk inclusive cumsum of g, for the columns `cols`.

  The same triple as _decay_tiles, computed from g for the first `n_tiles`
  tiles (the last element is then b at the last row of tile n_tiles - 1,
  b_C when n_tiles = N_TILES): each 16-row tile is cumsummed on its own and
  offset by the previous tiles' total (the last row of the previous tile,
  taken as a masked sum: exact). The intra kernel stores these b tiles for
  the backward, so every kernel sees the same rounded b; re-running this on
  the same slice gives the same bits, for any n_tiles.

  With g_min (the bounded path), g is clamped to g_min as it is loaded: the
  op is KDA on g' = where(g < g_min, g_min, g) (where, as the XLA clamp
  this replaces: a NaN stays NaN), and grad_k zeroes dg below g_min.
  """
  carry, b_tiles, anchors = None, [], []
  for t in range(n_tiles):
    g_t = g_ref[_rows(t), cols].astype(_F32)
    if g_min is not None:
      g_t = jnp.where(g_t < g_min, jnp.float32(g_min), g_t)
    b_t = jnp.cumsum(g_t, axis=0)
    if carry is not None:
      b_t = b_t + carry[None, :]
    row = jax.lax.broadcasted_iota(jnp.int32, b_t.shape, 0)
    b_tiles.append(b_t)
    anchors.append(jnp.sum(jnp.where(row == 0, b_t, 0.0), axis=0)[None, :])
    carry = jnp.sum(jnp.where(row == TILE - 1, b_t, 0.0), axis=0)
  return b_tiles, anchors, carry


def _tile_iota():
  row = jax.lax.broadcasted_iota(jnp.int32, (TILE, TILE), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (TILE, TILE), 1)
  return row, col


def _pair_decay(b_t, mask):
  """exp(b_i - b_j) on the position pairs of one tile [16, 16, w].

  The mask goes into the exponent (-inf where masked) BEFORE the exp: above
  the diagonal b_i - b_j >= 0 is unbounded and exp would overflow.
  """
  diff = b_t[:, None, :] - b_t[None, :, :]
  return jnp.exp(jnp.where(mask[:, :, None], diff, -jnp.inf))


def _row_slice_scores(i, xs, y_t, b, c, mask, bounded, mm):
  """One K slice's part of row tile i of P_ij = sum_d x_id y_jd
  exp(b_id - b_jd), j <= i, for every x in `xs` against the same keys y.

  xs: list of [16, w] fp32 query tiles (tile i); y_t, b: tiles 0..i
  [16, w] fp32; c: anchors [1, w] of tiles 0..i. Returns one list of i + 1
  [16, 16] tiles (j = 0..i) per x. Dense tiles are anchored at c_i (query
  factor <= 1; key factor <= 1 off the diagonal); the decayed key tile is
  built once per j and shared by every x. The diagonal tile of the unbounded
  path is computed on position pairs with `mask` in the exponent. The caller
  masks the diagonal tile (after summing the slices).
  """
  x_scale = jnp.exp(b[i] - c[i])                              # <= 1
  x_dec = [x * x_scale for x in xs]
  outs = [[] for _ in xs]
  for j in range(i + 1):
    if j == i and not bounded:
      yp = y_t[i][None, :, :] * _pair_decay(b[i], mask)       # [16, 16, w]
      for out, x in zip(outs, xs):
        out.append(jnp.sum(x[:, None, :] * yp, axis=-1))
    else:
      y_dec = y_t[j] * jnp.exp(c[i] - b[j])
      for out, xd in zip(outs, x_dec):
        out.append(_dot(xd, y_dec, _NT, mm))
  return outs


def _row_slice_operands(i, cols, q_ref, k_ref, g_ref, g_min, b_ref, qg_ref,
                        kg_ref, ec_ref):
  """The intra kernels' per-(row tile i, K slice) loads and decay stores.

  Computes b for tiles 0..i (clamped g, `_cumsum_tiles`) and stores what
  the later kernels need of it: b itself (b_ref, for the backward, or None),
  q exp(b) for row tile i, and on the last row tile, where b_C is known,
  k exp(b_C - b) and exp(b_C) (in the refs' dtypes: the matmul dtype the
  dots cast them to, and fp32). Returns (b, c, k_t, q_i): b and anchors c
  of tiles 0..i, the key tiles 0..i and query tile i, [16, w] fp32.
  """
  b, c, b_end = _cumsum_tiles(g_ref, cols, i + 1, g_min)
  k_t = [k_ref[_rows(t), cols].astype(_F32) for t in range(i + 1)]
  q_i = q_ref[_rows(i), cols].astype(_F32)
  _store_row_decays(i, cols, b, b_end, k_t, q_i, b_ref, qg_ref, kg_ref,
                    ec_ref)
  return b, c, k_t, q_i


def _store_row_decays(i, cols, b, b_end, k_t, q_i, b_ref, qg_ref, kg_ref,
                      ec_ref):
  """Row tile i's decay stores of one K slice (`_row_slice_operands`): b
  (b_ref, or None), q exp(b), and on the last row tile k exp(b_C - b) and
  exp(b_C). b, k_t: tiles 0..i [16, w] fp32; b_end [w]: b at the last row
  of tile i (b_C on the last); q_i [16, w] fp32."""
  if b_ref is not None:
    b_ref[_rows(i), cols] = b[i]
  qg_ref[_rows(i), cols] = (q_i * jnp.exp(b[i])).astype(qg_ref.dtype)
  if i == N_TILES - 1:
    for t in range(N_TILES):
      kg_ref[_rows(t), cols] = (
          k_t[t] * jnp.exp(b_end[None, :] - b[t])).astype(kg_ref.dtype)
    ec_ref[cols] = jnp.exp(b_end)


def _k_slice(kk, bk):
  """Columns of K slice kk (a traced loop index) of width bk."""
  return pl.ds(pl.multiple_of(kk * bk, bk), bk)


def _store_row(ref, i, tiles):
  """Writes row tile i of a lower-triangular [C, C] block: tiles j <= i from
  the list `tiles`, zeros above the diagonal, so the block is a dense lower
  triangular matrix that later kernels use in single [C, C] dots."""
  zero = jnp.zeros((TILE, TILE), ref.dtype)
  for j in range(N_TILES):
    t = tiles[j].astype(ref.dtype) if j <= i else zero
    ref[_rows(i), pl.ds(j * TILE, TILE)] = t


def _output_kernel(qg_ref, aqk_ref, vnew_ref, s_ref, o_ref, *, scale, mm):
  # qg_ref (q exp(b), exp(b) <= 1) [C, Kp]; aqk_ref [C, C]; vnew_ref, o_ref
  # [C, BV]; s_ref [Kp, BV]. O = scale ((q exp(b)) S + Aqk V').
  out = _dot(qg_ref[...], s_ref[...], mm=mm) + _dot(aqk_ref[...],
                                                    vnew_ref[...], mm=mm)
  o_ref[...] = (scale * out).astype(o_ref.dtype)


def _pad(x, tp, d_pad):
  """[B, T, H, D] -> [B, Tp, H, D_pad], zero padded (a no-op when aligned)."""
  t, d = x.shape[1], x.shape[3]
  if tp == t and d_pad == d:
    return x
  return jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, d_pad - d)))


def _chunk_spec(d, blocked=False):
  """Chunk n of a [B, Tp, H, D] array, columns [j d, (j+1) d) if blocked
  (grid (B, H, N, j)), else all of D (grid (B, H, N) or (B, H, N, j))."""
  if blocked:
    return pl.BlockSpec((None, CHUNK, None, d),
                        lambda b, h, n, j: (b, n, h, j))
  return pl.BlockSpec((None, CHUNK, None, d), lambda b, h, n, *_: (b, n, h, 0))


def _square_spec():
  """The [C, C] matrix of chunk n in [B, H, Tp, C]; grid (B, H, N[, j])."""
  return pl.BlockSpec((None, None, CHUNK, CHUNK),
                      lambda b, h, n, *_: (b, h, n, 0))


def _state_spec(kp, bv):
  """The [Kp, BV] state of chunk n in [B, H, N, Kp, V]; grid (B, H, N, j)."""
  return pl.BlockSpec((None, None, None, kp, bv),
                      lambda b, h, n, j: (b, h, n, 0, j))


def _chunk_layout(q, v, *, block_k, bv_pass, bk_pass=None, bv=64):
  """Static sizes of one call (the `lay` dict the wrappers pass around).

  T is padded to tp (a multiple of C), K to kp (a power of two). bk: the K
  slice width of the chunk kernels; bv (<= 64): the V block of the chunk
  kernels; bv_pass / bk_pass: the V / K blocks of the sequential passes
  (bk_pass None: all of K). mm: the dots' operand dtype.
  """
  bsz, t, h, dk = q.shape
  dv = v.shape[-1]
  tp = -(-t // CHUNK) * CHUNK
  kp = _next_pow2(dk)
  bv = _block_v(dv, bv)
  bv_pass = _block_v(dv, bv_pass)
  bk_pass = kp if bk_pass is None else min(kp, bk_pass)
  return dict(bsz=bsz, t=t, h=h, dk=dk, dv=dv, tp=tp, n_chunks=tp // CHUNK,
              chunk=CHUNK, kp=kp, bk=min(kp, block_k), bv=bv, nv=dv // bv,
              bv_pass=bv_pass, nv_pass=dv // bv_pass, bk_pass=bk_pass,
              nk_pass=kp // bk_pass,
              mm=jnp.bfloat16 if v.dtype == jnp.bfloat16 else _F32)


def _shape_of(lay, *names, dtype=_F32):
  return jax.ShapeDtypeStruct(tuple(lay[n] for n in names), dtype)


def _output_call(qg, aqk, v_new, states, lay, scale, dtype, interpret,
                 num_warps, name, kernel="triton"):
  """O = scale ((q exp(b)) S_n + Aqk X) [B, Tp, H, V] in dtype: qg [B, Tp,
  H, Kp], Aqk [B, H, Tp, C], X [B, Tp, H, V] (GLA: v; KDA: V'), states
  [B, H, N, Kp, V]. Grid (B, H, N, V/bv), parallel. kernel "mosaic": the
  Mosaic GPU kernel (state_mosaic.output, wgmma; bf16, K >= 64) instead of
  the Triton one."""
  kp, bv = lay["kp"], lay["bv"]
  if kernel == "mosaic":
    # Imported here: state_mosaic imports this module.
    from pallas_kernels.linear_attention import state_mosaic  # pylint: disable=g-import-not-at-top
    return state_mosaic.output(qg, aqk, v_new, states, scale=scale,
                               out_dtype=dtype, bv=bv, interpret=interpret)
  return pl.pallas_call(
      functools.partial(_output_kernel, scale=scale, mm=lay["mm"]),
      grid=(lay["bsz"], lay["h"], lay["n_chunks"], lay["nv"]),
      in_specs=[_chunk_spec(kp), _square_spec(), _chunk_spec(bv, True),
                _state_spec(kp, bv)],
      out_specs=_chunk_spec(bv, True),
      out_shape=_shape_of(lay, "bsz", "tp", "h", "dv", dtype=dtype),
      compiler_params=_compiler_params(num_warps, 2),
      interpret=interpret,
      name=name,
  )(qg, aqk, v_new, states)


# ---------------------------------------------------------------------------
# Key-side gradients (one K slice of one chunk): pieces shared by the GLA and
# KDA grad_k kernels. dL/db is formed term by term, "+b" terms (the query
# side, q exp(b)) minus "-b" terms (the key side, k exp(-b)), and dg is its
# within-chunk reverse cumsum.
# ---------------------------------------------------------------------------


def _tile(ref, i, j):
  """Tile (i, j) [16, 16] of a [C, C] block."""
  return ref[_rows(i), pl.ds(j * TILE, TILE)]


def _v_dot(x_ref, y_ref, t, *, bv, mm):
  """x[tile t] @ y^T over all of V in bv-column blocks: [16, V] x [w, V] ->
  [16, w] fp32."""
  acc = None
  for cv in range(0, x_ref.shape[-1], bv):
    cols = pl.ds(cv, bv)
    part = _dot(x_ref[_rows(t), cols], y_ref[:, cols], _NT, mm)
    acc = part if acc is None else acc + part
  return acc


def _end_terms(x_dh, dh_s, k_t, b, b_last):
  """The chunk-end terms of one K slice, through S_{n+1} = diag(exp(b_C)) S_n
  + (k exp(b_C - b))^T X (GLA: X = v; KDA: X = V').

  x_dh(j) -> (X dH^T)[tile j] [16, w] fp32 (dH the grad of the state
  leaving the chunk); dh_s [w] = sum_v dH * S_n; k_t 4 x [16, w] fp32;
  b 4 x [16, w], b_last [w] fp32.
  Returns (dk_neg, db_neg, d_end): the "-b" factors (X dH^T) exp(b_C - b)
  and k times them (4 x [16, w] each), and d/db_C [w] (the chunk's last
  row):  sum_v dH * S_{n+1} = exp(b_C) sum_v dH * S_n + sum_c k_c
  exp(b_C - b_c) (X dH^T)_c. The second sum is the column sum of the "-b"
  end terms just formed (the same fp32 products, so that they cancel in the
  reverse cumsum), and no S_{n+1} is read.
  """
  dk_neg, db_neg, d_end = [], [], None
  for j in range(N_TILES):
    t_end = x_dh(j) * jnp.exp(b_last[None, :] - b[j])
    dk_neg.append(t_end)
    db_neg.append(k_t[j] * t_end)
    part = jnp.sum(db_neg[j], axis=0)
    d_end = part if d_end is None else d_end + part
  return dk_neg, db_neg, d_end + jnp.exp(b_last) * dh_s


def _dh_dot_s(dh_ref, s_ref, bv):
  """sum_v dH * S [w] fp32 for state slices dh_ref, s_ref [w, V]."""
  acc = None
  for cv in range(0, dh_ref.shape[-1], bv):
    cols = pl.ds(cv, bv)
    part = jnp.sum(dh_ref[:, cols].astype(_F32) * s_ref[:, cols].astype(_F32),
                   axis=1)
    acc = part if acc is None else acc + part
  return acc


def _state_side_terms(refs, split, bv, mm, delta):
  """The state-side inputs of grad_k for one K slice, as functions of the
  row tile: (dO S^T, dU' S^T (KDA only, else None), X dH^T) and
  sum_v dH * S [w].

  split=False: refs = (do, [du,] x, s, dh) and the contractions over V are
  done here (`_v_dot`); split=True: refs = (p_do, [p_du,] p_end, e), the
  same contractions precomputed by `_state_side_kernel` [C, w] and [w]
  fp32.
  """
  if split:
    if delta:
      p_do, p_du, p_end, e_ref = refs
    else:
      (p_do, p_end, e_ref), p_du = refs, None
    rows = lambda ref: (lambda t: ref[_rows(t), :].astype(_F32))  # noqa: E731
    return (rows(p_do), rows(p_du) if delta else None, rows(p_end),
            e_ref[...].astype(_F32))
  if delta:
    do_ref, du_ref, x_ref, s_ref, dh_ref = refs
  else:
    (do_ref, x_ref, s_ref, dh_ref), du_ref = refs, None
  v_dot = functools.partial(_v_dot, bv=bv, mm=mm)
  return (lambda t: v_dot(do_ref, s_ref, t),
          (lambda t: v_dot(du_ref, s_ref, t)) if delta else None,
          lambda t: v_dot(x_ref, dh_ref, t),
          _dh_dot_s(dh_ref, s_ref, bv))


def _state_side_kernel(*refs, uses_dh, bv, mm):
  # One chunk, one K block of width w: refs = x_1..x_m [C, V] (dO, dU',
  # V' for KDA; dO, v for GLA), s_ref (state entering), dh_ref (grad of the
  # state leaving) [w, V] (matmul dtype), then the outputs p_1..p_m [C, w]
  # fp32 (p_i = x_i S^T, or x_i dH^T where uses_dh[i]) and e_ref [w] fp32
  # (sum_v dH * S). Dense [C, bv] x [bv, w] dots over V blocks: the
  # contractions over V that grad_k would otherwise redo per K slice in
  # [16, V] tiles.
  m = len(uses_dh)
  xs, (s_ref, dh_ref), ps, e_ref = (refs[:m], refs[m:m + 2],
                                    refs[m + 2:2 * m + 2], refs[-1])
  accs, e = [None] * m, None
  for cv in range(0, s_ref.shape[-1], bv):
    cols = pl.ds(cv, bv)
    s_blk, dh_blk = s_ref[:, cols], dh_ref[:, cols]
    for i in range(m):
      part = _dot(xs[i][:, cols], dh_blk if uses_dh[i] else s_blk, _NT, mm)
      accs[i] = part if accs[i] is None else accs[i] + part
    part = jnp.sum(dh_blk.astype(_F32) * s_blk.astype(_F32), axis=1)
    e = part if e is None else e + part
  for p_ref, acc in zip(ps, accs):
    p_ref[...] = acc
  e_ref[...] = e


def _state_side_call(xs, uses_dh, states, dstates, lay, bk, num_warps,
                     interpret, name):
  """The state-side contractions of grad_k, precomputed: for each x in xs
  ([B, Tp, H, V]) x S_n^T or x dH_n^T [B, Tp, H, Kp] fp32, and sum_v dH * S
  [B, H, N, Kp] fp32. Grid (B, H, N, Kp/bk), parallel."""
  kp, dv = lay["kp"], lay["dv"]
  bk = min(kp, bk)
  k_blk = _chunk_spec(bk, True)
  state_blk = pl.BlockSpec((None, None, None, bk, dv),
                           lambda b, h, n, j: (b, h, n, j, 0))
  return pl.pallas_call(
      functools.partial(_state_side_kernel, uses_dh=tuple(uses_dh),
                        bv=lay["bv"], mm=lay["mm"]),
      grid=(lay["bsz"], lay["h"], lay["n_chunks"], kp // bk),
      in_specs=[_chunk_spec(dv)] * len(xs) + [state_blk, state_blk],
      out_specs=[k_blk] * len(xs) + [pl.BlockSpec(
          (None, None, None, bk), lambda b, h, n, j: (b, h, n, j))],
      out_shape=[_shape_of(lay, "bsz", "tp", "h", "kp")] * len(xs)
      + [_shape_of(lay, "bsz", "h", "n_chunks", "kp")],
      compiler_params=_compiler_params(num_warps, 2),
      interpret=interpret,
      name=name,
  )(*xs, states, dstates)


def _state_side_inputs(xs, uses_dh, states, dstates, lay, split, bk_side,
                       num_warps, interpret, name):
  """grad_k's state-side inputs and their block specs (grid (B, H, N, K
  slice j)), in the order `_state_side_terms` unpacks them.

  xs: the [B, Tp, H, V] arrays contracted over V (KDA: dO, dU', V'; GLA:
  dO, v), each against S_n or, where uses_dh, dH_n; states, dstates
  [B, H, N, Kp, V]. split=False: xs, states, dstates themselves (grad_k
  contracts per K slice); split=True: their contractions, run here first in
  `_state_side_kernel` (K blocks of bk_side, num_warps warps, kernel name).
  """
  bk, dv = lay["bk"], lay["dv"]
  if split:
    side = _state_side_call(xs, uses_dh, states, dstates, lay, bk_side,
                            num_warps, interpret, name)
    specs = [_chunk_spec(bk, True)] * len(xs) + [pl.BlockSpec(
        (None, None, None, bk), lambda b, h, n, j: (b, h, n, j))]
    return list(side), specs
  state_slice = pl.BlockSpec((None, None, None, bk, dv),
                             lambda b, h, n, j: (b, h, n, j, 0))
  return (list(xs) + [states, dstates],
          [_chunk_spec(dv)] * len(xs) + [state_slice] * 2)


def _store_key_side_grads(dq, dk, db, d_end, dq_ref, dk_ref, dg_ref, g_ref,
                          g_min):
  """Stores dq, dk (in their refs' dtypes) and dg for one K slice.

  dq, dk, db: 4 x [16, w] fp32 (db = dL/db without the chunk-end term);
  d_end [w] (added at the chunk's last row). dg is the within-chunk reverse
  cumsum of dL/db, last tile first (`_store_key_side_tile`).
  """
  later = None
  for i in reversed(range(N_TILES)):
    later = _store_key_side_tile(i, dq[i], dk[i], db[i], d_end, later,
                                 dq_ref, dk_ref, dg_ref, g_ref, g_min)


def _pull_key_side_grads(row_terms, pairs, q_ref, k_ref, b_ref, g_ref,
                         x_dh, dh_s, dq_ref, dk_ref, dg_ref, *, bounded, mm,
                         g_min):
  """dq, dk and dg of one K slice, each row tile PULLING its own terms.

  The key-side grads of GLA and KDA (`grad_k` kernels, "pull" order). The
  row tiles run last first in a fori_loop; tile i forms its "+b" terms from
  the key tiles j <= i and its "-b" terms from the query tiles m >= i in
  inner fori_loops and stores dq, dk, dg at once: only the reverse
  cumsum's running row is carried across tiles, so the live set is one
  tile's (holding every tile's results to the end, the "held" order, took
  255 registers and spilled at w=32). Each tile pair's product is formed
  with the same rounded operands on its query and key sides, so the two
  cancel in dg's cumsum as in exact arithmetic.

  row_terms(i, q_i, k_i, b_i) -> (dq_i, dk_i, db_i) [16, w] fp32: row tile
  i's terms through the state (and KDA's delta-rule rows); it may store
  per-row outputs itself.
  pairs: [(mat_ref, is_k)]: the [C, C] gradients of the chunk's score
  matrices, each with the operand on its query side, q (is_k False) or k:
  GLA [(dA, False)], KDA [(dAqk, False), (dLk, True)]. A pair's "+b" term
  goes to that operand's gradient, its "-b" term to dk.
  q_ref, k_ref, b_ref (b: the within-chunk cumsum the intra kernel stored),
  g_ref (the caller's g, read with g_min only) [C, w]; x_dh(t) -> (X dH^T)
  [tile t] and dh_s [w] as `_state_side_terms` returns them.
  """
  w = q_ref.shape[-1]
  tile_row = jax.lax.broadcasted_iota(jnp.int32, (TILE, w), 0)
  b_last = jnp.sum(jnp.where(tile_row == TILE - 1,
                             b_ref[_rows(N_TILES - 1), :], 0.0), axis=0)
  row, col = _tile_iota()
  causal = row >= col

  def load(ref, t):
    return ref[_rows(t), :].astype(_F32)

  def anchor(t):   # b at the first row of tile t [1, w]
    return b_ref[pl.ds(t * TILE, 1), :].astype(_F32)

  def end_term(t):   # (X dH^T) exp(b_C - b) on row tile t [16, w]
    return x_dh(t) * jnp.exp(b_last[None, :] - load(b_ref, t))

  def end_sum(t, acc):
    return acc + jnp.sum(load(k_ref, t) * end_term(t), axis=0)

  # d/db_C (`_end_terms`), needed before the last tile is stored: the
  # chunk-end terms run once here for their column sums and again per tile
  # (same code: the two differ at most by fp32 rounding).
  d_end = jax.lax.fori_loop(0, N_TILES, end_sum, jnp.zeros((w,), _F32))
  d_end = d_end + jnp.exp(b_last) * dh_s

  def decayed(t):   # the query-side operands of tile t: x exp(b - anchor)
    x_scale = jnp.exp(load(b_ref, t) - anchor(t))             # <= 1
    return [(load(k_ref if is_k else q_ref, t) * x_scale).astype(mm)
            for _, is_k in pairs], x_scale

  def row_tile(it, later):
    i = N_TILES - 1 - it
    b_i, q_i, k_i = load(b_ref, i), load(q_ref, i), load(k_ref, i)
    c_i = anchor(i)
    dq_i, dk_i, db_i = row_terms(i, q_i, k_i, b_i)
    t_end = end_term(i)
    dk_neg, db_neg = t_end, k_i * t_end
    x_dec, x_scale = decayed(i)
    n_dense = i + 1 if bounded else i   # unbounded: diagonal pair by pair

    def plus_b(j, accs):   # key tile j <= i: mat_ij (k_j exp(c_i - b_j))
      y_dec = (load(k_ref, j) * jnp.exp(c_i - load(b_ref, j))).astype(mm)
      return tuple(a + _dot(_tile(m, i, j), y_dec, _NN, mm)
                   for a, (m, _) in zip(accs, pairs))

    zeros = tuple(jnp.zeros((TILE, w), _F32) for _ in pairs)
    accs = jax.lax.fori_loop(0, n_dense, plus_b, zeros)
    for acc, xd, (_, is_k) in zip(accs, x_dec, pairs):
      if is_k:
        dk_i = dk_i + acc * x_scale
      else:
        dq_i = dq_i + acc * x_scale
      db_i = db_i + acc * xd.astype(_F32)

    def minus_b(m, acc):   # query tile m >= i: the pair (m, i)'s key side
      dk_n, db_n = acc
      x_dec_m, _ = decayed(m)
      t_n = None
      for xd, (mat, _) in zip(x_dec_m, pairs):
        part = _dot(_tile(mat, m, i), xd, _TN, mm)
        t_n = part if t_n is None else t_n + part
      y_scale = jnp.exp(anchor(m) - b_i)        # <= 1 off the diagonal
      y_dec = (k_i * y_scale).astype(mm)
      return dk_n + t_n * y_scale, db_n + t_n * y_dec.astype(_F32)

    dk_neg, db_neg = jax.lax.fori_loop(i if bounded else i + 1, N_TILES,
                                       minus_b, (dk_neg, db_neg))
    if not bounded:   # the diagonal pair, position by position
      pd = _pair_decay(b_i, causal)                           # [16, 16, w]
      pk = pd * k_i[None, :, :]
      mix = None
      for mat, is_k in pairs:
        m_ii = _tile(mat, i, i)
        x_i = k_i if is_k else q_i
        p_x = jnp.sum(m_ii[:, :, None] * pk, axis=1)
        if is_k:
          dk_i = dk_i + p_x
        else:
          dq_i = dq_i + p_x
        db_i = db_i + x_i * p_x
        part = m_ii[:, :, None] * x_i[:, None, :]
        mix = part if mix is None else mix + part
      p_n = jnp.sum(pd * mix, axis=0)
      dk_neg, db_neg = dk_neg + p_n, db_neg + k_i * p_n
    # d_end enters at the chunk's last row, so every row's reverse sum
    # holds it: `later` starts at d_end (and the store adds no d_end).
    return _store_key_side_tile(i, dq_i, dk_i + dk_neg, db_i - db_neg, None,
                                later, dq_ref, dk_ref, dg_ref, g_ref, g_min)

  jax.lax.fori_loop(0, N_TILES, row_tile, d_end)


def _store_key_side_tile(i, dq_i, dk_i, db_i, d_end, later, dq_ref, dk_ref,
                         dg_ref, g_ref, g_min):
  """Stores row tile i of dq, dk (in their refs' dtypes) and dg; tiles go
  last first (i = 3, 2, 1, 0).

  dq_i, dk_i, db_i [16, w] fp32 (db = dL/db without the chunk-end term);
  d_end [w] (added at the chunk's last row; None when `later` already
  holds it, as in the pull order, where i may be traced); later [w]: the
  sum of dL/db over the tiles after i (None for the last tile). Returns it
  for tile i - 1. dg is the within-chunk reverse cumsum of dL/db: inside a
  tile one fp32 dot with the upper-triangular ones (row r sums rows r..15,
  each sum on its own, like XLA's windowed cumsum), plus `later` (row 0 of
  the previous tile's result, taken as a masked sum: exact). With g_min, dg is
  zero where g_ref (the caller's g) < g_min: the clamp's gradient, applied
  after the cumsum, which runs over the clamped g' the op was computed on.
  """
  row, col = _tile_iota()
  upper = jnp.where(col >= row, 1.0, 0.0).astype(_F32)
  tile_row = jax.lax.broadcasted_iota(jnp.int32, dq_i.shape, 0)
  dq_ref[_rows(i), :] = dq_i.astype(dq_ref.dtype)
  dk_ref[_rows(i), :] = dk_i.astype(dk_ref.dtype)
  if d_end is not None and i == N_TILES - 1:
    db_i = db_i + jnp.where(tile_row == TILE - 1, d_end[None, :], 0.0)
  dg_i = _dot(upper, db_i)
  if later is not None:
    dg_i = dg_i + later[None, :]
  later = jnp.sum(jnp.where(tile_row == 0, dg_i, 0.0), axis=0)
  if g_min is not None:
    dg_i = jnp.where(g_ref[_rows(i), :] < g_min, 0.0, dg_i)
  dg_ref[_rows(i), :] = dg_i
  return later
