"""Latent (MLA) attention with the sequence split over a mesh axis.

docs/design.md §5 / §8. Under context parallelism each device holds a
contiguous block of T_l = T / P query positions. Keys and values of MLA come from a small
latent c_kv [B, T, R] (R = kv_lora_rank, e.g. 512, much smaller than the
per-head keys + values H (D_qk + D_v)), so each device all_gathers the latent
of the whole sequence over the axis, up-projects it to keys and values
locally, and attends with its own queries. Causality uses global positions:
the query at local row i of device d sits at d T_l + i and sees keys
0 .. d T_l + i.

Cost per device: the up-projection of all T latents (P times the unsharded
per-device share; the price of moving R instead of H (D_qk + D_v) numbers per
token) and a [T_l, T] score block, of which the part right of the diagonal
block is masked (the usual causal load imbalance of contiguous blocks; a
striped or ring layout would even it out, not done here). The mask is
explicit (an offset causal mask), so on GPU `jax.nn.dot_product_attention`
picks an implementation that takes a mask.

Packed documents: with segment ids [B, T] each device also all_gathers the
ids of the whole sequence (B T ints, beside the B T R latent) and masks to
causal AND same document, so a query never sees an earlier document.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moe_jax.layers import mesh_utils


def _local_attention(q, c_kv, w_uk, w_uv, k_rope, segment_ids, *, axis,
                     scale, dtype, implementation):
  """One device's block: gather the latent, up-project, masked attention.

  Shapes are this device's shards: q [B, T_l, H, Dqk]; c_kv [B, T_l, R];
  w_uk [R, H, Dn]; w_uv [R, H, Dv]; k_rope [B, T_l, Dr] or None;
  segment_ids [B, T_l] int or None.
  Returns o [B, T_l, H, Dv].
  """
  bsz, t_local, h, dqk = q.shape
  dv = w_uv.shape[-1]
  c_full = jax.lax.all_gather(c_kv, axis, axis=1, tiled=True)    # [B, T, R]
  t = c_full.shape[1]
  c_full, w_uk, w_uv = (a.astype(dtype) for a in (c_full, w_uk, w_uv))
  k = jnp.einsum("btr,rhd->bthd", c_full, w_uk)
  v = jnp.einsum("btr,rhd->bthd", c_full, w_uv)
  if k_rope is not None:
    kr = jax.lax.all_gather(k_rope, axis, axis=1, tiled=True)    # [B, T, Dr]
    kr = jnp.broadcast_to(kr[:, :, None].astype(k.dtype),
                          (bsz, t, h, kr.shape[-1]))
    k = jnp.concatenate([k, kr], axis=-1)
  # One head dim for q, k and v (zero padding adds nothing to q.k).
  width = max(dqk, dv)
  pad = lambda a: jnp.pad(  # noqa: E731
      a, ((0, 0), (0, 0), (0, 0), (0, width - a.shape[-1])))
  q, k, v = pad(q), pad(k), pad(v)
  q_pos = jax.lax.axis_index(axis) * t_local + jnp.arange(t_local)
  mask = (jnp.arange(t)[None, :] <= q_pos[:, None])[None, None]  # [1,1,T_l,T]
  if segment_ids is not None:
    ids_full = jax.lax.all_gather(segment_ids, axis, axis=1, tiled=True)
    mask = mask & (segment_ids[:, None, :, None]
                   == ids_full[:, None, None, :])                # [B,1,T_l,T]
  o = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale,
                                   implementation=implementation)
  return o[..., :dv]


def context_parallel_latent_attention(
    q: jax.Array, c_kv: jax.Array, w_uk: jax.Array, w_uv: jax.Array,
    k_rope: Optional[jax.Array] = None, *, scale: float, mesh=None,
    axis: str = "context", dtype=jnp.float32,
    implementation: Optional[str] = None, batch_axes=None,
    head_axes=None, segment_ids: Optional[jax.Array] = None) -> jax.Array:
  """Causal MLA attention with queries split over `axis`, latent all-gathered.

  Args:
    q: [B, T, H, Dqk] queries (rotary part, if any, already applied with
      global positions, last in the head dim).
    c_kv: [B, T, R] normalised KV latent.
    w_uk: [R, H, Dn] key up-projection (Dn + Dr = Dqk).
    w_uv: [R, H, Dv] value up-projection.
    k_rope: None or [B, T, Dr] rotary key shared by the heads (rotated with
      global positions).
    scale: softmax scale.
    mesh: Mesh/AbstractMesh, None for the ambient mesh.
    axis: mesh axis splitting T (T must be divisible by its size).
    dtype: compute dtype of the up-projection (the layer's dtype).
    implementation: passed to jax.nn.dot_product_attention.
    batch_axes, head_axes: mesh axes splitting B and H; None picks among
      ("data", "fsdp", "expert") and ("tensor",) those that divide.
    segment_ids: None or [B, T] int, packed documents (a document is a run of
      equal ids): a query attends to earlier keys of its own document only.
  Returns:
    o [B, T, H, Dv] in the compute dtype, split like q.
  """
  mesh = mesh_utils.resolve_mesh(mesh)
  sizes = dict(mesh.shape)
  if axis not in sizes:
    raise ValueError(f"mesh axis {axis!r} is not in the mesh {sizes}")
  bsz, t, h, dqk = q.shape
  if c_kv.shape[:2] != (bsz, t) or w_uk.shape[0] != c_kv.shape[-1]:
    raise ValueError(f"c_kv must be [B, T, R] with R = w_uk.shape[0]; got "
                     f"q {q.shape}, c_kv {c_kv.shape}, w_uk {w_uk.shape}")
  dr = 0 if k_rope is None else k_rope.shape[-1]
  if w_uk.shape[1:] != (h, dqk - dr) or w_uv.shape[:2] != w_uk.shape[:2]:
    raise ValueError(f"w_uk must be [R, H, Dqk - Dr] and w_uv [R, H, Dv]; "
                     f"got {w_uk.shape}, {w_uv.shape} for q {q.shape}, "
                     f"Dr={dr}")
  if segment_ids is not None and jnp.shape(segment_ids) != (bsz, t):
    raise ValueError(f"segment_ids must have shape [B, T]={(bsz, t)}, got "
                     f"{jnp.shape(segment_ids)}")
  if t % sizes[axis]:
    raise ValueError(f"sequence length T={t} is not divisible by the "
                     f"{axis!r} axis size {sizes[axis]}")
  b_axes = mesh_utils.choose_axes(mesh, batch_axes,
                                  mesh_utils.DEFAULT_BATCH_AXES, bsz, (axis,))
  h_axes = mesh_utils.choose_axes(mesh, head_axes,
                                  mesh_utils.DEFAULT_HEAD_AXES, h,
                                  (axis,) + b_axes)
  bs, hs = mesh_utils.spec_entry(b_axes), mesh_utils.spec_entry(h_axes)
  args = [q, c_kv, w_uk, w_uv]
  specs = [P(bs, axis, hs, None), P(bs, axis, None), P(None, hs, None),
           P(None, hs, None)]
  optional = {}  # name -> position in args
  for name, x in (("k_rope", k_rope), ("segment_ids", segment_ids)):
    if x is not None:
      optional[name] = len(args)
      args.append(x)
      specs.append(P(bs, axis, None) if name == "k_rope" else P(bs, axis))

  def body(*xs):
    kw = {name: xs[i] for name, i in optional.items()}
    return _local_attention(*xs[:4], kw.get("k_rope"), kw.get("segment_ids"),
                            axis=axis, scale=scale, dtype=dtype,
                            implementation=implementation)

  args = [mesh_utils.reshard(x, s, mesh) for x, s in zip(args, specs)]
  # Manual over the axes used only, so the output is split over every manual
  # axis (no replication claim); then check_vma=False is safe (the weights'
  # cotangents are summed over devices as for any replicated input) and lets
  # attention backends without varying-axes types (cuDNN custom calls) run.
  manual = frozenset((axis,) + b_axes + h_axes)
  return jax.shard_map(body, mesh=mesh, in_specs=tuple(specs),
                       out_specs=P(bs, axis, hs, None), axis_names=manual,
                       check_vma=False)(*args)
