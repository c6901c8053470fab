"""Image-text: the hybrid model reads image patches as tokens.

Generated scenes (moe_jax/data/vision.py: shapes, digits, colours in four
quadrants) with questions of five types; a quarter of the rows are text-only
windows of the embedded corpus. Loss on answers only (and on every token of
the text rows). Evaluation: held-out answer accuracy per question type
(acc/<type>, against chance/<type>) on scenes whose (kind, colour) pairs
never appear in training.

Launch (from the repo root):
  python -m experiments.train --config=configs/vision.py --workdir=runs/vision
Baseline that sees the question but not the image (images zeroed):
  python -m experiments.train --config=configs/vision.py:text_only --workdir=runs/vision_text_only
Variants: vit (a 2-block ViT encoder instead of the linear patch embedding),
captions (adds 'describe the image.' examples; longer sequences), folder
(your own images: --config.data.vision.folder=DIR with DIR/captions.txt),
gpu (one GPU: d_model 256, 8 layers, bf16), tiny and smoke (tests,
notebooks), colour_only (colour questions only, no text rows) and
colour_by_kind (colour questions name the kind, not the position).
  python -m experiments.train --config=configs/vision.py:gpu --workdir=runs/vision_gpu
Colour on CPU (results/vision.md), then what the runs answer:
  python -m experiments.train --config=configs/vision.py:colour_only --workdir=runs/colour
  python -m experiments.train --config=configs/vision.py:colour_only,text_only --workdir=runs/colour_text_only
  python -m experiments.train --config=configs/vision.py:colour_only,colour_by_kind --workdir=runs/colour_by_kind
  python -m experiments.vision_colour --workdir=runs/colour
"""
from moe_jax.config_base import (apply_variant, base_config,
                                 load_config_file, setter)

_TYPES = "count,colour,position,larger,digit"


def _tiny(config):
  """configs/default.py's tiny model with a tiny encoder."""
  load_config_file("default.py", __file__).VARIANTS["tiny"](config)
  setter(**{"model.vision.width": 16, "model.vision.mlp_dim": 32,
            "model.vision.num_layers": 1})(config)


VARIANTS = {
    "linear": setter(**{"model.vision.encoder": "linear"}),
    "vit": setter(**{"model.vision.encoder": "vit"}),
    "text_only": setter(**{"data.vision.blank_images": True}),
    "colour_only": setter(**{"data.vision.question_types": "colour",
                             "data.vision.text_fraction": 0.0}),
    # Colour questions name the kind ("what colour is the circle?"): the
    # held-out answer is the colour training never gives that kind.
    "colour_by_kind": setter(**{"data.vision.colour_question": "kind"}),
    "captions": setter(**{"data.vision.question_types": _TYPES + ",caption",
                          "data.seq_len": 192}),
    "folder": setter(**{"data.vision.source": "folder",
                        "data.vision.text_fraction": 0.0}),
    "tiny": _tiny,
    # One GPU: d_model 256, 8 layers, bf16, 64 sequences per step.
    "gpu": setter(**{"model.d_model": 256, "model.num_layers": 8,
                     "model.dtype": "bfloat16", "model.kda.num_heads": 2,
                     "model.kda.decay_rank": 32, "model.kda.gate_rank": 32,
                     "model.mla.num_heads": 4, "model.mla.kv_lora_rank": 128,
                     "model.mla.qk_nope_head_dim": 64,
                     "model.mla.v_head_dim": 64, "model.moe.num_experts": 32,
                     "model.moe.d_expert": 128, "model.moe.d_shared": 256,
                     "model.vision.width": 128, "model.vision.mlp_dim": 256,
                     "data.batch_size": 64, "data.vision.eval_examples": 1024,
                     "train.steps": 3000, "train.learning_rate": 2e-3,
                     "train.warmup_steps": 100, "train.log_every": 100,
                     "train.eval_every": 1000, "train.eval_batches": 16,
                     "train.checkpoint_every": 3000}),
    "smoke": setter(**{"train.steps": 4, "train.warmup_steps": 1,
                       "train.log_every": 2, "train.eval_every": 4,
                       "train.checkpoint_every": 4, "train.eval_batches": 2,
                       "data.batch_size": 4, "data.max_bytes": 200_000,
                       "data.vision.eval_examples": 8,
                       "train.progress_bar": False}),
}


def get_config(arg: str | None = None):
  """Vision config; `arg` names variants to apply, e.g. 'text_only,tiny'."""
  c = base_config()
  c.model.vocab_size = 262          # bytes, PAD, BOS, EOS, BOI, EOI, IMAGE
  c.model.vision.encoder = "linear"
  c.model.vision.image_size = 32
  c.model.vision.patch_size = 8     # 16 image tokens per image
  c.data.source = "vision"
  c.data.vision.question_types = _TYPES
  c.data.seq_len = 96
  c.data.max_bytes = 2_000_000      # corpus for the text-only rows
  c.train.steps = 600
  c.train.warmup_steps = 40
  c.train.eval_every = 200
  c.train.eval_batches = 32         # 512 held-out examples
  return apply_variant(c, arg, VARIANTS)
