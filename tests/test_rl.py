"""Agentic RL: tool environments, GRPO loss and step, multi-turn rollouts."""
import importlib.util
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import config_validation
from moe_jax.config_validation import ConfigError, validate_config
from moe_jax.data import PAD
from moe_jax.model import build_model
from moe_jax.rl import envs, grpo, rollout
from moe_jax.rl import loop as rl_loop
from moe_jax.train.optimizer import make_optimizer
from moe_jax.train.checkpoint import Checkpointer, abstract_like
from moe_jax.train.step import init_train_state

_spec = importlib.util.spec_from_file_location(
    "rl_config", pathlib.Path(__file__).parents[1] / "configs" / "rl.py")
rl_config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rl_config)


# ----------------------------------------------------------------------------
# Environments.
# ----------------------------------------------------------------------------

def test_environment_answers_verified_and_splits_disjoint():
  for split in envs.SPLITS:
    for i in range(200):
      for level in envs.DIFFICULTIES:
        task = envs.make_task(3, split, i, difficulty=level)
        assert envs.check_demo(task), task
        # A function of (seed, split, index, difficulty).
        assert envs.make_task(3, split, i, difficulty=level) == task
  # Held-out operands and keys never occur in train tasks.
  train_ops = {int(n) for i in range(0, 200, 2) for n in
               envs._NUMBER.findall(envs.make_task(3, "train", i).prompt)}
  held_ops = {int(n) for i in range(0, 200, 2) for n in
              envs._NUMBER.findall(envs.make_task(3, "heldout", i).prompt)}
  assert train_ops and held_ops and not train_ops & held_ops
  assert all(k.startswith("q") for i in range(1, 50, 2)
             for k in envs.make_task(3, "heldout", i).store)
  assert not any("q" in k for i in range(1, 50, 2)
                 for k in envs.make_task(3, "train", i).store)
  # Easy level: one call; held-out operands and keys unseen in training,
  # with every letter of held-out keys seen in training keys.
  easy = {split: [envs.make_task(3, split, i, difficulty="easy")
                  for i in range(200)] for split in envs.SPLITS}
  ops = {split: {int(n) for t in ts if t.kind == "calc"
                 for n in envs._NUMBER.findall(t.prompt)}
         for split, ts in easy.items()}
  keys = {split: {k for t in ts for k in t.store}
          for split, ts in easy.items()}
  assert ops["train"] and ops["heldout"] and not ops["train"] & ops["heldout"]
  assert keys["heldout"] and not keys["train"] & keys["heldout"]
  assert set("".join(keys["heldout"])) <= set("".join(keys["train"]))
  assert all(len([s for s, own in t.demo if own]) == 2
             for ts in easy.values() for t in ts)
  # They fit the easy variant's buffer (demo_batch raises otherwise).
  rollout.demo_batch(easy["train"] + easy["heldout"], rl_loop.layout_of(
      rl_config.get_config("easy").rl), np.random.default_rng(0), 4)
  # A wrong answer gets no reward.
  task = envs.make_task(3, "train", 0)
  assert envs.reward(task, f" {task.answer} ") == 1.0
  assert envs.reward(task, task.answer + "0") == 0.0


def test_calculator_matches_python_on_random_expressions():
  rng = np.random.default_rng(0)
  for _ in range(200):
    parts = [str(int(rng.integers(0, 100)))]
    for _ in range(int(rng.integers(0, 4))):
      parts += [str(rng.choice(["+", "-", "*"])), str(int(rng.integers(0, 100)))]
    expr = "".join(parts)
    if rng.random() < 0.3:
      expr = f"({expr})*{int(rng.integers(1, 9))}"
    assert envs.evaluate_expression(expr) == eval(expr)  # pylint: disable=eval-used


@pytest.mark.parametrize("text", [
    "", "hello", "</calc>", "<calc>", "<calc>1+</calc>", "<calc>((2)</calc>",
    "<calc>2**9</calc>", "<calc>import os</calc>", "<calc>" + "9" * 80 +
    "</calc>", "<calc>99999999*99999999*99999</calc>", "<lookup></lookup>",
    "<lookup>nokey</lookup>", "</answer>", "<answer></answer>",
    "\x00\xff<<>></calc></lookup>", "<calc>1/0</calc>"])
def test_malformed_calls_give_an_error_in_context(text):
  task = envs.make_task(0, "train", 1)  # a lookup task
  action = envs.parse_action(text)
  obs = envs.observe(task, action)
  if action.kind == "answer":
    assert obs == "" and envs.reward(task, action.arg) == 0.0
  else:
    assert obs.startswith("<result>error") and obs.endswith("</result>"), obs


def test_parse_action_never_raises_on_random_bytes():
  rng = np.random.default_rng(1)
  alphabet = list("<>/calcookupanswer0123456789+-*() ")
  task = envs.make_task(0, "train", 0)
  for _ in range(300):
    text = "".join(rng.choice(alphabet, size=int(rng.integers(0, 40))))
    envs.observe(task, envs.parse_action(text))
  assert envs.parse_action("x<calc>3*4</calc>") == envs.Action("calc", "3*4")
  assert envs.parse_action("<lookup>kab</lookup>").kind == "lookup"


# ----------------------------------------------------------------------------
# GRPO.
# ----------------------------------------------------------------------------

def test_group_advantages_hand_example():
  rewards = jnp.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0],
                       [1.0, 0.0, 0.0, 0.0]])
  adv = np.asarray(grpo.group_advantages(rewards, eps=0.0 + 1e-9))
  # Group 0: mean 1/2, std 1/2. Group 1: no spread, no signal.
  # Group 2: mean 1/4, std sqrt(3)/4.
  s3 = np.sqrt(3.0)
  np.testing.assert_allclose(adv, [[1, -1, -1, 1], [0, 0, 0, 0],
                                   [3 / s3, -1 / s3, -1 / s3, -1 / s3]],
                             rtol=1e-5, atol=1e-6)


def _reference_loss(logp, old, ref, adv, mask, e, beta):
  total, kl, n = 0.0, 0.0, 0.0
  for b in range(logp.shape[0]):
    for t in range(logp.shape[1]):
      if mask[b, t]:
        rho = np.exp(logp[b, t] - old[b, t])
        total += min(rho * adv[b], np.clip(rho, 1 - e, 1 + e) * adv[b])
        d = ref[b, t] - logp[b, t]
        kl += np.exp(d) - d - 1
        n += 1
  return -total / n + beta * kl / n


def test_grpo_loss_matches_a_loop():
  rng = np.random.default_rng(2)
  shape = (3, 7)
  logp, old, ref = (-rng.random(shape) * 3 for _ in range(3))
  adv = rng.normal(size=3)
  mask = rng.random(shape) < 0.6
  loss, metrics = grpo.grpo_loss(*(jnp.asarray(x, jnp.float32) for x in
                                   (logp, old, ref, adv, mask)),
                                 clip_eps=0.2, kl_beta=0.1)
  want = _reference_loss(logp, old, ref, adv, mask, 0.2, 0.1)
  np.testing.assert_allclose(float(loss), want, rtol=1e-4)
  assert float(metrics["kl"]) >= 0 and float(metrics["own_tokens"]) == mask.sum()


@jax.jit
def _grad_at(log_ratio, advantage):
  old = jnp.full((1, 1), -1.0)
  f = lambda lp: grpo.grpo_loss(lp, old, lp, advantage[None],
                                jnp.ones((1, 1)), clip_eps=0.2,
                                kl_beta=0.0)[0]
  return jax.grad(f)(old + log_ratio)[0, 0]


def _grad(log_ratio, advantage):
  """d loss / d log pi(y) for one own token with log(pi/pi_old)=log_ratio
  (clip range 0.2)."""
  return float(_grad_at(jnp.float32(log_ratio), jnp.float32(advantage)))


def test_clipped_objective_gradient_sign():
  # Gradient descent on the loss raises log pi of a token with A > 0 and
  # lowers it for A < 0.
  assert _grad(0.0, 1.0) < 0
  assert _grad(0.0, -1.0) > 0
  # Beyond the clip range on the side the advantage pushes to: no gradient.
  assert _grad(np.log(1.5), 1.0) == 0.0
  assert _grad(np.log(0.5), -1.0) == 0.0
  # The other side is not clipped (the min keeps the unclipped term).
  assert _grad(np.log(0.5), 1.0) < 0
  assert _grad(np.log(1.5), -1.0) > 0
  np.testing.assert_allclose(_grad(np.log(1.1), 2.0), -2.0 * 1.1, rtol=1e-5)


def test_masked_tokens_carry_no_loss():
  rng = np.random.default_rng(3)
  shape = (2, 6)
  logp = jnp.asarray(-rng.random(shape) * 2, jnp.float32)
  old, ref = logp - 0.05, logp + 0.1
  mask = jnp.asarray([[0, 0, 1, 1, 0, 0], [0, 1, 1, 0, 0, 1]], jnp.float32)
  adv = jnp.array([1.0, -0.5])
  f = jax.jit(lambda lp: grpo.grpo_loss(lp, old, ref, adv, mask,
                                        clip_eps=0.2, kl_beta=0.1)[0])
  g = np.asarray(jax.jit(jax.grad(f))(logp))
  assert np.all(g[np.asarray(mask) == 0] == 0)
  assert np.all(g[np.asarray(mask) == 1] != 0)
  # Changing a masked-out token (a tool output) leaves the loss unchanged.
  np.testing.assert_array_equal(f(logp.at[0, 0].add(5.0)), f(logp))


def test_demo_batch_masks_prompts_and_tool_outputs():
  layout = rollout.Layout(prompt_len=96, max_len=320)
  tasks = [envs.make_task(0, "train", i) for i in range(4)]
  batch = rollout.demo_batch(tasks, layout, np.random.default_rng(0))
  assert batch["inputs"].shape == batch["loss_mask"].shape == (4, 319)
  np.testing.assert_array_equal(batch["inputs"][:, 1:],
                                batch["targets"][:, :-1])
  for b, task in enumerate(tasks):
    mask = batch["loss_mask"][b] == 1
    own = rollout.decode_bytes(batch["targets"][b][mask])
    other = rollout.decode_bytes(batch["targets"][b][~mask])
    assert own == "".join(t for t, is_own in task.demo if is_own)
    assert other.startswith(task.prompt)
    assert all(t in other for t, is_own in task.demo if not is_own)


def test_rl_config_validation():
  config = rl_config.get_config("tiny")
  validate_config(config)
  assert config_validation.RL_TASK_KINDS == envs.KINDS
  assert config_validation.RL_ROUTER_MODES == grpo.ROUTER_MODES
  assert config_validation.RL_DIFFICULTIES == envs.DIFFICULTIES
  validate_config(rl_config.get_config("easy,cpu"))
  for field, value in (("rl.router", "adaptive"), ("rl.tasks", "calc,chess"),
                       ("rl.difficulty", "hard"),
                       ("rl.group_size", 1), ("rl.clip_eps", 1.5),
                       ("rl.max_len", 100)):
    bad = rl_config.get_config("tiny")
    node, *rest = field.split(".")
    bad[node][rest[0]] = value
    with pytest.raises(ConfigError, match=field):
      validate_config(bad)


# ----------------------------------------------------------------------------
# Rollouts and the GRPO step on the tiny model.
# ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
  config = rl_config.get_config("tiny")
  model = build_model(config)
  tx = make_optimizer(config.train)
  # Placed as the RL loop places its states, so that the run below reuses
  # the programs these tests compile.
  state = rl_loop.placed(init_train_state(model, tx, jax.random.PRNGKey(0),
                                          16))
  layout = rl_loop.layout_of(config.rl)
  assert (layout.prompt_len, layout.max_len, layout.obs_len,
          layout.turn_tokens, layout.max_turns) == (96, 160, 32, 8, 2)
  tasks = [t for i in range(2) for t in [envs.make_task(0, "train", i)] * 2]
  return config, model, tx, state, layout, tasks


def test_rollouts_deterministic_with_tool_outputs_masked(tiny):
  _, model, _, state, layout, tasks = tiny
  run = lambda seed: rollout.rollout(model, state.params, state.router_state,
                                     tasks, jax.random.PRNGKey(seed), layout)
  a, b, c = run(1), run(1), run(2)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.own_mask, b.own_mask)
  assert not np.array_equal(a.tokens, c.tokens)
  p, o = layout.prompt_len, layout.obs_len
  assert not a.own_mask[:, :p].any()
  # Turn 1 fills [p, p + 8): own tokens up to a closing tag or EOS (then
  # PAD while the other rows sample), then the tool output block, not own;
  # an untrained model's turn is no call, so the output is an error.
  for i in range(len(tasks)):
    n = int(a.own_mask[i, p:p + 8].sum())
    assert n >= 1 and a.own_mask[i, p:p + n].all()
    assert (a.tokens[i, p + n:p + 8] == PAD).all()
    assert not a.own_mask[i, p + 8:p + 8 + o].any()
    obs = rollout.decode_bytes(a.tokens[i, p + 8:p + 8 + o])
    assert obs.startswith("<result>error") and obs.endswith("</result>"), obs
    assert a.own_mask[i, p + 8 + o]  # turn 2 starts right after it
  np.testing.assert_array_equal(a.turns, 2)
  np.testing.assert_array_equal(a.rewards, 0.0)
  # No tool output after the last turn: the buffer ends with that turn.
  assert (a.lengths == a.lengths[0]).all() and a.lengths[0] <= p + 16 + o
  assert (a.tokens[:, a.lengths[0]:] == PAD).all()


def test_grpo_step_updates_params_and_router(tiny):
  config, model, _, state, layout, tasks = tiny
  tx = rl_loop.rl_optimizer(config)
  state = rl_loop.placed(state.replace(opt_state=tx.init(state.params)))
  batch = rollout.rollout(model, state.params, state.router_state, tasks,
                          jax.random.PRNGKey(1), layout).train_batch()
  batch["advantages"] = np.array([1.0, -1.0, 0.5, -0.5], np.float32)
  step, log_probs = rl_loop.rl_steps(model, config)  # qb, as the run's
  batch["old_log_probs"] = log_probs(state.params, state.router_state, batch)
  batch["ref_log_probs"] = batch["old_log_probs"]
  new, metrics = step(state, batch)
  assert int(new.step) == 1
  assert all(np.isfinite(float(v)) for v in metrics.values())
  assert any(k.startswith("maxvio/") for k in metrics)
  # Ratio 1 and pi == pi_ref at the first step: no clipping, zero KL.
  assert float(metrics["kl"]) == pytest.approx(0.0, abs=1e-6)
  assert float(metrics["clip_frac"]) == 0.0
  assert float(metrics["own_tokens"]) == batch["loss_mask"].sum()
  changed = lambda a, b: any(jax.tree.leaves(jax.tree.map(
      lambda x, y: bool(jnp.any(x != y)), a, b)))
  assert changed(new.params, state.params)
  assert changed(new.router_state, state.router_state)  # QB moved the bias
  # Frozen: the bias stays whatever the stats say.
  stats = jax.tree.map(lambda x: x + 1.0, state.router_state)
  assert grpo.next_router_state(state.router_state, stats, config.model.moe,
                                "frozen") is state.router_state
  with pytest.raises(ValueError, match="rl.router"):
    grpo.make_grpo_step(model, tx, config.model.moe, clip_eps=0.2,
                        kl_beta=0.1, router="adaptive")


# ----------------------------------------------------------------------------
# Resuming the RL phase.
# ----------------------------------------------------------------------------

class _Interrupted(Exception):
  pass


def test_rl_run_resumes_to_the_uninterrupted_params(tiny, tmp_path,
                                                    monkeypatch):
  state = tiny[3]
  config = rl_config.get_config("tiny")
  config.rl.checkpoint_every = 1
  config.rl.eval_every = 10  # held-out evaluation only at the end
  full, part = str(tmp_path / "full"), str(tmp_path / "part")
  # Both runs start from the same finished warm-up (the fixture's state).
  for workdir in (full, part):
    ckpt = Checkpointer(f"{workdir}/warmup")
    rl_loop._save(ckpt, config.train.steps, state, config)
    ckpt.close()
  rl_loop.run(config, full)
  # The other run stops right after RL step 1's checkpoint, as a run killed
  # there would.
  save = rl_loop._save

  def save_then_stop(ckpt, step, *args, **kwargs):
    save(ckpt, step, *args, **kwargs)
    if ckpt.workdir == f"{part}/rl":
      raise _Interrupted(step)

  monkeypatch.setattr(rl_loop, "_save", save_then_stop)
  with pytest.raises(_Interrupted):
    rl_loop.run(config, part)
  monkeypatch.setattr(rl_loop, "_save", save)
  rows = [json.loads(l) for l in open(f"{part}/metrics.jsonl")]
  assert [r["step"] for r in rows if r["split"] == "rl"] == [1]
  with open(f"{part}/metrics.jsonl", "a") as f:  # written after the save
    for split in ("rl", "heldout", "train_tasks"):
      f.write(json.dumps({"step": 2, "split": split, "reward": -1.0}) + "\n")
    # The warm-up's rows count its own steps: they stay.
    f.write(json.dumps({"step": 300, "split": "warmup", "ce": 0.1}) + "\n")
  resumed = rl_loop.run(config, part)

  tx = rl_loop.rl_optimizer(config)
  target = abstract_like(state.replace(opt_state=tx.init(state.params)))

  def restore(workdir):
    ckpt = Checkpointer(f"{workdir}/rl")
    try:
      return ckpt.restore(2, target)[0]
    finally:
      ckpt.close()
  a, b = restore(full), restore(part)
  assert int(a.step) == int(b.step) == 2
  jax.tree.map(np.testing.assert_array_equal, a, b)
  assert resumed == rl_loop.run(config, full)  # finished: nothing reruns
  rows = [json.loads(l) for l in open(f"{part}/metrics.jsonl")]
  steps = lambda split: [r["step"] for r in rows if r["split"] == split]
  assert steps("rl") == [1, 2]
  assert steps("heldout") == steps("train_tasks") == [0, 2]
  assert steps("warmup") == [300]
  # RL checkpoints of another warm-up length: refused, nothing retrained.
  config.train.steps += 1
  with pytest.raises(rl_loop.RLWorkdirError, match="train.steps"):
    rl_loop.run(config, part)
  assert all(r.get("reward", 0) >= 0 for r in rows)
