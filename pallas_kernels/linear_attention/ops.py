"""Public linear-attention ops: GLA and KDA with per-channel log decay.

    o, final_state = gla(q, k, v, g, ...)
    o, final_state = kda(q, k, v, g, beta, ...)
    o, new_state   = gla_step(q, k, v, g, state) / kda_step(q, k, v, g, beta, state)
                     (one token, decoding; q, k, g [B, H, K], states fp32)

Shapes (docs/design.md §4): q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H];
states [B, H, K, V] fp32. o comes back in v.dtype, states in fp32.

Backends. "xla" runs the pure-JAX chunked oracle (gla/naive.py, kda/naive.py: chunk_*_ref),
which is safe for any g <= 0. "pallas" (GPU) and "interpret" (the same Pallas
kernels interpreted on CPU) are filled in by a kernel module calling
register_backend(...) at import; until then they raise NotImplementedError.
"auto" picks "pallas" on a GPU when the Pallas kernel accepts the call (see
_resolve), else "xla".
"""
from __future__ import annotations

import functools
import inspect
import logging
import math
import numbers
from typing import Callable, Dict, Mapping, Optional

import jax
import numpy as np

from pallas_kernels.linear_attention.gla.naive import (
    chunk_gla_ref, recurrent_step_gla)
from pallas_kernels.linear_attention.kda.naive import (
    chunk_kda_ref, recurrent_step_kda)

BACKENDS = ("auto", "xla", "pallas", "interpret")
CHUNK_SIZES = (16, 32, 64, 128)
OPS = ("gla", "kda")
_LOG = logging.getLogger(__name__)

# backend -> op name -> implementation. An implementation has the signature
#   impl(q, k, v, g, [beta,] *, scale, initial_state, chunk_size, g_min)
#     -> (o [B, T, H, V] in v.dtype, final_state [B, H, K, V] fp32)
# and receives already validated inputs. g_min is None (no bound promised) or
# a float < 0 that the caller guarantees g >= g_min (the bounded-decay
# contract a kernel may exploit for dense diagonal tiles, docs/design.md §3).
# An implementation that takes packed documents also has the keyword
# segment_ids ([B, T] int, passed only when not None).
_IMPLS: Dict[str, Dict[str, Callable]] = {}


def register_backend(backend: str, *, gla: Optional[Callable] = None,
                     kda: Optional[Callable] = None,
                     gla_step: Optional[Callable] = None,
                     kda_step: Optional[Callable] = None) -> None:
  """Registers implementations of the ops for a backend (kernel modules call this).

  The one-token steps have the signature
    step(q, k, v, g, [beta,] state, *, scale) -> (o [B, H, V], new_state fp32).
  """
  if backend not in BACKENDS or backend == "auto":
    raise ValueError(f"backend must be one of {BACKENDS[1:]}, got {backend!r}")
  table = _IMPLS.setdefault(backend, {})
  for name, fn in (("gla", gla), ("kda", kda), ("gla_step", gla_step),
                   ("kda_step", kda_step)):
    if fn is not None:
      table[name] = fn


def available_backends(op: str) -> tuple:
  """Backends with an implementation registered for op ("gla" | "kda")."""
  return tuple(b for b in BACKENDS[1:] if op in _IMPLS.get(b, {}))


def _xla_gla(q, k, v, g, *, scale, initial_state, chunk_size, g_min,
             segment_ids=None):
  del g_min  # the oracle is safe for any g <= 0; the bound buys it nothing
  return chunk_gla_ref(q, k, v, g, scale=scale, initial_state=initial_state,
                       chunk_size=chunk_size, segment_ids=segment_ids)


def _xla_kda(q, k, v, g, beta, *, scale, initial_state, chunk_size, g_min,
             segment_ids=None):
  del g_min
  return chunk_kda_ref(q, k, v, g, beta, scale=scale,
                       initial_state=initial_state, chunk_size=chunk_size,
                       segment_ids=segment_ids)


register_backend("xla", gla=_xla_gla, kda=_xla_kda,
                 gla_step=recurrent_step_gla, kda_step=recurrent_step_kda)


# Ops whose Pallas kernel has only the bounded path (g_min required).
_BOUNDED_ONLY: set = set()
KERNEL_CHUNK = 64        # the Pallas kernels' chunk length
KERNEL_G_MIN_LOWEST = -5.5  # the bounded kernels' lowest g_min (16-row tiles)


def set_bounded_only(op: str, bounded_only: bool) -> None:
  """Kernel modules declare whether their Pallas op lacks the unbounded path."""
  (_BOUNDED_ONLY.add if bounded_only else _BOUNDED_ONLY.discard)(op)


_FALLBACKS_LOGGED: set = set()


def _log_g_min_fallback(op: str, g_min: float, *, bounded_only: bool) -> None:
  """Logs once per (op, g_min) that "auto" skips the bounded kernel."""
  if (op, g_min) in _FALLBACKS_LOGGED:
    return
  _FALLBACKS_LOGGED.add((op, g_min))
  instead = ("the XLA reference" if bounded_only else
             "the unbounded Pallas path (g_min=None, slower)")
  _LOG.warning(
      "%s: g_min=%s is outside [%s, 0), the range the bounded Pallas kernels "
      "accept; backend='auto' runs %s instead", op, g_min,
      KERNEL_G_MIN_LOWEST, instead)


def _resolve(op: str, backend: str, *, chunk_size: int = 64,
             g_min: Optional[float] = None, dims=(16, 16)):
  """(implementation, g_min to pass) for op and backend.

  "auto" picks the Pallas kernel on a GPU whenever it accepts the call
  (chunk 64, K and V multiples of 16 up to 256): the bounded path when g_min
  is within the kernels' safe range [KERNEL_G_MIN_LOWEST, 0), else the
  unbounded (position-pair) path with g_min=None if the op has one; otherwise
  the XLA oracle. Skipping the bounded kernel for a g_min below the range is
  logged once per (op, g_min).
  """
  if not isinstance(backend, str) or backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if backend == "auto":
    backend = "xla"
    on_gpu = jax.default_backend() == "gpu"
    fits = (chunk_size == KERNEL_CHUNK
            and all(d % 16 == 0 and 0 < d <= 256 for d in dims))
    if on_gpu and fits and op in _IMPLS.get("pallas", {}):
      if g_min is not None and g_min >= KERNEL_G_MIN_LOWEST:
        backend = "pallas"
      else:
        if g_min is not None:
          _log_g_min_fallback(op, g_min, bounded_only=op in _BOUNDED_ONLY)
        if op not in _BOUNDED_ONLY:
          backend, g_min = "pallas", None
  impl = _IMPLS.get(backend, {}).get(op)
  if impl is None:
    raise NotImplementedError(
        f"{op}: backend={backend!r} has no implementation registered; "
        f"available: {available_backends(op)}")
  return impl, g_min


def _shape(x):
  return tuple(getattr(x, "shape", ()))


# The keywords every implementation takes; the rest of a Pallas kernel's
# keyword-only parameters are its options (pallas_options).
_OP_KEYWORDS = ("scale", "initial_state", "chunk_size", "g_min")


def _with_pallas_options(op: str, impl: Callable, options) -> Callable:
  """impl with `options` bound when it is a Pallas kernel ("pallas" or
  "interpret" backend); the XLA oracle has no such options and ignores them
  (so one config runs on a GPU and, through "auto", on CPU). ValueError
  naming the unknown keys and the allowed ones."""
  if options is None:
    return impl
  if not isinstance(options, Mapping):
    raise ValueError("pallas_options must be None or a dict of the Pallas "
                     f"kernel's keyword options, got {options!r}")
  pallas = [_IMPLS.get(b, {}).get(op) for b in ("pallas", "interpret")]
  if not options or impl not in pallas:
    return impl
  allowed = [name for name, p in inspect.signature(impl).parameters.items()
             if p.kind == p.KEYWORD_ONLY and name not in _OP_KEYWORDS
             and name not in ("interpret", "segment_ids")]
  bad = sorted(set(options) - set(allowed))
  if bad:
    raise ValueError(f"pallas_options: unknown option(s) {bad} for {op}; "
                     f"allowed: {', '.join(allowed)}")
  return functools.partial(impl, **options)


def check_shapes(q, k, v, g, beta, initial_state, *, need_beta=False):
  """Shape checks shared by the ops and the kernels; returns (B, H, K, V).

  beta is checked when given (KDA; need_beta: it must be given).
  """
  if len(_shape(q)) != 4:
    raise ValueError(f"q must have rank 4 [B, T, H, K], got shape {_shape(q)}")
  bsz, t, h, dk = _shape(q)
  for name, x in (("k", k), ("g", g)):
    if _shape(x) != _shape(q):
      raise ValueError(f"{name} must have the same shape as q [B, T, H, K]="
                       f"{_shape(q)}, got {_shape(x)}")
  if len(_shape(v)) != 4 or _shape(v)[:3] != (bsz, t, h):
    raise ValueError(f"v must have shape [B, T, H, V] with [B, T, H]="
                     f"{(bsz, t, h)} as in q, got {_shape(v)}")
  dv = _shape(v)[3]
  if (beta is not None or need_beta) and _shape(beta) != (bsz, t, h):
    raise ValueError(f"beta must have shape [B, T, H]={(bsz, t, h)}, got "
                     f"{_shape(beta)}")
  if initial_state is not None and _shape(initial_state) != (bsz, h, dk, dv):
    raise ValueError(f"initial_state must have shape [B, H, K, V]="
                     f"{(bsz, h, dk, dv)}, got {_shape(initial_state)}")
  return bsz, h, dk, dv


def _validate(q, k, v, g, beta, initial_state, chunk_size, g_min):
  """Static checks only (shapes and python options); g values are traced."""
  check_shapes(q, k, v, g, beta, initial_state)
  if (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
      or chunk_size not in CHUNK_SIZES):
    raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got "
                     f"{chunk_size!r}")
  if isinstance(g, (np.ndarray, jax.Array)) and not isinstance(
      g, jax.core.Tracer):
    # Concrete inputs only (eager calls, or constants closed over by a jit):
    # traced values cannot be checked without a host sync inside jit. numpy
    # does the max so that nothing is staged into an enclosing trace.
    g_max = float(np.max(np.asarray(g, np.float32))) if g.size else 0.0
    if not g_max <= 0.0:
      raise ValueError(f"g is a log decay and must be <= 0 everywhere, got "
                       f"max(g)={g_max}")
  if g_min is not None:
    if (isinstance(g_min, bool) or not isinstance(g_min, numbers.Real)
        or not math.isfinite(g_min) or not g_min < 0):
      raise ValueError("g_min must be None or a python float < 0 (the "
                       f"bounded-decay lower bound of g), got {g_min!r}")
    g_min = float(g_min)
  return g_min


def _with_documents(op: str, impl: Callable, backend: str, segment_ids,
                    q_shape) -> dict:
  """The segment_ids keyword for impl ({} when segment_ids is None);
  ValueError for a shape other than [B, T], NotImplementedError for an
  implementation without packed documents."""
  if segment_ids is None:
    return {}
  if _shape(segment_ids) != q_shape[:2]:
    raise ValueError(f"segment_ids must have shape [B, T]={q_shape[:2]}, "
                     f"got {_shape(segment_ids)}")
  if "segment_ids" not in inspect.signature(impl).parameters:
    raise NotImplementedError(
        f"{op}: backend={backend!r} resolved to an implementation without "
        "packed documents (segment_ids); use backend 'xla', 'pallas' or "
        "'interpret'")
  return dict(segment_ids=segment_ids)


def gla(q, k, v, g, *, scale=None, initial_state=None, backend="auto",
        chunk_size=64, g_min=None, pallas_options=None, segment_ids=None):
  """Gated linear attention, S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T, o_t = scale S_t^T q_t.

  Args:
    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log decay <= 0 (fp32).
    scale: query scale, default K**-0.5.
    initial_state: [B, H, K, V] or None (zeros).
    backend: "auto" | "xla" | "pallas" | "interpret".
    chunk_size: 16, 32, 64 or 128.
    g_min: None, or a python float < 0 promising g >= g_min (bounded decay).
    pallas_options: keyword options of the Pallas kernel (gla/chunk.py:
      tune, a gla.tuning.Tuning; bounded), used when the call runs it;
      ignored by the XLA oracle.
    segment_ids: [B, T] int or None: packed documents, as in `kda`.
  Returns:
    o [B, T, H, V] in v.dtype, final state [B, H, K, V] fp32 (of the row's
    last document).
  """
  g_min = _validate(q, k, v, g, None, initial_state, chunk_size, g_min)
  impl, g_min = _resolve("gla", backend, chunk_size=chunk_size, g_min=g_min,
                         dims=(_shape(q)[3], _shape(v)[3]))
  impl = _with_pallas_options("gla", impl, pallas_options)
  documents = _with_documents("gla", impl, backend, segment_ids, _shape(q))
  return impl(q, k, v, g, scale=scale, initial_state=initial_state,
              chunk_size=chunk_size, g_min=g_min, **documents)


def kda(q, k, v, g, beta, *, scale=None, initial_state=None, backend="auto",
        chunk_size=64, g_min=None, pallas_options=None, segment_ids=None):
  """Kimi delta attention (gated delta rule with per-channel decay).

  S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,
  o_t = scale S_t^T q_t. k is expected l2-normalised and beta in (0, 1) for a
  contractive update (not checked).

  Args:
    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log decay <= 0 (fp32);
    beta: [B, T, H].
    scale: query scale, default K**-0.5.
    initial_state: [B, H, K, V] or None (zeros).
    backend: "auto" | "xla" | "pallas" | "interpret".
    chunk_size: 16, 32, 64 or 128.
    g_min: None, or a python float < 0 promising g >= g_min (bounded decay).
    pallas_options: keyword options of the Pallas kernel (kda/chunk.py:
      tune, a kda.tuning.Tuning; bounded), used when the call runs it;
      ignored by the XLA oracle.
    segment_ids: [B, T] int or None: packed documents (a document is a
      contiguous run of equal ids, as fla's cu_seqlens delimits them); the
      state restarts from zero at each document start (kda/naive.py
      chunk_kda_ref; the Pallas kernels: common/documents.py).
  Returns:
    o [B, T, H, V] in v.dtype, final state [B, H, K, V] fp32 (of the row's
    last document).
  """
  if len(_shape(beta)) != 3:
    raise ValueError(f"beta must have rank 3 [B, T, H], got shape "
                     f"{_shape(beta)}")
  g_min = _validate(q, k, v, g, beta, initial_state, chunk_size, g_min)
  impl, g_min = _resolve("kda", backend, chunk_size=chunk_size, g_min=g_min,
                         dims=(_shape(q)[3], _shape(v)[3]))
  impl = _with_pallas_options("kda", impl, pallas_options)
  documents = _with_documents("kda", impl, backend, segment_ids, _shape(q))
  return impl(q, k, v, g, beta, scale=scale, initial_state=initial_state,
              chunk_size=chunk_size, g_min=g_min, **documents)


def _resolve_step(op: str, backend: str):
  """The step implementation: "auto" is the Pallas kernel on a GPU when one
  is registered, else the XLA step (the kernel checks its own K, V limits)."""
  if not isinstance(backend, str) or backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if backend == "auto":
    on_gpu = jax.default_backend() == "gpu"
    backend = "pallas" if on_gpu and op in _IMPLS.get("pallas", {}) else "xla"
  impl = _IMPLS.get(backend, {}).get(op)
  if impl is None:
    raise NotImplementedError(
        f"{op}: backend={backend!r} has no implementation registered; "
        f"available: {available_backends(op)}")
  return impl


def gla_step(q, k, v, g, state, *, scale=None, backend="auto"):
  """One GLA token (decoding): q, k, g [B, H, K]; v [B, H, V];
  state [B, H, K, V]. Returns o [B, H, V] in v.dtype, new state fp32."""
  return _resolve_step("gla_step", backend)(q, k, v, g, state, scale=scale)


def kda_step(q, k, v, g, beta, state, *, scale=None, backend="auto"):
  """One KDA token (decoding): q, k, g [B, H, K]; v [B, H, V]; beta [B, H];
  state [B, H, K, V]. Returns o [B, H, V] in v.dtype, new state fp32."""
  return _resolve_step("kda_step", backend)(q, k, v, g, beta, state,
                                            scale=scale)

__all__ = ["gla", "kda", "gla_step", "kda_step", "register_backend",
           "available_backends", "BACKENDS", "CHUNK_SIZES"]
