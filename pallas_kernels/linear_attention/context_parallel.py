"""Context (sequence-chunk) parallel GLA and KDA over a device mesh axis.

docs/design.md §4 / §8. The sequence axis (dim 1) is split over the mesh axis
`axis` (default "context"): device d holds tokens [d T_l, (d+1) T_l). Both
recurrences are affine in the state, so each device's segment is a map

    S_out = A_d S_in + S_d                                   (per batch, head)

and the true initial state of device d is the prefix composition of the maps
of devices 0..d-1 applied to the user's initial state. Per device:

  1. run the local op (`ops.gla` / `ops.kda`, any backend) on its tokens with
     a ZERO initial state: local outputs o_loc and the local final state S_d;
  2. get its transition A_d (below);
  3. all_gather the (A_d, S_d) of every device over `axis` and fold them in
     device order (a lax.scan over devices) starting from the user's initial
     state: the state entering each device and the global final state. This
     moves O(P x K x (K + V)) numbers per (batch, head), P = devices, and
     never anything O(T);
  4. correct the local outputs for the true entering state S_in.

GLA. A_d = diag(exp(sum_t g_t)) is diagonal: only the [K] vector is gathered.
With b_t the cumsum of g over the local segment (inclusive), the state at t is
diag(exp(b_t)) S_in + S_loc_t, so
    o_t += scale * S_in^T (q_t * exp(b_t))
an elementwise product and one [T_l, K] x [K, V] matmul, no rerun.

KDA. A_d = prod_t (I - beta_t k_t k_t^T) diag(exp(g_t)) is a dense [K, K]
matrix. The recurrence acts on each column of the state independently, so
one op call with the value/state widened by K columns,
    v' = [v | 0_K],   S'_0 = [0 | I_K],
gives, in the extra columns, the state P_t = A_t ... A_1 (the transition up to
token t; its last value is A_d) and the outputs scale * P_t^T q_t. Since the
true state is S_t = P_t S_in + S_loc_t,
    o_t += (scale * P_t^T q_t)^T S_in
again one [T_l, K] x [K, V] matmul: the correction is exact (no
approximation, no second pass after the exchange). Cost: the local op runs on
V + K value columns instead of V (2x the value-dependent work when K = V; the
V-independent part, the intra-chunk [C, C] matrices and the triangular
inverse, is shared), plus O(K^2 V) per device for A_d S_in in the fold. The
alternative (rerun the op with the true initial state after the exchange)
costs the same 2x but serialises the exchange between two op calls.

Packed documents (segment_ids [B, T], a document a run of equal ids, as in
`ops.kda`). Each device's local op gets its slice of the ids and restarts
from zero at every document start inside it. From the first local start t_0
on, the state entering the device reaches neither the outputs nor the exit
state: A_d = 0 (in a row with a local start) and the correction basis is
zero for t >= t_0. For KDA this comes by itself: the reset zeroes the whole
widened state, so P_t = 0 from t_0 on. For GLA, qp_t and diag(A) are
masked from t_0 on. A document may also start exactly at a
device's first token, which the device cannot see locally (the previous id
is on the previous device): every device all_gathers its first and last id
(2 ints per row) and the fold sets the state entering device d to
    where(reset_d, 0, A_{d-1} S_in_{d-1} + S_{d-1}),
reset_d = (first id of d != last id of d - 1); device 0 never resets, so the
user's initial state belongs to the row's first document, as in `ops.kda`.

Two shard_maps. Phase 1 (steps 1-2) is a pure map: every input and output
is split over every manual axis, with check_vma=False because Pallas kernels
(pallas_call) carry no varying-manual-axes types; a pure map's autodiff does
not need them. Phase 2 (steps 3-4) holds the collectives and runs vma-checked,
so JAX types the replicated final state and transposes all_gather / psum
exactly. Gradients flow through both (all_gather transposes to a
reduce-scatter); no custom_vjp is needed, and the local op's own custom_vjp
(Pallas backends) is used as is.

Mesh axes. Besides `axis` (sequence), the batch dim may be split over
`batch_axes` and the head dim over `head_axes`; by default the batch takes the
mesh axes among ("data", "fsdp", "expert") of size > 1 that divide it (in mesh
order), and the heads take "tensor" when it divides H. The shard_maps are
manual over these axes only; other mesh axes stay automatic (the compiler
replicates the work over them). Inputs laid out differently are resharded by
the compiler (Auto axes) or by `jax.reshard` here (Explicit axes), so the
result never depends on the input layout.

Kernels: with a Pallas backend the KDA kernel must accept V + K value
columns (the "auto" backend falls back to XLA when it does not).
"""
from __future__ import annotations

import functools
from typing import Iterable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels.linear_attention import ops
from pallas_kernels.linear_attention.common.naive import document_starts

_F32 = jnp.float32
_PREC = jax.lax.Precision.HIGHEST
DEFAULT_BATCH_AXES = ("data", "fsdp", "expert")
DEFAULT_HEAD_AXES = ("tensor",)


# ---------------------------------------------------------------------------
# Mesh helpers (kept here: pallas_kernels never imports moe_jax; the public
# ones are re-exported by moe_jax.layers.mesh_utils).
# ---------------------------------------------------------------------------


def resolve_mesh(mesh=None):
  """The given mesh, else the ambient one (`jax.set_mesh`); may be empty."""
  return jax.sharding.get_abstract_mesh() if mesh is None else mesh


def _axis_sizes(mesh) -> dict:
  return dict(mesh.shape)


def choose_axes(mesh, given, candidates: Iterable[str], dim: int,
                exclude: Sequence[str] = ()) -> tuple:
  """Mesh axes (in order) to split an array dim of size `dim` over.

  Args:
    mesh: Mesh or AbstractMesh.
    given: None = greedily take the `candidates` present in the mesh with
      size > 1 whose running product divides `dim` (in mesh order); else a
      str or tuple of axis names, validated (present, unused, product divides
      dim).
    candidates: default axis names (used when given is None).
    dim: size of the array dim to split.
    exclude: axes already used for another dim.
  Returns:
    A tuple of axis names (possibly empty).
  """
  sizes = _axis_sizes(mesh)
  if given is None:
    chosen, prod = [], 1
    for name, size in sizes.items():
      if (name in candidates and name not in exclude and size > 1
          and dim % (prod * size) == 0):
        chosen.append(name)
        prod *= size
    return tuple(chosen)
  given = (given,) if isinstance(given, str) else tuple(given)
  prod = 1
  for name in given:
    if name not in sizes:
      raise ValueError(f"axis {name!r} is not in the mesh {sizes}")
    if name in exclude:
      raise ValueError(f"axis {name!r} already splits another dim")
    prod *= sizes[name]
  if dim % prod:
    raise ValueError(f"dim {dim} is not divisible by the product {prod} of "
                     f"mesh axes {given}")
  return given


def spec_entry(axes: Sequence[str]):
  """PartitionSpec entry for a tuple of axes: None, one name, or the tuple."""
  axes = tuple(axes)
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else axes


def reshard(x, spec, mesh):
  """Puts x in `spec` where the mesh has Explicit axes (shard_map demands it).

  With Auto axes shard_map inserts the resharding itself; `jax.reshard`
  only accepts Explicit axis names, so Auto names are dropped from its spec.
  """
  types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ())))
  explicit = {n for n, t in types.items()
              if t == jax.sharding.AxisType.Explicit}
  if not explicit:
    return x

  def keep(entry):
    if entry is None:
      return None
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    names = tuple(n for n in names if n in explicit)
    return spec_entry(names)

  spec = P(*(keep(e) for e in spec))
  target = (NamedSharding(mesh, spec) if isinstance(mesh, jax.sharding.Mesh)
            else spec)
  return jax.reshard(x, target)


def vary_like(x, ref):
  """x typed to vary over the same manual mesh axes as ref (shard_map vma).

  Constants built inside the body (zero / identity states) are invariant
  across devices; a scan carry must keep one type, so they take the varying
  type of the data they meet. Adding a zero derived from ref does that on
  every JAX version (the vma introspection API moved between 0.10 and 0.11)
  and is exact; XLA folds it away.
  """
  zero = jnp.zeros_like(ref.reshape(-1)[:1]).astype(x.dtype)
  return x + zero.reshape((1,) * x.ndim)


# ---------------------------------------------------------------------------
# The device fold.
# ---------------------------------------------------------------------------


def _fold_states(mats, adds, s0, resets=None, *, diagonal: bool):
  """States entering every device and the final state.

  Args:
    mats: [P, B, H, K] (diagonal A) or [P, B, H, K, K] gathered transitions.
    adds: [P, B, H, K, V] gathered local final states S_d.
    s0: [B, H, K, V] fp32 state entering device 0.
    resets: None or bool [P, B]: a document starts at device d's first token
      (row b), so the state entering device d is zero.
    diagonal: whether mats holds diag(A) only.
  Returns:
    s_in [P, B, H, K, V] (entering device d), s_final [B, H, K, V].
  """
  def step(s, xs):
    a, add, reset = xs
    if reset is not None:
      s = jnp.where(reset[:, None, None, None], 0.0, s)
    if diagonal:
      s_next = a[..., None] * s + add
    else:
      s_next = jnp.einsum("bhij,bhjv->bhiv", a, s, precision=_PREC) + add
    return s_next, s

  s_final, s_in = jax.lax.scan(step, s0, (mats, adds, resets))
  return s_in, s_final


def _device_starts(segment_ids, axis):
  """bool [P, B]: whether a document starts at each device's first token.

  Each device holds segment_ids [B, T_l] of its own tokens; it cannot see
  its predecessor's last id, so the (first, last) ids of every device are
  all_gathered (2 P B ints). Device 0 never resets: the initial state
  belongs to the row's first document, as in ops.kda / ops.gla.
  """
  edges = jnp.stack([segment_ids[:, 0], segment_ids[:, -1]])      # [2, B]
  edges = jax.lax.all_gather(edges, axis)                         # [P, 2, B]
  first, last = edges[:, 0], edges[:, 1]
  return jnp.concatenate([jnp.zeros_like(first[:1], bool),
                          first[1:] != last[:-1]], axis=0)


def _exchange(mat, add, s0, axis, segment_ids=None, *, diagonal):
  """This device's entering state and the global final state.

  all_gathers the per-device maps (A_d, S_d) over `axis` (O(P K (K + V))
  numbers per batch and head) and folds them in device order from s0; with
  segment_ids the state entering a device whose first token starts a
  document is zero.

  Every device computes the same final state, but all_gather's result is
  typed as varying over `axis`; a psum of the last device's copy (the others
  zeroed) gives the replicated (invariant) value shard_map's out_specs
  promise, and routes its gradient through one copy only.
  """
  mats = jax.lax.all_gather(mat, axis)
  adds = jax.lax.all_gather(add, axis)
  resets = (None if segment_ids is None
            else _device_starts(segment_ids, axis))
  s_in, s_final = _fold_states(mats, adds, vary_like(s0, adds), resets,
                               diagonal=diagonal)
  idx = jax.lax.axis_index(axis)
  s_in = jax.lax.dynamic_index_in_dim(s_in, idx, 0, keepdims=False)
  last = idx == mats.shape[0] - 1
  s_final = jax.lax.psum(jnp.where(last, s_final, 0.0), axis)
  return s_in, s_final


# ---------------------------------------------------------------------------
# Per-device bodies.
# ---------------------------------------------------------------------------


def _gla_local(q, k, v, g, segment_ids=None, *, scale, op_kw):
  """Phase 1 (GLA): local op from a zero state, and the correction basis.

  Returns o_loc [B, Tl, H, V], qp = scale q exp(b) [B, Tl, H, K] fp32,
  diag(A) = exp(b_T) [1, B, H, K] and S_loc [1, B, H, K, V] (the leading 1 is
  this device's slot of the per-device stack). With segment_ids [B, Tl] the
  local op resets at every document start in the slice, and from the first
  one on no token reads the entering state: qp and A are zero there.
  """
  o, s_loc = ops.gla(q, k, v, g, scale=scale, initial_state=None,
                     segment_ids=segment_ids, **op_kw)
  b_cum = jnp.cumsum(g.astype(_F32), axis=1)                     # [B, Tl, H, K]
  qp = scale * q.astype(_F32) * jnp.exp(b_cum)
  mat = jnp.exp(b_cum[:, -1])
  if segment_ids is not None:
    # 1 up to the first local document start, 0 from it on.
    entering = (jnp.cumsum(document_starts(segment_ids), axis=1) == 0)
    entering = entering.astype(_F32)                             # [B, Tl]
    qp = qp * entering[:, :, None, None]
    mat = mat * entering[:, -1, None, None]
  return o, qp, mat[None], s_loc[None]


def _kda_local(q, k, v, g, beta, segment_ids=None, *, scale, op_kw):
  """Phase 1 (KDA): one local op on [v | 0] from [0 | I].

  Returns o_loc [B, Tl, H, V], qp = scale P_t^T q_t [B, Tl, H, K],
  A = P_T [1, B, H, K, K] and S_loc [1, B, H, K, V]. o_loc and qp come back
  in v.dtype (the op's output dtype): with bf16 values the correction basis
  is rounded to bf16 like the outputs themselves; states stay fp32. With
  segment_ids [B, Tl] the op zeroes the whole widened state at each local
  document start, so P_t (qp and A) vanish from the first one on by
  themselves.
  """
  bsz, tl, h, dk = q.shape
  dv = v.shape[-1]
  v_aug = jnp.concatenate([v, jnp.zeros((bsz, tl, h, dk), v.dtype)], axis=-1)
  eye = jnp.broadcast_to(jnp.eye(dk, dtype=_F32), (bsz, h, dk, dk))
  s_aug0 = jnp.concatenate([jnp.zeros((bsz, h, dk, dv), _F32), eye], axis=-1)
  o_aug, s_aug = ops.kda(q, k, v_aug, g, beta, scale=scale,
                         initial_state=s_aug0, segment_ids=segment_ids,
                         **op_kw)
  return (o_aug[..., :dv], o_aug[..., dv:], s_aug[..., dv:][None],
          s_aug[..., :dv][None])


def _combine(o_loc, qp, mat, add, s0, segment_ids, *, axis, diagonal):
  """Phase 2: exchange the maps, correct the outputs by the entering state.

  o_t += qp_t^T S_in (qp_t = scale P_t^T q_t, P_t the local transition up to
  token t). segment_ids: None or this device's [B, Tl] (document starts at
  device boundaries). Returns o [B, Tl, H, V] in o_loc.dtype and the final
  state.
  """
  bsz, _, h, dk = qp.shape
  dv = o_loc.shape[-1]
  if s0 is None:
    s0 = jnp.zeros((bsz, h, dk, dv), _F32)
  s_in, s_final = _exchange(mat[0], add[0], s0.astype(_F32), axis,
                            segment_ids, diagonal=diagonal)
  corr = jnp.einsum("bthk,bhkv->bthv", qp.astype(_F32), s_in, precision=_PREC)
  return (o_loc.astype(_F32) + corr).astype(o_loc.dtype), s_final


# ---------------------------------------------------------------------------
# Public ops.
# ---------------------------------------------------------------------------


def _context_parallel(kind, q, k, v, g, beta, *, mesh, axis, scale,
                      initial_state, chunk_size, backend, g_min, batch_axes,
                      head_axes, pallas_options=None, segment_ids=None):
  # Global validation first (clear errors before any tracing of shard_map).
  # pylint: disable-next=protected-access
  g_min = ops._validate(q, k, v, g, beta, initial_state, chunk_size, g_min)
  if segment_ids is not None and jnp.shape(segment_ids) != q.shape[:2]:
    raise ValueError(f"{kind}_context_parallel: segment_ids must have shape "
                     f"[B, T]={q.shape[:2]}, got {jnp.shape(segment_ids)}")
  mesh = resolve_mesh(mesh)
  sizes = _axis_sizes(mesh)
  if axis not in sizes:
    raise ValueError(f"{kind}_context_parallel: mesh axis {axis!r} not in the "
                     f"mesh {sizes} (pass mesh=, or call under jax.set_mesh)")
  bsz, t, h, dk = q.shape
  scale = float(dk) ** -0.5 if scale is None else scale
  op_kw = dict(backend=backend, chunk_size=chunk_size, g_min=g_min,
               pallas_options=pallas_options)
  n_dev = sizes[axis]
  if n_dev == 1:  # nothing to exchange: the plain op
    fn = ops.gla if kind == "gla" else ops.kda
    args = (q, k, v, g) if kind == "gla" else (q, k, v, g, beta)
    return fn(*args, scale=scale, initial_state=initial_state,
              segment_ids=segment_ids, **op_kw)
  if t % n_dev:
    raise ValueError(f"{kind}_context_parallel: sequence length T={t} is not "
                     f"divisible by the {axis!r} axis size {n_dev}")

  b_axes = choose_axes(mesh, batch_axes, DEFAULT_BATCH_AXES, bsz, (axis,))
  h_axes = choose_axes(mesh, head_axes, DEFAULT_HEAD_AXES, h,
                       (axis,) + b_axes)
  manual = frozenset((axis,) + b_axes + h_axes)
  bs, hs = spec_entry(b_axes), spec_entry(h_axes)
  tok = P(bs, axis, hs, None)                   # [B, T, H, *]
  ids = P(bs, axis)                             # segment ids [B, T]
  state = P(bs, hs, None, None)                 # initial / final state
  stacked = P(axis, bs, hs, None, None)         # per-device maps [P, B, H, ...]

  # Phase 1: the local op, a pure map (every input and output split over
  # every manual axis). check_vma=False because kernels (pallas_call) carry
  # no varying-axes types; a pure map's autodiff needs none.
  if kind == "gla":
    local = functools.partial(_gla_local, scale=scale, op_kw=op_kw)
    args, specs = [q, k, v, g], [tok] * 4
    mat_spec = P(axis, bs, hs, None)
  else:
    local = functools.partial(_kda_local, scale=scale, op_kw=op_kw)
    args, specs = [q, k, v, g, beta], [tok] * 4 + [P(bs, axis, hs)]
    mat_spec = stacked
  if segment_ids is not None:
    args.append(segment_ids)
    specs.append(ids)
  args = [reshard(x, s, mesh) for x, s in zip(args, specs)]
  if segment_ids is not None:
    segment_ids = args[-1]
  o_loc, qp, mat, add = jax.shard_map(
      local, mesh=mesh, in_specs=tuple(specs),
      out_specs=(tok, tok, mat_spec, stacked), axis_names=manual,
      check_vma=False)(*args)

  # Phase 2: exchange and correction (no kernels; vma-checked collectives).
  args, specs = [o_loc, qp, mat, add], [tok, tok, mat_spec, stacked]
  extra = {}  # optional inputs, by keyword
  if initial_state is not None:
    args.append(reshard(initial_state, state, mesh))
    specs.append(state)
    extra["s0"] = len(args) - 1
  if segment_ids is not None:
    args.append(segment_ids)
    specs.append(ids)
    extra["segment_ids"] = len(args) - 1

  def combine(*xs):
    kw = {name: xs[i] for name, i in extra.items()}
    return _combine(*xs[:4], kw.get("s0"), kw.get("segment_ids"), axis=axis,
                    diagonal=kind == "gla")

  return jax.shard_map(combine, mesh=mesh, in_specs=tuple(specs),
                       out_specs=(tok, state), axis_names=manual)(*args)


def gla_context_parallel(q, k, v, g, *, mesh=None, axis: str = "context",
                         scale: Optional[float] = None, initial_state=None,
                         chunk_size: int = 64, backend: str = "xla",
                         g_min: Optional[float] = None, batch_axes=None,
                         head_axes=None, pallas_options=None,
                         segment_ids=None):
  """GLA with the sequence split over a mesh axis; equals `ops.gla`.

  Args:
    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log decay <= 0.
      T must be divisible by the axis size (T / size need not be a multiple
      of chunk_size: the local op pads).
    mesh: a Mesh/AbstractMesh, or None for the ambient one (jax.set_mesh).
    axis: the mesh axis splitting the sequence.
    scale, initial_state ([B, H, K, V]), chunk_size, backend, g_min,
      pallas_options: as `ops.gla` (the local op gets them; the initial
      state enters device 0).
    batch_axes, head_axes: mesh axes splitting B and H (str or tuple), None
      for the defaults (module docstring).
    segment_ids: [B, T] int or None: packed documents, as in `ops.gla` (the
      state restarts from zero at every document start, inside a device's
      slice or at its first token; module docstring).
  Returns:
    o [B, T, H, V] in v.dtype, final state [B, H, K, V] fp32 (replicated
    over `axis`).
  """
  return _context_parallel(
      "gla", q, k, v, g, None, mesh=mesh, axis=axis, scale=scale,
      initial_state=initial_state, chunk_size=chunk_size, backend=backend,
      g_min=g_min, batch_axes=batch_axes, head_axes=head_axes,
      pallas_options=pallas_options, segment_ids=segment_ids)


def kda_context_parallel(q, k, v, g, beta, *, mesh=None, axis: str = "context",
                         scale: Optional[float] = None, initial_state=None,
                         chunk_size: int = 64, backend: str = "xla",
                         g_min: Optional[float] = None, batch_axes=None,
                         head_axes=None, pallas_options=None,
                         segment_ids=None):
  """KDA with the sequence split over a mesh axis; equals `ops.kda`.

  The local op runs on V + K value columns (module docstring: the extra K
  columns carry the [K, K] transition and the exact output correction).

  Args:
    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log decay <= 0;
      beta: [B, T, H]. T must be divisible by the axis size.
    mesh, axis, scale, initial_state, chunk_size, backend, g_min, batch_axes,
      head_axes, segment_ids: as `gla_context_parallel`.
    pallas_options: as `ops.kda` (the local op gets them).
  Returns:
    o [B, T, H, V] in v.dtype, final state [B, H, K, V] fp32.
  """
  if len(ops._shape(beta)) != 3:  # pylint: disable=protected-access
    raise ValueError(f"beta must have rank 3 [B, T, H], got shape "
                     f"{ops._shape(beta)}")  # pylint: disable=protected-access
  return _context_parallel(
      "kda", q, k, v, g, beta, mesh=mesh, axis=axis, scale=scale,
      initial_state=initial_state, chunk_size=chunk_size, backend=backend,
      g_min=g_min, batch_axes=batch_axes, head_axes=head_axes,
      pallas_options=pallas_options, segment_ids=segment_ids)


__all__ = ["gla_context_parallel", "kda_context_parallel", "choose_axes",
           "spec_entry", "resolve_mesh", "reshard", "vary_like"]
