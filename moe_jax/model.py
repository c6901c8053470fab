"""The hybrid KDA/MLA sparse-MoE language model.

A stack of `num_layers` transformer layers. Each layer is two *sublayers*: a
token mixer (KDA or gated MLA, by `layer_pattern`, default 3 KDA : 1 MLA) and
a feed-forward (the sparse MoE, or a dense SwiGLU for the first
`first_dense_layers`). Sublayers are joined either by Block Attention
Residuals (default) or by standard pre-norm residuals (ablation).

Collections:
  params        trained weights.
  router_state  per-MoE-layer router bias (Quantile Balancing); never a param.
  router_stats  what the balancing update needs, emitted by the forward pass
                (make it mutable in apply()).
  cache         decoding only (`decode=True`, mutable): per KDA layer its
                state and conv tails, per MLA layer its latent cache
                (moe_jax/decode.py).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from moe_jax.balancing import QB_HIST_SCALE
from moe_jax.data.vision import IMAGE_TOKEN
from moe_jax.layers import expert_parallel, mesh_utils
from moe_jax.layers.attn_res import AttnResMix, BlockAttnResState
from moe_jax.layers.kda import KDA
from moe_jax.layers.mla import GatedMLA
from moe_jax.layers.moe import MoE, SwiGLU
from moe_jax.layers.norms import RMSNorm
from moe_jax.layers.param_axes import DEFAULT_KERNEL_INIT, with_axes
from moe_jax.layers.vision import VisionEncoder, place_image_tokens
from moe_jax.sharding import HIDDEN_AXES, LOGITS_AXES, constrain

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# Vocabularies up to this size are embedded as a one-hot product.
ONE_HOT_MAX_VOCAB = 4096

# model.remat: what each sublayer keeps for the backward pass. "none" keeps
# every activation; "sublayer" keeps only the sublayer's input and recomputes
# the rest (one more forward, the least memory); "dots" keeps the outputs of
# its matmuls and recomputes the elementwise work between them; "experts"
# keeps the routed experts' gate/up products and outputs ([N k, 2F] + [N k, D]
# per MoE layer) and recomputes the rest, so the backward runs no grouped
# matmul forward again.
REMAT_POLICIES = {
    "none": None,
    "sublayer": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "experts": jax.checkpoint_policies.save_only_these_names(
        expert_parallel.EXPERT_GATE_UP, expert_parallel.EXPERT_OUTPUT),
}


def layer_kinds(model_cfg) -> list[str]:
  """'K' or 'M' for each layer: the pattern tiled over num_layers."""
  p = model_cfg.layer_pattern
  return [p[i % len(p)] for i in range(model_cfg.num_layers)]


class HybridLM(nn.Module):
  """Causal LM over token ids.

  Attributes:
    cfg: config.model as a FrozenConfigDict (hashable, immutable).
    rules: logical-to-mesh axis rules (config.mesh.rules) for the activation
      sharding constraints; None = config_base.DEFAULT_RULES. The constraints
      only apply under a multi-device mesh (moe_jax.sharding.use_mesh).
  """
  cfg: ml_collections.FrozenConfigDict
  rules: tuple | None = None

  def _mesh_axes(self) -> mesh_utils.MeshAxes:
    """The axes the shard_map layers split over, from the rules table."""
    return mesh_utils.mesh_axes(self.rules)

  def _sublayer(self, cls, decode: bool = False):
    """cls, wrapped in nn.remat under the config's policy (same params).

    Decoding keeps nothing for a backward pass: never wrapped.
    """
    if self.cfg.remat == "none" or decode:
      return cls
    return nn.remat(cls, policy=REMAT_POLICIES[self.cfg.remat],
                    prevent_cse=True)

  def _mixer(self, kind: str, i: int, decode: bool = False) -> nn.Module:
    c = self.cfg
    dtype, pdtype = _DTYPES[c.dtype], _DTYPES[c.param_dtype]
    out_scale = 1.0 / (2 * c.num_layers)
    if kind == "K":
      k = c.kda
      return self._sublayer(KDA, decode)(
          d_model=c.d_model, num_heads=k.num_heads, decay=k.decay,
          g_min=k.g_min, decay_rank=k.decay_rank, gate_rank=k.gate_rank,
          conv_size=k.conv_size, chunk_size=k.chunk_size, backend=k.backend,
          pallas_stages=k.pallas_stages, mesh_axes=self._mesh_axes(),
          norm_eps=c.norm_eps, out_init_scale=out_scale, dtype=dtype,
          param_dtype=pdtype, name=f"layer_{i}_kda")
    m = c.mla
    return self._sublayer(GatedMLA, decode)(
        d_model=c.d_model, num_heads=m.num_heads,
        kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
        v_head_dim=m.v_head_dim, q_lora_rank=m.q_lora_rank,
        qk_rope_head_dim=m.qk_rope_head_dim, rope_theta=m.rope_theta,
        logn_scale_len=m.get("logn_scale_len", 0),
        attention_impl=m.attention_impl, mesh_axes=self._mesh_axes(),
        norm_eps=c.norm_eps, out_init_scale=out_scale, dtype=dtype,
        param_dtype=pdtype, name=f"layer_{i}_mla")

  def _ffn(self, i: int, decode: bool = False) -> nn.Module:
    c = self.cfg
    dtype, pdtype = _DTYPES[c.dtype], _DTYPES[c.param_dtype]
    e = c.moe
    if i < e.first_dense_layers:
      return self._sublayer(SwiGLU, decode)(
          d_ff=e.d_dense, dtype=dtype, param_dtype=pdtype,
          name=f"layer_{i}_dense")
    return self._sublayer(MoE, decode)(
        d_model=c.d_model, num_experts=e.num_experts, top_k=e.top_k,
        d_expert=e.d_expert, num_shared=e.num_shared, d_shared=e.d_shared,
        balancing=e.balancing, route_scale=e.route_scale,
        aux_loss_coef=e.aux_loss_coef, qb_estimator=e.qb_estimator,
        qb_bins=e.qb_bins, qb_range=e.qb_range,
        # Configs saved before the field existed used the constant.
        qb_scale=e.get("qb_hist_scale", QB_HIST_SCALE),
        expert_latent_dim=e.expert_latent_dim, dispatch=e.dispatch,
        grouped_matmul=e.grouped_matmul, mesh_axes=self._mesh_axes(),
        dtype=dtype, param_dtype=pdtype, name=f"layer_{i}_moe")

  def _with_images(self, x: jax.Array, tokens: jax.Array,
                   images: jax.Array | None) -> jax.Array:
    """x with the image placeholders' embeddings replaced by patches.

    Unchanged without a vision encoder; an init without images still
    creates the encoder's params (from a blank image).
    """
    v = self.cfg.get("vision")
    if v is None or v.encoder == "none":
      return x
    if images is None:
      if not self.is_initializing():
        return x
      images = jnp.zeros((x.shape[0], 1, v.image_size, v.image_size, 3))
    c = self.cfg
    patches = VisionEncoder(
        d_model=c.d_model, encoder=v.encoder, patch_size=v.patch_size,
        width=v.width, num_layers=v.num_layers, num_heads=v.num_heads,
        mlp_dim=v.mlp_dim, norm_eps=c.norm_eps, dtype=_DTYPES[c.dtype],
        param_dtype=_DTYPES[c.param_dtype], name="vision")(images)
    return place_image_tokens(x, tokens, patches, IMAGE_TOKEN)

  @nn.compact
  def __call__(self, tokens: jax.Array, decode: bool = False,
               new_sequence: bool = False,
               images: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
    """tokens: int [B, T] -> logits fp32 [B, T, vocab_size].

    decode: the tokens continue the sequence held in the `cache` collection
      (apply with mutable=["cache"]), which is updated: a prefill (T > 1)
      or one step (T == 1). The MoE and Block AttnRes are per token and run
      unchanged. See moe_jax/decode.py.
    new_sequence (with decode): the tokens start a new sequence in the
      cache (KDA from zero states, MLA over these tokens only, with the
      training attention).
    images: [B, N, H, W, C] (uint8, or float in [0, 1]) with
      model.vision.encoder set: the embeddings at IMAGE_TOKEN placeholders
      become the images' projected patches, in order
      (moe_jax/layers/vision.py). None: text only.
    segment_ids: int [B, T] or None, packed documents (a document is a run
      of equal ids, data.packing='documents'): MLA attends within a
      document and KDA's short convs and state restart at each document
      start, so a packed row computes what each document alone would
      (any model.kda.backend, with or without context parallelism). With
      decode, the ids of these tokens: the cache keeps the ids it holds,
      and a token whose id differs from the previous one's starts a new
      document; None continues the cached document (a new sequence: one
      document).
    """
    c = self.cfg
    dtype = _DTYPES[c.dtype]
    embed = nn.Embed(c.vocab_size, c.d_model, dtype=dtype,
                     param_dtype=_DTYPES[c.param_dtype],
                     embedding_init=with_axes(nn.initializers.normal(1.0),
                                              "vocab", "embed"),
                     name="embed")
    if c.vocab_size <= ONE_HOT_MAX_VOCAB:
      # The lookup's gradient is a scatter-add of every token's row onto a
      # few hundred table rows, which serialises on a GPU; as a one-hot
      # product (exact: one nonzero per row) the gradient is a matmul.
      x = jnp.dot(jax.nn.one_hot(tokens, c.vocab_size, dtype=dtype),
                  embed.embedding.astype(dtype),
                  precision=jax.lax.Precision.HIGHEST)
    else:
      x = embed(tokens)
    x = self._with_images(x, tokens, images)
    # Batch over the data axes, sequence over 'context', from here on.
    x = constrain(x, HIDDEN_AXES, self.rules)

    sublayers = []
    for i, kind in enumerate(layer_kinds(c)):
      mixer = self._mixer(kind, i, decode)
      def apply_mixer(y, f=mixer):
        if decode:
          return f(y, decode, new_sequence, segment_ids)
        if segment_ids is not None:
          return f(y, segment_ids=segment_ids)
        return f(y)
      sublayers.append((f"layer_{i}_mixer_norm", apply_mixer))
      sublayers.append((f"layer_{i}_ffn_norm", self._ffn(i, decode)))

    if c.residual == "standard":
      for norm_name, f in sublayers:
        self._sow_hidden_rms(x)
        x = x + f(RMSNorm(c.norm_eps, dtype=dtype, name=norm_name)(x))
      h = x
    else:
      state = BlockAttnResState(x, c.attn_res_layers_per_block, c.norm_eps)
      mixers = [AttnResMix(c.d_model, c.norm_eps, name=name + "_attn_res")
                for name in [n for n, _ in sublayers] + ["final"]]
      for j, (norm_name, f) in enumerate(sublayers):
        h = state.mix(mixers, j)
        self._sow_hidden_rms(h)
        state.add(f(RMSNorm(c.norm_eps, dtype=dtype, name=norm_name)(h)))
      h = state.mix(mixers, len(sublayers))
    self._sow_hidden_rms(h)

    h = RMSNorm(c.norm_eps, dtype=dtype, name="final_norm")(h)
    logits = nn.Dense(c.vocab_size, use_bias=False, dtype=dtype,
                      param_dtype=_DTYPES[c.param_dtype],
                      kernel_init=with_axes(DEFAULT_KERNEL_INIT, "embed",
                                            "vocab"), name="head")(h)
    return constrain(logits.astype(jnp.float32), LOGITS_AXES, self.rules)

  def _sow_hidden_rms(self, h: jax.Array) -> None:
    """With mutable=["intermediates"]: appends the RMS of the hidden state a
    sublayer reads (and, last, the final one) to 'hidden_rms', a tuple of
    2 * num_layers + 1 fp32 scalars: the growth over depth that AttnRes
    bounds."""
    if self.is_mutable_collection("intermediates"):
      self.sow("intermediates", "hidden_rms",
               jnp.sqrt(jnp.mean(jnp.square(h.astype(jnp.float32)))))


def build_model(config: ml_collections.ConfigDict) -> HybridLM:
  """The model for a (validated) run config."""
  mesh = config.get("mesh")
  rules = None if mesh is None else tuple(
      (name, tuple(axes) if isinstance(axes, list) else axes)
      for name, axes in mesh.rules)
  return HybridLM(ml_collections.FrozenConfigDict(config.model), rules=rules)
