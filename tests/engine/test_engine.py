"""The serving engine against `ji.generate`, request by request.

Every engine here shares one cache and batch shape (block size 4, 33 blocks = 128 token slots,
B = 8 rows, M = 16 blocks per sequence) so the jitted step compiles once per token bucket T for
the whole file. The pool is small enough that the parity workloads preempt (asserted), and the
reference is `ji.generate`, which runs each batch in one compiled program with its own private
contiguous cache: no scheduling, no sharing, no preemption.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer.cache.metadata import SeqChunk, build_metadata
from jaxinfer.engine import Engine, EngineConfig
from jaxinfer.engine import engine as engine_mod
from jaxinfer.engine.engine import _copy_groups
from jaxinfer.requests import stop_ids
from jaxinfer.sampling import SamplingBatch, process_logits
from tests.helpers import random_params

CFG = ji.preset("tiny-llama").replace(eos_token_id=None)
S = 4  # block size
MAX_TOKENS = 12
ECFG = EngineConfig(
    block_size=S,
    num_blocks=25,  # 24 usable blocks = 96 slots: ten ~25-token requests must preempt
    max_num_seqs=8,
    max_num_batched_tokens=256,
    backend="reference",
    min_token_bucket=16,
    min_block_bucket=16,  # M fixed at 16 (64 positions) for every workload below
    min_seq_bucket=8,  # B fixed at max_num_seqs
)


def _compiles() -> dict[str, int]:
    """Programs compiled so far by the engine's jitted step and block copy (their own caches)."""
    return {"step": engine_mod._step._cache_size(), "copy": engine_mod._copy._cache_size()}


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, seed=7)


def _rand(rng, n):
    return rng.randint(0, CFG.vocab_size, n).tolist()


def _workload():
    """Ten prompts in pairs sharing prefixes of 0, S-1, S, 2S+3 tokens and a whole prompt.

    Returns (prompts, wave): wave 0 holds the first of each pair, wave 1 the second, which
    arrives once wave 0 has prefilled so its shared blocks are in the prefix cache.
    """
    rng = np.random.RandomState(3)
    prompts, wave = [], []
    for shared in (0, S - 1, S, 2 * S + 3):
        prefix = _rand(rng, shared)
        for w in (0, 1):
            prompts.append(prefix + _rand(rng, rng.randint(3, 14)))
            wave.append(w)
    whole = _rand(rng, 2 * S + 6)
    prompts += [whole, list(whole)]
    wave += [0, 1]
    return prompts, wave


PROMPTS, WAVE = _workload()
GREEDY = ji.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def _sampled_params(stops=None):
    """Per-request sampled settings (temperature, top-k, top-p, min-p, seeds; some stop ids)."""
    sps = []
    for i in range(len(PROMPTS)):
        sps.append(
            ji.SamplingParams(
                temperature=(0.7, 1.0, 1.3)[i % 3],
                top_k=(0, 20)[i % 2],
                top_p=(1.0, 0.9)[(i // 2) % 2],
                min_p=0.02 if i == 4 else 0.0,
                max_tokens=MAX_TOKENS,
                seed=100 + i,
                stop_token_ids=() if stops is None or stops[i] is None else (stops[i],),
            )
        )
    return sps


@pytest.fixture(scope="module")
def greedy_ref(params):
    return ji.generate(CFG, params, PROMPTS, GREEDY, backend="reference")


def _run_waves(engine, prompts, sampling, wave):
    """Adds wave 0, steps until each of its requests streamed a token, adds wave 1, drains.

    Returns, per request, (streamed tokens, finish reason) and checks the stream's shape: one
    `finished` output per request, the last one.
    """
    streams = {i: [] for i in range(len(prompts))}
    finished = {}
    for i, p in enumerate(prompts):
        if wave[i] == 0:
            engine.add_request(p, sampling[i], request_id=i)

    def step():
        for o in engine.step():
            assert o.sample_index == 0
            assert o.request_id not in finished, "tokens streamed after the finish"
            streams[o.request_id].extend(o.new_token_ids)
            if o.finished:
                assert o.request_finished
                finished[o.request_id] = o.finish_reason

    while any(wave[i] == 0 and not streams[i] for i in streams):
        step()
    for i, p in enumerate(prompts):
        if wave[i] == 1:
            engine.add_request(p, sampling[i], request_id=i)
    while engine.has_unfinished():
        step()
    assert sorted(finished) == list(streams)
    return [(streams[i], finished[i]) for i in range(len(prompts))]


@pytest.mark.parametrize(
    "budget,prefix,chunked",
    [
        (1, True, True),
        (1, False, True),
        (7, True, True),
        (7, False, True),
        (256, True, True),
        (256, False, True),
        (256, True, False),
        (256, False, False),
    ],
)
def test_greedy_stream_matches_generate(params, greedy_ref, budget, prefix, chunked):
    ecfg = dataclasses.replace(
        ECFG,
        max_num_batched_tokens=budget,
        enable_prefix_caching=prefix,
        enable_chunked_prefill=chunked,
    )
    engine = Engine(CFG, params, ecfg)
    got = _run_waves(engine, PROMPTS, [GREEDY] * len(PROMPTS), WAVE)
    for i, ((tokens, reason), ref) in enumerate(zip(got, greedy_ref)):
        assert tokens == ref.token_ids, f"request {i}"
        assert reason == ref.finish_reason == "length"
    m = engine.metrics()
    # A budget of one token runs the oldest decode alone until it finishes: too few sequences
    # hold blocks at once to preempt. Every larger budget must preempt in this pool.
    assert m.num_preemptions == engine.num_preemptions
    assert engine.num_preemptions > 0 or budget == 1
    assert m.num_completed == len(PROMPTS) and m.total_output_tokens == len(PROMPTS) * MAX_TOKENS
    assert all(s.num_batched_tokens <= budget for s in engine.metrics_collector.steps)
    if prefix:
        assert engine.allocator.prefix_cache_hits > 0
    else:
        assert engine.allocator.prefix_cache_hits == 0 and m.prefix_cache_hit_rate == 0.0
    assert engine.allocator.num_used_blocks == 0


def test_sampled_matches_generate(params):
    plain = ji.generate(CFG, params, PROMPTS, _sampled_params(), backend="reference")
    # Stop tokens taken from the sampled outputs, so some requests finish early with "stop".
    stops = [r.token_ids[5] if i % 3 == 0 else None for i, r in enumerate(plain)]
    sps = _sampled_params(stops)
    ref = ji.generate(CFG, params, PROMPTS, sps, backend="reference")
    ecfg = dataclasses.replace(ECFG, long_prefill_threshold=5)  # prompts mix with decodes
    engine = Engine(CFG, params, ecfg)
    outs = engine.generate(PROMPTS, sps)
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert o.token_ids == r.token_ids and o.finish_reason == r.finish_reason, f"request {i}"
        assert len(o.samples) == 1 and o.samples[0].token_ids == o.token_ids
    assert sum(r.finish_reason == "stop" for r in ref) >= 2
    assert engine.num_preemptions > 0
    # A negative control: the outputs depend on the seeds.
    other = [dataclasses.replace(sp, seed=sp.seed + 1) for sp in sps]
    assert [o.token_ids for o in engine.generate(PROMPTS[:3], other[:3])] != [
        r.token_ids for r in ref[:3]
    ]


@jax.jit
def _dense_next(params, tokens, length, sb, seed, sample_index):
    """Next token of a sequence, from the dense forward, with the engine's per-sample noise."""
    logits = ji.forward_dense(params, CFG, tokens[None])[0, length - 1]  # [V]
    x = process_logits(logits[None], sb)[0]
    key = jax.random.fold_in(jax.random.key(seed), sample_index)
    g = jax.random.gumbel(jax.random.fold_in(key, length), x.shape)
    return jnp.argmax(x + g)


def _dense_sample(params, prompt, sp, sample_index):
    """What sample `sample_index` > 0 of a request must generate (scored without any cache)."""
    sb = SamplingBatch.from_params([sp])
    seq = list(prompt)
    for _ in range(sp.max_tokens):
        padded = np.zeros(64, np.int32)
        padded[: len(seq)] = seq
        seq.append(int(_dense_next(params, padded, len(seq), sb, sp.seed, sample_index)))
    return seq[len(prompt) :]


def test_parallel_sampling(params, greedy_ref):
    sampled = _sampled_params()
    sps = [
        dataclasses.replace(GREEDY, n=3),
        dataclasses.replace(sampled[1], n=3),
        sampled[2],
    ]
    engine = Engine(CFG, params, ECFG)
    outs = engine.generate(PROMPTS[:3], sps)
    ref = ji.generate(CFG, params, PROMPTS, sampled, backend="reference")
    # Greedy forks share the prompt's blocks; every sample continues exactly as n = 1.
    assert [s.token_ids for s in outs[0].samples] == [greedy_ref[0].token_ids] * 3
    # Sample 0 is the n = 1 output; the forks differ from it and from each other.
    samples = [s.token_ids for s in outs[1].samples]
    assert len(samples) == 3 and samples[0] == ref[1].token_ids
    assert len({tuple(s) for s in samples}) == 3
    for j in (1, 2):
        assert samples[j] == _dense_sample(params, PROMPTS[1], sampled[1], j)
    assert outs[2].token_ids == ref[2].token_ids and len(outs[2].samples) == 1
    # Prompts of 3 and 6 tokens end inside a block: the first append copies it (CoW).
    assert engine.allocator.num_cow_copies >= 2 * 2 and _compiles()["copy"] >= 1
    assert engine.allocator.num_used_blocks == 0


@pytest.mark.parametrize(
    "prompt,sp,ecfg_changes,match",
    [
        ([1] * 100, ji.SamplingParams(max_tokens=40), {}, "can never fit"),
        ([1] * 5, ji.SamplingParams(max_tokens=4, n=9), {}, "n=9"),
        ([1, CFG.vocab_size], ji.SamplingParams(max_tokens=4), {}, "outside the vocabulary"),
        ([1] * 5, ji.SamplingParams(max_tokens=300), {}, "max_position_embeddings"),
        (
            [1] * 20,
            ji.SamplingParams(max_tokens=4),
            {"enable_chunked_prefill": False, "max_num_batched_tokens": 7},
            "without chunked prefill",
        ),
    ],
    ids=["pool", "n", "vocab", "positions", "budget"],
)
def test_infeasible_request_refused_before_anything_runs(params, prompt, sp, ecfg_changes, match):
    engine = Engine(CFG, params, dataclasses.replace(ECFG, **ecfg_changes))
    traces = _compiles()
    good = ji.SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match=match):
        engine.generate([[1, 2, 3], prompt, [4, 5]], [good, sp, good])
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, sp)
    assert not engine.has_unfinished() and engine.num_steps == 0
    assert engine.metrics().num_requests == 0 and _compiles() == traces
    assert engine.allocator.num_used_blocks == 0


def test_abort_during_prefill_and_decode_returns_every_block(params, greedy_ref):
    engine = Engine(CFG, params, dataclasses.replace(ECFG, max_num_batched_tokens=7))
    alloc = engine.allocator
    rng = np.random.RandomState(9)
    sp = ji.SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, seed=1)

    def held_blocks():  # distinct blocks in the tables of live sequences
        return len({b for sid in alloc.seq_ids() for b in alloc.block_table(sid)})

    # Prefill: a 30-token prompt under a 7-token budget is mid-prefill after one step.
    engine.add_request(_rand(rng, 30), sp, request_id="a")
    assert engine.step() == []
    assert alloc.num_used_blocks > 0 and alloc.seq_ids()
    assert engine.abort("a") and alloc.num_used_blocks == 0 and not engine.has_unfinished()
    assert not engine.abort("a") and not engine.abort("never")

    # Decode: abort an n = 1 and a forked n = 3 request after each streamed tokens.
    engine.add_request(_rand(rng, 9), sp, request_id="b")
    engine.add_request(_rand(rng, 6), dataclasses.replace(sp, n=3), request_id="c")
    engine.add_request(PROMPTS[4], GREEDY, request_id="d")
    got = {"b": [], "c": [], "d": []}
    c_samples = set()
    while len(got["b"]) < 3 or len(got["c"]) < 6:
        for o in engine.step():
            got[o.request_id].extend(o.new_token_ids)
            if o.request_id == "c":
                c_samples.add(o.sample_index)
    assert c_samples == {0, 1, 2} and not engine.metrics_collector.requests["c"].completed
    assert engine.abort("b") and engine.abort("c")
    assert alloc.seq_ids() and alloc.num_used_blocks == held_blocks()
    assert len(alloc.seq_ids()) == 1  # "d"
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id == "d"
            got["d"].extend(o.new_token_ids)
    assert got["d"] == greedy_ref[4].token_ids
    assert alloc.num_used_blocks == 0
    usage = alloc.usage()
    assert usage.num_free_blocks + usage.num_cached_blocks == ECFG.num_blocks - 1
    m = engine.metrics()
    assert (m.num_requests, m.num_aborted, m.num_completed) == (4, 3, 1)


def test_compile_count_is_bounded_and_reused(params):
    """A long mixed run compiles at most once per distinct (T, B, M); a rerun compiles nothing."""
    rng = np.random.RandomState(11)
    prompts = [_rand(rng, rng.randint(1, 40)) for _ in range(24)]
    sps = [
        ji.SamplingParams(temperature=t, max_tokens=int(rng.randint(1, 20)), seed=i)
        for i, t in enumerate(rng.choice([0.0, 1.0], 24))
    ]

    def run():
        engine = Engine(CFG, params, ECFG)
        before = _compiles()["step"]
        outs = engine.generate(prompts, sps)
        return engine, _compiles()["step"] - before, outs

    engine, compiled, outs = run()
    t_buckets = {16, 32, 64, 128, 256}
    assert engine.num_steps > 40
    assert all(t in t_buckets and (b, m) == (8, 16) for t, b, m in engine.step_shapes)
    assert compiled <= len(engine.step_shapes) <= len(t_buckets)
    engine2, compiled2, outs2 = run()
    assert compiled2 == 0 and engine2.step_shapes == engine.step_shapes
    assert [o.token_ids for o in outs2] == [o.token_ids for o in outs]


def test_quantized_params(params, greedy_ref):
    # RTN int4 of every stacked layer linear, as `ji.quant.quantize(method="rtn")` does.
    layers = {
        k: ji.quant.rtn_quantize(w, bits=4, group_size=16) if k.startswith("w") else w
        for k, w in params["layers"].items()
    }
    qparams = {**params, "layers": layers}
    assert sum(ji.quant.is_quantized(w) for w in layers.values()) == 7
    ref = ji.generate(CFG, qparams, PROMPTS[:3], GREEDY, backend="reference")
    outs = Engine(CFG, qparams, ECFG).generate(PROMPTS[:3], GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    # Negative control: 4-bit weights change some greedy output of the dense model.
    assert [r.token_ids for r in ref] != [r.token_ids for r in greedy_ref[:3]]


@functools.partial(jax.jit, static_argnums=1)
def _reference_forward(params, cfg, meta, cache):
    """`ji.forward` on the reference backend, compiled (two shapes a prompt: its prefill, then
    one-token decodes; op by op it was most of the test's time)."""
    return ji.forward(params, cfg, meta, cache, backend="reference")


def _greedy_on_quantized_cache(params, prompt, kv_format, max_tokens):
    """Reference: one sequence, whole-prompt prefill then one decode per step, through
    `ji.forward` on its own (undonated) cache of `kv_format`; greedy."""
    blocks = list(range(1, 1 + -(-(len(prompt) + max_tokens) // S)))
    cache = ji.init_cache(CFG, 1 + len(blocks), S, kv_format=kv_format)
    tokens, chunk, start = [], list(prompt), 0
    for _ in range(max_tokens):
        meta, _ = build_metadata([SeqChunk(chunk, start, blocks)], S)
        meta = ji.BatchMetadata(*(jnp.asarray(x) for x in meta.__dict__.values()))
        logits, cache = _reference_forward(params, CFG, meta, cache)
        tokens.append(int(np.argmax(np.asarray(logits[0]))))
        start, chunk = start + len(chunk), [tokens[-1]]
    return tokens


@pytest.mark.parametrize("kv_format", ["int8", "fp8"])
def test_quantized_kv_cache(params, greedy_ref, kv_format):
    """The engine on an int8 / fp8 cache (donated every step, chunked, preempting) gives the
    tokens of a plain forward loop on a cache of the same format."""
    ecfg = dataclasses.replace(ECFG, kv_format=kv_format, max_num_batched_tokens=7)
    engine = Engine(CFG, params, ecfg)
    assert engine.cache.k.dtype == {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[kv_format]
    got = _run_waves(engine, PROMPTS, [GREEDY] * len(PROMPTS), WAVE)
    assert engine.num_preemptions > 0
    for i in (0, 3, 9):
        want = _greedy_on_quantized_cache(params, PROMPTS[i], kv_format, MAX_TOKENS)
        assert got[i][0] == want, f"request {i}"
    # The format is in effect: some greedy token differs from the float cache's.
    assert [t for t, _ in got] != [r.token_ids for r in greedy_ref]


def test_pallas_interpret_backend(params, greedy_ref):
    ecfg = dataclasses.replace(ECFG, backend="pallas-interpret")
    sp = dataclasses.replace(GREEDY, max_tokens=4)
    outs = Engine(CFG, params, ecfg).generate([PROMPTS[0], PROMPTS[7]], sp)
    assert outs[0].token_ids == greedy_ref[0].token_ids[:4]
    assert outs[1].token_ids == greedy_ref[7].token_ids[:4]


def test_copy_groups_keep_sequential_semantics():
    rng = np.random.RandomState(0)
    for _ in range(200):
        copies = [tuple(int(x) for x in rng.randint(0, 6, 2)) for _ in range(rng.randint(1, 6))]
        seq = list(range(6))
        for src, dst in copies:
            seq[dst] = seq[src]
        par = list(range(6))
        for group in _copy_groups(copies):
            old = list(par)
            for src, dst in group:
                assert dst not in {d for _, d in group[: group.index((src, dst))]}
                par[dst] = old[src]
        assert par == seq, copies


def test_stop_ids_and_config_validation():
    eos_cfg = CFG.replace(eos_token_id=5)
    assert stop_ids(eos_cfg, ji.SamplingParams(stop_token_ids=(9,))) == (5, 9)
    assert stop_ids(eos_cfg, ji.SamplingParams(stop_token_ids=(9,), ignore_eos=True)) == (9,)
    assert stop_ids(CFG, ji.SamplingParams()) == ()
    for bad, match in [
        ({"block_size": 0}, "block_size"),
        ({"num_blocks": 1}, "num_blocks"),
        ({"max_num_seqs": 2.5}, "max_num_seqs"),
        ({"backend": "cuda"}, "backend"),
        ({"kv_format": "int4"}, "kv_format"),
        ({"kv_dtype": "notadtype"}, "kv_dtype"),
        ({"enable_prefix_caching": 1}, "enable_prefix_caching"),
        ({"enable_chunked_prefill": False, "long_prefill_threshold": 8}, "long_prefill"),
    ]:
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(ECFG, **bad)
    assert ECFG.kv_slots == 96
