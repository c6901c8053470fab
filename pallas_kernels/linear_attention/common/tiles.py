"""Tiles, layouts and checks shared by the chunked GLA and KDA Pallas ops.

docs/design.md §4. A chunk is C = 64 rows in 4 tiles of 16; b is the
within-chunk inclusive cumsum of the log decay g and b_C its last row.
  * `cumsum_tiles`: b tile by tile (computed once, by the intra kernel,
    and stored: every later kernel sees the same rounded b);
  * `row_slice_scores`: one K slice of one row tile of a decayed score
    matrix P_ij = sum_d x_id y_jd exp(b_id - b_jd), j <= i; dense dots
    anchored at the query tile's first row on the bounded path, position
    pairs on the unbounded path's diagonal tile;
  * `row_slice_operands` / `store_row_decays`: the intra kernels' per-slice
    loads and the stores of b, q exp(b), k exp(b_C - b), exp(b_C);
  * `store_row`: a row tile of a dense lower-triangular [C, C] matrix;
  * the block specs of the [B, T, H, D] layout (no transposes) and of the
    [B, H, Tp, C] per-chunk matrices, and `chunk_layout`, the dict of
    static sizes (`lay`) the wrappers pass around;
  * the input checks (`check_g_min`, `check_dims`).
"""
from __future__ import annotations

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


F32 = jnp.float32


NN = ((1,), (0,))  # a @ b


NT = ((1,), (1,))  # a @ b^T


TN = ((0,), (0,))  # a^T @ b


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


def compiler_params(num_warps=4, num_stages=2):
  if plgpu_triton is None:
    return None
  return plgpu_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def next_pow2(n):
  return 1 << (n - 1).bit_length()


def block_v(dv, cap=64):
  """Largest power of two dividing dv, at most cap (dv is a multiple of 16)."""
  bv = cap
  while dv % bv:
    bv //= 2
  return bv


def mm_dot(a, b, dims=NN, mm=F32):
  """dot_general with operands cast to mm and fp32 accumulation.

  fp32 operands use Precision.HIGHEST (IEEE fp32, not TF32, on the GPU).
  """
  prec = jax.lax.Precision.HIGHEST if mm == F32 else None
  return jax.lax.dot_general(a.astype(mm), b.astype(mm), (dims, ((), ())),
                             precision=prec, preferred_element_type=F32)


def tile_rows(t):
  return pl.ds(t * TILE, TILE)


def cumsum_tiles(g_ref, cols, n_tiles=N_TILES, g_min=None):
  """b, the within-chunk inclusive cumsum of g, for the columns `cols`.

  Returns b_tiles (n_tiles x [16, w] fp32), anchors (n_tiles x [1, w]: b at
  the first row of each tile) and b at the last row of tile n_tiles - 1
  [w] (b_C when n_tiles = N_TILES). Each 16-row tile is cumsummed on its
  own and offset by the previous tiles' total (the last row of the previous
  tile, taken as a masked sum: exact). The intra kernel stores these b tiles for
  the backward, so every kernel sees the same rounded b; re-running this on
  the same slice gives the same bits, for any n_tiles.

  With g_min (the bounded path), g is clamped to g_min as it is loaded: the
  op is KDA on g' = where(g < g_min, g_min, g) (where, as the XLA clamp
  this replaces: a NaN stays NaN), and grad_k zeroes dg below g_min.
  """
  carry, b_tiles, anchors = None, [], []
  for t in range(n_tiles):
    g_t = g_ref[tile_rows(t), cols].astype(F32)
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


def tile_iota():
  row = jax.lax.broadcasted_iota(jnp.int32, (TILE, TILE), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (TILE, TILE), 1)
  return row, col


def pair_decay(b_t, mask):
  """exp(b_i - b_j) on the position pairs of one tile [16, 16, w].

  The mask goes into the exponent (-inf where masked) BEFORE the exp: above
  the diagonal b_i - b_j >= 0 is unbounded and exp would overflow.
  """
  diff = b_t[:, None, :] - b_t[None, :, :]
  return jnp.exp(jnp.where(mask[:, :, None], diff, -jnp.inf))


def row_slice_scores(i, xs, y_t, b, c, mask, bounded, mm):
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
      yp = y_t[i][None, :, :] * pair_decay(b[i], mask)       # [16, 16, w]
      for out, x in zip(outs, xs):
        out.append(jnp.sum(x[:, None, :] * yp, axis=-1))
    else:
      y_dec = y_t[j] * jnp.exp(c[i] - b[j])
      for out, xd in zip(outs, x_dec):
        out.append(mm_dot(xd, y_dec, NT, mm))
  return outs


def row_slice_operands(i, cols, q_ref, k_ref, g_ref, g_min, b_ref, qg_ref,
                       kg_ref, ec_ref, docs=None):
  """The intra kernels' per-(row tile i, K slice) loads and decay stores.

  Computes b for tiles 0..i (clamped g, `cumsum_tiles`) and stores what
  the later kernels need of it: b itself (b_ref, for the backward, or None),
  q exp(b) for row tile i, and on the last row tile, where b_C is known,
  k exp(b_C - b) and exp(b_C) (in the refs' dtypes: the matmul dtype the
  dots cast them to, and fp32). Returns (b, c, k_t, q_i): b and anchors c
  of tiles 0..i, the key tiles 0..i and query tile i, [16, w] fp32. docs:
  packed documents (`store_row_decays`) or None.
  """
  b, c, b_end = cumsum_tiles(g_ref, cols, i + 1, g_min)
  k_t = [k_ref[tile_rows(t), cols].astype(F32) for t in range(i + 1)]
  q_i = q_ref[tile_rows(i), cols].astype(F32)
  store_row_decays(i, cols, b, b_end, k_t, q_i, b_ref, qg_ref, kg_ref,
                   ec_ref, docs)
  return b, c, k_t, q_i


def store_row_decays(i, cols, b, b_end, k_t, q_i, b_ref, qg_ref, kg_ref,
                     ec_ref, docs=None):
  """Row tile i's decay stores of one K slice (`row_slice_operands`): b
  (b_ref, or None), q exp(b), and on the last row tile k exp(b_C - b) and
  exp(b_C). b, k_t: tiles 0..i [16, w] fp32; b_end [w]: b at the last row
  of tile i (b_C on the last); q_i [16, w] fp32. docs (packed documents, a
  common.documents.ChunkDocuments, or None): q exp(b) kept on the rows
  that read the entering state, k exp(b_C - b) on the rows of the chunk's
  last document, exp(b_C) only when the chunk has no document start."""
  if b_ref is not None:
    b_ref[tile_rows(i), cols] = b[i]
  qg = q_i * jnp.exp(b[i])
  if docs is not None:
    qg = jnp.where(docs.reads_state(i), qg, 0.0)
  qg_ref[tile_rows(i), cols] = qg.astype(qg_ref.dtype)
  if i == N_TILES - 1:
    for t in range(N_TILES):
      kg = k_t[t] * jnp.exp(b_end[None, :] - b[t])
      if docs is not None:
        kg = jnp.where(docs.in_last(t), kg, 0.0)
      kg_ref[tile_rows(t), cols] = kg.astype(kg_ref.dtype)
    ec = jnp.exp(b_end)
    if docs is not None:
      ec = jnp.where(docs.keeps_state(), ec, 0.0)
    ec_ref[cols] = ec


def k_slice(kk, bk):
  """Columns of K slice kk (a traced loop index) of width bk."""
  return pl.ds(pl.multiple_of(kk * bk, bk), bk)


def store_row(ref, i, tiles):
  """Writes row tile i of a lower-triangular [C, C] block: tiles j <= i from
  the list `tiles`, zeros above the diagonal, so the block is a dense lower
  triangular matrix that later kernels use in single [C, C] dots."""
  zero = jnp.zeros((TILE, TILE), ref.dtype)
  for j in range(N_TILES):
    t = tiles[j].astype(ref.dtype) if j <= i else zero
    ref[tile_rows(i), pl.ds(j * TILE, TILE)] = t


def pad_to(x, tp, d_pad):
  """[B, T, H, D] -> [B, Tp, H, D_pad], zero padded (a no-op when aligned)."""
  t, d = x.shape[1], x.shape[3]
  if tp == t and d_pad == d:
    return x
  return jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, d_pad - d)))


def chunk_spec(d, blocked=False):
  """Chunk n of a [B, Tp, H, D] array, columns [j d, (j+1) d) if blocked
  (grid (B, H, N, j)), else all of D (grid (B, H, N) or (B, H, N, j))."""
  if blocked:
    return pl.BlockSpec((None, CHUNK, None, d),
                        lambda b, h, n, j: (b, n, h, j))
  return pl.BlockSpec((None, CHUNK, None, d), lambda b, h, n, *_: (b, n, h, 0))


def square_spec():
  """The [C, C] matrix of chunk n in [B, H, Tp, C]; grid (B, H, N[, j])."""
  return pl.BlockSpec((None, None, CHUNK, CHUNK),
                      lambda b, h, n, *_: (b, h, n, 0))


def state_spec(kp, bv):
  """The [Kp, BV] state of chunk n in [B, H, N, Kp, V]; grid (B, H, N, j)."""
  return pl.BlockSpec((None, None, None, kp, bv),
                      lambda b, h, n, j: (b, h, n, 0, j))


def chunk_layout(q, v, *, block_k, bv_pass, bk_pass=None, bv=64):
  """Static sizes of one call (the `lay` dict the wrappers pass around).

  T is padded to tp (a multiple of C), K to kp (a power of two). bk: the K
  slice width of the chunk kernels; bv (<= 64): the V block of the chunk
  kernels; bv_pass / bk_pass: the V / K blocks of the sequential passes
  (bk_pass None: all of K). mm: the dots' operand dtype.
  """
  bsz, t, h, dk = q.shape
  dv = v.shape[-1]
  tp = -(-t // CHUNK) * CHUNK
  kp = next_pow2(dk)
  bv = block_v(dv, bv)
  bv_pass = block_v(dv, bv_pass)
  bk_pass = kp if bk_pass is None else min(kp, bk_pass)
  return dict(bsz=bsz, t=t, h=h, dk=dk, dv=dv, tp=tp, n_chunks=tp // CHUNK,
              chunk=CHUNK, kp=kp, bk=min(kp, block_k), bv=bv, nv=dv // bv,
              bv_pass=bv_pass, nv_pass=dv // bv_pass, bk_pass=bk_pass,
              nk_pass=kp // bk_pass,
              mm=jnp.bfloat16 if v.dtype == jnp.bfloat16 else F32)


def shape_of(lay, *names, dtype=F32):
  return jax.ShapeDtypeStruct(tuple(lay[n] for n in names), dtype)


def square_tile(ref, i, j):
  """Tile (i, j) [16, 16] of a [C, C] block."""
  return ref[tile_rows(i), pl.ds(j * TILE, TILE)]
