"""GRPO: group-normalised advantages and the clipped, KL-regularised loss.

Per prompt a group of G rollouts is sampled; rollout i gets the advantage

  A_i = (R_i - mean_j R_j) / (std_j R_j + eps)            (std over the group)

and every token the model sampled itself (mask m_t = 1; prompts, tool outputs
and padding have m_t = 0) the clipped surrogate with the ratio
rho_t = pi(y_t) / pi_old(y_t):

  loss = -sum_t m_t min(rho_t A, clip(rho_t, 1-e, 1+e) A) / sum_t m_t
         + beta * sum_t m_t KL_t / sum_t m_t

The mean is over all own tokens of the batch (each token weighs the same,
whatever its trajectory's length). KL_t is the k3 estimator of
KL(pi || pi_ref) at the sampled token, with d = log pi_ref - log pi:
KL_t = exp(d) - d - 1 (>= 0, unbiased under samples from pi).

The step keeps the order of the supervised step (moe_jax/train/step.py):
forward with the old router bias, gradient and optimizer step, then the
router-bias update from the forward's statistics when config rl.router is
"qb"; with "frozen" the bias stays as the warm-up left it. The forward runs
over the rollouts, so the MaxVio it reports is the load on rollout tokens.
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from moe_jax import balancing
from moe_jax.balancing import STATS_COLLECTION
from moe_jax.eval.step import layer_label, token_cross_entropy
from moe_jax.train.step import TrainState, global_norm, qb_hist_scale

PyTree = Any
ROUTER_MODES = ("qb", "frozen")


def group_advantages(rewards: jax.Array, eps: float = 1e-6) -> jax.Array:
  """rewards [P, G] (G rollouts per prompt) -> advantages [P, G].

  A group whose rewards are all equal gets zero advantages (no signal).
  """
  r = rewards.astype(jnp.float32)
  mean = r.mean(axis=-1, keepdims=True)
  std = r.std(axis=-1, keepdims=True)
  return (r - mean) / (std + eps)


def token_log_probs(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """log pi(target) per position: logits [B, T, V], targets [B, T] -> [B, T]."""
  return -token_cross_entropy(logits.astype(jnp.float32), targets)


def k3_kl(log_probs: jax.Array, ref_log_probs: jax.Array) -> jax.Array:
  """k3 estimate of KL(pi || pi_ref) per sampled token (>= 0)."""
  d = ref_log_probs - log_probs
  return jnp.exp(d) - d - 1.0


def grpo_loss(log_probs: jax.Array, old_log_probs: jax.Array,
              ref_log_probs: jax.Array, advantages: jax.Array,
              mask: jax.Array, *, clip_eps: float, kl_beta: float
              ) -> tuple[jax.Array, dict]:
  """The GRPO loss and its parts.

  Args:
    log_probs: [B, T] log pi of the sampled tokens (differentiated).
    old_log_probs: [B, T] under the policy that sampled them (constant).
    ref_log_probs: [B, T] under the frozen reference (constant).
    advantages: [B], one per trajectory.
    mask: [B, T], 1 on the model's own tokens.
    clip_eps: e of clip(rho, 1 - e, 1 + e).
    kl_beta: beta, the KL weight.
  Returns:
    (loss, {"pg_loss", "kl", "clip_frac", "own_tokens"}).
  """
  mask = mask.astype(jnp.float32)
  n = jnp.maximum(mask.sum(), 1.0)
  ratio = jnp.exp(log_probs - jax.lax.stop_gradient(old_log_probs))
  a = advantages.astype(jnp.float32)[:, None]
  surrogate = jnp.minimum(ratio * a,
                          jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * a)
  pg_loss = -(surrogate * mask).sum() / n
  kl = (k3_kl(log_probs, jax.lax.stop_gradient(ref_log_probs)) * mask
        ).sum() / n
  clipped = (jnp.abs(ratio - 1.0) > clip_eps).astype(jnp.float32)
  metrics = {"pg_loss": pg_loss, "kl": kl,
             "clip_frac": (clipped * mask).sum() / n, "own_tokens": mask.sum()}
  return pg_loss + kl_beta * kl, metrics


def make_log_prob_fn(model: nn.Module) -> Callable:
  """log_probs(params, router_state, batch) -> [B, T] of batch["targets"]
  given batch["inputs"] (jit it outside); the router bias is only read."""
  def log_probs(params, router_state, batch):
    logits = model.apply({"params": params, "router_state": router_state},
                         batch["inputs"])
    return token_log_probs(logits, batch["targets"])
  return log_probs


def next_router_state(router_state: PyTree, stats: PyTree, moe_cfg,
                      router: str) -> PyTree:
  """The router_state after a GRPO step: the balancing rule of moe_cfg
  applied to the step's router stats ("qb"), or unchanged ("frozen")."""
  if router not in ROUTER_MODES:
    raise ValueError(f"rl.router must be one of {list(ROUTER_MODES)}, got "
                     f"{router!r}")
  if router == "frozen":
    return router_state
  return balancing.update_router_state(
      router_state, stats, method=moe_cfg.balancing, ema=moe_cfg.qb_ema,
      sign_rate=moe_cfg.sign_rate, qb_range=moe_cfg.qb_range,
      top_k=moe_cfg.top_k, qb_scale=qb_hist_scale(moe_cfg))


def make_grpo_step(model: nn.Module, tx: optax.GradientTransformation,
                   moe_cfg, *, clip_eps: float, kl_beta: float,
                   router: str = "qb") -> Callable:
  """grpo_step(state, batch) -> (state, metrics); jit it outside.

  batch: inputs, targets [B, T] int32; loss_mask [B, T] (own tokens);
  advantages [B]; old_log_probs, ref_log_probs [B, T] fp32.
  router: "qb" updates the router bias by the configured balancing rule
  after the optimizer step; "frozen" keeps it.
  """
  if router not in ROUTER_MODES:
    raise ValueError(f"rl.router must be one of {list(ROUTER_MODES)}, got "
                     f"{router!r}")

  def loss_fn(params, router_state, batch):
    logits, mutated = model.apply(
        {"params": params, "router_state": router_state}, batch["inputs"],
        mutable=[STATS_COLLECTION])
    logp = token_log_probs(logits, batch["targets"])
    loss, metrics = grpo_loss(
        logp, batch["old_log_probs"], batch["ref_log_probs"],
        batch["advantages"], batch["loss_mask"], clip_eps=clip_eps,
        kl_beta=kl_beta)
    return loss, (metrics, mutated.get(STATS_COLLECTION, {}))

  def grpo_step(state: TrainState, batch: dict):
    (loss, (metrics, stats)), grads = jax.value_and_grad(
        loss_fn, has_aux=True)(state.params, state.router_state, batch)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    router_state = next_router_state(state.router_state, stats, moe_cfg,
                                     router)
    metrics = dict(metrics, loss=loss, grad_norm=global_norm(grads))
    for path, load in balancing.collect_loads(stats).items():
      metrics[f"maxvio/{layer_label(path)}"] = balancing.max_violation(load)
    return state.replace(step=state.step + 1, params=params,
                         opt_state=opt_state,
                         router_state=router_state), metrics

  return grpo_step
