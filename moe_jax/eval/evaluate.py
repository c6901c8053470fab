"""Validation: loss, bits per byte, and MaxVio over the whole validation set.

One token is one byte in the embedded corpus (specials BOS/EOS count as
tokens), so bits per token = bits per byte. The unigram bits per byte of the
same split is the baseline a model has to beat.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.balancing import max_violation
from moe_jax.eval.step import layer_label


def evaluate(eval_step: Callable, params, router_state,
             batches: Iterable[dict]) -> dict[str, float]:
  """Runs eval_step over batches; returns val_loss, val_bpb, MaxVio_global.

  eval_step: jitted (params, router_state, batch) -> (ce_sum, count, loads).
  MaxVio_global per layer is computed from the loads summed over the whole
  validation set (the global batch), unlike the per-step MaxVio_batch.
  """
  total, count, loads = 0.0, 0, {}
  for batch in batches:
    ce_sum, n, layer_loads = eval_step(params, router_state, batch)
    total += float(ce_sum)
    count += int(n)
    for k, v in layer_loads.items():
      loads[k] = loads.get(k, 0) + np.asarray(v, np.float64)
  if count == 0:
    raise ValueError("evaluate() got no batches: the validation split is "
                     "shorter than one batch of data.seq_len + 1 tokens")
  loss = total / count
  out = {"val_loss": loss, "val_bpb": loss / math.log(2.0),
         "val_tokens": count}
  for k, v in sorted(loads.items()):
    out[f"maxvio_global/{layer_label(k)}"] = float(
        max_violation(jnp.asarray(v)))
  out["_loads"] = {layer_label(k): v for k, v in sorted(loads.items())}
  return out
