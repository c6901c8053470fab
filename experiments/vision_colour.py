r"""What an image-text run answers to colour questions: confusion matrices.

  python -m experiments.vision_colour --workdir=runs/vision --examples=240

Restores the run's newest checkpoint and ranks the six colour names as
whole answers (teacher-forced log-likelihood of name + EOS) for colour
questions of two sets: held-out scenes (the asked object is a held-out
(kind, colour) pair) and training compositions that no step draws. Prints
per set: the confusion matrix (true colour rows, predicted columns), the
accuracy of that ranking and of the run's exact-match scorer (they differ
only where an answer's first byte and its whole-name likelihood disagree,
as in an undertrained model), how often the predicted
colour is the colour of another object in the scene, and greedy decodes of
a few examples (what the model writes, byte for byte).
"""
from __future__ import annotations

import json
import os

import jax
import ml_collections
import numpy as np

from moe_jax.data import vision as vd
from moe_jax.eval import vision as ev
from moe_jax.eval.step import apply_model


def restore(workdir: str):
  """(config, model, params, router_state) of the newest checkpoint."""
  from moe_jax.train.checkpoint import Checkpointer, with_shardings  # pylint: disable=import-outside-toplevel
  from moe_jax.train.loop import build_train_step  # pylint: disable=import-outside-toplevel
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    config = ml_collections.ConfigDict(json.load(f))
  config.mesh.num_devices = 1
  setup = build_train_step(config)
  ckpt = Checkpointer(workdir, keep=config.train.keep_checkpoints)
  step, state, _, _ = ckpt.restore_latest(
      with_shardings(setup.abstract_state, setup.state_shardings))
  ckpt.close()
  return config, step, setup.model, state.params, state.router_state


def colour_examples(data: vd.VisionData, split: str, n: int) -> list:
  """n colour questions: held-out scenes, or training compositions from
  vd.SEEN_OFFSET (indices no training step draws)."""
  if split == "heldout":
    return [data.example("heldout", i, "colour") for i in range(n)]
  return [data.example("train", vd.SEEN_OFFSET + i, "colour")
          for i in range(n)]


def asked_object(example: vd.Example) -> vd.SceneObject:
  """The object a colour question asks about, named by position or kind."""
  for o in example.objects:
    if (f" the {vd.QUADRANTS[o.quadrant]} object?" in example.prompt or
        f" the {o.kind}?" in example.prompt):
      return o
  raise ValueError(f"no object of {example.objects} is named in "
                   f"{example.prompt!r}")


def report(workdir: str, n: int, decodes: int = 6) -> None:
  config, step, model, params, router_state = restore(workdir)
  v = config.model.vision
  data = vd.VisionData(config.data, v.image_size, v.patch_size, config.seed)
  colours = list(vd.COLOURS)
  answer_step = jax.jit(ev.make_answer_step(model))
  logits_fn = jax.jit(lambda batch: apply_model(
      model, {"params": params, "router_state": router_state}, batch))
  print(f"{workdir}: step {step}, blank_images={data.blank_images}")
  for split in ("heldout", "seen"):
    examples = colour_examples(data, split, n)
    ll = ev.candidate_log_likelihoods(
        logits_fn, examples, colours, data.seq_len, data.patches,
        data.image_size, data.batch_size, data.blank_images)
    pred = [colours[i] for i in ll.argmax(1)]
    truth = [e.answer for e in examples]
    m = ev.confusion_matrix(truth, pred, colours)
    print(f"\n{split}: {n} colour questions; rows true, columns predicted")
    print(" " * 9 + "".join(f"{c:>9s}" for c in colours))
    for c, row in zip(colours, m):
      if row.sum():
        print(f"{c:>9s}" + "".join(f"{x:9d}" for x in row))
    right = np.array([p == t for p, t in zip(pred, truth)])
    asked = [asked_object(e) for e in examples]
    others = np.array([p in {o.colour for o in e.objects if o is not a}
                       for p, e, a in zip(pred, examples, asked)])
    never = np.array([(a.kind, p) in vd.HELD_OUT_PAIRS
                      for p, a in zip(pred, asked)])
    scorer = ev.answer_accuracy(answer_step, params, router_state,
                                data.eval_batches(examples=examples))
    print(f"ranked accuracy {right.mean():.3f}; exact-match scorer "
          f"{scorer.get('acc/colour', float('nan')):.3f}; predicted = another "
          f"object's colour {others[~right].mean() if (~right).any() else 0:.3f}"
          f" of the wrong ones; predicted a held-out pair {never.mean():.3f}")
    for kind in vd.KINDS:
      rows = [i for i, a in enumerate(asked) if a.kind == kind]
      counts = {c: sum(pred[i] == c for i in rows) for c in colours}
      print(f"  {kind:9s} ({len(rows):3d}): " + " ".join(
          f"{c}={x}" for c, x in counts.items() if x))
    greedy = ev.greedy_answers(model, params, router_state,
                               examples[:decodes], data.seq_len,
                               data.patches, max_len=12,
                               blank_images=data.blank_images)
    for e, g in zip(examples[:decodes], greedy):
      print(f"  {e.prompt!r} true={e.answer!r} greedy={g!r} objects="
            + ", ".join(f"{o.colour} {o.kind}" for o in e.objects))


if __name__ == "__main__":
  from absl import app, flags  # pylint: disable=import-outside-toplevel
  _WORKDIR = flags.DEFINE_string("workdir", "runs/vision", "Training workdir.")
  _EXAMPLES = flags.DEFINE_integer("examples", 240,
                                   "Colour questions per set.")
  app.run(lambda argv: report(_WORKDIR.value, _EXAMPLES.value))
