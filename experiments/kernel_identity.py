r"""Outputs and gradients of the linear-attention ops, saved for a bit-exact
comparison between two versions of the kernel package (CPU, interpret mode).

For both ops (GLA, KDA), both dtypes (fp32, bf16) and every path (the Pallas
kernels in interpret mode, bounded and unbounded, and the XLA chunked
reference), on fixed seeds and tiny shapes (T=130: three chunks, the last a
partial tile; K=32, V=32; an initial state), records the output, the final
state and the gradients w.r.t. every input (q, k, v, g, [beta,] initial
state) for fixed cotangents, and the one-token steps. A refactor that moves
code without changing what it computes must reproduce every array exactly:

  PYTHONPATH=. python -m experiments.kernel_identity --save=/tmp/before.npz
  ... (move the code) ...
  PYTHONPATH=. python -m experiments.kernel_identity --save=/tmp/after.npz \
      --compare=/tmp/before.npz

The comparison is np.array_equal per array (bf16 values are stored as their
exact fp32 upcast); it prints the arrays that differ and exits 1 if any.
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.linear_attention import gla, gla_step, kda, kda_step

SHAPE = dict(b=1, t=130, h=2, dk=32, dv=32)
G_MIN = -5.0
# (backend, g_min): the kernels' two intra-chunk paths and the XLA oracle.
PATHS = {"interpret_bounded": ("interpret", G_MIN),
         "interpret_unbounded": ("interpret", None),
         "xla": ("xla", G_MIN)}
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


def make_inputs(seed, b, t, h, dk, dv):
  """q, k, v, g, beta, s0 fp32 (k l2-normalised, g in [G_MIN, 0))."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape)  # noqa: E731
  sigmoid = lambda x: 1.0 / (1.0 + np.exp(-x))  # noqa: E731
  k = normal(b, t, h, dk)
  k = k / np.linalg.norm(k, axis=-1, keepdims=True)
  arrays = (normal(b, t, h, dk), k, normal(b, t, h, dv),
            G_MIN * sigmoid(2.0 * normal(b, t, h, dk) - 2.0),
            sigmoid(normal(b, t, h)), 0.5 * normal(b, h, dk, dv))
  return tuple(jnp.asarray(a, jnp.float32) for a in arrays)


def _arrays(prefix, names, values):
  return {f"{prefix}/{n}": np.asarray(jnp.asarray(x, jnp.float32))
          for n, x in zip(names, values)}


def op_results(op, dtype_name, path):
  """{name: array} of one (op, dtype, path): o, final state, gradients."""
  dtype = DTYPES[dtype_name]
  backend, g_min = PATHS[path]
  q, k, v, g, beta, s0 = make_inputs(0, **SHAPE)
  q, k, v = (x.astype(dtype) for x in (q, k, v))
  rng = np.random.default_rng(1)
  do = jnp.asarray(rng.standard_normal(v.shape), jnp.float32).astype(dtype)
  ds = jnp.asarray(rng.standard_normal(s0.shape), jnp.float32)
  if op == "kda":
    fn = lambda q, k, v, g, beta, s0: kda(  # noqa: E731
        q, k, v, g, beta, initial_state=s0, backend=backend, g_min=g_min)
    args, names = (q, k, v, g, beta, s0), ("q", "k", "v", "g", "beta", "s0")
  else:
    fn = lambda q, k, v, g, s0: gla(  # noqa: E731
        q, k, v, g, initial_state=s0, backend=backend, g_min=g_min)
    args, names = (q, k, v, g, s0), ("q", "k", "v", "g", "s0")
  (o, s_final), vjp = jax.vjp(fn, *args)
  grads = vjp((do, ds))
  prefix = f"{op}/{dtype_name}/{path}"
  return {**_arrays(prefix, ("o", "final_state"), (o, s_final)),
          **_arrays(prefix, tuple("d" + n for n in names), grads)}


def step_results(op, dtype_name):
  """{name: array}: one decoding step on the interpret backend."""
  dtype = DTYPES[dtype_name]
  q, k, v, g, beta, s0 = make_inputs(2, **dict(SHAPE, t=1))
  q, k, v = (x[:, 0].astype(dtype) for x in (q, k, v))
  g, beta = g[:, 0], beta[:, 0]
  if op == "kda":
    o, s = kda_step(q, k, v, g, beta, s0, backend="interpret")
  else:
    o, s = gla_step(q, k, v, g, s0, backend="interpret")
  return _arrays(f"{op}_step/{dtype_name}", ("o", "state"), (o, s))


def all_results():
  out = {}
  for op in ("gla", "kda"):
    for dtype_name in DTYPES:
      for path in PATHS:
        out.update(op_results(op, dtype_name, path))
        print("done", op, dtype_name, path, flush=True)
      out.update(step_results(op, dtype_name))
  return out


def compare(got, want):
  """Names of the arrays that differ (or are missing on one side)."""
  bad = sorted(set(got) ^ set(want))
  bad += [n for n in sorted(set(got) & set(want))
          if not np.array_equal(got[n], want[n], equal_nan=True)]
  return bad


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--save", required=True, help="npz file to write")
  parser.add_argument("--compare", default=None,
                      help="npz file of another version to compare with")
  args = parser.parse_args(argv)
  results = all_results()
  np.savez(args.save, **results)
  print(f"saved {len(results)} arrays to {args.save}")
  if args.compare:
    with np.load(args.compare) as f:
      want = dict(f)
    bad = compare(results, want)
    for name in bad:
      print("differs:", name)
    print(f"bit-identical: {'yes' if not bad else 'no'} "
          f"({len(results)} arrays)")
    return 1 if bad else 0
  return 0


if __name__ == "__main__":
  sys.exit(main())
