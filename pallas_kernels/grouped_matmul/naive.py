"""Reference grouped matmul: one masked dense product per group.

Rows of `x` are sorted by group: group g owns rows [start_g, end_g) with
end_g = sum(group_sizes[:g+1]); rows past sum(group_sizes) belong to no group
and give zero rows (the convention of `jax.lax.ragged_dot`). O(E) times the
work of the grouped product: for tests on small shapes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def group_of_rows(group_sizes: jax.Array, m: int) -> jax.Array:
  """Group id of each of m rows (E for rows past the last group). int32 [m]."""
  ends = jnp.cumsum(group_sizes)
  return jnp.searchsorted(ends, jnp.arange(m), side="right").astype(jnp.int32)


def gmm_reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                  transpose_rhs: bool = False) -> jax.Array:
  """out[r] = x[r] @ w[g(r)] (or w[g(r)]^T), zero where r is in no group.

  Args:
    x: [M, K] rows sorted by group.
    w: [E, K, N] (transpose_rhs: [E, N, K]).
    group_sizes: int [E], sum <= M.
    transpose_rhs: multiply by each group's matrix transposed.

  Returns:
    [M, N] in x.dtype, accumulated in fp32.
  """
  if transpose_rhs:
    w = jnp.swapaxes(w, 1, 2)
  g = group_of_rows(group_sizes, x.shape[0])
  out = jnp.zeros((x.shape[0], w.shape[-1]), jnp.float32)
  for e in range(w.shape[0]):
    y = jnp.dot(x, w[e], preferred_element_type=jnp.float32)
    out = jnp.where((g == e)[:, None], y, out)
  return out.astype(x.dtype)


def tgmm_reference(x: jax.Array, dy: jax.Array,
                   group_sizes: jax.Array) -> jax.Array:
  """out[g] = x[rows of g]^T @ dy[rows of g]: the weight gradient. [E, K, N].

  Args:
    x: [M, K], dy: [M, N], rows sorted by group; group_sizes int [E].

  Returns:
    [E, K, N] fp32.
  """
  g = group_of_rows(group_sizes, x.shape[0])
  xf = x.astype(jnp.float32)
  return jnp.stack([
      jnp.dot(xf.T, jnp.where((g == e)[:, None], dy.astype(jnp.float32), 0.0))
      for e in range(group_sizes.shape[0])])
