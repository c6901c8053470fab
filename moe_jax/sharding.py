"""Device mesh, logical axis names and shardings (docs/design.md §8).

One mesh with axes ('data', 'fsdp', 'expert', 'context', 'tensor'), built
from config.mesh. Arrays are described by *logical* axis names (one per dim,
or None); config.mesh.rules maps each logical name to mesh axes, MaxText
style. A dim is only sharded over the axes whose product divides it: an axis
that does not divide is dropped (that dim is replicated over it) and logged,
so every config runs on every mesh, just less sharded.

Parameters get their logical names where the layers create them
(moe_jax/layers/param_axes.py); `param_logical_axes` reads them from the
boxed params of model.init, and a parameter without names is an error.
Optimizer state mirrors the parameter shardings; the router state is
replicated (one [E] bias per MoE layer).

`use_mesh(mesh)` (jax.set_mesh) must be active while a step is traced, so
that layers can read the mesh with jax.sharding.get_abstract_mesh() (for
shard_map paths); `jit_in_mesh` does that for every call.

Ground floor: imports nothing of ours above config.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np
import optax
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from moe_jax.config_base import DEFAULT_RULES
from moe_jax.config_validation import MESH_AXES, ConfigError

PyTree = Any
Rules = Sequence[tuple[str, Any]]

# Logical axes of activations (resolved through the same rules).
BATCH_AXES = ("batch", "sequence")
HIDDEN_AXES = ("batch", "sequence", "act_embed")
LOGITS_AXES = ("batch", "sequence", "vocab")


# ----------------------------------------------------------------------------
# Mesh.
# ----------------------------------------------------------------------------


def mesh_shape(mesh_cfg, num_devices: int) -> dict[str, int]:
  """{axis: size} for config.mesh on num_devices devices; resolves data=-1.

  Raises:
    ConfigError naming the mesh fields when the sizes do not fit the devices.
  """
  sizes = {a: mesh_cfg[a] for a in MESH_AXES}
  for a, v in sizes.items():
    if isinstance(v, bool) or not isinstance(v, int) or not (
        v >= 1 or (a == "data" and v == -1)):
      allowed = "-1 or an integer >= 1" if a == "data" else "an integer >= 1"
      raise ConfigError(f"mesh.{a} must be {allowed}, got {v!r}")
  others = math.prod(v for a, v in sizes.items() if a != "data")
  if sizes["data"] == -1:
    if num_devices % others:
      raise ConfigError(
          f"mesh.fsdp * mesh.expert * mesh.context * mesh.tensor = {others} "
          f"must divide the device count {num_devices} when mesh.data=-1; "
          f"allowed products: the divisors of {num_devices}")
    sizes["data"] = num_devices // others
  total = math.prod(sizes.values())
  if total != num_devices:
    raise ConfigError(
        "mesh.data * mesh.fsdp * mesh.expert * mesh.context * mesh.tensor = "
        f"{' * '.join(str(sizes[a]) for a in MESH_AXES)} = {total} must equal "
        f"the device count {num_devices} (or set mesh.data=-1)")
  return sizes


def make_mesh(mesh_cfg, devices: Sequence[Any] | None = None) -> Mesh:
  """The ('data', 'fsdp', 'expert', 'context', 'tensor') mesh of config.mesh.

  All axes are Auto (GSPMD propagation; explicit sharding-in-types is not
  used), so layers written for one device run unchanged on the mesh.

  Args:
    mesh_cfg: config.mesh (mesh.num_devices = N > 0 takes the first N).
    devices: the devices to use, default jax.devices() (all processes').
  """
  devices = list(jax.devices() if devices is None else devices)
  n = mesh_cfg.get("num_devices", -1)
  if n != -1:
    if n > len(devices) or (jax.process_count() > 1 and n != len(devices)):
      allowed = (f"-1 or 1..{len(devices)}" if jax.process_count() == 1 else
                 f"-1 or {len(devices)} (every device of every process)")
      raise ConfigError(f"mesh.num_devices = {n}, but {len(devices)} devices "
                        f"are visible; allowed: {allowed}")
    devices = devices[:n]
  sizes = mesh_shape(mesh_cfg, len(devices))
  shape = tuple(sizes[a] for a in MESH_AXES)
  axis_type = getattr(jax.sharding, "AxisType", None)
  kwargs = ({"axis_types": (axis_type.Auto,) * len(MESH_AXES)}
            if axis_type is not None else {})
  return jax.make_mesh(shape, MESH_AXES, devices=devices, **kwargs)


def use_mesh(mesh: Mesh):
  """Context manager making `mesh` the current (abstract and concrete) mesh."""
  if hasattr(jax, "set_mesh"):
    return jax.set_mesh(mesh)
  if hasattr(jax.sharding, "use_mesh"):
    return jax.sharding.use_mesh(mesh)
  return mesh  # Old JAX: `with mesh:` sets the resource environment.


def jit_in_mesh(fn: Callable, mesh: Mesh, **jit_kwargs) -> Callable:
  """jax.jit(fn, **jit_kwargs), called (and traced) under use_mesh(mesh).

  The returned function also has `.lower(*args)` under the same mesh.
  """
  jitted = jax.jit(fn, **jit_kwargs)

  @functools.wraps(fn)
  def call(*args, **kwargs):
    with use_mesh(mesh):
      return jitted(*args, **kwargs)

  def lower(*args, **kwargs):
    with use_mesh(mesh):
      return jitted.lower(*args, **kwargs)

  call.lower = lower
  call.jitted = jitted
  return call


def init_distributed(coordinator_address: str | None,
                     num_processes: int | None,
                     process_id: int | None) -> bool:
  """jax.distributed.initialize when any multi-host setting is given.

  Must run before anything touches a JAX backend (experiments/train.py calls
  it first, from --coordinator_address, --num_processes, --process_id).
  Settings left out are auto-detected by JAX where the cluster supports it
  (e.g. SLURM).

  Returns:
    True when the distributed runtime was initialised, False when nothing
    was given (single process).

  Raises:
    ValueError naming the flag for an out-of-range value.
  """
  if (coordinator_address is None and num_processes is None
      and process_id is None):
    return False
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"--num_processes must be >= 1, got {num_processes}")
  if process_id is not None and (process_id < 0 or (
      num_processes is not None and process_id >= num_processes)):
    raise ValueError(f"--process_id must be in [0, {num_processes}), got "
                     f"{process_id}")
  try:  # collectives between CPU processes (tests, CPU clusters); the GPU
    # backend does not read this option.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  except (AttributeError, ValueError):  # pragma: no cover - older/newer jax
    pass
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes,
                             process_id=process_id)
  return True


# ----------------------------------------------------------------------------
# Logical axes -> PartitionSpec.
# ----------------------------------------------------------------------------


def rules_dict(rules: Rules | None) -> dict[str, tuple[str, ...]]:
  """{logical name: mesh axes tuple} from (name, None | axis | axes) pairs."""
  out = {}
  for name, axes in (DEFAULT_RULES if rules is None else rules):
    out[name] = (() if axes is None else
                 (axes,) if isinstance(axes, str) else tuple(axes))
  return out


_LOGGED: set = set()


def _log_once(message: str, warn: bool = False) -> None:
  if message not in _LOGGED:
    _LOGGED.add(message)
    (logging.warning if warn else logging.info)("%s", message)


def logical_to_spec(logical_axes: Sequence[str | None], shape: Sequence[int],
                    rules: Rules | None, mesh_sizes: Mapping[str, int],
                    what: str = "array", warn: bool = False) -> PartitionSpec:
  """PartitionSpec for an array of `shape` with one logical name per dim.

  Per dim, the rule's mesh axes are kept in order while their product divides
  the dim; an axis that does not divide it, is already used by an earlier dim,
  has size 1 or is not in the mesh is skipped (the dim is then replicated over
  it; a skipped axis of size > 1 is logged once).

  Args:
    logical_axes: one logical name (or None) per dim of `shape`.
    shape: the array's global shape.
    rules: (logical name, mesh axes) pairs; None = config_base.DEFAULT_RULES.
    mesh_sizes: {mesh axis: size} of the target mesh.
    what: the array's name, for the log.
    warn: log a skipped axis as a warning (params) rather than info.
  """
  if len(logical_axes) != len(shape):
    raise ValueError(f"{what}: {len(logical_axes)} logical axes "
                     f"{tuple(logical_axes)} for shape {tuple(shape)}")
  table = rules_dict(rules)
  used: set[str] = set()
  spec = []
  for dim, name in zip(shape, logical_axes):
    kept, prod = [], 1
    for axis in table.get(name, ()) if name is not None else ():
      size = mesh_sizes.get(axis, 1)
      if axis in used or size == 1:
        continue
      if dim % (prod * size):
        _log_once(f"sharding: {what} dim {name}={dim} is not divisible by "
                  f"{'*'.join(kept + [axis])}={prod * size}; replicated over "
                  f"mesh axis {axis!r}", warn)
        continue
      kept.append(axis)
      prod *= size
    used.update(kept)
    spec.append(None if not kept else kept[0] if len(kept) == 1
                else tuple(kept))
  while spec and spec[-1] is None:
    spec.pop()
  return PartitionSpec(*spec)


def _path_str(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "name", k)))
                  for k in path)


def _is_boxed(x) -> bool:
  return isinstance(x, nn.Partitioned)


def param_logical_axes(params: PyTree) -> PyTree:
  """Logical axes per parameter, as declared where the layer created it.

  Args:
    params: the 'params' tree of model.init (or of jax.eval_shape of it),
      whose leaves the layers boxed with their logical names
      (moe_jax.layers.param_axes.with_axes).

  Returns:
    The unboxed tree with a tuple of names (str or None) per leaf.

  Raises:
    ValueError naming every parameter created without logical axes (or with
    one name too many or too few).
  """
  bad = []

  def one(path, leaf):
    if not _is_boxed(leaf):
      bad.append(f"{_path_str(path)} {tuple(leaf.shape)}: no logical axes")
      return (None,) * len(leaf.shape)
    if len(leaf.names) != len(leaf.value.shape):
      bad.append(f"{_path_str(path)} {tuple(leaf.value.shape)}: logical "
                 f"axes {tuple(leaf.names)}")
    return tuple(leaf.names)

  axes = jax.tree_util.tree_map_with_path(one, params, is_leaf=_is_boxed)
  if bad:
    raise ValueError(
        "parameters need one logical axis name (or None) per dim, declared "
        "where the layer creates them (moe_jax.layers.param_axes.with_axes):"
        "\n  " + "\n  ".join(bad))
  return axes


def _mesh_sizes(mesh) -> dict[str, int]:
  return dict(mesh.shape)  # Mesh and AbstractMesh: {axis name: size}


def param_shardings(params: PyTree, mesh: Mesh,
                    rules: Rules | None) -> PyTree:
  """NamedSharding per parameter.

  Args:
    params: boxed params (arrays or ShapeDtypeStructs) as model.init makes
      them; see `param_logical_axes`.
    mesh: the target mesh.
    rules: (logical name, mesh axes) pairs; None = DEFAULT_RULES.

  Returns:
    The unboxed params tree with a NamedSharding per leaf.
  """
  sizes = _mesh_sizes(mesh)
  axes = param_logical_axes(params)
  return jax.tree_util.tree_map_with_path(
      lambda path, p, a: NamedSharding(mesh, logical_to_spec(
          a, p.shape, rules, sizes, _path_str(path), warn=True)),
      nn.meta.unbox(params), axes)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def opt_state_shardings(tx: optax.GradientTransformation, opt_state: PyTree,
                        params_shardings: PyTree, params: PyTree,
                        mesh: Mesh) -> PyTree:
  """Optimizer state shardings: param-shaped copies mirror the params.

  Uses optax.tree_utils.tree_map_params to find the copies of the param tree
  inside the state (Adam's mu and nu); every other leaf (counts, scalars) and
  any copy whose shape differs from its param is replicated.
  """
  rep = replicated(mesh)

  def mirror(leaf, sharding, param):
    return sharding if tuple(leaf.shape) == tuple(param.shape) else rep

  return optax.tree_utils.tree_map_params(
      tx, mirror, opt_state, params_shardings, params,
      transform_non_params=lambda _: rep)


def batch_sharding(mesh: Mesh, rules: Rules | None,
                   shape: Sequence[int]) -> NamedSharding:
  """Sharding of token batches [B, T]: ('batch', 'sequence')."""
  return NamedSharding(mesh, logical_to_spec(
      BATCH_AXES, shape, rules, _mesh_sizes(mesh), "batch"))


def shard_batch(batch: Mapping[str, np.ndarray], sharding: NamedSharding,
                global_batch_size: int) -> dict[str, jax.Array]:
  """Global arrays from this process's rows of a batch.

  Each process passes its own slice of the global batch (moe_jax.data gives
  process i rows [i * B / P, (i + 1) * B / P)); the loss is a mean over rows,
  so which global rows a process's devices hold does not matter, only that
  the processes together hold every row once.
  """
  out = {}
  for key, x in batch.items():
    x = np.asarray(x)
    global_shape = (global_batch_size,) + x.shape[1:]
    try:
      out[key] = jax.make_array_from_process_local_data(sharding, x,
                                                        global_shape)
    except ValueError as e:
      raise ValueError(
          f"cannot build the global batch {global_shape} from this process's "
          f"rows {x.shape} with sharding {sharding.spec}: with several "
          "processes the batch dim must be split over processes (mesh.rules "
          "'batch' axes dividing data.batch_size)") from e
  return out


# ----------------------------------------------------------------------------
# Activations.
# ----------------------------------------------------------------------------


def _manual_axes(mesh) -> set[str]:
  types = getattr(mesh, "axis_types", None)
  axis_type = getattr(jax.sharding, "AxisType", None)
  if types is None or axis_type is None:
    return set()
  return {a for a, t in zip(mesh.axis_names, types)
          if t == axis_type.Manual}


def constrain(x: jax.Array, logical_axes: Sequence[str | None],
              rules: Rules | None) -> jax.Array:
  """with_sharding_constraint by logical names under the current mesh.

  A no-op without a mesh (jax.set_mesh / use_mesh) or on a one-device mesh,
  so single-device code paths are unchanged. Manual axes (inside a
  shard_map) are left alone.

  Args:
    x: array with len(logical_axes) dims.
    logical_axes: e.g. HIDDEN_AXES.
    rules: (logical name, mesh axes) pairs; None = DEFAULT_RULES.
  """
  get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
  mesh = get_mesh() if get_mesh is not None else None
  if mesh is None or mesh.empty or math.prod(mesh.shape.values()) == 1:
    return x
  manual = _manual_axes(mesh)
  sizes = {a: s for a, s in _mesh_sizes(mesh).items() if a not in manual}
  spec = logical_to_spec(logical_axes, x.shape, rules, sizes,
                         f"activation {tuple(logical_axes)}")
  return jax.lax.with_sharding_constraint(x, spec)

