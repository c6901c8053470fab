r"""Planning at full scale by computation (docs/design.md §9).

`plan(config, mesh_shape, seq_len, micro_batch)` instantiates the model
abstractly (`jax.eval_shape(model.init, ...)`: shapes only, no memory), shards
every parameter over a `jax.sharding.AbstractMesh` (no devices needed) and
returns parameters, FLOPs, memory per device and communication per step as
plain Python numbers. experiments/plan.py prints it; tests check it against
the initialised model and closed forms. Everything below is per micro-step
unless it says "per step" (a step = `accum_steps` micro-steps of gradient
accumulation + one optimizer update).

Notation: D d_model, L layers (2L sublayers), T sequence length, C KDA chunk,
H heads, K = V = D / H_kda the KDA head dims, dqk = qk_nope + qk_rope and dv
the MLA head dims, r_kv the MLA latent width, E experts, k top-k, F the
routed expert width, d_in the routed experts' input width (expert_latent_dim,
or D). b = bytes of the compute dtype.

Parameters (exact, from the abstract init): every leaf is classified by its
module path into a component. Active params per token count the routed
experts at k/E and everything else fully (the router scores every expert,
the shared expert and attention see every token).

FLOPs per token, forward, at length T (a multiply-add = 2 FLOPs):
  matmuls   2 * (active params of every >= 2-D leaf except the embedding
            table, which is a lookup). Depthwise conv taps count too (one
            multiply-add per tap per token). 1-D leaves (norm scales, AttnRes
            queries, dt_bias, A_log) are elementwise and not counted.
  MLA       per layer 2 * H * (dqk + dv) * (T + 1) / 2: query t scores and
            mixes t + 1 keys (causal), QK^T costs 2 H dqk and PV 2 H dv per
            key; averaged over t. (Math FLOPs: the model pads q, k, v to
            max(dqk, dv) for dot_product_attention.)
  KDA       per layer H * (6CK + 4CV + C^2/3 + 6KV), the chunked algorithm of
            docs/design.md §4 per chunk and head divided by C: Akk and Aqk (2C^2K
            each), the unit-triangular inverse (C^3/3), W = M(beta k e^b)
            (2C^2K), U = M(beta v) (2C^2V), Aqk V' (2C^2V), and three
            C x K x V products: W S, (q e^b) S and the state update (2CKV each).
  AttnRes   per sublayer 4 * S * D with S sources: the logits w . rmsnorm(v_i)
            and the weighted sum (2 S D each); the final mix likewise.
Training (model FLOPs, what MFU counts) = 3 x forward (backward = 2 x
forward). With rematerialisation the hardware runs one more forward: 4 x.
`6 N_active` is printed beside it as the usual reference.

Memory per device (bytes). Sharding: a leaf of >= 2 dims is split over the
`fsdp_axes` group along its largest divisible dim and over `tensor` along
another; routed expert stacks [E, ., .] put E on `expert` first; 1-D leaves
are replicated. Tokens: the batch over data x fsdp x expert (the expert axis
is a batch axis outside the MoE, as in GShard / DeepSeek EP), the sequence
over context, replicated over tensor.
  params       the shards in their param dtype.
  master       an fp32 copy of every bf16 param shard (none for fp32 params).
  adam         AdamW's two moments, fp32, per param shard element (8 bytes).
               (optax.adamw keeps its moments in the param dtype; with fp32
               params, the default at scale, that is the same.)
  grads        the accumulated gradient shard, param dtype.
  gathered     FSDP working copies: the largest module's params gathered over
               fsdp_axes in the compute dtype, two in flight (prefetch).
  residuals    remat checkpoints. remat="sublayer": every sublayer output and
               the embedding, (2L + 1) N D b (with Block AttnRes these 2L + 1
               tensors are exactly the sources any sublayer can need).
               remat="block": only the AttnRes sources (embedding + block
               sums) are kept, a block is recomputed as a whole, so
               (n_blocks + 1 + layers_per_block) N D b.
  working set  the largest sublayer's activations during its backward, twice
               (activations + cotangents), N local tokens:
               KDA  N [b (D + 11 H K) + 4 (2 H K) + 4 H K V / C + 4 (3 C H)]
                    (projections, convs, normed q k, gates; fp32 g and o;
                    per-chunk fp32 states kept for the backward; the chunk's
                    Akk, Aqk and inverse).
               MLA  N [b (D + q_lora + H dqk + r_kv + H (dn + dv) + 3 H w +
                    3 H dv) + 4 H] + the latent gathered over context
                    (micro_batch T (r_kv + dr) b) + a double-buffered remote
                    K/V block up-projected from it, 2 N H (dn + dv) b (ring
                    style: never the whole T of K/V at once).
               MoE  N [2 b D + 8 E + k (2 b d_in + 3 b F + 4 d_in)
                    + 2 b d_in (latent) + 3 b F_shared] (router fp32 scores,
                    send + receive buffers, gate/up/h, fp32 combine).
               FFN  N b (2 D + 3 d_dense).
  logits       N vocab 8 (the model returns fp32 logits; + their cotangent).
  Peak activations = residuals + max(2 x working set, logits).

Communication per step, bytes received per device (ring collectives: an
all-gather or reduce-scatter over a group of S moves (S-1)/S of the full
tensor, an all-reduce twice that):
  fsdp all-gather     params are cast to the compute dtype, then gathered:
                      forward and again for the backward (ZeRO-3), per
                      micro-step.
  fsdp reduce-scatter the transpose of that gather: compute-dtype grads, once
                      per micro-step.
  grad all-reduce     fp32 accumulated grads over every token axis a leaf is
                      replicated on (data; expert for dense leaves unless it
                      is in fsdp_axes; context likewise), once per step.
  expert all-to-all   per MoE layer N k d_in b (S_e-1)/S_e each way: dispatch
                      and combine in the forward, the recompute and the
                      backward: 6 per micro-step.
  KDA context state   per KDA layer an associative scan over the P context
                      devices of each device's segment transition
                      S -> A S + B (A: K x K, B: K x V per head, fp32):
                      ceil(log2 P) rounds (Hillis-Steele), each receiving one
                      transition, so micro_batch ceil(log2 P) H (K^2 + K V) 4
                      bytes, x3 (forward, recompute, backward). O(devices K V)
                      in all, never O(T).
  MLA latent gather   per MLA layer micro_batch (T - T/P) (r_kv + dr) b,
                      x3 (forward, recompute, backward reduce-scatter).
  tensor all-reduce   per sublayer an all-reduce of N D b, x3.
Times use one bandwidth per collective: intra-node when the whole group lies
in one node (mesh axes ordered as given, the last varying fastest), else the
per-GPU network bandwidth; no overlap is assumed (an upper bound).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from moe_jax.config_validation import MESH_AXES
from moe_jax.model import build_model, layer_kinds
from moe_jax.sharding import rules_dict

BATCH_AXES = rules_dict(None)["batch"]  # ("data", "fsdp", "expert")
SEQUENCE_AXES = rules_dict(None)["sequence"]  # ("context",)
COMPONENTS = ("embed", "KDA", "MLA", "dense FFN", "router", "MoE routed",
              "MoE latent proj", "MoE shared", "norms/AttnRes", "head")
REMAT_POLICIES = ("sublayer", "block")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class Hardware:
  """What the time estimates assume (defaults: NVIDIA H200, 8 per node).

  Attributes:
    peak_tflops: dense bf16 peak per device, TFLOP/s.
    mfu: fraction of peak the compute estimate assumes.
    hbm_gib: device memory, GiB.
    gpus_per_node: devices per node (NVLink domain).
    intra_node_gbps: per-device bandwidth inside a node, GB/s.
    inter_node_gbps: per-device network bandwidth across nodes, GB/s.
  """
  peak_tflops: float = 989.0
  mfu: float = 0.4
  hbm_gib: float = 140.0
  gpus_per_node: int = 8
  intra_node_gbps: float = 450.0
  inter_node_gbps: float = 50.0


def parse_mesh(spec: str) -> dict[str, int]:
  """'data=8,fsdp=32' -> {'data': 8, 'fsdp': 32, 'expert': 1, ...}.

  Axis order is kept as given (it decides which axes lie inside a node);
  axes left out are appended with size 1.
  """
  mesh: dict[str, int] = {}
  for part in [p.strip() for p in spec.split(",") if p.strip()]:
    name, _, size = part.partition("=")
    name = name.strip()
    if name not in MESH_AXES:
      raise ValueError(f"--mesh axis {name!r} is unknown; allowed axes: "
                       f"{list(MESH_AXES)}")
    if name in mesh:
      raise ValueError(f"--mesh axis {name!r} is given twice in {spec!r}")
    try:
      mesh[name] = int(size)
    except ValueError:
      raise ValueError(f"--mesh axis {name!r} needs an integer size, e.g. "
                       f"{name}=8, got {part!r}") from None
    if mesh[name] < 1:
      raise ValueError(f"--mesh axis {name!r} must be >= 1, got {mesh[name]}")
  for name in MESH_AXES:
    mesh.setdefault(name, 1)
  return mesh


def abstract_variables(config: ml_collections.ConfigDict) -> Mapping:
  """All variables of the model as ShapeDtypeStructs (nothing allocated).

  Params do not depend on T, so the init is traced at one KDA chunk.
  """
  model = build_model(config)
  t = config.model.kda.chunk_size
  tokens = jax.ShapeDtypeStruct((1, t), jnp.int32)
  variables = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)
  return nn.meta.unbox(variables)  # drop the layers' logical-axes boxes


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One parameter: where it sits and how it counts."""
  path: tuple[str, ...]
  shape: tuple[int, ...]
  dtype: str
  component: str
  active_size: int   # elements used per token (k/E of a routed expert stack)

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))

  @property
  def module(self) -> str:
    return self.path[0]

  @property
  def is_matmul(self) -> bool:
    """2 FLOPs per active element per token (the embedding is a lookup)."""
    return len(self.shape) >= 2 and self.component != "embed"


def classify(path: Sequence[str]) -> str:
  """The component of a param path like ('layer_3_moe', 'router', 'kernel')."""
  top = path[0]
  if top in ("embed", "head"):
    return top
  if top.endswith("_kda"):
    return "KDA"
  if top.endswith("_mla"):
    return "MLA"
  if top.endswith("_dense"):
    return "dense FFN"
  if top.endswith("_moe"):
    sub = path[1]
    if sub == "router":
      return "router"
    if sub == "shared":
      return "MoE shared"
    if sub in ("latent_down", "latent_up"):
      return "MoE latent proj"
    if sub in ("w_gate", "w_up", "w_down"):
      return "MoE routed"
  if top.endswith("_norm") or top.endswith("_attn_res"):
    return "norms/AttnRes"
  raise ValueError(
      f"planner: param {'/'.join(path)} belongs to no known component "
      f"{list(COMPONENTS)}; teach moe_jax.planning.classify about it")


def param_leaves(params: Mapping, model_cfg) -> list[Leaf]:
  """Flattens a params tree (arrays or ShapeDtypeStructs, boxed with logical
  axes as model.init makes them, or plain) into Leaf records."""
  e, k = model_cfg.moe.num_experts, model_cfg.moe.top_k
  leaves = []
  for key_path, x in jax.tree_util.tree_flatten_with_path(
      nn.meta.unbox(params))[0]:
    path = tuple(str(getattr(p, "key", p)) for p in key_path)
    comp = classify(path)
    shape = tuple(int(s) for s in x.shape)
    size = int(np.prod(shape, dtype=np.int64))
    if comp == "MoE routed":
      if shape[0] != e:
        raise ValueError(f"planner: {'/'.join(path)} has shape {shape}, "
                         f"expected a leading num_experts={e}")
      active = size // e * k
    else:
      active = size
    leaves.append(Leaf(path, shape, jnp.dtype(x.dtype).name, comp, active))
  return leaves


def leaf_spec(leaf: Leaf, mesh: Mapping[str, int],
              fsdp_axes: Sequence[str]) -> PartitionSpec:
  """How a parameter is sharded (see the module docstring)."""
  spec: list[Any] = [None] * len(leaf.shape)
  if len(leaf.shape) < 2:
    return PartitionSpec(*spec)
  free = list(range(len(leaf.shape)))
  if leaf.component == "MoE routed":
    if leaf.shape[0] % mesh["expert"]:
      raise ValueError(
          f"mesh expert={mesh['expert']} must divide model.moe.num_experts="
          f"{leaf.shape[0]}")
    if mesh["expert"] > 1:
      spec[0] = "expert"
    free.remove(0)
  group = tuple(a for a in fsdp_axes if mesh[a] > 1)
  n = math.prod(mesh[a] for a in group)
  if group:
    for d in sorted(free, key=lambda d: -leaf.shape[d]):
      if leaf.shape[d] % n == 0:
        spec[d] = group if len(group) > 1 else group[0]
        free.remove(d)
        break
  if mesh["tensor"] > 1:
    for d in sorted(free, key=lambda d: -leaf.shape[d]):
      if leaf.shape[d] % mesh["tensor"] == 0:
        spec[d] = "tensor"
        break
  return PartitionSpec(*spec)


def _spec_axes(spec: PartitionSpec) -> set[str]:
  axes = set()
  for s in spec:
    if s is None:
      continue
    axes.update(s if isinstance(s, tuple) else (s,))
  return axes


def _without(spec: PartitionSpec, drop: Sequence[str]) -> PartitionSpec:
  """spec with the `drop` axes removed (what a gather over them leaves)."""
  out = []
  for s in spec:
    names = () if s is None else (s if isinstance(s, tuple) else (s,))
    kept = tuple(a for a in names if a not in drop)
    out.append(None if not kept else kept if len(kept) > 1 else kept[0])
  return PartitionSpec(*out)


def _shard_size(mesh: AbstractMesh, spec: PartitionSpec, shape) -> int:
  return int(np.prod(NamedSharding(mesh, spec).shard_shape(shape),
                     dtype=np.int64))


def _attn_res_sources(num_sublayers: int, layers_per_block: int) -> list[int]:
  """Sources each AttnRes mix reads; the last entry is the final mix."""
  out = []
  for i in range(num_sublayers + 1):
    out.append(1 + i // layers_per_block + (1 if i % layers_per_block else 0))
  return out


def _group_is_intra_node(mesh: Mapping[str, int], axes: Sequence[str],
                         gpus_per_node: int) -> bool:
  """True when a collective over `axes` stays inside one node."""
  order = list(mesh)
  span = 1
  for a in axes:
    if mesh[a] == 1:
      continue
    stride = math.prod(mesh[b] for b in order[order.index(a) + 1:])
    span = max(span, stride * mesh[a])
  return span <= gpus_per_node


def plan(config: ml_collections.ConfigDict, mesh_shape: Mapping[str, int],
         seq_len: int | None = None, micro_batch: int = 1, *,
         fsdp_axes: Sequence[str] = ("fsdp",), global_batch: int | None = None,
         remat: str = "sublayer", hardware: Hardware = Hardware(),
         variables: Mapping | None = None) -> dict:
  """Parameters, FLOPs, memory and communication of a run on a mesh.

  Args:
    config: a run config (config.model, config.data).
    mesh_shape: axis -> size over MESH_AXES (missing axes are size 1); the
      order given is the device order (last axis fastest).
    seq_len: sequence length T; default config.data.seq_len.
    micro_batch: sequences per batch shard (data x fsdp x expert) per
      micro-step; each device holds micro_batch * T / context tokens.
    fsdp_axes: mesh axes the params and optimizer state are sharded over
      (ZeRO-3); routed experts are sharded over `expert` as well.
    global_batch: sequences per step; default keeps config's tokens per step
      (config.data.batch_size * config.data.seq_len / T, docs/design.md §9).
    remat: "sublayer" | "block" (see the module docstring).
    hardware: assumptions of the time estimates and the memory headroom.
    variables: abstract (or real) model variables, to skip the init trace.

  Returns:
    A JSON-ready dict: "run", "params", "flops_per_token", "flops_per_step",
    "memory_per_device", "comm_per_step", "time_per_step".
  """
  m = config.model
  mesh = {a: int(mesh_shape.get(a, 1)) for a in mesh_shape}
  for a in MESH_AXES:
    mesh.setdefault(a, 1)
  unknown = set(mesh) - set(MESH_AXES)
  if unknown:
    raise ValueError(f"mesh axes {sorted(unknown)} are unknown; allowed axes: "
                     f"{list(MESH_AXES)}")
  if any(n < 1 for n in mesh.values()):
    raise ValueError(f"mesh axis sizes must be >= 1, got {mesh}")
  for a in fsdp_axes:
    if a not in MESH_AXES or a in ("expert", "tensor"):
      raise ValueError(f"fsdp_axes entry {a!r} must be one of "
                       "['data', 'fsdp', 'context']")
  if remat not in REMAT_POLICIES:
    raise ValueError(f"remat must be one of {list(REMAT_POLICIES)}, got "
                     f"{remat!r}")
  devices = math.prod(mesh.values())
  t = int(seq_len or config.data.seq_len)
  ctx = mesh["context"]
  if t % ctx:
    raise ValueError(f"seq_len={t} must be divisible by mesh context={ctx}")
  t_loc = t // ctx
  kinds = layer_kinds(m)
  n_kda, n_mla = kinds.count("K"), kinds.count("M")
  if n_kda and t_loc % m.kda.chunk_size:
    raise ValueError(
        f"seq_len / context = {t_loc} tokens per device must be a multiple of "
        f"model.kda.chunk_size={m.kda.chunk_size}")
  if micro_batch < 1:
    raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
  batch_shards = math.prod(mesh[a] for a in BATCH_AXES)
  if global_batch is None:
    step_tokens = config.data.batch_size * config.data.seq_len
    if step_tokens % t:
      raise ValueError(
          f"config tokens per step data.batch_size*data.seq_len={step_tokens} "
          f"is not a whole number of sequences of seq_len={t}; pass "
          "global_batch")
    global_batch = step_tokens // t
  per_micro = micro_batch * batch_shards
  if global_batch % per_micro:
    raise ValueError(
        f"global batch {global_batch} sequences must be a multiple of "
        f"micro_batch={micro_batch} x batch shards (data*fsdp*expert="
        f"{batch_shards}) = {per_micro}; change the mesh, micro_batch or "
        "global_batch")
  accum = global_batch // per_micro
  n_loc = micro_batch * t_loc                 # tokens per device per micro-step
  tokens_per_step = global_batch * t

  if variables is None:
    variables = abstract_variables(config)
  leaves = param_leaves(variables["params"], m)

  # ----- parameters -----
  by_comp = {c: {"total": 0, "active": 0} for c in COMPONENTS}
  for lf in leaves:
    by_comp[lf.component]["total"] += lf.size
    by_comp[lf.component]["active"] += lf.active_size
  total = sum(v["total"] for v in by_comp.values())
  active = sum(v["active"] for v in by_comp.values())

  # ----- FLOPs per token (forward) -----
  fwd: dict[str, float] = {c: 0.0 for c in COMPONENTS}
  for lf in leaves:
    if lf.is_matmul:
      fwd[lf.component] += 2.0 * lf.active_size
  fwd = {f"{c} matmuls": v for c, v in fwd.items() if v}
  ml = m.mla
  dqk, dv = ml.qk_nope_head_dim + ml.qk_rope_head_dim, ml.v_head_dim
  fwd["MLA attention"] = n_mla * 2.0 * ml.num_heads * (dqk + dv) * (t + 1) / 2
  h_kda = m.kda.num_heads
  kk = vv = m.d_model // h_kda
  c_ = m.kda.chunk_size
  fwd["KDA chunked"] = n_kda * h_kda * (
      6 * c_ * kk + 4 * c_ * vv + c_ * c_ / 3 + 6 * kk * vv)
  if m.residual == "block_attn_res":
    srcs = _attn_res_sources(2 * m.num_layers, m.attn_res_layers_per_block)
    fwd["AttnRes mixing"] = 4.0 * m.d_model * sum(srcs)
  fwd_total = sum(fwd.values())
  flops_tok = {
      "forward": fwd,
      "forward_total": fwd_total,
      "train_model": 3 * fwd_total,
      "train_with_remat": 4 * fwd_total,
      "six_n_active": 6.0 * active,
  }
  # Context parallelism: every device up-projects the other devices' latents
  # to K/V (forward, recompute, and 2x in the backward).
  cp_extra = (n_mla * 2.0 * micro_batch * (t - t_loc) * ml.kv_lora_rank *
              (ml.num_heads / mesh["tensor"]) * (ml.qk_nope_head_dim + dv)
              * 4 * accum)
  train_dev = (flops_tok["train_with_remat"] * tokens_per_step / devices
               + cp_extra)
  flops_step = {
      "train_model_total": flops_tok["train_model"] * tokens_per_step,
      "train_with_remat_per_device": train_dev,
      "context_parallel_kv_upproj_per_device": cp_extra,
  }

  # ----- memory per device -----
  amesh = AbstractMesh(tuple(mesh.values()), tuple(mesh))
  cb = _DTYPE_BYTES[m.dtype]
  specs = [leaf_spec(lf, mesh, fsdp_axes) for lf in leaves]
  shard = [_shard_size(amesh, s, lf.shape) for lf, s in zip(leaves, specs)]
  gathered = [_shard_size(amesh, _without(s, fsdp_axes), lf.shape)
              for lf, s in zip(leaves, specs)]
  pbytes = [_DTYPE_BYTES[lf.dtype] for lf in leaves]
  mem: dict[str, float] = {}
  mem["params"] = float(sum(n * b for n, b in zip(shard, pbytes)))
  mem["master fp32"] = float(sum(n * 4 for n, lf in zip(shard, leaves)
                                 if lf.dtype != "float32"))
  mem["adam moments"] = float(sum(shard) * 8)
  mem["grads"] = mem["params"]
  per_module: dict[str, int] = {}
  for lf, g in zip(leaves, gathered):
    per_module[lf.module] = per_module.get(lf.module, 0) + g
  mem["gathered params"] = float(2 * max(per_module.values()) * cb)

  d, h_t = m.d_model, mesh["tensor"]
  n_sub = 2 * m.num_layers
  lpb = m.attn_res_layers_per_block
  n_blocks = -(-n_sub // lpb)
  saved = n_sub + 1 if remat == "sublayer" else n_blocks + 1 + lpb
  mem["residual checkpoints"] = float(saved * n_loc * d * cb)
  work: dict[str, float] = {}
  if n_kda:
    hl = h_kda / h_t
    hk = hl * kk
    work["KDA"] = n_loc * (cb * (d + 11 * hk) + 4 * 2 * hk
                           + 4 * hl * kk * vv / c_ + 4 * 3 * c_ * hl)
  if n_mla:
    hl = ml.num_heads / h_t
    w = max(dqk, dv)
    per_tok = cb * (d + ml.q_lora_rank + hl * dqk + ml.kv_lora_rank
                    + hl * (ml.qk_nope_head_dim + dv) + 3 * hl * w
                    + 3 * hl * dv) + 4 * hl
    latent = micro_batch * t * (ml.kv_lora_rank + ml.qk_rope_head_dim) * cb
    remote_kv = (2 * n_loc * hl * (ml.qk_nope_head_dim + dv) * cb
                 if ctx > 1 else 0)
    work["MLA"] = n_loc * per_tok + latent + remote_kv
  e_ = m.moe
  if e_.first_dense_layers < m.num_layers:
    d_in = e_.expert_latent_dim or d
    f_l = e_.d_expert / h_t
    work["MoE"] = n_loc * (
        2 * cb * d + 8 * e_.num_experts
        + e_.top_k * (2 * cb * d_in + 3 * cb * f_l + 4 * d_in)
        + (2 * cb * d_in if e_.expert_latent_dim else 0)
        + 3 * cb * e_.num_shared * e_.d_shared / h_t)
  if e_.first_dense_layers:
    work["dense FFN"] = n_loc * cb * (2 * d + 3 * e_.d_dense / h_t)
  worst = max(work, key=work.get)
  mem[f"working set x2 ({worst})"] = 2 * work[worst]
  mem["logits fp32 + grad"] = float(n_loc * m.vocab_size / h_t * 8)
  # The head's logits peak when no sublayer's working set is live.
  act_peak = mem["residual checkpoints"] + max(
      mem[f"working set x2 ({worst})"], mem["logits fp32 + grad"])
  state = sum(mem[k] for k in ("params", "master fp32", "adam moments",
                               "grads", "gathered params"))
  memory = {
      "items": mem,
      "sublayer_working_sets": work,
      "activations_peak": act_peak,
      "total": state + act_peak,
      "hbm": hardware.hbm_gib * 2**30,
  }

  # ----- communication per step (bytes received per device) -----
  comm: dict[str, dict] = {}

  def add(name, axes, nbytes):
    axes = tuple(a for a in axes if mesh[a] > 1)
    if not axes or nbytes <= 0:
      return
    intra = _group_is_intra_node(mesh, axes, hardware.gpus_per_node)
    bw = (hardware.intra_node_gbps if intra else hardware.inter_node_gbps)
    comm[name] = {"axes": list(axes), "bytes": float(nbytes),
                  "intra_node": intra, "seconds": nbytes / (bw * 1e9)}

  fsdp_group = tuple(a for a in fsdp_axes if mesh[a] > 1)
  fsdp_bytes = sum((g - n) * cb for g, n in zip(gathered, shard))
  add("fsdp all-gather", fsdp_group, 2 * fsdp_bytes * accum)
  add("fsdp reduce-scatter", fsdp_group, fsdp_bytes * accum)
  token_axes = BATCH_AXES + SEQUENCE_AXES
  reduce_groups: dict[tuple, float] = {}
  for lf, s, n in zip(leaves, specs, shard):
    axes = tuple(a for a in token_axes
                 if a not in _spec_axes(s) and mesh[a] > 1)
    if axes:
      size = math.prod(mesh[a] for a in axes)
      reduce_groups[axes] = (reduce_groups.get(axes, 0.0)
                             + 2 * (size - 1) / size * n * 4)
  for axes, nbytes in sorted(reduce_groups.items()):
    add(f"grad all-reduce ({','.join(axes)})", axes, nbytes)
  n_moe = m.num_layers - min(e_.first_dense_layers, m.num_layers)
  s_e = mesh["expert"]
  d_in = e_.expert_latent_dim or d
  add("expert all-to-all", ("expert",),
      n_moe * 6 * n_loc * e_.top_k * d_in * cb * (s_e - 1) / s_e * accum)
  add("KDA context state", ("context",),
      n_kda * 3 * micro_batch * math.ceil(math.log2(ctx)) * (h_kda / h_t)
      * (kk * kk + kk * vv) * 4 * accum)
  add("MLA latent gather", ("context",),
      n_mla * 3 * micro_batch * (t - t_loc)
      * (ml.kv_lora_rank + ml.qk_rope_head_dim) * cb * accum)
  add("tensor all-reduce", ("tensor",),
      n_sub * 3 * 2 * (h_t - 1) / h_t * n_loc * d * cb * accum)
  comm_total = sum(c["bytes"] for c in comm.values())

  compute_s = train_dev / (hardware.peak_tflops * 1e12 * hardware.mfu)
  comm_s = sum(c["seconds"] for c in comm.values())
  unsharded = ["/".join(lf.path) for lf, s in zip(leaves, specs)
               if len(lf.shape) >= 2 and fsdp_group
               and not (_spec_axes(s) & set(fsdp_group))]
  return {
      "run": {
          "mesh": mesh, "devices": devices, "fsdp_axes": list(fsdp_axes),
          "seq_len": t, "tokens_per_device_micro": n_loc,
          "micro_batch": micro_batch, "global_batch": global_batch,
          "accum_steps": accum, "tokens_per_step": tokens_per_step,
          "remat": remat, "compute_dtype": m.dtype,
          "param_dtype": m.param_dtype, "kda_layers": n_kda,
          "mla_layers": n_mla, "moe_layers": n_moe,
          "params_not_fsdp_sharded": unsharded,
      },
      "params": {"total": total, "active": active, "by_component": by_comp},
      "flops_per_token": flops_tok,
      "flops_per_step": flops_step,
      "memory_per_device": memory,
      "comm_per_step": {"collectives": comm, "total_bytes": comm_total},
      "time_per_step": {
          "compute_seconds": compute_s, "comm_seconds_no_overlap": comm_s,
          "mfu_assumed": hardware.mfu,
          # Upper bound: communication fully hidden behind compute.
          "tokens_per_second_overlapped": (
              tokens_per_step / max(compute_s, comm_s)),
      },
  }
