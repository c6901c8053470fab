r"""Do two ways of running the training step compute the same step?

For each row (a set of config overrides, e.g. another grouped matmul or
linear-attention backend), from the same init and batches:
  1. one train step on batch 0. Its learning rate is 0 (the warmup starts at
     0), so the parameters must come out bit-identical; only the router bias
     moves (QB / sign rule). The largest parameter change and the leaves that
     changed are printed: anything but 0 is a bug of that path.
  2. the loss of batch 1 from a second train step, and from the row's own
     (non-donating) grad fn on the state after step 1.
Then, across rows: the relative L2 difference of the router state, the
parameters, the optimizer state and the gradients of both batches against
the last row; and every row's grad fn evaluated on every row's state after
step 1. When the grad fns agree on each state but the states differ, the
forward and backward agree and the step itself (its update or its buffers)
is what differs.

  python -m experiments.check_train_step --config=configs/gpu_small.py \
      --rows=model.moe.grouped_matmul=pallas,model.moe.grouped_matmul=ragged_dot
  python -m experiments.check_train_step --config=configs/gpu_small.py \
      --rows=model.kda.backend=pallas,model.kda.backend=xla --nodonate

A row may set several fields, joined by '+':
  --rows=model.kda.backend=xla+model.moe.grouped_matmul=ragged_dot,...
On a CPU use the interpret paths with a tiny config, e.g.
  --config=configs/default.py:tiny,smoke
  --rows=model.moe.grouped_matmul=interpret,model.moe.grouped_matmul=ragged_dot
"""
from __future__ import annotations

import time

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/gpu_small.py", "Config file (path.py[:variants]).",
    lock_config=False)
_ROWS = flags.DEFINE_list(
    "rows", ["model.moe.grouped_matmul=pallas",
             "model.moe.grouped_matmul=ragged_dot"],
    "Rows: dotted.field=value overrides, several per row joined by '+'.")
_BATCH = flags.DEFINE_integer("batch_size", 0, "Batch size; 0 = the "
                              "config's.")
_DONATE = flags.DEFINE_bool("donate", True, "Donate the state to the step "
                            "(as the training loop does).")


def parse_row(row: str) -> list[tuple[str, str]]:
  """'a.b=1+c.d=x' -> [('a.b', '1'), ('c.d', 'x')]."""
  pairs = []
  for item in row.split("+"):
    field, sep, value = item.partition("=")
    if not sep or not field:
      raise app.UsageError(f"--rows entry {item!r} is not dotted.field=value")
    pairs.append((field.strip(), value.strip()))
  return pairs


def apply_row(config, pairs):
  """A copy of config with the row's overrides, typed like the fields."""
  c = config.copy_and_resolve_references()
  for field, value in pairs:
    *parents, leaf = field.split(".")
    node = c
    for p in parents:
      node = node[p]
    if leaf not in node:
      raise app.UsageError(f"--rows: no config field {field!r}")
    old = node[leaf]
    node[leaf] = (value if isinstance(old, str) else
                  (value.lower() in ("1", "true")) if isinstance(old, bool)
                  else type(old)(value))
  return c


def rel_l2(a: list, b: list) -> float:
  """||a - b|| / ||b|| over lists of arrays."""
  import numpy as np
  num = sum(float(np.sum((x - y) ** 2)) for x, y in zip(a, b))
  den = sum(float(np.sum(y ** 2)) for y in b) or 1.0
  return float(np.sqrt(num / den))


def run_row(config, batches, donate: bool) -> dict:
  """Two train steps of one row; host copies of what the report compares."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from moe_jax.config_validation import validate_config
  from moe_jax.train.loop import build_train_step
  from moe_jax.train.step import init_train_state, make_grad_fn, make_train_step

  validate_config(config)
  setup = build_train_step(config)
  step = setup.train_step
  if not donate:
    step = jax.jit(make_train_step(setup.model, setup.tx, config.model.moe))
  state = init_train_state(setup.model, setup.tx, setup.rng,
                           config.data.seq_len,
                           shardings=setup.state_shardings)
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_leaves_with_path(state.params)]
  host = lambda t: [np.asarray(x, np.float64) for x in jax.tree.leaves(t)]  # noqa: E731
  grad_fn = jax.jit(make_grad_fn(setup.model, config.model.moe))
  p0 = host(state.params)
  (_, *_), g0 = grad_fn(state.params, state.router_state, batches[0])
  g0 = host(g0)
  state, m0 = step(state, batches[0])
  p1 = host(state.params)
  kept = jax.tree.map(jnp.copy, (state.params, state.router_state))
  (loss1_fn, *_), g1 = grad_fn(state.params, state.router_state, batches[1])
  out = dict(
      loss0=float(m0["loss"]), lr0=float(m0.get("lr", float("nan"))),
      router1=host(state.router_state), opt1=host(state.opt_state),
      params1=p1, grads0=g0, grads1=host(g1), loss1_fn=float(loss1_fn),
      state1=kept, grad_fn=grad_fn)
  changes = [(float(np.max(np.abs(a - b))) if a.size else 0.0, path)
             for a, b, path in zip(p1, p0, paths)]
  out["param_change"] = max(c for c, _ in changes)
  out["changed_leaves"] = sorted((c for c in changes if c[0] > 0),
                                 reverse=True)
  state, m1 = step(state, batches[1])
  out["loss1"] = float(m1["loss"])
  return out


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  from moe_jax.data import make_datasets

  config = _CONFIG.value
  if _BATCH.value:
    config.data.batch_size = _BATCH.value
  train_iter, *_ = make_datasets(dict(config.data.to_dict(),
                                      seed=config.seed))
  batches = [jax.tree.map(jnp.asarray, next(train_iter)) for _ in range(2)]
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"batch {config.data.batch_size} x {config.data.seq_len}, donate "
        f"{_DONATE.value}", flush=True)
  rows, t0 = {}, time.time()
  for row in _ROWS.value:
    r = run_row(apply_row(config, parse_row(row)), batches, _DONATE.value)
    rows[row] = r
    top = ", ".join(f"{p} {c:.2e}" for c, p in r["changed_leaves"][:3])
    print(f"{row}: loss0 {r['loss0']:.6f} (lr {r['lr0']:g}), loss1 "
          f"{r['loss1']:.6f} (grad fn {r['loss1_fn']:.6f}), params changed "
          f"at lr 0 by {r['param_change']:.3e} in "
          f"{len(r['changed_leaves'])} leaves{': ' + top if top else ''} "
          f"[{time.time() - t0:.0f} s]", flush=True)
  names = list(rows)
  ref = rows[names[-1]]
  for name in names[:-1]:
    r = rows[name]
    print(f"{name} vs {names[-1]}: " + ", ".join(
        f"{key} {rel_l2(r[key], ref[key]):.2e}" for key in
        ("router1", "params1", "opt1", "grads0", "grads1")))
  for a in names:
    for b in names:
      (loss, *_), _ = rows[a]["grad_fn"](*rows[b]["state1"], batches[1])
      print(f"grad fn of {a} on the state of {b}: loss1 {float(loss):.6f}")


if __name__ == "__main__":
  app.run(main)
