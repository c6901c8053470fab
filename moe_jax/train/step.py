"""Train state and the jitted train step.

The order inside one step is the contract of Quantile Balancing
(docs/design.md §6): route with the old router bias, take the gradient and
the optimizer step, then apply the router-bias update from the statistics
the forward emitted (moe_jax/balancing.py). With model.moe.qb_update_every
> 1 the statistics are summed over a window of steps in router_state and the
bias changes only at the end of each period. The eval step is in
moe_jax/eval/.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from moe_jax import balancing, sharding
from moe_jax.balancing import STATS_COLLECTION, THRESHOLDS_COLLECTION
from moe_jax.eval.step import apply_model, cross_entropy, layer_label

PyTree = Any
LN2 = math.log(2.0)


@flax.struct.dataclass
class TrainState:
  """Everything a step reads and writes; all of it is checkpointed."""
  step: jax.Array
  params: PyTree
  opt_state: PyTree
  router_state: PyTree


def qb_window_config(moe_cfg) -> tuple[int, int]:
  """(qb_window_steps, qb_update_every) of a moe config; (1, 1) if absent."""
  get = (moe_cfg.get if hasattr(moe_cfg, "get")
         else lambda k, d: getattr(moe_cfg, k, d))
  return int(get("qb_window_steps", 1)), int(get("qb_update_every", 1))


def qb_hist_scale(moe_cfg) -> float:
  """model.moe.qb_hist_scale; balancing.QB_HIST_SCALE if absent (a config
  saved before the field existed)."""
  return float(getattr(moe_cfg, "qb_hist_scale", balancing.QB_HIST_SCALE))


def _router_state(model: nn.Module, variables: PyTree, tokens: jax.Array
                  ) -> PyTree:
  """The model's router_state, plus the empty QB window when it has one.

  The window (balancing.WINDOW_KEY) is created when the model's config
  (`model.cfg.moe`) asks for qb_update_every > 1: shaped like one step's
  router_stats, which do not depend on the token count.
  """
  router_state = variables.get("router_state", {})
  cfg = getattr(model, "cfg", None)
  if cfg is None or qb_window_config(cfg.moe)[1] == 1:
    return router_state
  stats = jax.eval_shape(lambda: model.apply(
      variables, tokens, mutable=[STATS_COLLECTION])[1][STATS_COLLECTION])
  out = dict(flax.core.unfreeze(router_state))
  out[balancing.WINDOW_KEY] = balancing.init_qb_window(
      flax.core.unfreeze(stats))
  return out


def _init_fn(model: nn.Module, tx: optax.GradientTransformation,
             seq_len: int, boxed: bool = False
             ) -> Callable[[jax.Array], TrainState]:
  """init(rng) -> TrainState; params unboxed (plain arrays) unless boxed."""
  def init(rng):
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    variables = model.init(rng, tokens)
    params = nn.meta.unbox(variables["params"])
    return TrainState(step=jnp.zeros((), jnp.int32),
                      params=variables["params"] if boxed else params,
                      opt_state=tx.init(params),
                      router_state=_router_state(model, variables, tokens))
  return init


def abstract_train_state(model: nn.Module, tx: optax.GradientTransformation,
                         rng: jax.Array, seq_len: int) -> TrainState:
  """The TrainState as jax.ShapeDtypeStructs (nothing is computed).

  Its params keep the logical-axes boxes of the layers
  (nn.LogicallyPartitioned) for `train_state_shardings`;
  train.checkpoint.with_shardings drops them.
  """
  return jax.eval_shape(_init_fn(model, tx, seq_len, boxed=True), rng)


def train_state_shardings(abstract_state: TrainState,
                          tx: optax.GradientTransformation, mesh,
                          rules) -> TrainState:
  """NamedSharding per leaf of the (unboxed) train state.

  Params by the logical axes their layers declared, mapped through `rules`;
  optimizer state mirroring them; step and router_state replicated.
  """
  params = sharding.param_shardings(abstract_state.params, mesh, rules)
  rep = sharding.replicated(mesh)
  return TrainState(
      step=rep, params=params,
      opt_state=sharding.opt_state_shardings(
          tx, abstract_state.opt_state, params,
          nn.meta.unbox(abstract_state.params), mesh),
      router_state=jax.tree.map(lambda _: rep, abstract_state.router_state))


def init_train_state(model: nn.Module, tx: optax.GradientTransformation,
                     rng: jax.Array, seq_len: int,
                     shardings: TrainState | None = None) -> TrainState:
  """Initialises params, router_state and the optimizer state.

  shardings: from `train_state_shardings`; the state is then created
  directly in that layout (one jit with out_shardings). The values do not
  depend on the layout (JAX's partitionable threefry RNG).
  """
  if shardings is not None:
    return jax.jit(_init_fn(model, tx, seq_len), out_shardings=shardings)(rng)
  # Jitted: eager init would dispatch every op of the model one by one.
  tokens = jnp.zeros((1, seq_len), jnp.int32)
  variables = jax.jit(model.init)(rng, tokens)
  params = nn.meta.unbox(variables["params"])
  router_state = _router_state(model, variables, tokens)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=tx.init(params), router_state=router_state)


def global_norm(tree: PyTree) -> jax.Array:
  """sqrt(sum of squares) over all leaves, in fp32."""
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
                      for x in jax.tree.leaves(tree)))


def split_microbatches(batch: dict, microbatches: int) -> dict:
  """[B, ...] leaves -> [M, B/M, ...]; microbatch j holds rows j, j+M, ...

  Strided rather than contiguous: with the batch dim sharded over devices,
  every device then holds B/(M * devices) rows of every microbatch, so each
  pass keeps all devices busy and the split moves no data.
  """
  def split(x):
    if x.shape[0] % microbatches:
      raise ValueError(
          f"batch dim {x.shape[0]} is not divisible by train.microbatches="
          f"{microbatches}; allowed: the divisors of {x.shape[0]}")
    x = x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:])
    return jnp.swapaxes(x, 0, 1)
  return jax.tree.map(split, batch)


def make_grad_fn(model: nn.Module, moe_cfg, microbatches: int = 1
                 ) -> Callable[[PyTree, PyTree, dict], tuple]:
  """grad_fn(params, router_state, batch) -> ((loss, ce, aux, stats), grads).

  microbatches > 1: gradient accumulation. The batch is split with
  `split_microbatches` and a jax.lax.scan runs the forward and backward once
  per microbatch, all with the same (old) params and router bias; loss, ce,
  aux and grads are the means over microbatches (= the full-batch values for
  a mean loss), and the router stats are combined over microbatches
  (`reduce_router_stats`: loads and histograms summed). For the exact QB
  estimator the per-token thresholds of every microbatch are merged into a
  running q+1 smallest per expert, so qb_target is the exact order statistic
  of the whole batch, not a mean of per-microbatch targets. Grads accumulate
  in fp32 and come back in the param dtype.

  batch["loss_mask"] [B, T] (optional): the cross-entropy is the mean over
  the masked-in tokens (of each microbatch); batch["images"] (optional) go
  to the model with the tokens.
  """
  exact_qb = moe_cfg.balancing == "qb" and moe_cfg.qb_estimator == "exact"

  def loss_fn(params, router_state, batch, mutable):
    logits, mutated = apply_model(
        model, {"params": params, "router_state": router_state}, batch,
        mutable=mutable)
    stats = mutated.get(STATS_COLLECTION, {})
    ce = cross_entropy(logits, batch["targets"], batch.get("loss_mask"))
    aux = balancing.sum_aux_losses(stats)
    return ce + aux, (ce, aux, stats, mutated.get(THRESHOLDS_COLLECTION, {}))

  if microbatches == 1:
    def grad_fn(params, router_state, batch):
      (loss, (ce, aux, stats, _)), grads = jax.value_and_grad(
          loss_fn, has_aux=True)(params, router_state, batch,
                                 [STATS_COLLECTION])
      return (loss, ce, aux, stats), grads
    return grad_fn

  mutable = [STATS_COLLECTION] + (
      [THRESHOLDS_COLLECTION] if exact_qb else [])
  vg = jax.value_and_grad(loss_fn, has_aux=True)

  def grad_fn(params, router_state, batch):
    mbs = split_microbatches(batch, microbatches)
    # Shapes of the per-token thresholds r [..., N_mb, E] (exact QB only).
    thr_shape = jax.eval_shape(lambda: apply_model(
        model, {"params": params, "router_state": router_state},
        jax.tree.map(lambda x: x[0], mbs),
        mutable=mutable)[1].get(THRESHOLDS_COLLECTION, {}))

    smallest0 = jax.tree.map(lambda r: balancing.init_smallest(
        r, microbatches, moe_cfg.top_k), thr_shape)
    grads0 = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

    def body(carry, mb):
      grads_acc, smallest = carry
      (loss, (ce, aux, stats, thr)), grads = vg(params, router_state, mb,
                                                mutable)
      grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32),
                               grads_acc, grads)
      smallest = jax.tree.map(balancing.merge_smallest, smallest, thr)
      return (grads_acc, smallest), (loss, ce, aux, stats)

    (grads, smallest), (loss, ce, aux, stats) = jax.lax.scan(
        body, (grads0, smallest0), mbs)
    grads = jax.tree.map(lambda g, p: (g / microbatches).astype(p.dtype),
                         grads, params)
    stats = balancing.reduce_router_stats(stats)
    if exact_qb:
      stats = balancing.set_exact_targets(flax.core.unfreeze(stats),
                                          flax.core.unfreeze(smallest))
    return (loss.mean(), ce.mean(), aux.mean(), stats), grads

  return grad_fn


def make_train_step(model: nn.Module, tx: optax.GradientTransformation,
                    moe_cfg, schedule: optax.Schedule | None = None,
                    microbatches: int = 1
                    ) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
  """Returns train_step(state, batch) -> (state, metrics); jit it outside.

  microbatches > 1 accumulates gradients and router statistics over that
  many passes (`make_grad_fn`); the optimizer step and the router-bias update
  run once, after all of them.

  moe_cfg.qb_update_every = P > 1 (QB histogram only): the stats of the last
  qb_window_steps = W steps of each period are summed in
  router_state[balancing.WINDOW_KEY] and the bias is updated at the period's
  last step (`balancing.qb_window_update`); the state must come from
  `init_train_state` of a model whose cfg has the same P.
  """
  grad_fn = make_grad_fn(model, moe_cfg, microbatches)
  window_steps, update_every = qb_window_config(moe_cfg)
  update_kwargs = dict(method=moe_cfg.balancing, ema=moe_cfg.qb_ema,
                       sign_rate=moe_cfg.sign_rate, qb_range=moe_cfg.qb_range,
                       top_k=moe_cfg.top_k, qb_scale=qb_hist_scale(moe_cfg))

  def train_step(state: TrainState, batch: dict):
    if moe_cfg.balancing == "qb":
      # Static at trace time: warns once per compiled batch shape.
      balancing.warn_few_qb_tokens(
          math.prod(batch["inputs"].shape) * window_steps,
          moe_cfg.num_experts, moe_cfg.top_k)
    routers, _ = balancing.split_qb_window(state.router_state)
    (loss, ce, aux, stats), grads = grad_fn(state.params, routers, batch)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # After the optimizer step, outside the gradient: the router bias update.
    if update_every > 1:
      router_state = balancing.qb_window_update(
          state.router_state, stats, state.step, window_steps=window_steps,
          update_every=update_every, **update_kwargs)
    else:
      router_state = balancing.update_router_state(
          state.router_state, stats, **update_kwargs)
    metrics = {"loss": loss, "ce": ce, "bpb": ce / LN2, "aux_loss": aux,
               "grad_norm": global_norm(grads),
               "param_norm": global_norm(params)}
    if schedule is not None:
      metrics["lr"] = schedule(state.step)
    for path, load in balancing.collect_loads(stats).items():
      metrics[f"maxvio/{layer_label(path)}"] = balancing.max_violation(load)
    new_state = state.replace(step=state.step + 1, params=params,
                              opt_state=opt_state, router_state=router_state)
    return new_state, metrics

  return train_step
