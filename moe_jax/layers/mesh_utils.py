"""Small mesh helpers shared by the shard_map layers (context attention, EP).

Layers decide at trace time whether to run a parallel path by looking at the
ambient mesh (`jax.set_mesh(mesh)` around the jitted step, or the mesh
passed explicitly). With no mesh, or a size-1 axis, they keep their plain
single-device code, so results without a mesh are bit-identical to before.

`resolve_mesh`, `choose_axes`, `spec_entry`, `reshard` and `vary_like` live
in pallas_kernels/linear_attention/context_parallel.py and are re-exported
here (pallas_kernels never imports moe_jax, so the shared code sits there).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
from jax.sharding import NamedSharding

from moe_jax.sharding import rules_dict
# Re-exported (see __all__): the layers call them as mesh_utils.<name>.
from pallas_kernels.linear_attention.context_parallel import (
    choose_axes, reshard, resolve_mesh, spec_entry, vary_like)

# Mesh axes the shard_map layers may split activations over, from the rules
# table (config_base.DEFAULT_RULES): batch ('data', 'fsdp', 'expert'),
# sequence ('context',), heads ('tensor',).
DEFAULT_BATCH_AXES = rules_dict(None)["batch"]
DEFAULT_SEQUENCE_AXES = rules_dict(None)["sequence"]
DEFAULT_HEAD_AXES = rules_dict(None)["heads"]


@dataclasses.dataclass(frozen=True)
class MeshAxes:
  """The mesh axes the shard_map layers use, read from the rules table.

  batch, heads: candidate axes for B and H (those present with size > 1
    whose product divides the dim are used, in mesh order);
  context: the one axis that splits the sequence (None: never split);
  expert: the axis the routed experts are split over (None: never split).
  """
  batch: tuple[str, ...] = DEFAULT_BATCH_AXES
  heads: tuple[str, ...] = DEFAULT_HEAD_AXES
  context: Optional[str] = DEFAULT_SEQUENCE_AXES[0]
  expert: Optional[str] = rules_dict(None)["expert"][0]

  def split_axes(self, mesh, batch: int, heads: int) -> tuple[tuple, tuple]:
    """(batch axes, head axes) for a context-parallel call: the candidates
    that divide B and H, never the context axis."""
    b = choose_axes(mesh, None, self.batch, batch, (self.context,))
    h = choose_axes(mesh, None, self.heads, heads, (self.context,) + b)
    return b, h


def _one_axis(rules: dict, name: str) -> Optional[str]:
  axes = rules.get(name, ())
  if len(axes) > 1:
    raise ValueError(
        f"mesh.rules maps {name!r} to {axes}; the shard_map layers split "
        f"it over one mesh axis (give one axis name or None)")
  return axes[0] if axes else None


def mesh_axes(rules=None) -> MeshAxes:
  """MeshAxes of a rules table (config.mesh.rules; None = the defaults):
  batch <- 'batch', heads <- 'heads', context <- 'sequence', expert <-
  'expert'."""
  r = rules_dict(rules)
  return MeshAxes(batch=r.get("batch", ()), heads=r.get("heads", ()),
                  context=_one_axis(r, "sequence"),
                  expert=_one_axis(r, "expert"))


def axis_size(name: Optional[str], mesh=None) -> int:
  """Size of mesh axis `name` (1 when None, absent, or without a mesh)."""
  if name is None:
    return 1
  return dict(resolve_mesh(mesh).shape).get(name, 1)


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


__all__ = ["DEFAULT_BATCH_AXES", "DEFAULT_SEQUENCE_AXES",
           "DEFAULT_HEAD_AXES", "MeshAxes", "mesh_axes", "axis_size",
           "match_sharding", "choose_axes", "reshard", "resolve_mesh",
           "spec_entry", "vary_like"]
