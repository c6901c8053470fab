"""Routed experts: grouped-matmul dispatch, on one device or expert-parallel.

docs/design.md §5 / §8. `ragged_experts` is the single-device dropless
dispatch (sort (token, slot) pairs by expert, `jax.lax.ragged_dot`).
`expert_parallel_experts` runs the same computation with the experts split
over the mesh axis "expert" (E_l = E / P experts per device, P = axis size)
inside `jax.shard_map`; tokens are split over the expert axis too (plus the
batch / sequence axes), and per device:

  1. dispatch: for each destination device d, the local tokens routed to at
     least one expert of d are compacted, in token order, into a buffer of
     `capacity` rows (a token goes to a device once, however many of its
     top-k experts live there), together with its slot -> local-expert ids
     (a sentinel E_l for slots on other devices) and combine weights;
  2. `all_to_all` over the expert axis: each device receives P such buffers;
  3. the received (row, slot) pairs are sorted by local expert and run
     through `ragged_experts` with the device's E_l experts; the combine
     weights are applied and the slots of a row summed there;
  4. the reverse `all_to_all` brings one row per (token, device) back, and
     the rows are scattered (summed) onto the tokens.

Dropless by default: capacity = all local tokens (n), the worst case (every
local token routed to one device), so nothing is ever dropped and the
result equals the single-device dispatch. That costs static buffers of
P x n rows each way, i.e. P/k times the average traffic (uniform routing),
and a receiving grouped matmul over P n k (row, slot) pairs, the real ones
first (whether ragged_dot skips the padded tail depends on its lowering);
`capacity_factor` c > 0 shrinks the buffers to ceil(c n k / P) rows, and the
tokens beyond it for a destination (the last in token order) lose that
destination's experts (never the default; docs/design.md §5). A ragged
all-to-all (`jax.lax.ragged_all_to_all`) would send only the real rows, but
XLA:CPU (jax 0.10.2) does not implement it ("UNIMPLEMENTED: ragged-all-to-all"), so
it could not be tested here and is not used.

The router runs outside, on the global token set, so routing and the
Quantile-Balancing statistics are the same as without the mesh; the
experts' gradients come back split over the expert axis like the weights.
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from moe_jax.balancing import id_counts
from moe_jax.layers import mesh_utils
from pallas_kernels.grouped_matmul import Tuning, gmm, mosaic_gpu_available

# How the experts' grouped products run: "ragged_dot" (jax.lax.ragged_dot,
# XLA's lowering), "pallas" (pallas_kernels.grouped_matmul, GPU),
# "interpret" (the same kernels in the Pallas interpreter, for CPU tests),
# "mosaic" (the Mosaic GPU kernels, grouped_matmul/mosaic.py: Hopper, bf16,
# widths multiples of 64), "auto" (mosaic where it applies, else pallas on a
# GPU, ragged_dot elsewhere: the whole gpu_1b step is 14% faster on Mosaic
# than on Triton on an H100, results/train_step.md).
GROUPED_MATMULS = ("auto", "ragged_dot", "pallas", "interpret", "mosaic")
# The kernels' parameters under "mosaic" (experiments/bench_moe.py swaps it).
MOSAIC_TUNING = Tuning(kernel="mosaic")

# checkpoint_name tags of the experts' activations (model.REMAT_POLICIES).
EXPERT_GATE_UP = "expert_gate_up"
EXPERT_OUTPUT = "expert_output"

# Axes that may split the token dims [B, T] (or [N]); the expert axis must be
# one of them so that each token is dispatched by exactly one device.


def resolve_grouped_matmul(matmul: str, dims: Sequence[int] = (),
                           dtype=None) -> str:
  """'auto' on a GPU -> 'mosaic' where its kernels apply (compute capability
  9.0 or later, bf16 rows, every dim a multiple of 64), else 'pallas' when
  every dim is a multiple of 16 (the Triton kernels' limit); 'ragged_dot'
  off a GPU or otherwise. Other names unchanged."""
  if matmul not in GROUPED_MATMULS:
    raise ValueError(f"grouped_matmul must be one of {GROUPED_MATMULS}, got "
                     f"{matmul!r}")
  if matmul != "auto":
    return matmul
  if jax.default_backend() != "gpu" or any(d % 16 for d in dims):
    return "ragged_dot"
  if (mosaic_gpu_available() and dtype is not None
      and jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16)
      and all(d % 64 == 0 for d in dims)):
    return "mosaic"
  return "pallas"


def expert_ffn(xs, group_sizes, w_gate, w_up, w_down, matmul="ragged_dot"):
  """SwiGLU of each row under its group's expert. xs [M, D] group-sorted.

  The Pallas paths (pallas, interpret, mosaic) run gate and up as one
  product against [E, D, 2F] (xs read once, one launch); ragged_dot keeps
  the two products.

  The gate/up product and the output are named for remat policies
  (EXPERT_GATE_UP, EXPERT_OUTPUT; model.remat="experts" keeps them, so the
  backward recomputes neither grouped matmul).

  Returns [M, D] in xs.dtype (zero rows past sum(group_sizes)).
  """
  matmul = resolve_grouped_matmul(matmul, w_gate.shape[1:], xs.dtype)
  if matmul == "ragged_dot":
    gate = checkpoint_name(jax.lax.ragged_dot(xs, w_gate, group_sizes),
                           EXPERT_GATE_UP)
    up = checkpoint_name(jax.lax.ragged_dot(xs, w_up, group_sizes),
                         EXPERT_GATE_UP)
    h = jax.nn.silu(gate) * up                                   # [M, F]
    return checkpoint_name(jax.lax.ragged_dot(h, w_down, group_sizes),
                           EXPERT_OUTPUT)
  kw = dict(interpret=matmul == "interpret")
  if matmul == "mosaic":
    kw["tuning"] = MOSAIC_TUNING
  f = w_gate.shape[-1]
  gu = gmm(xs, jnp.concatenate([w_gate, w_up], axis=-1), group_sizes,
           **kw)                                                 # [M, 2F]
  gu = checkpoint_name(gu, EXPERT_GATE_UP)
  h = jax.nn.silu(gu[:, :f]) * gu[:, f:]
  return checkpoint_name(gmm(h, w_down, group_sizes, **kw), EXPERT_OUTPUT)


def ragged_experts(x, idx, w, w_gate, w_up, w_down, matmul="ragged_dot"):
  """Dropless grouped-matmul dispatch on one device.

  Expert ids equal to E (one past the last) are allowed and dropped: they sort
  last, outside every group, where ragged_dot writes zeros (the
  expert-parallel path marks slots routed to other devices that way).

  Args:
    x: [N, D] tokens (compute dtype).
    idx: [N, k] int32 expert ids in [0, E].
    w: [N, k] fp32 combine weights.
    w_gate, w_up: [E, D, F]; w_down: [E, F, D].
    matmul: one of GROUPED_MATMULS (`expert_ffn`).

  Returns:
    [N, D] fp32 routed output: sum over slots of w * expert(x).
  """
  n, k = idx.shape
  e = w_gate.shape[0]
  flat_e = idx.reshape(-1)                                       # [N*k]
  # Stable sort keeps token order inside each expert group (determinism).
  order = jnp.argsort(flat_e, stable=True).astype(jnp.int32)    # [N*k]
  # order is a permutation: its scatter needs no atomics or ordering.
  inv = jnp.zeros_like(order).at[order].set(
      jnp.arange(order.shape[0], dtype=order.dtype), unique_indices=True)
  group_sizes = id_counts(flat_e, e)                             # [E]
  xs = permute_rows(x, order, inv, k)                            # [N*k, D]
  ys = expert_ffn(xs, group_sizes, w_gate, w_up, w_down, matmul)  # [N*k, D]
  # Back to (token, slot) order in the compute dtype, then weighted and
  # summed over the slots in fp32 in one fused pass: no [N*k, D] fp32
  # buffer (the same products and sums as weighting before the gather).
  ys = permute_rows(ys, inv, order).reshape(n, k, -1)             # [N, k, D]
  return (ys.astype(jnp.float32) * w[..., None]).sum(axis=1)


def gathered_experts(x, idx, w, w_gate, w_up, w_down):
  """Few-token dispatch: each (token, slot) gathers its expert's weights.

  Same args and result as `ragged_experts`. It reads the weights of the
  N*k routed slots instead of streaming all E experts, with no sort and no
  grouped kernel: the path for a decode step (N*k <= E).
  """
  e = w_gate.shape[0]
  # Ids equal to E (dropped slots) clip to expert E - 1 under a zero weight.
  w = jnp.where(idx < e, w, 0.0)
  take = lambda a: jnp.take(a, idx, axis=0, mode="clip")  # noqa: E731
  gate = jnp.einsum("nd,nkdf->nkf", x, take(w_gate))
  up = jnp.einsum("nd,nkdf->nkf", x, take(w_up))
  h = jax.nn.silu(gate) * up                                     # [N, k, F]
  ys = jnp.einsum("nkf,nkfd->nkd", h, take(w_down))              # [N, k, D]
  return (ys.astype(jnp.float32) * w[..., None]).sum(axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def permute_rows(a: jax.Array, perm: jax.Array, inv: jax.Array,
                 slots: int = 1) -> jax.Array:
  """a[perm // slots]: [M / slots, D] -> [M, D], perm a permutation of
  range(M) with inverse inv (slots > 1: each row of a fills `slots` rows).

  Its gradient gathers ct[inv] and sums each row's slots; jnp.take's would
  be a scatter-add, which the GPU runs far slower than a gather. The
  indices are in bounds by construction: mode="clip" is exact and spares
  the default mode's out-of-bounds mask (a select over every gathered row).
  """
  return _take_rows(a, perm // slots)


def _take_rows(a, rows):
  return jnp.take(a, rows, axis=0, mode="clip")


def _permute_fwd(a, perm, inv, slots):
  return _take_rows(a, perm // slots), (perm, inv)


def _permute_bwd(slots, res, ct):
  _, inv = res
  ct = _take_rows(ct, inv)
  return ct.reshape(-1, slots, *ct.shape[1:]).sum(axis=1), None, None


permute_rows.defvjp(_permute_fwd, _permute_bwd)


def token_axes(mesh, lead_shape: Sequence[int], expert_axis: str = "expert",
               batch_axes: Sequence[str] = mesh_utils.DEFAULT_BATCH_AXES,
               context_axis: Optional[str] = "context") -> Optional[tuple]:
  """Mesh axes splitting each token dim for the expert-parallel path.

  Leading dims [B, T]: B over batch_axes (default ("data", "fsdp",
  "expert")), T over (context_axis, expert_axis) (greedy, mesh order, each
  axis once, only axes that divide); a flat [N] takes all of them. Returns
  None when the expert axis cannot split the tokens (then the caller keeps
  the single-device path).
  """
  seq = (() if context_axis is None else (context_axis,)) + (expert_axis,)
  if len(lead_shape) == 1:
    groups = [tuple(batch_axes) + seq]
  elif len(lead_shape) == 2:
    groups = [tuple(batch_axes), seq]
  else:
    raise ValueError(f"token dims must be [N] or [B, T], got {lead_shape}")
  used, out = (), []
  for dim, cands in zip(lead_shape, groups):
    axes = mesh_utils.choose_axes(mesh, None, cands, dim, used)
    out.append(axes)
    used += axes
  if expert_axis not in used:
    return None
  return tuple(out)


def _dispatch_body(x, idx, w, w_gate, w_up, w_down, *, axis, n_dev, capacity,
                   matmul):
  """One device: dispatch, local grouped matmul, return, combine.

  Args (this device's shards):
    x: [..., D] tokens; idx, w: [..., k] global expert ids and weights.
    w_gate, w_up: [E_l, D, F]; w_down: [E_l, F, D] local experts.
  Returns [..., D] fp32.
  """
  lead, d = x.shape[:-1], x.shape[-1]
  k = idx.shape[-1]
  x, idx, w = x.reshape(-1, d), idx.reshape(-1, k), w.reshape(-1, k)
  n = x.shape[0]
  e_local = w_gate.shape[0]
  dest = idx // e_local                                          # [n, k]
  on_dev = dest[None] == jnp.arange(n_dev)[:, None, None]        # [P, n, k]
  goes = jnp.any(on_dev, axis=-1)                                # [P, n]
  # Tokens routed to d first, in token order; the first `capacity` are sent.
  sel = jnp.argsort(~goes, axis=-1, stable=True)[:, :capacity]   # [P, cap]
  valid = jnp.arange(capacity)[None] < jnp.sum(goes, -1)[:, None]
  pick = lambda a: jnp.take_along_axis(a, sel[..., None], axis=1)  # noqa: E731
  on_sel = pick(on_dev) & valid[..., None]                       # [P, cap, k]
  local_e = jnp.broadcast_to(idx % e_local, on_dev.shape)
  send_le = jnp.where(on_sel, pick(local_e), e_local).astype(jnp.int32)
  send_w = jnp.where(on_sel, pick(jnp.broadcast_to(w, on_dev.shape)), 0.0)
  send_x = jnp.take(x, sel, axis=0)                              # [P, cap, D]

  a2a = lambda a: jax.lax.all_to_all(a, axis, 0, 0, tiled=True)  # noqa: E731
  recv_x, recv_le, recv_w = a2a(send_x), a2a(send_le), a2a(send_w)
  y = ragged_experts(recv_x.reshape(-1, d), recv_le.reshape(-1, k),
                     recv_w.reshape(-1, k), w_gate, w_up, w_down, matmul)
  back = a2a(y.reshape(n_dev, capacity, d))                      # [P, cap, D]
  back = jnp.where(valid[..., None], back, 0.0)
  out = jax.ops.segment_sum(back.reshape(-1, d), sel.reshape(-1),
                            num_segments=n)
  return out.reshape(*lead, d)


def expert_parallel_experts(x, idx, w, w_gate, w_up, w_down, *, mesh=None,
                            expert_axis: str = "expert",
                            batch_axes: Sequence[str] = (
                                mesh_utils.DEFAULT_BATCH_AXES),
                            context_axis: Optional[str] = "context",
                            capacity_factor: Optional[float] = None,
                            matmul: str = "ragged_dot"):
  """Routed experts split over `expert_axis` with an all-to-all dispatch.

  Same values and gradients as `ragged_experts` on the gathered arrays (with
  the default dropless capacity).

  Args:
    x: [N, D] or [B, T, D] tokens (compute dtype).
    idx: [..., k] int expert ids in [0, E); w: [..., k] fp32 combine weights.
    w_gate, w_up: [E, D, F]; w_down: [E, F, D]; E divisible by the axis size.
    mesh: Mesh/AbstractMesh, None for the ambient one (jax.set_mesh).
    expert_axis: the mesh axis the experts are split over.
    batch_axes, context_axis: mesh axes that may split the token dims
      (`token_axes`), from the run's rules.
    capacity_factor: None = dropless (capacity = all local tokens); c > 0 =
      ceil(c n k / P) rows per destination (drops tokens beyond it).
    matmul: the local grouped product, one of GROUPED_MATMULS.

  Returns:
    [..., D] fp32, like x (and laid out like x on Explicit mesh axes).
  """
  mesh = mesh_utils.resolve_mesh(mesh)
  sizes = dict(mesh.shape)
  if expert_axis not in sizes:
    raise ValueError(f"mesh axis {expert_axis!r} is not in the mesh {sizes}")
  n_dev = sizes[expert_axis]
  e = w_gate.shape[0]
  if e % n_dev:
    raise ValueError(f"num_experts={e} is not divisible by the "
                     f"{expert_axis!r} axis size {n_dev}")
  lead = x.shape[:-1]
  if idx.shape[:-1] != lead or w.shape != idx.shape:
    raise ValueError(f"idx and w must be [..., k] over the token dims of x "
                     f"{x.shape}; got {idx.shape}, {w.shape}")
  axes = token_axes(mesh, lead, expert_axis, batch_axes, context_axis)
  if axes is None:
    raise ValueError(f"token dims {lead} cannot be split over the "
                     f"{expert_axis!r} axis (size {n_dev}) of mesh {sizes}")
  n_local = math.prod(lead) // math.prod(
      sizes[a] for group in axes for a in group)
  k = idx.shape[-1]
  if capacity_factor is None:
    capacity = n_local
  else:
    if not capacity_factor > 0:
      raise ValueError(f"capacity_factor must be None or > 0, got "
                       f"{capacity_factor!r}")
    capacity = min(n_local, math.ceil(capacity_factor * n_local * k / n_dev))

  tok = tuple(mesh_utils.spec_entry(a) for a in axes)
  specs = (P(*tok, None), P(*tok, None), P(*tok, None),
           P(expert_axis, None, None), P(expert_axis, None, None),
           P(expert_axis, None, None))
  args = (x, idx.astype(jnp.int32), w.astype(jnp.float32), w_gate, w_up,
          w_down)
  args = [mesh_utils.reshard(a, s, mesh) for a, s in zip(args, specs)]

  def body(*xs):
    return _dispatch_body(*xs, axis=expert_axis, n_dev=n_dev,
                          capacity=capacity, matmul=matmul)

  out = jax.shard_map(body, mesh=mesh, in_specs=specs,
                      out_specs=P(*tok, None))(*args)
  return mesh_utils.match_sharding(out, x, mesh)
