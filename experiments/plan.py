r"""Plans a run at full scale: params, FLOPs, memory, comms.

docs/design.md §9.

  python -m experiments.plan --config=configs/trillion.py \
      --mesh=data=1,fsdp=1,expert=16,context=128,tensor=1 \
      --fsdp_axes=fsdp,context --seq_len=1048576 --micro_batch=1
  python -m experiments.plan --config=configs/default.py:tiny \
      --mesh=data=2,fsdp=4 --out=/tmp/plan.json

The model is instantiated abstractly (jax.eval_shape of model.init: shapes
only) and sharded over a jax.sharding.AbstractMesh, so no devices or memory
are needed; it runs on a CPU in seconds. The formulas and every assumption
(remat, optimizer state, sharding rules, collectives) are in the docstring of
moe_jax/planning.py. --out writes the same numbers as JSON.
"""
import json

from absl import app, flags
from ml_collections import config_flags

from moe_jax import planning
from moe_jax.config_validation import validate_config

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/trillion.py",
    "Config file, optionally with variants: path.py[:variant,variant].",
    lock_config=True)
_MESH = flags.DEFINE_string(
    "mesh", "data=1,fsdp=1,expert=16,context=128,tensor=1",
    "Mesh axis sizes in device order (last fastest), e.g. "
    "data=8,fsdp=32,expert=8,context=1,tensor=1.")
_FSDP_AXES = flags.DEFINE_list(
    "fsdp_axes", ["fsdp"], "Axes that shard params and optimizer state "
    "(ZeRO-3); experts are sharded over expert as well.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", None,
                                "Sequence length; default config.data.seq_len.")
_MICRO_BATCH = flags.DEFINE_integer(
    "micro_batch", 1, "Sequences per batch shard (data*fsdp*expert) per "
    "micro-step.")
_GLOBAL_BATCH = flags.DEFINE_integer(
    "global_batch", None, "Sequences per step; default keeps the config's "
    "tokens per step.")
_REMAT = flags.DEFINE_enum("remat", "sublayer", list(planning.REMAT_POLICIES),
                           "What the backward keeps: every sublayer output, "
                           "or only the AttnRes block sums.")
_PEAK = flags.DEFINE_float("peak_tflops", 989.0, "Dense bf16 peak per device.")
_MFU = flags.DEFINE_float("mfu", 0.4, "Fraction of peak the time estimate "
                          "assumes.")
_HBM = flags.DEFINE_float("hbm_gib", 140.0, "Device memory, GiB.")
_GPN = flags.DEFINE_integer("gpus_per_node", 8, "Devices per node.")
_INTRA = flags.DEFINE_float("intra_node_gbps", 450.0,
                            "Per-device bandwidth inside a node, GB/s.")
_INTER = flags.DEFINE_float("inter_node_gbps", 50.0,
                            "Per-device network bandwidth, GB/s.")
_OUT = flags.DEFINE_string("out", None, "Optional: write the plan as JSON.")


def _table(title: str, header: list[str], rows: list[list[str]]) -> str:
  """Aligned text table: first column left, the others right."""
  widths = [max(len(str(r[i])) for r in [header] + rows)
            for i in range(len(header))]
  def line(r):
    return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                     for i, (c, w) in enumerate(zip(r, widths)))
  rule = "-" * len(line(header))
  return "\n".join([title, rule, line(header), rule]
                   + [line(r) for r in rows] + [rule])


def _b(n: float) -> str:
  return f"{n / 1e9:,.3f}B"


def format_plan(p: dict) -> str:
  """The plan as printed tables."""
  r = p["run"]
  out = []
  mesh = ",".join(f"{a}={n}" for a, n in r["mesh"].items())
  out.append(
      f"mesh {mesh} ({r['devices']} devices), params sharded over "
      f"{' x '.join(r['fsdp_axes'])}; seq_len {r['seq_len']:,}, micro_batch "
      f"{r['micro_batch']}, {r['tokens_per_device_micro']:,} tokens/device/"
      f"micro-step, global batch {r['global_batch']} sequences = "
      f"{r['tokens_per_step']:,} tokens/step, {r['accum_steps']} micro-step(s)"
      f"; {r['kda_layers']} KDA + {r['mla_layers']} MLA layers, "
      f"{r['moe_layers']} MoE; compute {r['compute_dtype']}, params "
      f"{r['param_dtype']}, remat={r['remat']}")

  pr = p["params"]
  rows = [[c, f"{v['total']:,}", _b(v["total"]), f"{v['active']:,}",
           _b(v["active"])] for c, v in pr["by_component"].items()
          if v["total"]]
  rows.append(["TOTAL", f"{pr['total']:,}", _b(pr["total"]),
               f"{pr['active']:,}", _b(pr["active"])])
  out.append(_table("Parameters (active = per token; routed experts at "
                    "top_k/num_experts)",
                    ["component", "total", "(B)", "active", "(B)"], rows))

  f = p["flops_per_token"]
  rows = [[k, f"{v / 1e9:,.3f}", f"{100 * v / f['forward_total']:.1f}%"]
          for k, v in f["forward"].items()]
  rows += [["forward total", f"{f['forward_total'] / 1e9:,.3f}", "100.0%"],
           ["training (3x fwd, model FLOPs)",
            f"{f['train_model'] / 1e9:,.3f}", ""],
           ["training with remat (4x fwd)",
            f"{f['train_with_remat'] / 1e9:,.3f}", ""],
           ["reference: 6 * N_active", f"{f['six_n_active'] / 1e9:,.3f}", ""]]
  out.append(_table(f"FLOPs per token at T={r['seq_len']:,} (GFLOP)",
                    ["term", "GFLOP", "of fwd"], rows))
  fs = p["flops_per_step"]
  out.append(_table("FLOPs per step", ["", "PFLOP"], [
      ["training, all devices (model FLOPs)",
       f"{fs['train_model_total'] / 1e15:,.1f}"],
      ["per device, with remat + CP overhead",
       f"{fs['train_with_remat_per_device'] / 1e15:,.2f}"],
      ["  of which context-parallel K/V up-projection",
       f"{fs['context_parallel_kv_upproj_per_device'] / 1e15:,.3f}"]]))

  mm = p["memory_per_device"]
  gib = 2.0 ** 30
  rows = [[k, f"{v / gib:,.2f}"] for k, v in mm["items"].items()]
  rows += [["activations at peak (residuals + max(work, logits))",
            f"{mm['activations_peak'] / gib:,.2f}"],
           ["TOTAL", f"{mm['total'] / gib:,.2f}"],
           ["device memory (--hbm_gib)", f"{mm['hbm'] / gib:,.2f}"]]
  verdict = "fits" if mm["total"] <= mm["hbm"] else "DOES NOT FIT"
  out.append(_table(f"Memory per device (GiB): {verdict}", ["item", "GiB"],
                    rows))

  cm = p["comm_per_step"]
  rows = [[k, ",".join(v["axes"]), "node" if v["intra_node"] else "network",
           f"{v['bytes'] / 1e9:,.3f}", f"{v['seconds']:,.3f}"]
          for k, v in cm["collectives"].items()]
  rows.append(["TOTAL", "", "", f"{cm['total_bytes'] / 1e9:,.3f}",
               f"{p['time_per_step']['comm_seconds_no_overlap']:,.3f}"])
  out.append(_table("Communication per step, received per device",
                    ["collective", "axes", "link", "GB", "s"], rows))

  tp = p["time_per_step"]
  out.append(
      f"step time: compute {tp['compute_seconds']:,.2f} s at "
      f"{100 * tp['mfu_assumed']:.0f}% of peak, communication "
      f"{tp['comm_seconds_no_overlap']:,.2f} s unoverlapped; at best "
      f"{tp['tokens_per_second_overlapped']:,.0f} tokens/s")
  if r["params_not_fsdp_sharded"]:
    out.append(f"note: {len(r['params_not_fsdp_sharded'])} matrices have no "
               "dim divisible by the fsdp group and stay replicated, e.g. "
               f"{r['params_not_fsdp_sharded'][:3]}")
  return "\n\n".join(out)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  validate_config(config)
  hardware = planning.Hardware(
      peak_tflops=_PEAK.value, mfu=_MFU.value, hbm_gib=_HBM.value,
      gpus_per_node=_GPN.value, intra_node_gbps=_INTRA.value,
      inter_node_gbps=_INTER.value)
  p = planning.plan(config, planning.parse_mesh(_MESH.value), _SEQ_LEN.value,
                    _MICRO_BATCH.value, fsdp_axes=_FSDP_AXES.value,
                    global_batch=_GLOBAL_BATCH.value, remat=_REMAT.value,
                    hardware=hardware)
  print(format_plan(p))
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(p, f, indent=2)
    print(f"\nwrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
