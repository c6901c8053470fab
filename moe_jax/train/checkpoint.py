"""Orbax checkpoints: train state + data iterator state + config, verified.

Saves are atomic (orbax writes to a temporary folder and renames it when
complete), so a crash mid-save leaves the last good checkpoint intact; the
loop never saves a state whose loss or gradients were not finite. Once a
save is complete, the primary process writes `checksums.json` into the step
folder: the size and SHA-256 of every file of the checkpoint. A restore
verifies them first, so flipped, truncated or missing files are found before
any of them is read as state.

`restore_latest` tries the newest checkpoint first and on a failed check or
restore logs one line and tries the next older one. Damaged checkpoints are
never deleted: once an older one restores, they are moved to
`<workdir>/checkpoints_damaged/` (the run would otherwise save over their
step numbers). When none restores, one `CheckpointError` names each failure
and nothing is moved.

Sharded arrays are saved by every process (each writes its own shards; orbax
coordinates the commit, and the JSON items are written by the primary host
only), so `save` must be called on every process. A restore reads each array
into the sharding of its target (`with_shardings`), so a checkpoint written
on one mesh restores on another.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any, Callable

import flax.linen as nn
import jax
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

CHECKSUMS = "checksums.json"
DAMAGED_DIR = "checkpoints_damaged"


class CheckpointError(RuntimeError):
  """No checkpoint of a workdir restores; the message names each failure."""


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def _files(step_dir: str) -> list[str]:
  """Paths of every file under step_dir, relative to it, sorted."""
  out = []
  for root, _, names in os.walk(step_dir):
    for name in names:
      out.append(os.path.relpath(os.path.join(root, name), step_dir))
  return sorted(p for p in out if p != CHECKSUMS)


def write_checksums(step_dir: str) -> None:
  """Records {relative path: {size, sha256}} of step_dir's files, atomically."""
  files = {p: {"size": os.path.getsize(os.path.join(step_dir, p)),
               "sha256": _sha256(os.path.join(step_dir, p))}
           for p in _files(step_dir)}
  tmp = os.path.join(step_dir, CHECKSUMS + ".tmp")
  with open(tmp, "w") as f:
    json.dump({"files": files}, f, indent=0, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, os.path.join(step_dir, CHECKSUMS))


def verify_checksums(step_dir: str) -> str | None:
  """None if every recorded file matches, else what is wrong (one line).

  A checkpoint without checksums.json (the process died between orbax's
  commit and the checksums) is accepted: orbax committed it whole.
  """
  path = os.path.join(step_dir, CHECKSUMS)
  if not os.path.exists(path):
    logging.warning("%s has no %s; restoring it unverified", step_dir,
                    CHECKSUMS)
    return None
  try:
    with open(path) as f:
      files = json.load(f)["files"]
  except (OSError, ValueError, KeyError) as e:
    return f"unreadable {CHECKSUMS} ({e})"
  for rel, want in sorted(files.items()):
    full = os.path.join(step_dir, rel)
    if not os.path.isfile(full):
      return f"missing file {rel}"
    size = os.path.getsize(full)
    if size != want["size"]:
      return f"{rel} has {size} bytes, {want['size']} were written"
    if _sha256(full) != want["sha256"]:
      return f"{rel} does not match its SHA-256 checksum"
  return None


def _one_line(e: BaseException, limit: int = 200) -> str:
  text = " ".join(str(e).split())
  text = text if len(text) <= limit else text[:limit] + "..."
  return f"{type(e).__name__}: {text}"


class Checkpointer:
  """Thin wrapper over ocp.CheckpointManager with our three items."""

  def __init__(self, workdir: str, keep: int = 2):
    self.workdir = os.path.abspath(workdir)
    self.directory = os.path.join(self.workdir, "checkpoints")
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        item_names=("state", "data", "config"),
    )

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def save(self, step: int, state: Any, data_state: dict,
           config_dict: dict) -> None:
    """Saves and returns once the checkpoint and its checksums are written."""
    self.manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(config_dict)),
    )
    # The checksums cover the committed files, so wait for the commit (all
    # processes; orbax syncs them) before the primary reads them back.
    self.manager.wait_until_finished()
    if jax.process_index() == 0:
      write_checksums(self.step_dir(step))

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict, dict]:
    """Restores (state, data_state, config_dict) into abstract_state's layout.

    abstract_state: a pytree of jax.ShapeDtypeStruct (with shardings), e.g.
    from jax.eval_shape; restoring onto another mesh works by changing them.
    Does not verify checksums (`restore_latest` does).
    """
    restored = self.manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=ocp.args.JsonRestore(),
            config=ocp.args.JsonRestore()),
    )
    return restored.state, restored.data, restored.config

  def saved_config(self, step: int) -> dict:
    """The config dict saved with `step` (reads no state)."""
    return self.manager.restore(
        step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config

  def restore_latest(
      self, abstract_state: Any,
      check_config: Callable[[int, dict], None] | None = None,
  ) -> tuple[int, Any, dict, dict] | None:
    """(step, state, data_state, config_dict) of the newest good checkpoint.

    Args:
      abstract_state: restore target, as for `restore`.
      check_config: called with (step, saved config dict) after the step's
        checksums pass and before its state is read; what it raises (e.g. a
        config that changes the state's shapes) propagates unchanged.

    Returns:
      None when the workdir has no checkpoint.

    Raises:
      CheckpointError: checkpoints exist and none restores.
    """
    steps = sorted(self.manager.all_steps(), reverse=True)
    failures = []
    for step in steps:
      problem = verify_checksums(self.step_dir(step))
      if problem is None:
        try:
          config_dict = self.saved_config(step)
        except Exception as e:  # pylint: disable=broad-except
          problem = f"config unreadable ({_one_line(e)})"
      if problem is None:
        if check_config is not None:
          check_config(step, config_dict)
        try:
          state, data_state, config_dict = self.restore(step, abstract_state)
        except Exception as e:  # pylint: disable=broad-except
          problem = f"restore failed ({_one_line(e)})"
      if problem is None:
        self._move_aside([s for s, _ in failures], failures)
        return step, state, data_state, config_dict
      logging.warning("Checkpoint %s is damaged: %s; trying the next older "
                      "one", self.step_dir(step), problem)
      failures.append((step, problem))
    if not failures:
      return None
    raise CheckpointError(
        f"no checkpoint in {self.directory} restores: " + "; ".join(
            f"step {s}: {p}" for s, p in failures) + ". Nothing was moved or "
        "deleted; move the damaged steps away to start over from an older "
        "one, or use a new --workdir")

  def _move_aside(self, steps: list[int], failures: list) -> None:
    """Moves damaged step folders to <workdir>/checkpoints_damaged/."""
    if not steps:
      return
    multi = jax.process_count() > 1
    if multi:  # Every process has finished reading before anything moves.
      multihost_utils.sync_global_devices("moe_jax_checkpoint_move_aside")
    if jax.process_index() == 0:
      reasons = dict(failures)
      for step in steps:
        dest = os.path.join(self.workdir, DAMAGED_DIR, str(step))
        n = 1
        while os.path.exists(dest):  # An earlier damaged copy of this step.
          n += 1
          dest = os.path.join(self.workdir, DAMAGED_DIR, f"{step}-{n}")
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.move(self.step_dir(step), dest)
        with open(os.path.join(dest, "DAMAGED.txt"), "w") as f:
          f.write(reasons[step] + "\n")
        logging.warning("Moved damaged checkpoint %d to %s", step, dest)
    if multi:
      multihost_utils.sync_global_devices("moe_jax_checkpoint_moved_aside")
    self.manager.reload()

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
