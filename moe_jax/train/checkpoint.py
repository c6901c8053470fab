"""Orbax checkpoints: train state + data iterator state + config.

Saves are atomic (orbax writes to a temporary folder and renames it when
complete), so a crash mid-save leaves the last good checkpoint intact; the
loop never saves a state whose loss or gradients were not finite.

Sharded arrays are saved by every process (each writes its own shards; orbax
coordinates the commit, and the JSON items are written by the primary host
only), so `save` must be called on every process. A restore reads each array
into the sharding of its target (`with_shardings`), so a checkpoint written
on one mesh restores on another.
"""
from __future__ import annotations

import os
from typing import Any

import flax.linen as nn
import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Thin wrapper over ocp.CheckpointManager with our three items."""

  def __init__(self, workdir: str, keep: int = 2):
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        item_names=("state", "data", "config"),
    )

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: Any, data_state: dict,
           config_dict: dict) -> None:
    self.manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(config_dict)),
    )

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict, dict]:
    """Restores (state, data_state, config_dict) into abstract_state's layout.

    abstract_state: a pytree of jax.ShapeDtypeStruct (with shardings), e.g.
    from jax.eval_shape; restoring onto another mesh works by changing them.
    """
    restored = self.manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=ocp.args.JsonRestore(),
            config=ocp.args.JsonRestore()),
    )
    return restored.state, restored.data, restored.config

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def abstract_like(tree: Any) -> Any:
  """ShapeDtypeStructs (with shardings where known) for a concrete pytree."""
  def one(x):
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  return jax.tree_util.tree_map(one, tree)


def with_shardings(abstract: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs of `abstract` carrying the matching `shardings`.

  The restore target for another mesh: orbax reads each array straight into
  its target sharding, whatever the layout it was saved with. Logical-axes
  boxes in `abstract` (train.step.abstract_train_state) are dropped: the
  checkpoint holds plain arrays.
  """
  return jax.tree_util.tree_map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      nn.meta.unbox(abstract), shardings)
