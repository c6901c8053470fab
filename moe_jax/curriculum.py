"""The multi-stage context curriculum: stages parsed from the config.

`config.curriculum.stages` is a compact string, so that it overrides and
sweeps like any other field (`--config.curriculum.stages=256:200,1024:60`):
comma-separated stages `seq_len:steps` or `seq_len:steps:batch_size`, in
order of strictly increasing seq_len. Empty means one stage of
(data.seq_len, train.steps, data.batch_size): a run without a curriculum is
a ladder of one stage.

Tokens per step are held constant by default: a stage without an explicit
batch size gets data.batch_size * data.seq_len / seq_len sequences, and an
explicit one must give the same product unless
curriculum.constant_tokens=False. train.steps must equal the sum of the
stages' steps (the learning-rate schedule runs over the whole ladder);
curriculum.stage_warmup_steps > 0 ramps the learning rate up again at the
start of every stage after the first; curriculum.stage_end_factor > 0
measures the extrapolation to that many times each stage's length at its
end (moe_jax.eval.long_context.stage_end_metrics), at every stage's end or,
with curriculum.stage_end_stages="last", only at the last one's.

config_validation calls `stages_of`; both raise moe_jax.config_error's
ConfigError.
"""
from __future__ import annotations

from typing import NamedTuple

import ml_collections

from moe_jax.config_error import ConfigError

STAGE_END_STAGES = ("every", "last")
FORMAT = ("comma-separated seq_len:steps or seq_len:steps:batch_size with "
          "seq_len strictly increasing, e.g. '256:200,1024:60,4096:20'")


class Stage(NamedTuple):
  """One stage of the ladder; it runs global steps (start, end]."""
  index: int
  seq_len: int
  batch_size: int          # global sequences per step
  start: int               # global step count before its first step
  end: int                 # global step count after its last step

  @property
  def steps(self) -> int:
    return self.end - self.start

  @property
  def tokens_per_step(self) -> int:
    return self.seq_len * self.batch_size


def _parse_int(text: str, what: str, entry: str) -> int:
  try:
    return int(text)
  except ValueError:
    raise ConfigError(
        f"curriculum.stages entry {entry!r}: {what} {text!r} is not an "
        f"integer; allowed: {FORMAT}") from None


def parse_stages(text: str) -> list[tuple[int, int, int | None]]:
  """[(seq_len, steps, batch_size or None)] of a stages string (no checks
  against the rest of the config)."""
  out = []
  for entry in (e.strip() for e in text.split(",")):
    parts = entry.split(":")
    if not entry or len(parts) not in (2, 3):
      raise ConfigError(f"curriculum.stages entry {entry!r} is malformed; "
                        f"allowed: {FORMAT}")
    seq_len = _parse_int(parts[0], "seq_len", entry)
    steps = _parse_int(parts[1], "steps", entry)
    batch = _parse_int(parts[2], "batch_size", entry) if len(parts) == 3 \
        else None
    out.append((seq_len, steps, batch))
  return out


def stages_of(config: ml_collections.ConfigDict) -> list[Stage]:
  """The validated ladder of a config; ConfigError names the bad field.

  Fields besides curriculum.stages default where a config saved before
  they existed lacks them.
  """
  cur = config.curriculum
  ref_len, ref_batch = config.data.seq_len, config.data.batch_size
  text = cur.stages.strip() if isinstance(cur.stages, str) else cur.stages
  if not isinstance(text, str):
    raise ConfigError(f"curriculum.stages must be a string ({FORMAT}; '' = "
                      f"one stage of data.seq_len), got {cur.stages!r}")
  if not text:
    return [Stage(0, ref_len, ref_batch, 0, config.train.steps)]
  tokens = ref_len * ref_batch
  stages, start = [], 0
  for i, (seq_len, steps, batch) in enumerate(parse_stages(text)):
    where = f"curriculum.stages[{i}] ({seq_len}:{steps})"
    if seq_len < 2:
      raise ConfigError(f"{where}: seq_len must be >= 2, got {seq_len}")
    if stages and seq_len <= stages[-1].seq_len:
      raise ConfigError(
          f"{where}: seq_len must be strictly increasing, got {seq_len} after "
          f"{stages[-1].seq_len}; allowed: {FORMAT}")
    if steps < 1:
      raise ConfigError(f"{where}: steps must be >= 1, got {steps}")
    if batch is None:
      if tokens % seq_len:
        raise ConfigError(
            f"{where}: tokens per step (data.batch_size * data.seq_len = "
            f"{ref_batch} * {ref_len} = {tokens}) is not a multiple of "
            f"seq_len {seq_len}; allowed: seq_len dividing {tokens}, or an "
            "explicit batch size (seq_len:steps:batch_size) with "
            "curriculum.constant_tokens=False")
      batch = tokens // seq_len
    elif batch < 1:
      raise ConfigError(f"{where}: batch_size must be >= 1, got {batch}")
    elif cur.get("constant_tokens", True) and batch * seq_len != tokens:
      raise ConfigError(
          f"{where}: batch_size {batch} gives {batch * seq_len} tokens per "
          f"step, not data.batch_size * data.seq_len = {tokens}; allowed: "
          f"batch_size {tokens / seq_len:g}, or "
          "curriculum.constant_tokens=False")
    if batch % config.train.microbatches:
      raise ConfigError(
          f"{where}: batch_size {batch} is not divisible by "
          f"train.microbatches={config.train.microbatches}; allowed: "
          "train.microbatches dividing every stage's batch size")
    stages.append(Stage(i, seq_len, batch, start, start + steps))
    start += steps
  if config.train.steps != start:
    raise ConfigError(
        f"train.steps={config.train.steps} must equal the sum of the "
        f"curriculum.stages steps ({start}); set --config.train.steps={start}")
  factor = cur.get("stage_end_factor", 0)
  if isinstance(factor, bool) or not isinstance(factor, int) or factor < 0:
    raise ConfigError("curriculum.stage_end_factor must be an integer >= 0 "
                      f"(0 = off), got {factor!r}")
  which = cur.get("stage_end_stages", "every")
  if which not in STAGE_END_STAGES:
    raise ConfigError(f"curriculum.stage_end_stages must be one of "
                      f"{list(STAGE_END_STAGES)}, got {which!r}")
  warmup = cur.get("stage_warmup_steps", 0)
  if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
    raise ConfigError("curriculum.stage_warmup_steps must be an integer >= 0,"
                      f" got {warmup!r}")
  return stages


def stage_end_eval_due(config: ml_collections.ConfigDict,
                       stages: list[Stage], stage: Stage) -> bool:
  """Whether `stage` ends with the length-extrapolation evaluation:
  curriculum.stage_end_factor > 0, and the stage is the last one or
  curriculum.stage_end_stages is "every"."""
  cur = config.curriculum
  return bool(cur.stage_end_factor) and (
      cur.get("stage_end_stages", "every") == "every"
      or stage.index == stages[-1].index)


def stage_at(stages: list[Stage], step: int) -> Stage:
  """The stage that runs the step after global step count `step`."""
  for stage in stages:
    if step < stage.end:
      return stage
  return stages[-1]


def warmup_restarts(config: ml_collections.ConfigDict
                    ) -> tuple[tuple[int, ...], int]:
  """(global steps where the learning rate ramps up again, ramp length)."""
  warmup = config.curriculum.stage_warmup_steps
  if not warmup:
    return (), 0
  return tuple(s.start for s in stages_of(config)[1:]), warmup
