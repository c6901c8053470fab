"""Small mesh helpers shared by the shard_map layers (context attention, EP).

Layers decide at trace time whether to run a parallel path by looking at the
ambient mesh (`jax.set_mesh(mesh)` around the jitted step, or the mesh
passed explicitly). With no mesh, or a size-1 axis, they keep their plain
single-device code, so results without a mesh are bit-identical to before.

(pallas_kernels/linear_attention/context_parallel.py keeps private copies of
the same few lines: pallas_kernels never imports moe_jax.)
"""
from __future__ import annotations

from typing import Iterable, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

DEFAULT_BATCH_AXES = ("data", "fsdp", "expert")


def resolve_mesh(mesh=None):
  """The given mesh, else the ambient one (`jax.set_mesh`); may be empty."""
  return jax.sharding.get_abstract_mesh() if mesh is None else mesh


def axis_size(name: str, mesh=None) -> int:
  """Size of mesh axis `name` (1 when absent or when there is no mesh)."""
  return dict(resolve_mesh(mesh).shape).get(name, 1)


def choose_axes(mesh, given, candidates: Iterable[str], dim: int,
                exclude: Sequence[str] = ()) -> tuple:
  """Mesh axes (in order) to split an array dim of size `dim` over.

  Args:
    mesh: Mesh or AbstractMesh.
    given: None = greedily take the `candidates` present in the mesh with
      size > 1 whose running product divides `dim` (in mesh order); else a
      str or tuple of axis names, validated.
    candidates: default axis names (used when given is None).
    dim: size of the array dim to split.
    exclude: axes already used for another dim.
  Returns:
    A tuple of axis names (possibly empty).
  """
  sizes = dict(mesh.shape)
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


def reshard(x, spec: P, mesh):
  """Puts x in `spec` on the mesh's Explicit axes (shard_map demands it).

  With Auto axes shard_map inserts the resharding itself and `jax.reshard`
  refuses Auto names, so only Explicit names are kept in the target spec.
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
    return spec_entry(tuple(n for n in names if n in explicit))

  spec = P(*(keep(e) for e in spec))
  target = (NamedSharding(mesh, spec) if isinstance(mesh, jax.sharding.Mesh)
            else spec)
  return jax.reshard(x, target)


def vary_like(x, ref):
  """x typed to vary over the same manual mesh axes as ref (shard_map vma).

  Adding a zero derived from ref works on every JAX version (the vma
  introspection API moved between 0.10 and 0.11); exact, folded by XLA.
  """
  zero = jax.numpy.zeros_like(ref.reshape(-1)[:1]).astype(x.dtype)
  return x + zero.reshape((1,) * x.ndim)


def match_sharding(out, ref, mesh):
  """out resharded like ref where the mesh has Explicit axes, else as is.

  A shard_map output carries its out_specs in its type under Explicit axes;
  callers that reshape it (e.g. flatten tokens) need the layout their input
  had, which this restores. With Auto axes the compiler chooses; no-op.
  """
  types = getattr(mesh, "axis_types", ())
  if jax.sharding.AxisType.Explicit not in tuple(types):
    return out
  spec = jax.typeof(ref).sharding.spec
  target = (NamedSharding(mesh, spec) if isinstance(mesh, jax.sharding.Mesh)
            else spec)
  return jax.reshard(out, target)
