"""Image-text data: generated scenes with questions, and a user image folder.

Scenes (numpy, no downloads, a pure function of (seed, split, index)): a
black S x S RGB image with 1-4 objects, one per quadrant. An object is a
circle, square, triangle or digit (drawn from a built-in 3x5 bitmap font),
in one of six colours, small or large, jittered inside its quadrant. Each
example asks one question about its scene:

  count     "how many circles?"                           -> "2"
  colour    "what colour is the top left object?"         -> "red"
  position  "where is the blue triangle?"                 -> "top left"
  larger    "which is larger, the circle or the digit?"   -> "digit"
  digit     "what digit is shown?"                        -> "7"
  caption   "describe the image."  -> "large red circle top left, small ..."

Held-out split by composition: each kind has one held-out colour
(HELD_OUT_PAIRS). No training scene contains an object of a held-out
(kind, colour) pair; every held-out example asks about such an object.
Colour questions name their object by its quadrant, not its kind: asked
"what colour is the circle?" of a held-out green circle, the right answer
is the one colour that training never gives to that question, so a model
that fits its training data learns to rule it out (a model that sees no
image scores 0, below chance). Named by position, every colour stays a
possible answer, and the question tests reading the colour of a
composition never seen. colour_question='kind' keeps the kind-named form.

Colours of training objects: each kind draws among its five training
colours with weights (TRAIN_COLOURS) that make all six colours equally
frequent over training objects when kinds are (as in colour, position,
larger and caption scenes): magenta and cyan, held out with no kind, 1/6
each; the others 2/9. Drawn uniformly per kind, magenta and cyan would be a
third more frequent than the other four, an answer prior that pulls
held-out colour answers toward them. The other objects of held-out scenes
draw uniformly among their kind's training colours.

Token layout of one example (byte-level text, model.vocab_size >= VOCAB_SIZE):
  BOS BOI IMG*P EOI <prompt bytes> <answer bytes> EOS PAD...
with P = (S / patch)^2 placeholder ids (IMAGE_TOKEN), one per image patch,
replaced in the model by the projected patches (moe_jax/layers/vision.py).
inputs = tokens[:-1], targets = tokens[1:]; loss_mask is 1 exactly where the
target is an answer byte or the closing EOS (no loss on the image or prompt).

Training batches mix such examples with text-only windows of the embedded
corpus (data.vision.text_fraction of the rows; images zero, no placeholders,
loss on every token). The text_only baseline (data.vision.blank_images)
keeps the layout but zeroes every image: it sees the question, not the image.

User folder (data.vision.source='folder'): `captions.txt` in the folder, one
`<file name>\\t<caption>` per line, images as PNG (read with PIL) or .npy,
uint8 [S, S, 3]. Each image becomes a caption example; the last
data.val_fraction of the lines (in file order) are held out.

Ground floor: numpy (and PIL for PNG files) and this package only.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterator, Mapping

import numpy as np

from moe_jax.data import pipeline
from moe_jax.data import stdlib_corpus
from moe_jax.data.stdlib_corpus import BOS, EOS, PAD

# Specials after the byte vocabulary (259 = 256 bytes + PAD, BOS, EOS).
BOI = stdlib_corpus.VOCAB_SIZE        # 259 begin of image
EOI = BOI + 1                         # 260 end of image
IMAGE_TOKEN = BOI + 2                 # 261 one image patch (placeholder)
VOCAB_SIZE = BOI + 3                  # 262

QUESTION_TYPES = ("count", "colour", "position", "larger", "digit",
                  "caption")
KINDS = ("circle", "square", "triangle", "digit")
COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60),
           "blue": (50, 90, 240), "yellow": (230, 220, 40),
           "magenta": (220, 50, 220), "cyan": (40, 220, 220)}
QUADRANTS = ("top left", "top right", "bottom left", "bottom right")
SIZES = ("small", "large")
HELD_OUT_PAIRS = frozenset({("circle", "green"), ("square", "blue"),
                            ("triangle", "red"), ("digit", "yellow")})
SPLITS = {"train": 0, "heldout": 1}


def balanced_colour_weights(kinds, colours, held_out
                            ) -> dict[str, tuple[tuple[str, ...], np.ndarray]]:
  """Per kind, (its training colours, probabilities) with every colour
  equally frequent over kinds that are equally frequent.

  A kind's training colours are those not held out with it. The weights
  solve sum_c w[k, c] = 1 per kind and sum_k w[k, c] = len(kinds) /
  len(colours) per colour, w >= 0 and 0 on held-out pairs: the solution of
  maximum entropy, by iterative proportional fitting from uniform weights
  (symmetric sets give symmetric weights). Raises ValueError when no such
  weights exist (naming colours that too few kinds allow) or when they all
  need a weight of 0 on a pair a kind allows.
  """
  kinds, colours = tuple(kinds), tuple(colours)
  allowed = np.array([[(k, c) not in held_out for c in colours]
                      for k in kinds])
  share = len(kinds) / len(colours)  # each colour's total weight
  # Weights exist iff no set of colours needs more than the kinds allowing
  # any of them can give, 1 each (Gale's supply-demand condition).
  for subset in range(1, 1 << len(colours)):
    cols = [j for j in range(len(colours)) if subset >> j & 1]
    givers = allowed[:, cols].any(1).sum()
    if len(cols) * share > givers + 1e-9:
      raise ValueError(
          f"HELD_OUT_PAIRS leave colours {[colours[j] for j in cols]} to "
          f"{givers} kind(s), too few for each colour to be "
          f"{1 / len(colours):.3f} of the training objects; hold out fewer "
          "pairs of these colours")
  w = allowed.astype(np.float64)
  for _ in range(10_000):
    w /= w.sum(1, keepdims=True)
    w *= share / w.sum(0, keepdims=True)
    if np.abs(w.sum(1) - 1).max() < 1e-12:
      break
  w /= w.sum(1, keepdims=True)
  if np.abs(w.sum(0) - share).max() > 1e-6:
    raise ValueError(
        "HELD_OUT_PAIRS: equal colour frequencies need a weight of 0 on a "
        "colour a kind allows; hold out fewer pairs")
  return {k: (tuple(c for c, a in zip(colours, allowed[i]) if a),
              w[i][allowed[i]]) for i, k in enumerate(kinds)}


# Training colour draw per kind: every colour equally frequent (magenta and
# cyan, held out with no kind, weigh 1/6 per kind; the others 2/9).
TRAIN_COLOURS = balanced_colour_weights(KINDS, COLOURS, HELD_OUT_PAIRS)

# Answers each question type can have on held-out scenes (for chance).
ANSWERS = {
    "count": ("1", "2", "3"),          # held-out counts include the target
    "colour": tuple(COLOURS),
    "position": QUADRANTS,
    "larger": KINDS,                   # the model may name any kind
    "digit": tuple("0123456789"),
}

# 3x5 bitmap font, rows top to bottom.
_FONT = {
    "0": ("111", "101", "101", "101", "111"),
    "1": ("010", "110", "010", "010", "111"),
    "2": ("111", "001", "111", "100", "111"),
    "3": ("111", "001", "111", "001", "111"),
    "4": ("101", "101", "111", "001", "001"),
    "5": ("111", "100", "111", "001", "111"),
    "6": ("111", "100", "111", "101", "111"),
    "7": ("111", "001", "001", "001", "001"),
    "8": ("111", "101", "111", "101", "111"),
    "9": ("111", "101", "111", "001", "111"),
}


# Training draws example s * batch_size + r at step s; evaluation of training
# compositions uses indices from here on (never reached by a run).
SEEN_OFFSET = 1 << 40


class VisionDataError(ValueError):
  """A user image folder, its captions file or an image is unusable."""


@dataclasses.dataclass(frozen=True)
class SceneObject:
  kind: str      # KINDS
  colour: str    # COLOURS
  size: str      # SIZES
  quadrant: int  # index into QUADRANTS
  digit: str = ""  # kind == 'digit': '0'..'9'

  def name(self) -> str:
    """How questions refer to the object's kind."""
    return self.kind


@dataclasses.dataclass
class Example:
  """One image-text example.

  images: uint8 [N, S, S, 3]; prompt, answer: text; qtype: QUESTION_TYPES.
  """
  images: np.ndarray
  prompt: str
  answer: str
  qtype: str
  objects: tuple = ()


def _rng(*keys: int) -> np.random.Generator:
  return np.random.Generator(np.random.PCG64(np.random.SeedSequence(keys)))


# ----------------------------------------------------------------------------
# Drawing.
# ----------------------------------------------------------------------------


def _radius(size: str, image_size: int) -> int:
  return image_size // 8 if size == "small" else (image_size * 7) // 32


def render(objects, image_size: int, rng: np.random.Generator) -> np.ndarray:
  """uint8 [S, S, 3]: the objects drawn on black, jittered in quadrants."""
  s = image_size
  img = np.zeros((s, s, 3), np.uint8)
  yy, xx = np.mgrid[0:s, 0:s]
  for o in objects:
    r = _radius(o.size, s)
    jitter = max(0, s // 4 - r - 1)
    cy = (s // 4 if o.quadrant < 2 else 3 * s // 4) + int(
        rng.integers(-jitter, jitter + 1))
    cx = (s // 4 if o.quadrant % 2 == 0 else 3 * s // 4) + int(
        rng.integers(-jitter, jitter + 1))
    dy, dx = yy - cy, xx - cx
    if o.kind == "circle":
      mask = dy * dy + dx * dx <= r * r
    elif o.kind == "square":
      mask = (np.abs(dy) < r) & (np.abs(dx) < r)
    elif o.kind == "triangle":  # apex up, base at cy + r
      mask = (dy >= -r) & (dy < r) & (2 * np.abs(dx) <= dy + r)
    else:
      scale = max(1, s // 16) if o.size == "small" else max(1, 3 * s // 32)
      glyph = np.array([[c == "1" for c in row] for row in _FONT[o.digit]])
      glyph = np.kron(glyph, np.ones((scale, scale), bool))
      h, w = glyph.shape
      mask = np.zeros((s, s), bool)
      y0, x0 = cy - h // 2, cx - w // 2
      mask[y0:y0 + h, x0:x0 + w] = glyph
    img[mask] = COLOURS[o.colour]
  return img


# ----------------------------------------------------------------------------
# Scenes and questions.
# ----------------------------------------------------------------------------


def _random_object(rng, kind: str, quadrant: int, held_out: bool,
                   balanced: bool, size: str | None = None) -> SceneObject:
  """held_out: the kind's held-out colour, else one of its training colours,
  drawn with TRAIN_COLOURS' weights when balanced (training scenes) or
  uniformly (the other objects of held-out scenes)."""
  colours, weights = TRAIN_COLOURS[kind]
  if held_out:
    colour = next(c for k, c in HELD_OUT_PAIRS if k == kind)
  elif balanced:
    colour = rng.choice(colours, p=weights)
  else:
    colour = rng.choice(colours)
  return SceneObject(kind=kind, colour=str(colour),
                     size=size or str(rng.choice(SIZES)), quadrant=quadrant,
                     digit=str(rng.integers(10)) if kind == "digit" else "")


def _fill(rng, objects: list, exclude_kinds, n_total: int,
          balanced: bool) -> list:
  """Adds objects of training pairs and kinds not in exclude_kinds up to
  n_total (colours as _random_object's)."""
  free = [q for q in range(4) if q not in {o.quadrant for o in objects}]
  rng.shuffle(free)
  kinds = [k for k in KINDS if k not in exclude_kinds]
  while len(objects) < n_total and free and kinds:
    objects.append(_random_object(rng, str(rng.choice(kinds)), free.pop(),
                                  False, balanced))
  return objects


def _plural(kind: str) -> str:
  return kind + "s"


COLOUR_QUESTIONS = ("position", "kind")


def make_scene_example(seed: int, split: str, index: int, qtype: str,
                       image_size: int, colour_question: str = "position"
                       ) -> Example:
  """Example `index` of `split` ('train' | 'heldout') with question qtype.

  colour_question (COLOUR_QUESTIONS): how a colour question names its
  object; the scene is the same either way.
  """
  rng = _rng(seed, SPLITS[split], QUESTION_TYPES.index(qtype), index)
  held = split == "heldout"
  quads = list(rng.permutation(4))
  extra = int(rng.integers(0, 3))  # distractors
  if qtype == "count":
    kind = str(rng.choice(KINDS[:3]))
    n = int(rng.integers(1 if held else 0, 4))
    objs = [_random_object(rng, kind, int(quads[i]), held and i == 0,
                           not held) for i in range(n)]
    objs = _fill(rng, objs, (kind,), min(4, n + max(extra, 1 - n)), not held)
    prompt, answer = f"how many {_plural(kind)}?", str(n)
  elif qtype in ("colour", "position", "digit"):
    kind = "digit" if qtype == "digit" else str(rng.choice(KINDS))
    target = _random_object(rng, kind, int(quads[0]), held, not held)
    objs = _fill(rng, [target], (kind,), 1 + extra, not held)
    if qtype == "colour":
      if colour_question == "kind":
        prompt = f"what colour is the {kind}?"
      elif colour_question == "position":
        prompt = f"what colour is the {QUADRANTS[target.quadrant]} object?"
      else:
        raise ValueError(f"colour_question must be one of "
                         f"{list(COLOUR_QUESTIONS)}, got {colour_question!r}")
      answer = target.colour
    elif qtype == "position":
      prompt = f"where is the {target.colour} {kind}?"
      answer = QUADRANTS[target.quadrant]
    else:
      prompt, answer = "what digit is shown?", target.digit
  elif qtype == "larger":
    a, b = (str(k) for k in rng.choice(KINDS, 2, replace=False))
    big = int(rng.integers(2))
    pair = [_random_object(rng, k, int(quads[i]), held and i == 0, not held,
                           size="large" if i == big else "small")
            for i, k in enumerate((a, b))]
    objs = _fill(rng, pair, (a, b), 2 + min(extra, 1), not held)
    first, second = (a, b) if rng.integers(2) else (b, a)
    prompt = f"which is larger, the {first} or the {second}?"
    answer = (a, b)[big]
  elif qtype == "caption":
    kind = str(rng.choice(KINDS))
    objs = _fill(rng, [_random_object(rng, kind, int(quads[0]), held,
                                      not held)], (), 1 + extra, not held)
    prompt, answer = "describe the image.", caption(objs)
  else:
    raise ValueError(f"question type must be one of {list(QUESTION_TYPES)}, "
                     f"got {qtype!r}")
  image = render(objs, image_size, rng)
  return Example(images=image[None], prompt=f"Q: {prompt} A: ",
                 answer=answer, qtype=qtype, objects=tuple(objs))


def caption(objects) -> str:
  """'large red circle top left, small blue 3 bottom right' (quadrant order)."""
  parts = []
  for o in sorted(objects, key=lambda o: o.quadrant):
    what = o.digit if o.kind == "digit" else o.kind
    parts.append(f"{o.size} {o.colour} {what} {QUADRANTS[o.quadrant]}")
  return ", ".join(parts)


# ----------------------------------------------------------------------------
# Token layout.
# ----------------------------------------------------------------------------


def patches_per_image(image_size: int, patch_size: int) -> int:
  return (image_size // patch_size) ** 2


def prompt_ids(example: Example, patches: int) -> list[int]:
  """The token ids before the answer: BOS, the images, the prompt."""
  ids = [BOS]
  for _ in range(example.images.shape[0]):
    ids += [BOI] + [IMAGE_TOKEN] * patches + [EOI]
  return ids + list(example.prompt.encode())


def encode_example(example: Example, seq_len: int,
                   patches: int) -> tuple[np.ndarray, np.ndarray]:
  """(tokens int32 [seq_len + 1], loss_mask float32 [seq_len]).

  Raises ValueError when the example does not fit in seq_len + 1 tokens.
  """
  ids = prompt_ids(example, patches)
  start = len(ids)  # first answer token
  ids += list(example.answer.encode()) + [EOS]
  if len(ids) > seq_len + 1:
    raise ValueError(
        f"an example needs {len(ids)} tokens ({example.images.shape[0]} "
        f"image(s) of {patches} patches, prompt {example.prompt!r}, answer "
        f"{example.answer!r}), more than data.seq_len + 1 = {seq_len + 1}; "
        "raise data.seq_len or model.vision.patch_size")
  tokens = np.full(seq_len + 1, PAD, np.int32)
  tokens[:len(ids)] = ids
  mask = np.zeros(seq_len, np.float32)
  mask[start - 1:len(ids) - 1] = 1.0  # targets[t] = tokens[t + 1]
  return tokens, mask


def collate(examples, seq_len: int, patches: int, image_size: int,
            blank_images: bool = False) -> dict[str, np.ndarray]:
  """Batch of examples: inputs, targets int32 [B, T]; loss_mask fp32 [B, T];
  images uint8 [B, 1, S, S, 3]; qtype int32 [B] (index in QUESTION_TYPES)."""
  enc = [encode_example(e, seq_len, patches) for e in examples]
  tokens = np.stack([t for t, _ in enc])
  images = np.stack([e.images for e in examples])
  if images.shape[2:] != (image_size, image_size, 3):
    raise VisionDataError(f"images must be [S, S, 3] with S = "
                          f"model.vision.image_size = {image_size}, got "
                          f"{images.shape[2:]}")
  if blank_images:
    images = np.zeros_like(images)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
          "loss_mask": np.stack([m for _, m in enc]), "images": images,
          "qtype": np.array([QUESTION_TYPES.index(e.qtype)
                             for e in examples], np.int32)}


# ----------------------------------------------------------------------------
# User image folder.
# ----------------------------------------------------------------------------

CAPTIONS_FILE = "captions.txt"


def _load_image(path: str) -> np.ndarray:
  if path.endswith(".npy"):
    return np.load(path)
  try:
    from PIL import Image  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise VisionDataError(f"reading {path} needs PIL (pip install pillow); "
                          "or save the image as .npy") from e
  with Image.open(path) as im:
    return np.asarray(im)


def load_image_folder(folder: str, image_size: int) -> list[Example]:
  """Caption examples from folder/captions.txt (`<file>\\t<caption>` lines).

  Images are PNG or .npy, uint8 [image_size, image_size, 3].
  Raises VisionDataError naming the folder, file or line at fault.
  """
  if not folder or not os.path.isdir(folder):
    raise VisionDataError(f"data.vision.folder {folder!r} is not a directory")
  path = os.path.join(folder, CAPTIONS_FILE)
  if not os.path.isfile(path):
    raise VisionDataError(
        f"{path} is missing: data.vision.folder needs a {CAPTIONS_FILE} with "
        "one '<image file>\\t<caption>' line per image")
  examples = []
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      if "\t" not in line:
        raise VisionDataError(f"{path}:{n}: expected '<image file>\\t<caption>'"
                              f", got {line.rstrip()!r}")
      name, text = line.rstrip("\n").split("\t", 1)
      image_path = os.path.join(folder, name)
      if not os.path.isfile(image_path):
        raise VisionDataError(f"{path}:{n}: image {image_path} does not exist")
      image = _load_image(image_path)
      if image.dtype != np.uint8:
        raise VisionDataError(f"{image_path}: dtype must be uint8, got "
                              f"{image.dtype}")
      if image.shape != (image_size, image_size, 3):
        raise VisionDataError(
            f"{image_path}: shape must be ({image_size}, {image_size}, 3) "
            f"(model.vision.image_size, RGB), got {image.shape}")
      examples.append(Example(images=image[None], prompt="Q: describe the "
                              "image. A: ", answer=text, qtype="caption"))
  if len(examples) < 2:
    raise VisionDataError(f"{path} lists {len(examples)} image(s); need at "
                          "least 2 (one for training, one held out)")
  return examples


# ----------------------------------------------------------------------------
# Batching.
# ----------------------------------------------------------------------------


def _field(cfg: Any, name: str, default: Any = None) -> Any:
  return pipeline._get(cfg, name, default)  # pylint: disable=protected-access


class VisionBatcher:
  """Training batches, a pure function of (seed, step); state = {'step'}.

  Row r of the global batch at step s: a text window of the corpus with
  probability text_fraction, else example s * batch_size + r of the
  training split (question type drawn from question_types).
  """

  def __init__(self, data: "VisionData"):
    self.data = data
    self._step = 0
    self.batch_size = data.batch_size

  def batch_at(self, step: int) -> dict[str, np.ndarray]:
    d = self.data
    rng = _rng(d.seed, 7, step)
    is_text = rng.random(d.batch_size) < d.text_fraction
    qtypes = rng.choice(d.question_types, d.batch_size)
    examples = [d.train_example(step * d.batch_size + r, str(qtypes[r]))
                for r in range(d.batch_size)]
    batch = collate(examples, d.seq_len, d.patches, d.image_size,
                    d.blank_images)
    if is_text.any():
      text = d.text_batcher.batch_at(step)
      for key in ("inputs", "targets"):
        batch[key][is_text] = text[key][is_text]
      batch["loss_mask"][is_text] = 1.0
      batch["images"][is_text] = 0
    del batch["qtype"]
    lo = d.process_index * (d.batch_size // d.process_count)
    hi = lo + d.batch_size // d.process_count
    return {k: v[lo:hi] for k, v in batch.items()}

  def get_state(self) -> dict[str, int]:
    return {"step": self._step}

  def set_state(self, state: Mapping[str, Any]) -> None:
    step = state["step"]
    self._step = int(step.item() if isinstance(step, np.ndarray) else step)

  def __iter__(self) -> Iterator[dict]:
    return self

  def __next__(self) -> dict:
    batch = self.batch_at(self._step)
    self._step += 1
    return batch


class VisionData:
  """The image-text data of a run (config `data` with data.source='vision').

  Fields read: seq_len, batch_size, val_fraction, max_bytes and vision.*
  (source, question_types, text_fraction, blank_images, eval_examples,
  colour_question, folder). image_size and patch_size are model.vision's.
  """

  def __init__(self, data_cfg: Any, image_size: int, patch_size: int,
               seed: int = 0, process_index: int = 0, process_count: int = 1):
    v = _field(data_cfg, "vision")
    self.seed = seed
    self.seq_len = int(_field(data_cfg, "seq_len"))
    self.batch_size = int(_field(data_cfg, "batch_size"))
    self.process_index, self.process_count = pipeline._check_process(  # pylint: disable=protected-access
        self.batch_size, process_index, process_count)
    self.image_size = int(image_size)
    self.patches = patches_per_image(self.image_size, int(patch_size))
    self.source = _field(v, "source", "shapes")
    self.question_types = tuple(_field(v, "question_types").split(","))
    self.text_fraction = float(_field(v, "text_fraction", 0.0))
    self.blank_images = bool(_field(v, "blank_images", False))
    self.eval_examples = int(_field(v, "eval_examples"))
    # A config saved without the field comes from runs that named the kind.
    self.colour_question = _field(v, "colour_question", "kind")
    self.folder_examples = None
    if self.source == "folder":
      examples = load_image_folder(_field(v, "folder"), self.image_size)
      n_val = max(1, int(round(len(examples) *
                               float(_field(data_cfg, "val_fraction")))))
      self.folder_examples = {"train": examples[:-n_val],
                              "heldout": examples[-n_val:]}
      self.question_types = ("caption",)
    self.text_batcher = None
    if self.text_fraction > 0:
      max_bytes = int(_field(data_cfg, "max_bytes", 0)) or None
      splits = stdlib_corpus.load_stdlib_splits(
          float(_field(data_cfg, "val_fraction")), max_bytes)
      self.text_batcher = pipeline.TokenBatcher(
          splits["train"], self.seq_len, self.batch_size, seed)
    self.train = VisionBatcher(self)

  def example(self, split: str, index: int, qtype: str) -> Example:
    if self.folder_examples is not None:
      pool = self.folder_examples[split]
      return pool[index % len(pool)]
    return make_scene_example(self.seed, split, index, qtype,
                              self.image_size, self.colour_question)

  def train_example(self, index: int, qtype: str) -> Example:
    return self.example("train", index, qtype)

  def heldout_examples(self, n: int | None = None) -> list[Example]:
    """The first n held-out examples, question types in turn."""
    n = self.eval_examples if n is None else n
    if self.folder_examples is not None:  # at least one batch, cycling
      n = max(min(n, len(self.folder_examples["heldout"])), self.batch_size)
    types = self.question_types
    return [self.example("heldout", i // len(types), types[i % len(types)])
            for i in range(n)]

  def seen_examples(self, n: int | None = None) -> list[Example]:
    """n in-distribution examples (training compositions) that no training
    step draws (indices from SEEN_OFFSET): perception vs composition."""
    n = self.eval_examples if n is None else n
    types = self.question_types
    if self.folder_examples is not None:
      return self.folder_examples["train"][:n]
    return [self.example("train", SEEN_OFFSET + i // len(types),
                         types[i % len(types)]) for i in range(n)]

  def eval_batches(self, max_batches: int | None = None,
                   process_index: int = 0, process_count: int = 1,
                   examples: list[Example] | None = None
                   ) -> Iterator[dict[str, np.ndarray]]:
    """Held-out batches (with 'qtype'); the last partial batch is dropped."""
    examples = self.heldout_examples() if examples is None else examples
    n_batches = len(examples) // self.batch_size
    if n_batches == 0:
      raise ValueError(f"data.vision.eval_examples ({len(examples)} held-out "
                       f"examples) < data.batch_size ({self.batch_size})")
    if max_batches:
      n_batches = min(n_batches, max_batches)
    local = self.batch_size // process_count
    for b in range(n_batches):
      lo = b * self.batch_size + process_index * local
      yield collate(examples[lo:lo + local], self.seq_len, self.patches,
                    self.image_size, self.blank_images)

  def unigram_bpb(self, batches: int = 4) -> float:
    """Unigram bits per token of held-out loss-masked targets, counts from
    as many training batches (the baseline val_bpb is compared with)."""
    def masked(b):
      return b["targets"][b["loss_mask"] > 0]
    train = np.concatenate([masked(self.train.batch_at(s))
                            for s in range(batches)])
    held = np.concatenate([masked(b) for b in self.eval_batches(batches)])
    return pipeline.unigram_bits_per_byte(train, held, VOCAB_SIZE)


def chance_accuracy(qtype: str) -> float:
  """1 / (number of possible answers) of a question type on held-out data."""
  return 1.0 / len(ANSWERS[qtype]) if qtype in ANSWERS else 0.0
