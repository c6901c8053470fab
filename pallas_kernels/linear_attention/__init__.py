"""GLA and KDA, linear attention with per-channel log decay (docs/design.md §4).

One folder per op, gla/ and kda/ (naive.py the references, chunk.py the Pallas
op, its kernels, tuning.py, step.py), common/ for what both share; ops.py is
the public API. The op functions `gla` and `kda` bound here hide the
subpackages' names as attributes of this package: import a folder's module by
its full path (`from pallas_kernels.linear_attention.kda import chunk`).
"""
import functools

from pallas_kernels.linear_attention import ops
from pallas_kernels.linear_attention.ops import (
    BACKENDS, CHUNK_SIZES, available_backends, gla, gla_step, kda, kda_step,
    register_backend)
from pallas_kernels.linear_attention.gla.naive import (
    chunk_gla_ref, naive_recurrent_gla, recurrent_step_gla)
from pallas_kernels.linear_attention.kda.naive import (
    chunk_kda_ref, naive_recurrent_kda, recurrent_step_kda)
from pallas_kernels.linear_attention.gla import chunk as _gla_chunk
from pallas_kernels.linear_attention.gla.step import gla_step_pallas
from pallas_kernels.linear_attention.kda import chunk as _kda_chunk
from pallas_kernels.linear_attention.kda.step import kda_step_pallas

_gla_chunk.register()  # "pallas" / "interpret" backends for gla
_kda_chunk.register()  # ... and for kda (forward and backward kernels)
# ... and the one-token decoding steps
ops.register_backend("pallas", gla_step=gla_step_pallas,
                     kda_step=kda_step_pallas)
ops.register_backend(
    "interpret",
    gla_step=functools.partial(gla_step_pallas, interpret=True),
    kda_step=functools.partial(kda_step_pallas, interpret=True))

__all__ = [
    "gla", "kda", "gla_step", "kda_step", "register_backend",
    "available_backends", "BACKENDS", "CHUNK_SIZES", "chunk_gla_ref",
    "chunk_kda_ref", "naive_recurrent_gla", "naive_recurrent_kda",
    "recurrent_step_gla", "recurrent_step_kda",
]
