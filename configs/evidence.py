"""Evidence sweeps: each design claim against its baseline, over 3 seeds.

gpu_small-sized runs of 1000 steps (32 x 1024 tokens per step; a few minutes
each once the training step is fast). The config arg names one sweep, then
optional variants: a size other than gpu_small, 'cpu' (configs/default.py's
model, 300 steps of 16 x 128 tokens, a few minutes a run on 2 CPU cores; its
balancing sweeps use 32 sequences per batch) or 'tiny' (the tiny,smoke model
of configs/default.py, for tests and notebook 03), then any of the size's
config file's VARIANTS (e.g. gpu_small's 'short').

Sweeps (SWEEPS; one GPU command each, resumable: rerun to continue):
  residuals: standard residuals (baseline), Block AttnRes with 8, 4 and 2
    sublayers per block (2, 4 and 8 blocks over gpu_small's 16 sublayers),
    full AttnRes; depth 8 layers and length 1024 fixed.
      python -m experiments.sweep --config=configs/evidence.py:residuals \
          --workdir=runs/ev_residuals
  residual_length: standard and Block AttnRes (2 sublayers per block) at
    sequence lengths 256, 1024 and 4096, 32768 tokens per step at each; each
    AttnRes entry is compared with standard residuals at its length.
      python -m experiments.sweep --config=configs/evidence.py:residual_length \
          --workdir=runs/ev_residual_length
  decay: unbounded softplus decay (baseline) against the bounded gate at
    g_min -5 (the default) and g_min -2 (the most negative bound
    results/range_scan.md finds safe for 32-row tiles anchored at the first
    row, fp32 and bf16).
      python -m experiments.sweep --config=configs/evidence.py:decay \
          --workdir=runs/ev_decay
  balancing: 64 experts top-4: qb-exact, qb-histogram, sign (baseline), aux,
    none.
      python -m experiments.sweep --config=configs/evidence.py:balancing \
          --workdir=runs/ev_balancing
  balancing_extreme: the same at 256 experts top-8 (gpu_small:extreme).
      python -m experiments.sweep --config=configs/evidence.py:balancing_extreme \
          --workdir=runs/ev_balancing_extreme

CPU version (results/evidence.md): configs/default.py's 4 layers (8
sublayers: block-4 and block-2), lengths 64, 128 and 512 at 2048 tokens per
step; balancing at 16 experts top-2 and balancing_extreme at 256 top-8, both
at 32 x 128 tokens per step:
  python -m experiments.sweep --config=configs/evidence.py:residuals,cpu \
      --workdir=runs/ev_cpu_residuals
Tiny CPU version (what the tests and notebook 03 use; 2 layers, so its
residuals sweep has block-4 and block-2):
  python -m experiments.sweep --config=configs/evidence.py:residuals,tiny \
      --workdir=/tmp/ev_res --seeds=0,1
"""
from moe_jax.config_base import apply_variant, load_config_file, setter

# The config files of the sizes: cpu and tiny are default.py's model.
_DEFAULT = load_config_file("default.py", __file__)
_GPU_SMALL = load_config_file("gpu_small.py", __file__)

SWEEPS = ("residuals", "residual_length", "decay", "balancing",
          "balancing_extreme")
SEEDS = (0, 1, 2)
SIZES = ("gpu_small", "cpu", "tiny")
# Sublayers per Block AttnRes block in the residuals sweep, per size: 2, 4, 8
# blocks of gpu_small's 16 sublayers; 2 and 4 of cpu's 8; 1 and 2 of tiny's 4.
BLOCK_SIZES = {"gpu_small": (8, 4, 2), "cpu": (4, 2), "tiny": (4, 2)}
# Sequence lengths of residual_length per size; tokens per step fixed.
LENGTHS = {"gpu_small": (256, 1024, 4096), "cpu": (64, 128, 512),
           "tiny": (16, 32, 64)}
TOKENS_PER_STEP = {"gpu_small": 32 * 1024, "cpu": 16 * 128, "tiny": 4 * 32}
LENGTH_BLOCK_SIZE = 2
G_MINS = (-5.0, -2.0)


def _parse(arg: str | None) -> tuple[str, list[str]]:
  """(sweep name, the other words) of 'SWEEP[,variant...]'."""
  words = [a.strip() for a in (arg or "").split(",") if a.strip()]
  named = [w for w in words if w in SWEEPS]
  if len(named) != 1:
    raise ValueError(
        f"configs/evidence.py needs exactly one sweep name in its arg, got "
        f"{arg!r}; allowed sweeps: {list(SWEEPS)} (e.g. "
        "'configs/evidence.py:residuals' or ':residuals,tiny')")
  return named[0], [w for w in words if w != named[0]]


def _size(variants: list[str]) -> str:
  """The model size the variants name (default gpu_small)."""
  named = [v for v in variants if v in SIZES]
  if len(named) > 1:
    raise ValueError(f"configs/evidence.py: at most one size, got {named}; "
                     f"allowed sizes: {list(SIZES)}")
  return named[0] if named else "gpu_small"


def _variants(names: str, variants):
  """A variant applying the named `variants` ("a,b") in order."""
  return lambda c: apply_variant(c, names, variants)


# Per sweep and size, what the base model changes. The CPU balancing sweeps
# take 32 sequences per batch (default.py's batch32): at 16 the per-batch
# sampling noise of the expert counts is most of what is left
# (results/load_balancing.md).
_SWEEP_BASE = {
    "residuals": {},
    "residual_length": {},
    "decay": {},
    "balancing": {"cpu": _DEFAULT.VARIANTS["batch32"]},
    "balancing_extreme": {
        "gpu_small": _GPU_SMALL.VARIANTS["extreme"],
        "cpu": _variants("extreme,batch32", _DEFAULT.VARIANTS),
        "tiny": setter(**{"model.moe.num_experts": 32, "model.moe.top_k": 8,
                          "model.moe.d_expert": 8})},
}


def get_config(arg: str | None = None):
  """The base config of sweep `arg` ('SWEEP[,SIZE][,variant...]')."""
  sweep, variants = _parse(arg)
  size = _size(variants)
  variants = [v for v in variants if v != size]
  change = _SWEEP_BASE[sweep].get(size, setter())
  if size != "gpu_small":
    c = _DEFAULT.get_config("tiny,smoke" if size == "tiny" else None)
    change(c)
    return apply_variant(c, ",".join(variants), _DEFAULT.VARIANTS)
  c = _GPU_SMALL.get_config()
  c.train.steps = 1000
  c.train.warmup_steps = 100
  c.train.eval_every = 500
  c.train.checkpoint_every = 500
  change(c)
  return apply_variant(c, ",".join(variants), _GPU_SMALL.VARIANTS)


def _claim(text, column, candidate, baseline, claim, scale=1.0):
  return {"text": text, "column": column, "candidate": candidate,
          "baseline": baseline, "claim": claim, "scale": scale}


def get_sweep(arg: str | None = None):
  """{'entries', 'seeds', 'baseline', 'claims'} of sweep `arg`.

  Claims (moe_jax/eval/sweep_stats.py verdicts, one line each in the
  summary): residuals: every AttnRes variant lowers val loss against
  standard residuals, block-2 gives up nothing against full AttnRes, and
  every AttnRes variant keeps 95% of standard's tokens/s (the sweep's
  training tokens/s; experiments/bench_train_step.py times the step alone);
  residual_length: block AttnRes lowers val loss at each length; decay:
  bounded decay costs no val loss against unbounded; balancing: QB (exact,
  histogram) has at most half the sign rule's MaxVio_batch over the last
  20% of steps (mean over layers, and the first layer) at no val loss
  against aux.
  """
  sweep, variants = _parse(arg)
  size = _size(variants)
  if sweep == "residuals":
    entries = [{"name": "standard",
                "overrides": {"model.residual": "standard"}}]
    entries += [{"name": f"block-{n}", "overrides": {
        "model.residual": "block_attn_res",
        "model.attn_res_layers_per_block": n}} for n in BLOCK_SIZES[size]]
    entries += [{"name": "full", "overrides": {
        "model.residual": "block_attn_res",
        "model.attn_res_layers_per_block": 1}}]
    baseline = "standard"
    claims = [_claim(f"{e['name']} lowers val loss vs standard residuals",
                     "val_loss", e["name"], "standard", "lower")
              for e in entries[1:]]
    recovers = f"block-{BLOCK_SIZES[size][-1]}"
    claims.append(_claim(f"{recovers} costs no val loss vs full AttnRes",
                         "val_loss", recovers, "full", "no_higher"))
    claims += [_claim(f"{e['name']} trains at >= 0.95x standard's tokens/s",
                      "tokens_per_sec", e["name"], "standard", "no_lower",
                      0.95) for e in entries[1:]]
  elif sweep == "residual_length":
    entries = []
    for length in LENGTHS[size]:
      data = {"data.seq_len": length,
              "data.batch_size": TOKENS_PER_STEP[size] // length}
      entries.append({"name": f"standard-T{length}", "overrides": dict(
          data, **{"model.residual": "standard"})})
      entries.append({"name": f"block-{LENGTH_BLOCK_SIZE}-T{length}",
                      "baseline": f"standard-T{length}",
                      "overrides": dict(data, **{
                          "model.residual": "block_attn_res",
                          "model.attn_res_layers_per_block":
                              LENGTH_BLOCK_SIZE})})
    baseline = f"standard-T{LENGTHS[size][1]}"
    claims = [_claim(f"block AttnRes lowers val loss at length {length}",
                     "val_loss", f"block-{LENGTH_BLOCK_SIZE}-T{length}",
                     f"standard-T{length}", "lower")
              for length in LENGTHS[size]]
  elif sweep == "decay":
    entries = [{"name": "unbounded",
                "overrides": {"model.kda.decay": "unbounded"}}]
    entries += [{"name": f"bounded-g{int(-g)}", "overrides": {
        "model.kda.decay": "bounded", "model.kda.g_min": g}} for g in G_MINS]
    baseline = "unbounded"
    claims = [_claim(f"{e['name']} costs no val loss vs unbounded decay",
                     "val_loss", e["name"], "unbounded", "no_higher")
              for e in entries[1:]]
  else:  # balancing, balancing_extreme
    # The strategies of configs/ablations.py's load-balancing sweep.
    entries = load_config_file("ablations.py", __file__).get_sweep()
    baseline = "sign"
    claims = []
    for qb in ("qb-exact", "qb-histogram"):
      claims += [
          _claim(f"{qb}: MaxVio_batch (last 20%) at most 0.5x sign's",
                 "maxvio_batch_last20", qb, "sign", "no_higher", 0.5),
          _claim(f"{qb}: first layer's MaxVio_batch (last 20%) at most 0.5x "
                 "sign's", "maxvio_batch_last20_first", qb, "sign",
                 "no_higher", 0.5),
          _claim(f"{qb}: no val loss cost vs aux", "val_loss", qb, "aux",
                 "no_higher")]
  return {"entries": entries, "seeds": list(SEEDS), "baseline": baseline,
          "claims": claims}
