"""Decoding: prefill + steps == the full forward, the cache, sampling."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_config, set_field
from moe_jax import decode
from moe_jax.model import build_model

SEQ = 24      # total tokens of the test sequences
PREFIX = 19   # prefill length: past one KDA chunk (16), not a multiple of it

# Packed documents, one row each: (length, id) runs. Row 0: starts at a
# chunk boundary, a one-token document, and a prefill ending 2 tokens into a
# document (shorter than the conv tail, 3); row 1: a document starts at the
# first step; row 2: a start mid-prefill and one in the steps. Ids need not
# start at 0 (a new sequence ignores the cached ones).
DOCUMENTS = ([(16, 0), (1, 1), (7, 2)], [(19, 4), (5, 5)],
             [(5, 1), (16, 2), (3, 3)])


# The other branches a decode must follow: standard residuals, low-rank
# queries, a dense first layer, latent experts, unbounded decay.
OTHERS = {"model.residual": "standard", "model.mla.q_lora_rank": 8,
          "model.moe.first_dense_layers": 1, "model.moe.d_dense": 32,
          "model.moe.expert_latent_dim": 16, "model.kda.decay": "unbounded",
          "model.num_layers": 4, "model.layer_pattern": "MK"}


@functools.cache
def _tiny(rope: int = 0, others: bool = False, backend: str = "auto",
          logn: int = 0):
  """(model, params, router_state) of the tiny hybrid (KDA + MLA, Block
  AttnRes, MoE), random params and nonzero router biases (decode must read
  them). numpy values: no init to compile. logn: model.mla.logn_scale_len."""
  config = load_config("default.py", "tiny,smoke")
  config.model.mla.qk_rope_head_dim = rope
  config.model.mla.logn_scale_len = logn
  for field, value in (OTHERS.items() if others else ()):
    set_field(config, field, value)
  if backend != "auto":  # the Pallas kernels run at their chunk, 64
    config.model.kda.backend, config.model.kda.chunk_size = backend, 64
  model = build_model(config)
  shapes = nn.meta.unbox(jax.eval_shape(
      model.init, jax.random.PRNGKey(0), jnp.zeros((1, SEQ), jnp.int32)))
  rng = np.random.default_rng(3)
  def fill(s):
    if len(s.shape) == 1:  # norm scales, AttnRes queries, A_log, biases
      return jnp.asarray(1 + 0.3 * rng.standard_normal(s.shape), s.dtype)
    return jnp.asarray(rng.standard_normal(s.shape) / np.sqrt(s.shape[-2]),
                       s.dtype)
  return (model, jax.tree.map(fill, shapes["params"]),
          jax.tree.map(fill, shapes["router_state"]))


# rope_others_logn: queries scaled from position 6 on (in the prefill and in
# every step).
@pytest.fixture(scope="module", params=[(0, False), (8, False),
                                        (4, True, "auto", 6)],
                ids=["nope", "rope", "rope_others_logn"])
def tiny(request):
  return _tiny(*request.param)


@pytest.fixture(scope="module")
def nope():
  return _tiny(0)


def _forward(model):
  return jax.jit(lambda p, s, t, ids=None: model.apply(
      {"params": p, "router_state": s}, t, segment_ids=ids))


def _packed_ids():
  return jnp.asarray([np.repeat([i for _, i in row], [n for n, _ in row])
                      for row in DOCUMENTS], jnp.int32)


def _check_prefill_then_steps(model, params, router_state, segment_ids=None):
  """Prefill of PREFIX tokens, then steps: the full forward's logits (with
  segment_ids [B, SEQ]: the packed forward's, the ids given to each call)."""
  b = 2 if segment_ids is None else segment_ids.shape[0]
  ids = (lambda sl: None) if segment_ids is None else (  # noqa: E731
      lambda sl: segment_ids[:, sl])
  tokens = jax.random.randint(jax.random.PRNGKey(1), (b, SEQ), 0, 256)
  full = np.asarray(_forward(model)(params, router_state, tokens,
                                    segment_ids))

  cache = decode.init_cache(model, params, router_state, b, SEQ)
  step = jax.jit(lambda p, s, c, t, i: decode.decode_step(
      model, p, s, c, t, segment_ids=i))
  # A new sequence (as generate prefills) in a cache holding another one.
  cache = jax.tree.map(lambda c: c + 1, cache)
  prefill = jax.jit(lambda p, s, c, t, i: decode.prefill(
      model, p, s, c, t, new_sequence=True, segment_ids=i))
  logits, cache = prefill(params, router_state, cache, tokens[:, :PREFIX],
                          ids(slice(0, PREFIX)))
  got = [np.asarray(logits)]
  for t in range(PREFIX, SEQ):
    logits, cache = step(params, router_state, cache, tokens[:, t], ids(t))
    got.append(np.asarray(logits)[:, None])
  assert np.abs(full).max() > 1.0  # logits of a useful size for the atol
  np.testing.assert_allclose(np.concatenate(got, 1), full, rtol=0, atol=1e-4)
  # Only the mixers cache; the routers emit no training statistics here.
  assert all(k.endswith(("_kda", "_mla")) for k in cache)
  assert all(int(c["index"]) == SEQ for k, c in cache.items()
             if k.endswith("_mla"))


def test_prefill_then_steps_match_full_forward(tiny):
  """Packed rows (DOCUMENTS): documents start inside the prefill, at the
  first step and inside the steps."""
  _check_prefill_then_steps(*tiny, segment_ids=_packed_ids())


def test_prefill_then_steps_through_the_pallas_kernels():
  """The GPU path (chunked Pallas KDA for the prefill, the Pallas step),
  interpreted on CPU, on the packed rows 1 and 2 (the kernels reset at
  document starts; ids continue from the cache into the steps)."""
  _check_prefill_then_steps(*_tiny(backend="interpret"),
                            segment_ids=_packed_ids()[1:])


def test_prefill_continues_from_a_cache(nope):
  """Two prefills continuing a cache (the first shorter than the conv tail,
  the second scored against the latent cache) == one forward. The first
  without ids (one document, id 0), the second packed: row 0 continues
  document 0 and starts document 1 inside, row 1 starts document 1 at its
  first token."""
  model, params, router_state = nope
  tokens = jax.random.randint(jax.random.PRNGKey(4), (2, PREFIX), 0, 256)
  ids = jnp.asarray([[0] * 9 + [1] * 10, [0] * 2 + [1] * 17], jnp.int32)
  full = np.asarray(_forward(model)(params, router_state, tokens, ids))
  cache = decode.init_cache(model, params, router_state, 2, SEQ)
  prefill = jax.jit(lambda p, s, c, t, i=None: decode.prefill(
      model, p, s, c, t, segment_ids=i))
  a, cache = prefill(params, router_state, cache, tokens[:, :2])
  b, _ = prefill(params, router_state, cache, tokens[:, 2:], ids[:, 2:])
  np.testing.assert_allclose(np.concatenate([a, b], 1), full, rtol=0,
                             atol=1e-4)


@pytest.mark.parametrize("rope", [0, 8])
def test_cache_report_kda_constant_mla_latent_only(rope):
  config = load_config("default.py", "tiny,smoke")
  config.model.mla.qk_rope_head_dim = rope
  model = build_model(config)
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0),
                          jnp.zeros((1, 8), jnp.int32))
  params, router_state = nn.meta.unbox(shapes["params"]), shapes[
      "router_state"]
  reports = {n: decode.cache_report(jax.eval_shape(
      lambda n=n: decode.init_cache(model, params, router_state, 3, n)))
             for n in (64, 1024)}
  m = config.model
  dk = m.d_model // m.kda.num_heads
  for short, long in zip(reports[64], reports[1024]):
    assert short["layer"] == long["layer"]
    if short["kind"] == "KDA":
      assert short == long  # constant in the context length
      assert short["shapes"]["state"] == (3, m.kda.num_heads, dk, dk)
      assert short["shapes"]["q_conv_tail"] == (3, m.kda.conv_size - 1,
                                                m.d_model)
      assert short["shapes"]["segment_id"] == (3,)
    else:
      # Only the latent (+ the shared rotary key), the positions' segment
      # ids and the write position.
      width = m.mla.kv_lora_rank + rope
      want = {"c_kv": (3, 1024, m.mla.kv_lora_rank), "index": (),
              "segment_ids": (3, 1024)}
      if rope:
        want["rope_key"] = (3, 1024, rope)
      assert long["shapes"] == want
      assert long["bytes"] == 3 * 1024 * (width + 1) * 4 + 4
  assert [r["kind"] for r in reports[64]] == ["KDA", "MLA"]


def test_greedy_generate_is_argmax_of_the_full_forward(nope):
  model, params, router_state = nope
  prompt = jax.random.randint(jax.random.PRNGKey(5), (2, PREFIX), 0, 256)
  n = 4
  out = np.asarray(decode.generate(model, params, router_state, prompt, n,
                                   jax.random.PRNGKey(0)))
  assert out.shape == (2, n) and out.dtype == np.int32
  # The model is causal: one forward over a fixed-length buffer gives each
  # prefix's next-token logits (the growing sequence, re-run from scratch).
  seq = np.zeros((2, PREFIX + n), np.int32)
  seq[:, :PREFIX] = prompt
  forward = _forward(model)
  for i in range(n):
    logits = np.asarray(forward(params, router_state, jnp.asarray(seq)))
    seq[:, PREFIX + i] = logits[:, PREFIX + i - 1].argmax(-1)
  np.testing.assert_array_equal(out, seq[:, PREFIX:])


def test_top_k_1_is_greedy_and_sampling_is_deterministic(nope):
  model, params, router_state = nope
  # The shapes of the test above: its greedy program is reused.
  prompt = jax.random.randint(jax.random.PRNGKey(6), (2, PREFIX), 0, 256)
  gen = lambda seed, **kw: np.asarray(decode.generate(  # noqa: E731
      model, params, router_state, prompt, 4, jax.random.PRNGKey(seed),
      **kw))
  np.testing.assert_array_equal(gen(0, temperature=1.0, top_k=1), gen(1))
  sampled = gen(7, temperature=1.0, top_p=0.9)
  np.testing.assert_array_equal(sampled, gen(7, temperature=1.0, top_p=0.9))
  assert not np.array_equal(sampled, gen(8, temperature=1.0, top_p=0.9))


def test_sample_logits_top_k_and_top_p():
  probs = np.array([0.5, 0.3, 0.15, 0.05])
  logits = jnp.asarray(np.log(np.tile(probs, (512, 1))), jnp.float32)
  def draw(**kw):
    return set(np.asarray(decode.sample_logits(
        logits, jax.random.PRNGKey(0), temperature=1.0, **kw)).tolist())
  assert draw() == {0, 1, 2, 3}
  assert draw(top_k=2) == {0, 1}
  assert draw(top_p=0.5) == {0}        # the first token alone reaches 0.5
  assert draw(top_p=0.7) == {0, 1}
  assert draw(top_k=3, top_p=0.99) == {0, 1, 2}
  greedy = decode.sample_logits(logits, jax.random.PRNGKey(0))
  assert set(np.asarray(greedy).tolist()) == {0}
  with pytest.raises(ValueError, match="top_p must be in"):
    decode.sample_logits(logits, jax.random.PRNGKey(0), top_p=0.0)
  with pytest.raises(ValueError, match=r"top_k must be in \[0, vocab_size=4"):
    decode.sample_logits(logits, jax.random.PRNGKey(0), top_k=5)


def test_prompt_longer_than_the_cache_is_an_error(nope):
  model, params, router_state = nope
  prompt = jnp.zeros((1, 12), jnp.int32)
  with pytest.raises(ValueError, match=r"prompt of 12 tokens is longer than "
                     r"the cache \(cache_size=8"):
    decode.generate(model, params, router_state, prompt, 2,
                    jax.random.PRNGKey(0), cache_size=8)
  with pytest.raises(ValueError, match="needs a cache of 15 positions, "
                     "cache_size=12"):
    decode.generate(model, params, router_state, prompt, 4,
                    jax.random.PRNGKey(0), cache_size=12)
  cache = decode.init_cache(model, params, router_state, 1, 8)
  with pytest.raises(ValueError, match="12 tokens do not fit the latent "
                     "cache of T_max=8"):
    jax.eval_shape(lambda: decode.prefill(model, params, router_state, cache,
                                          prompt))
  with pytest.raises(ValueError, match=r"segment_ids must have the tokens' "
                     r"shape \(1, 4\), got \(1, 3\)"):
    decode.prefill(model, params, router_state, cache, prompt[:, :4],
                   segment_ids=jnp.zeros((1, 3), jnp.int32))
  with pytest.raises(ValueError, match=r"segment_ids must have the token's "
                     r"shape \(1,\), got \(1, 1\)"):
    decode.decode_step(model, params, router_state, cache, prompt[:, 0],
                       segment_ids=jnp.zeros((1, 1), jnp.int32))


def test_generate_script_restores_the_smoke_run(smoke_run):
  from experiments import generate as script
  _, workdir, _ = smoke_run
  res = script.continue_prompt(workdir, "def f(x):\n", 5, temperature=0.7,
                               top_k=20, seed=1)
  assert res["step"] == 6 and res["tokens"].shape == (5,)
  assert res["tokens_per_sec"] > 0 and isinstance(res["text"], str)
  again = script.continue_prompt(workdir, "def f(x):\n", 5, step=3)
  assert again["step"] == 3
  with pytest.raises(ValueError, match=r"no checkpoint of step 4 in .*; "
                     r"saved steps: \[3, 6\]"):
    script.load_checkpoint(workdir, step=4)
  with pytest.raises(ValueError, match="prompt of 11 tokens is longer than "
                     "the cache"):
    script.continue_prompt(workdir, "def f(x):\n", 2, cache_size=8)


def test_bench_decode_rows_hybrid_against_all_mla(tmp_path):
  from experiments import bench_decode
  rows = []
  for pattern in ("KM", "M"):
    config = load_config("default.py", "tiny,smoke")
    config.model.layer_pattern = pattern
    trace = str(tmp_path / pattern) if pattern == "KM" else None
    rows.append(bench_decode.bench_row(config, 64, batch=2, steps=2,
                                       trace_dir=trace))
  hybrid, all_mla = rows
  assert hybrid["kda_cache_bytes"] > 0 and all_mla["kda_cache_bytes"] == 0
  r = load_config("default.py", "tiny,smoke").model.mla.kv_lora_rank
  # 2 MLA layers: per sequence a latent and segment id per position; an index.
  assert all_mla["mla_cache_bytes"] == 2 * (2 * 64 * (r + 1) * 4 + 4)
  assert hybrid["mla_cache_bytes"] == all_mla["mla_cache_bytes"] // 2
  # A step emits one token per sequence.
  for row in rows:
    assert row["ms_per_token"] > 0
    np.testing.assert_allclose(row["ms_per_token"], row["ms_per_step"] / 2)
  # The traced row: device time and ops per step, its busiest ops.
  assert 0 < hybrid["device_ms_per_step"] and hybrid["ops_per_step"] >= 10
  assert len(hybrid["top_ops"]) == 8 and "device_ms_per_step" not in all_mla
  assert all(row["loop_temp_bytes"] >= 0 for row in rows)
  text = bench_decode.table(rows)
  assert "| KM | 64 | 2 |" in text and text.count("| 1.00 | 1.00 | - | - |") == 1
  assert "Busiest device ops per step, KM at L=64, B=2" in text


def test_bench_decode_reports_a_row_out_of_memory(monkeypatch):
  from experiments import bench_decode
  def oom(*args, **kwargs):
    raise jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4.00GiB")
  monkeypatch.setattr(bench_decode, "bench_row", oom)
  config = load_config("default.py", "tiny,smoke")
  config.model.layer_pattern = "M"
  row = bench_decode.run_row(config, 64, 8, 2, None)
  assert row["error"].startswith("out of memory: RESOURCE_EXHAUSTED")
  assert "| M | 64 | 8 | out of memory" in bench_decode.table([row])
