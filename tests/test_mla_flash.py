"""The flash-attention path of MLA (model.mla.attention_impl 'pallas').

The Pallas flash kernel with segment ids (pallas_kernels/flash_attention.py),
run in the Pallas interpreter, against dense masked attention: the wrapper
alone with tiles smaller than T (several forward and backward tiles, a
document starting mid-tile, T padded, head dims unequal and not powers of
two), and the gated MLA layer ('interpret' against 'xla', the dense
same-document mask), packed and unpacked, RoPE on and off: outputs and
gradients wrt inputs and params, fp32. Plus which path 'auto' picks, and
the clear errors for values and head widths the kernel cannot take.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.default import get_config
from moe_jax.config_validation import ConfigError, validate_config
from moe_jax.layers.mla import GatedMLA, cudnn_takes
from moe_jax.layers.norms import rms_normalize
from pallas_kernels.flash_attention import (MAX_HEAD_WIDTH, flash_attention,
                                            forward_block, padded_length)

B, D, T = 2, 16, 40  # T pads to 48 (tiles of 16) or 64 (the default tiles)
# Per row, document lengths: one starts mid-tile (5), one ends the row with
# a 3-token document; the second row also starts a document at 16 (a tile
# boundary).
LENGTHS = ([5, 20, 15], [16, 21, 3])


def _segment_ids():
  return jnp.asarray(np.stack([np.repeat(np.arange(len(l)), l)
                               for l in LENGTHS]), jnp.int32)


def _dense_attention(q, k, v, segment_ids, scale):
  """Softmax attention with a dense causal (and same-document) mask."""
  t = q.shape[1]
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
  mask = jnp.tril(jnp.ones((t, t), bool))[None, None]
  if segment_ids is not None:
    mask = mask & (segment_ids[:, None, :, None] ==
                   segment_ids[:, None, None, :])
  p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def _assert_close(got, want, rtol, atol):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert np.all(np.isfinite(g)), "NaN or inf"
    np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


def test_tile_sizes():
  assert forward_block(128, 2) == 128          # bf16 up to width 128
  assert forward_block(256, 2) == 64
  assert forward_block(256, 4) == 32           # fp32, widest
  assert padded_length(40, 16, 16) == 48
  assert padded_length(40, 128, 32) == 64      # short T: next power of two
  assert padded_length(5, 128, 32) == 16
  assert padded_length(300, 128, 32) == 384
  assert padded_length(256, 128, 32) == 256    # already a multiple: no pad


def _rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_flash_attention_small_tiles_matches_dense(dtype):
  """Tiles of 16 rows: 3 forward and 3 backward tiles over T=48. The
  reference runs in fp32 on the same (rounded) inputs."""
  h, dqk, dv, scale = 2, 24, 20, 0.3
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(keys[0], (B, T, h, dqk), dtype)
  k = jax.random.normal(keys[1], (B, T, h, dqk), dtype)
  v = jax.random.normal(keys[2], (B, T, h, dv), dtype)
  ct = jax.random.normal(keys[3], (B, T, h, dv))
  ids = _segment_ids()

  def loss(fn):
    return jax.value_and_grad(
        lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * ct),
        argnums=(0, 1, 2))
  got = jax.jit(loss(lambda q, k, v: flash_attention(
      q, k, v, ids, scale=scale, interpret=True, block=16,
      backward_block=16)))(q, k, v)
  f32 = [a.astype(jnp.float32) for a in (q, k, v)]
  want = loss(lambda q, k, v: _dense_attention(q, k, v, ids, scale))(*f32)
  if dtype == jnp.float32:
    _assert_close(got, want, rtol=1e-4, atol=1e-5)
  else:
    o = flash_attention(q, k, v, ids, scale=scale, interpret=True, block=16,
                        backward_block=16)
    assert o.dtype == dtype
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert np.all(np.isfinite(np.asarray(g, np.float32))), "NaN or inf"
      assert _rel_err(g, w) < 1e-2


def test_flash_attention_rejects_bad_input():
  q = jnp.zeros((1, 16, 1, 8))
  with pytest.raises(ValueError, match="segment_ids must be"):
    flash_attention(q, q, q, jnp.zeros((1, 8), jnp.int32), scale=1.0)
  with pytest.raises(ValueError, match="above the kernel's 256"):
    wide = jnp.zeros((1, 16, 1, MAX_HEAD_WIDTH + 1))
    flash_attention(wide, wide, q, scale=1.0)
  with pytest.raises(ValueError, match="block must be a power of two"):
    flash_attention(q, q, q, scale=1.0, block=24)


def _mla(rope_dim, impl):
  return GatedMLA(d_model=D, num_heads=2, kv_lora_rank=8,
                  qk_nope_head_dim=8, v_head_dim=12,
                  qk_rope_head_dim=rope_dim, attention_impl=impl)


@pytest.mark.parametrize("rope_dim,packed", [(0, True), (4, True),
                                             (4, False)])
def test_mla_flash_matches_xla(rope_dim, packed):
  x = jax.random.normal(jax.random.PRNGKey(1), (B, T, D))
  ct = jax.random.normal(jax.random.PRNGKey(2), (B, T, D))
  ids = _segment_ids() if packed else None
  params = jax.jit(_mla(rope_dim, "xla").init)(jax.random.PRNGKey(3),
                                               x[:, :4])

  def value_and_grad(impl):
    def loss(params, x):
      y = _mla(rope_dim, impl).apply(params, x, segment_ids=ids)
      return jnp.sum(y * ct), y
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  (_, y), grads = value_and_grad("interpret")(params, x)
  (_, y_ref), grads_ref = value_and_grad("xla")(params, x)
  _assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
  _assert_close(grads, grads_ref, rtol=1e-4, atol=1e-5)


def test_auto_picks_cudnn_or_flash_on_gpu(monkeypatch):
  # jax.nn.dot_product_attention's own default is XLA ([B, H, T, T] scores),
  # so "auto" names cuDNN on a GPU wherever cuDNN takes the inputs.
  mla = GatedMLA(d_model=D, num_heads=2, kv_lora_rank=8, qk_nope_head_dim=16,
                 v_head_dim=16)
  bf16, f32 = jnp.bfloat16, jnp.float32
  assert mla._resolved_impl(True, bf16) == "xla"       # CPU: dense mask
  assert mla._resolved_impl(False, bf16) == "xla"
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert mla._resolved_impl(True, bf16) == "pallas"    # packed: ids per tile
  assert mla._resolved_impl(False, bf16) == "cudnn"
  assert mla._resolved_impl(False, f32) == "xla"       # cuDNN: bf16/fp16 only
  assert _mla(0, "auto")._resolved_impl(False, bf16) == "xla"     # width 12
  # Padded width 200 + 64: above cuDNN's 128 (this host has no compute
  # capability) and the flash kernel's 256: XLA is the only one left.
  wide = GatedMLA(d_model=D, num_heads=2, kv_lora_rank=8,
                  qk_nope_head_dim=200, qk_rope_head_dim=64, v_head_dim=8)
  assert wide._resolved_impl(True, bf16) == "xla"
  assert wide._resolved_impl(False, bf16) == "xla"
  # Width 192 (RoPE on gpu_1b's heads): too wide for cuDNN before Hopper
  # (this host has no compute capability); the flash kernel when packed.
  rope = GatedMLA(d_model=D, num_heads=2, kv_lora_rank=8,
                  qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
  assert rope._resolved_impl(False, bf16) == "xla"
  assert rope._resolved_impl(True, bf16) == "pallas"
  assert _mla(0, "xla")._resolved_impl(True, bf16) == "xla"
  assert _mla(0, "cudnn")._resolved_impl(True, bf16) == "xla"
  assert _mla(0, "cudnn")._resolved_impl(False, bf16) == "cudnn"
  assert _mla(0, "pallas")._resolved_impl(False, bf16) == "pallas"
  assert not cudnn_takes(bf16, 100) and cudnn_takes(jnp.float16, 128)


def test_mla_flash_errors_name_the_field():
  x = jnp.zeros((1, 8, D))
  wide = GatedMLA(d_model=D, num_heads=2, kv_lora_rank=8,
                  qk_nope_head_dim=200, qk_rope_head_dim=64, v_head_dim=8,
                  attention_impl="pallas")
  with pytest.raises(ValueError, match="model.mla.attention_impl='pallas'"):
    jax.eval_shape(wide.init, jax.random.PRNGKey(0), x)
  with pytest.raises(ValueError, match="model.mla.attention_impl must be"):
    jax.eval_shape(_mla(0, "flash").init, jax.random.PRNGKey(0), x)

  config = get_config("tiny")
  config.model.mla.attention_impl = "flash"
  with pytest.raises(ConfigError, match="model.mla.attention_impl must be one"):
    validate_config(config)
  config.model.mla.attention_impl = "pallas"
  validate_config(config)
  config.model.mla.qk_nope_head_dim = MAX_HEAD_WIDTH - 8
  config.model.mla.qk_rope_head_dim = 8
  validate_config(config)                       # exactly the widest tile
  config.model.mla.qk_rope_head_dim = 10
  with pytest.raises(ConfigError, match="model.mla.attention_impl='pallas' "
                     "needs max"):
    validate_config(config)


def test_logn_scale_matches_a_per_position_reference():
  """logn_scale_len = L: queries at position p times max(1, log(p+1)/log L),
  against attention written out from the params; L >= T changes nothing;
  the flash kernel (packed) agrees with XLA."""
  x = jax.random.normal(jax.random.PRNGKey(4), (B, T, D))
  mla = lambda n, impl="xla": GatedMLA(  # noqa: E731
      d_model=D, num_heads=2, kv_lora_rank=8, qk_nope_head_dim=8,
      v_head_dim=12, logn_scale_len=n, attention_impl=impl)
  params = mla(0).init(jax.random.PRNGKey(5), x[:, :4])
  y = mla(6).apply(params, x)

  p = nn.meta.unbox(params)["params"]
  c = rms_normalize(x @ p["kv_down"]["kernel"]) * p["kv_norm"]["scale"]
  q = (x @ p["q_proj"]["kernel"]).reshape(B, T, 2, 8)
  k = (c @ p["k_up"]["kernel"]).reshape(B, T, 2, 8)
  v = (c @ p["v_up"]["kernel"]).reshape(B, T, 2, 12)
  pos = np.arange(T)
  s = np.maximum(1.0, np.log(pos + 1.0) / np.log(6.0))
  assert s[5] == 1.0 and s[6] > 1.0
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * s[:, None] / np.sqrt(8.0)
  logits = jnp.where(pos[:, None] >= pos[None, :], logits, -jnp.inf)
  o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), v)
  gate = jax.nn.sigmoid(x @ p["gate_proj"]["kernel"])
  want = (o.reshape(B, T, 24) * gate) @ p["o_proj"]["kernel"]
  _assert_close(y, want, rtol=1e-4, atol=1e-5)

  np.testing.assert_array_equal(mla(T).apply(params, x),
                                mla(0).apply(params, x))
  ids = _segment_ids()
  _assert_close(mla(6, "interpret").apply(params, x, segment_ids=ids),
                mla(6).apply(params, x, segment_ids=ids), rtol=1e-4,
                atol=1e-5)
  config = get_config("tiny")
  config.model.mla.logn_scale_len = 1
  with pytest.raises(ConfigError, match="model.mla.logn_scale_len must be 0"):
    validate_config(config)
