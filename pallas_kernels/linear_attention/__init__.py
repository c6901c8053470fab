"""Chunked linear attention (GLA, KDA) with per-channel log decay. docs/design.md §4."""
from pallas_kernels.linear_attention.ops import (
    BACKENDS, CHUNK_SIZES, available_backends, gla, gla_step, kda, kda_step,
    register_backend)
from pallas_kernels.linear_attention.reference import (
    chunk_gla_ref, chunk_kda_ref, naive_recurrent_gla, naive_recurrent_kda,
    recurrent_step_gla, recurrent_step_kda)
from pallas_kernels.linear_attention import gla_pallas as _gla_pallas
from pallas_kernels.linear_attention import kda_pallas as _kda_pallas
from pallas_kernels.linear_attention import step_pallas as _step_pallas

_gla_pallas.register()  # "pallas" / "interpret" backends for gla
_kda_pallas.register()  # ... and for kda (forward and backward kernels)
_step_pallas.register()  # ... and the one-token decoding steps

__all__ = [
    "gla", "kda", "gla_step", "kda_step", "register_backend",
    "available_backends", "BACKENDS", "CHUNK_SIZES", "chunk_gla_ref",
    "chunk_kda_ref", "naive_recurrent_gla", "naive_recurrent_kda",
    "recurrent_step_gla", "recurrent_step_kda",
]
