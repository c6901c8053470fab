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


def axis_size(name: str, mesh=None) -> int:
  """Size of mesh axis `name` (1 when absent or when there is no mesh)."""
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
           "DEFAULT_HEAD_AXES", "axis_size", "match_sharding", "choose_axes",
           "reshard", "resolve_mesh", "spec_entry", "vary_like"]
