"""Visual input: data, patchify, the image front end in the model, loss masks."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import load_config, set_field
from moe_jax import config_validation
from moe_jax.config_validation import ConfigError, validate_config
from moe_jax.data import vision as vd
from moe_jax.eval.step import cross_entropy
from moe_jax.eval.vision import (answers_right, candidate_log_likelihoods,
                                 confusion_matrix)
from moe_jax.layers.vision import patchify, place_image_tokens, unpatchify
from moe_jax import sharding
from moe_jax.model import HybridLM, build_model

S, P_SIZE = 32, 8
PATCHES = (S // P_SIZE) ** 2


def test_patchify_round_trip_and_raster_order():
  x = np.random.default_rng(0).normal(size=(2, 3, 16, 24, 3)).astype(
      np.float32)
  p = patchify(jnp.asarray(x), 4)
  assert p.shape == (2, 3, 4 * 6, 4 * 4 * 3)
  np.testing.assert_array_equal(np.asarray(unpatchify(p, 4, 16, 24)), x)
  # Patch (row 1, column 2) is the image block [4:8, 8:12], flattened.
  np.testing.assert_array_equal(np.asarray(p[1, 2, 1 * 6 + 2]),
                                x[1, 2, 4:8, 8:12].reshape(-1))


def test_place_image_tokens_matches_a_loop():
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, 256, (3, 20))
  tokens[0, 2:6] = vd.IMAGE_TOKEN
  tokens[1, [1, 7, 8, 19]] = vd.IMAGE_TOKEN  # scattered, still in order
  x = rng.normal(size=(3, 20, 5)).astype(np.float32)
  patches = rng.normal(size=(3, 4, 5)).astype(np.float32)
  want = x.copy()
  for b in range(3):
    k = 0
    for t in range(20):
      if tokens[b, t] == vd.IMAGE_TOKEN:
        want[b, t] = patches[b, k]
        k += 1
  got = place_image_tokens(jnp.asarray(x), jnp.asarray(tokens),
                           jnp.asarray(patches), vd.IMAGE_TOKEN)
  np.testing.assert_array_equal(np.asarray(got), want)


def _examples(split, n):
  return [vd.make_scene_example(0, split, i, q, S)
          for i in range(n) for q in vd.QUESTION_TYPES]


def test_batch_layout_shapes_and_loss_mask():
  examples = _examples("train", 3)
  batch = vd.collate(examples, 192, PATCHES, S)
  b = len(examples)
  assert batch["inputs"].shape == batch["targets"].shape == (b, 192)
  assert batch["loss_mask"].shape == (b, 192)
  assert batch["images"].shape == (b, 1, S, S, 3)
  assert batch["images"].dtype == np.uint8
  np.testing.assert_array_equal(batch["inputs"][:, 1:],
                                batch["targets"][:, :-1])
  for row, e in enumerate(examples):
    inputs, mask = batch["inputs"][row], batch["loss_mask"][row]
    assert (inputs == vd.IMAGE_TOKEN).sum() == PATCHES
    assert inputs[1] == vd.BOI and inputs[2 + PATCHES] == vd.EOI
    # The loss sees exactly the answer bytes and the closing EOS.
    want = list(e.answer.encode()) + [vd.EOS]
    assert batch["targets"][row][mask > 0].tolist() == want
    assert not (mask[inputs == vd.IMAGE_TOKEN] > 0).any()


def test_scenes_are_deterministic_and_answers_match_the_objects():
  a = vd.make_scene_example(3, "train", 5, "colour", S)
  b = vd.make_scene_example(3, "train", 5, "colour", S)
  np.testing.assert_array_equal(a.images, b.images)
  assert (a.prompt, a.answer) == (b.prompt, b.answer)
  for e in _examples("train", 20):
    kinds = [o.kind for o in e.objects]
    quadrants = [o.quadrant for o in e.objects]
    assert len(set(quadrants)) == len(quadrants)  # one object per quadrant
    if e.qtype == "count":
      assert e.answer == str(kinds.count(e.prompt.split()[3][:-2]))
    if e.qtype == "colour":
      target = [o for o in e.objects if e.prompt.startswith(
          f"Q: what colour is the {vd.QUADRANTS[o.quadrant]} object?")]
      assert len(target) == 1 and target[0].colour == e.answer
    # Every object's colour is drawn somewhere in the image.
    for o in e.objects:
      assert (e.images[0] == vd.COLOURS[o.colour]).all(-1).any()


def test_heldout_compositions_never_appear_in_training():
  train = _examples("train", 60)
  held = _examples("heldout", 60)
  pairs = lambda e: {(o.kind, o.colour) for o in e.objects}
  assert all(not pairs(e) & vd.HELD_OUT_PAIRS for e in train)
  assert all(pairs(e) & vd.HELD_OUT_PAIRS for e in held)
  # Held-out questions name or ask about the held-out object.
  for e in held:
    if e.qtype == "colour":
      asked = [o for o in e.objects
               if f" the {vd.QUADRANTS[o.quadrant]} object?" in e.prompt]
      assert [(o.kind, o.colour) for o in asked] == [(asked[0].kind,
                                                      e.answer)]
      assert (asked[0].kind, e.answer) in vd.HELD_OUT_PAIRS
  # Every kind and every colour of a held-out pair appears in training with
  # several partners, and held-out pairs are a minority per kind and per
  # colour: "kind X is never colour Y" is a fact about a few pairs, not a
  # rule about a kind or a colour.
  seen = {(o.kind, o.colour) for e in train for o in e.objects}
  assert seen == {(k, c) for k in vd.KINDS for c in vd.COLOURS} - \
      vd.HELD_OUT_PAIRS
  for kind, colour in vd.HELD_OUT_PAIRS:
    held_k = sum(k == kind for k, _ in vd.HELD_OUT_PAIRS)
    held_c = sum(c == colour for _, c in vd.HELD_OUT_PAIRS)
    seen_k = sum(k == kind for k, _ in seen)
    seen_c = sum(c == colour for _, c in seen)
    assert seen_k >= 3 and seen_c >= 2
    assert held_k < seen_k and held_c < seen_c


def test_training_colours_are_equally_frequent():
  """Over the objects of training scenes every colour is 1/6 (uniform per
  kind would give magenta and cyan, allowed for every kind, 1/5 each and
  the others 3/20)."""
  for kind, (colours, weights) in vd.TRAIN_COLOURS.items():
    want = [1 / 6 if all((k, c) not in vd.HELD_OUT_PAIRS for k in vd.KINDS)
            else 2 / 9 for c in colours]
    np.testing.assert_allclose(weights, want, rtol=1e-9)
    assert kind in vd.KINDS and not {(kind, c) for c in colours} & \
        vd.HELD_OUT_PAIRS
  colours = [o.colour for i in range(2000)
             for o in vd.make_scene_example(1, "train", i, "colour",
                                            S).objects]
  assert len(colours) > 3500
  freq = np.array([colours.count(c) for c in vd.COLOURS]) / len(colours)
  np.testing.assert_allclose(freq, 1 / 6, atol=0.025)  # 4 sigma
  # No weights make every colour equal when colours are left to too few
  # kinds: y and z need 2/3 each, and only kind b (weight 1) has them.
  with pytest.raises(ValueError, match=r"colours \['y', 'z'\] to 1 kind"):
    vd.balanced_colour_weights(("a", "b"), ("x", "y", "z"),
                               {("a", "y"), ("a", "z"), ("b", "x")})


def test_colour_question_names_the_object_by_position_or_kind():
  """Same scene either way; only the question's wording changes."""
  for i in range(20):
    for split in vd.SPLITS:
      by_pos = vd.make_scene_example(0, split, i, "colour", S)
      by_kind = vd.make_scene_example(0, split, i, "colour", S, "kind")
      np.testing.assert_array_equal(by_pos.images, by_kind.images)
      assert by_pos.objects == by_kind.objects
      assert by_pos.answer == by_kind.answer
      (asked,) = [o for o in by_kind.objects if o.colour == by_kind.answer
                  and f" the {o.kind}?" in by_kind.prompt]
      assert by_pos.prompt == (f"Q: what colour is the "
                               f"{vd.QUADRANTS[asked.quadrant]} object? A: ")
  with pytest.raises(ValueError, match="colour_question must be one of"):
    vd.make_scene_example(0, "train", 0, "colour", S, "size")
  # The config decides; a saved config without the field named the kind.
  config = load_config("vision.py", "tiny,smoke")
  config.data.vision.text_fraction = 0.0
  prompt = lambda: vd.VisionData(config.data, S, P_SIZE).example(
      "heldout", 0, "colour").prompt
  assert prompt() == vd.make_scene_example(0, "heldout", 0, "colour",
                                           S).prompt
  del config.data.vision["colour_question"]
  assert prompt() == vd.make_scene_example(0, "heldout", 0, "colour", S,
                                           "kind").prompt


@pytest.fixture(scope="module")
def vision_model():
  """(config, model, boxed param shapes, params, router_state, apply).

  Params with init's structure filled from numpy: compiling the random
  initialisers would take longer than the tests. apply(params, tokens,
  images) is jitted.
  """
  config = load_config("vision.py", "tiny,smoke,vit")
  validate_config(config)
  model = build_model(config)
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0),
                          jnp.zeros((2, 48), jnp.int32))
  rng = np.random.default_rng(0)
  fill = lambda s: jnp.asarray(
      rng.standard_normal(s.shape) / np.sqrt(s.shape[-2]) if len(s.shape) > 1
      else np.ones(s.shape), s.dtype)
  params = jax.tree.map(fill, nn.meta.unbox(shapes["params"]))
  router_state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                              shapes["router_state"])
  apply = jax.jit(lambda p, t, im: model.apply(
      {"params": p, "router_state": router_state}, t, images=im))
  return config, model, shapes, params, router_state, apply


def _interleaved_tokens(rng, batch=2, length=48):
  """Text, image 0, text, image 1, text: [BOS t*5 BOI I*16 EOI t*3 BOI ...]."""
  tokens = rng.integers(0, 256, (batch, length)).astype(np.int32)
  tokens[:, 0] = vd.BOS
  for start in (6, 27):
    tokens[:, start] = vd.BOI
    tokens[:, start + 1:start + 1 + PATCHES] = vd.IMAGE_TOKEN
    tokens[:, start + 1 + PATCHES] = vd.EOI
  return tokens  # placeholders at 7..22 and 28..43


def test_vision_model_shapes_and_params_have_logical_axes(vision_model):
  config, _, shapes, params, _, apply = vision_model
  rng = np.random.default_rng(2)
  images = rng.integers(0, 256, (2, 2, S, S, 3), dtype=np.uint8)
  logits = apply(params, jnp.asarray(_interleaved_tokens(rng)),
                 jnp.asarray(images))
  assert logits.shape == (2, 48, vd.VOCAB_SIZE)
  assert np.isfinite(np.asarray(logits)).all()
  # Every vision param is boxed with one logical name per dim.
  boxed = jax.tree.leaves(shapes["params"]["vision"],
                          is_leaf=lambda x: isinstance(x, nn.Partitioned))
  v = config.model.vision  # 4 of the linear encoder, 6 per ViT block, 1
  assert v.encoder == "vit" and len(boxed) == 4 + 6 * v.num_layers + 1
  for leaf in boxed:
    assert isinstance(leaf, nn.LogicallyPartitioned)
    assert len(leaf.names) == leaf.value.ndim
  assert {"embed", "mlp"} <= {n for leaf in boxed for n in leaf.names}
  # The default rules shard them like the rest: embed over fsdp, mlp and
  # heads over tensor.
  mesh_cfg = config.mesh.copy_and_resolve_references()
  mesh_cfg.num_devices, mesh_cfg.fsdp, mesh_cfg.tensor = 4, 2, 2
  specs = sharding.param_shardings(shapes["params"]["vision"],
                                   sharding.make_mesh(mesh_cfg), None)
  assert specs["patch_embed"]["kernel"].spec == P(None, "fsdp")
  assert specs["proj_in"]["kernel"].spec == P("fsdp", "tensor")
  assert specs["vit_0"]["qkv"]["kernel"].spec == P("fsdp", "tensor")


def test_later_image_never_changes_earlier_logits(vision_model):
  _, _, _, params, _, apply_p = vision_model
  apply = lambda t, im: apply_p(params, t, im)
  rng = np.random.default_rng(3)
  tokens = jnp.asarray(_interleaved_tokens(rng))
  images = rng.integers(0, 256, (2, 2, S, S, 3), dtype=np.uint8)
  base = np.asarray(apply(tokens, jnp.asarray(images)))
  # Image 1 (placeholders from 28) changes: text and image 0 before it stay.
  changed = images.copy()
  changed[:, 1] = 255 - changed[:, 1]
  out = np.asarray(apply(tokens, jnp.asarray(changed)))
  np.testing.assert_allclose(out[:, :28], base[:, :28], rtol=0, atol=1e-6)
  assert not np.allclose(out[:, 28:], base[:, 28:])  # the test can fail
  # A text token after image 0 never changes image 0's logits.
  perturbed = tokens.at[:, 25].set((tokens[:, 25] + 97) % 256)
  out = np.asarray(apply(perturbed, jnp.asarray(images)))
  np.testing.assert_allclose(out[:, :25], base[:, :25], rtol=0, atol=1e-6)
  assert not np.allclose(out[:, 25:], base[:, 25:])


def test_prefill_with_images_matches_the_training_forward(vision_model):
  """Decoding reads images in the prompt: moe_jax.decode.prefill."""
  from moe_jax import decode
  _, model, _, params, router_state, apply = vision_model
  rng = np.random.default_rng(5)
  tokens = jnp.asarray(_interleaved_tokens(rng))
  images = jnp.asarray(rng.integers(0, 256, (2, 2, S, S, 3)), jnp.uint8)
  cache = decode.init_cache(model, params, router_state, 2, 48)
  logits, _ = jax.jit(lambda c, t, im: decode.prefill(
      model, params, router_state, c, t, new_sequence=True, images=im))(
          cache, tokens, images)
  np.testing.assert_allclose(np.asarray(logits),
                             np.asarray(apply(params, tokens, images)),
                             rtol=1e-4, atol=1e-4)


def test_vision_off_text_path_is_unchanged(vision_model):
  config, model, _, params, router_state, apply = vision_model
  rng = np.random.default_rng(4)
  text = jnp.asarray(rng.integers(0, 256, (2, 48)), jnp.int32)
  off_cfg = config.model.to_dict()
  off_cfg["vision"]["encoder"] = "none"
  off = HybridLM(ml_collections.FrozenConfigDict(off_cfg))
  text_params = {k: v for k, v in params.items() if k != "vision"}
  shapes = jax.eval_shape(off.init, jax.random.PRNGKey(0), text)
  assert "vision" not in shapes["params"]
  assert (jax.tree.structure(nn.meta.unbox(shapes["params"])) ==
          jax.tree.structure(text_params))
  # Without images the vision model runs exactly the text model's program.
  run = lambda m: lambda p, t: m.apply(
      {"params": p, "router_state": router_state}, t)
  assert (str(jax.make_jaxpr(run(model))(text_params, text)) ==
          str(jax.make_jaxpr(run(off))(text_params, text)))
  # Images with no placeholder in the row change nothing.
  text_only = np.asarray(jax.jit(run(off))(text_params, text))
  images = jnp.asarray(rng.integers(0, 256, (2, 2, S, S, 3)), jnp.uint8)
  np.testing.assert_allclose(np.asarray(apply(params, text, images)),
                             text_only, rtol=0, atol=1e-6)


def test_masked_cross_entropy_and_gradient_match_a_reference():
  rng = np.random.default_rng(5)
  logits = rng.normal(size=(3, 7, 11)).astype(np.float32)
  targets = rng.integers(0, 11, (3, 7))
  mask = (rng.random((3, 7)) < 0.4).astype(np.float32)
  mask[0, 0] = 1.0

  def reference(lg):  # mean of -log softmax over the masked-in positions
    logp = jax.nn.log_softmax(lg, -1)
    picked = [-logp[b, t, targets[b, t]] for b, t in zip(*np.nonzero(mask))]
    return jnp.stack(picked).mean()

  got, grad = jax.jit(jax.value_and_grad(lambda lg: cross_entropy(
      lg, jnp.asarray(targets), jnp.asarray(mask))))(jnp.asarray(logits))
  want, want_grad = jax.jit(jax.value_and_grad(reference))(
      jnp.asarray(logits))
  np.testing.assert_allclose(got, want, rtol=1e-5)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
  assert not np.asarray(grad)[mask == 0].any()  # masked positions: no grad
  # Changing logits or targets where the mask is 0 leaves the loss alone.
  noisy = np.where(mask[..., None] > 0, logits, 100 * logits)
  other = np.where(mask > 0, targets, (targets + 1) % 11)
  np.testing.assert_allclose(cross_entropy(
      jnp.asarray(noisy), jnp.asarray(other), jnp.asarray(mask)), got,
                             rtol=1e-6)
  # An all-ones mask is the unmasked mean.
  np.testing.assert_allclose(
      cross_entropy(jnp.asarray(logits), jnp.asarray(targets),
                    jnp.ones((3, 7))),
      cross_entropy(jnp.asarray(logits), jnp.asarray(targets)), rtol=1e-6)


def test_answers_right_needs_every_masked_position():
  targets = np.array([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
  mask = np.array([[0, 1, 1], [0, 1, 1], [0, 0, 0]], np.float32)
  pred = np.array([[0, 2, 3], [1, 2, 0], [1, 2, 3]])  # row 0 right only
  logits = jax.nn.one_hot(pred, 5)
  np.testing.assert_array_equal(
      answers_right(logits, jnp.asarray(targets), jnp.asarray(mask)),
      [True, False, False])


def test_candidate_log_likelihoods_match_a_loop():
  """Whole-answer scores of a bigram "model" (logits = table[input]) against
  a sum over the answer's bytes and EOS; 'blu' is a prefix of 'blue'."""
  table = np.random.default_rng(7).normal(size=(vd.VOCAB_SIZE,
                                                vd.VOCAB_SIZE))
  logits_fn = lambda batch: table[batch["inputs"]]
  examples = [vd.make_scene_example(0, "heldout", i, "colour", S)
              for i in range(3)]
  candidates = ("blue", "blu", "red", "yellow", "magenta")
  got = candidate_log_likelihoods(logits_fn, examples, candidates, 80,
                                  PATCHES, S, batch_size=4)
  logp = table - np.log(np.exp(table).sum(-1, keepdims=True))
  for i, e in enumerate(examples):
    prompt = vd.prompt_ids(e, PATCHES)
    for j, c in enumerate(candidates):
      ids = prompt + list(c.encode()) + [vd.EOS]
      want = sum(logp[ids[t], ids[t + 1]]
                 for t in range(len(prompt) - 1, len(ids) - 1))
      np.testing.assert_allclose(got[i, j], want, rtol=1e-5)
  assert len(set(got[0].round(4))) == len(candidates)  # the test can fail
  np.testing.assert_array_equal(
      confusion_matrix(["red", "blue", "red", "red"],
                       ["red", "red", "blue", "red"], ("red", "blue")),
      [[2, 1], [1, 0]])


def test_image_folder_loader_and_its_errors(tmp_path):
  from PIL import Image
  img = np.random.default_rng(6).integers(0, 256, (S, S, 3), dtype=np.uint8)
  Image.fromarray(img).save(tmp_path / "a.png")
  np.save(tmp_path / "b.npy", img)
  with pytest.raises(vd.VisionDataError, match="captions.txt is missing"):
    vd.load_image_folder(str(tmp_path), S)
  (tmp_path / "captions.txt").write_text("a.png\ta red thing\nb.npy\tnoise\n")
  examples = vd.load_image_folder(str(tmp_path), S)
  np.testing.assert_array_equal(examples[0].images[0], img)
  assert examples[1].answer == "noise"
  with pytest.raises(vd.VisionDataError, match="not a directory"):
    vd.load_image_folder(str(tmp_path / "nope"), S)
  np.save(tmp_path / "b.npy", img[:16])
  with pytest.raises(vd.VisionDataError, match=r"shape must be \(32, 32, 3\)"):
    vd.load_image_folder(str(tmp_path), S)
  np.save(tmp_path / "b.npy", img.astype(np.float32))
  with pytest.raises(vd.VisionDataError, match="dtype must be uint8"):
    vd.load_image_folder(str(tmp_path), S)
  (tmp_path / "captions.txt").write_text("c.png\tmissing\n")
  with pytest.raises(vd.VisionDataError, match="c.png does not exist"):
    vd.load_image_folder(str(tmp_path), S)
  with pytest.raises(ValueError, match="raise data.seq_len"):
    vd.encode_example(examples[0], 20, PATCHES)


@pytest.mark.parametrize("field,value,match", [
    ("model.vision.encoder", "cnn", "model.vision.encoder must be one of"),
    ("model.vision.patch_size", 5, "model.vision.patch_size=5 must divide"),
    ("model.vocab_size", 259, "model.vocab_size must be >= 262"),
    ("data.vision.question_types", "count,shape",
     "data.vision.question_types must be"),
    ("data.vision.source", "web", "data.vision.source must be one of"),
    ("data.vision.colour_question", "size",
     "data.vision.colour_question must be one of"),
    ("data.vision.text_fraction", 1.0, "data.vision.text_fraction"),
    ("curriculum.stage_end_factor", 2, "trains at one length"),
])
def test_bad_vision_config_is_a_clear_error(field, value, match):
  config = load_config("vision.py", "tiny,smoke")
  set_field(config, field, value)
  with pytest.raises(ConfigError, match=match):
    validate_config(config)


def test_vision_data_needs_an_encoder_and_names_agree():
  config = load_config("vision.py", "tiny,smoke")
  config.model.vision.encoder = "none"
  with pytest.raises(ConfigError, match="data.source='vision' needs"):
    validate_config(config)
  assert config_validation.VISION_VOCAB_SIZE == vd.VOCAB_SIZE
  assert config_validation.VISION_QUESTION_TYPES == vd.QUESTION_TYPES


def test_training_loop_and_notebook_on_a_tiny_run(tmp_path, monkeypatch):
  """experiments/train.py's loop on image-text batches (text rows mixed in),
  held-out accuracy per question type, then notebooks/05_vision.ipynb."""
  from conftest import execute_notebook
  from moe_jax.train.loop import train_and_evaluate
  config = load_config("vision.py", "tiny,smoke")
  config.data.vision.text_fraction = 0.5
  result = train_and_evaluate(config, str(tmp_path))
  assert result["step"] == config.train.steps
  assert np.isfinite(result["loss"]) and np.isfinite(result["val_loss"])
  for q in config.data.vision.question_types.split(","):
    assert 0.0 <= result[f"acc/{q}"] <= 1.0
    assert result[f"chance/{q}"] == vd.chance_accuracy(q) > 0
  monkeypatch.setenv("MOE_JAX_WORKDIR", str(tmp_path))
  monkeypatch.setenv("MOE_JAX_BASELINE_WORKDIR", str(tmp_path / "none"))
  _, outputs = execute_notebook("05_vision.ipynb")
  assert (tmp_path / "vision_examples.png").exists()
  assert "restored step 4" in outputs and "chance" in outputs


def test_training_batches_mix_text_rows_by_the_configured_ratio():
  config = load_config("vision.py", "tiny,smoke")
  config.data.batch_size, config.data.vision.text_fraction = 16, 0.25
  data = vd.VisionData(config.data, S, P_SIZE, seed=1)
  batches = [data.train.batch_at(s) for s in range(8)]
  again = data.train.batch_at(3)
  for key in batches[3]:
    np.testing.assert_array_equal(again[key], batches[3][key])  # pure
  n_text = 0
  for b in batches:
    is_image = (b["inputs"] == vd.IMAGE_TOKEN).any(1)
    text = ~is_image
    n_text += text.sum()
    assert (b["loss_mask"][text] == 1).all()        # loss on every byte
    assert not b["images"][text].any()               # no image
    assert (b["inputs"][is_image] == vd.IMAGE_TOKEN).sum(1).tolist() == [
        PATCHES] * is_image.sum()
    assert (b["loss_mask"][is_image].sum(1) >= 2).all()  # answer + EOS
    assert b["images"][is_image].reshape(is_image.sum(), -1).any(1).all()
  assert 0.1 < n_text / (8 * 16) < 0.4
