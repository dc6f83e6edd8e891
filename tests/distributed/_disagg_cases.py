"""Disaggregated serving in one process: prefill on devices 0-1, decode on 2-3 (4 fake CPUs).

Not collected by the suite; `test_disagg.py` runs it in a child process (run alone:
`python -m pytest tests/distributed/_disagg_cases.py`, which sets 4 devices unless XLA_FLAGS is).

The reference is one colocated engine on one device. Disaggregated tokens must equal it request
by request (greedy and seeded) while both sides hit their prefix caches and both preempt (the
decode side by itself, the prefill side forced mid-prefill: a prefill reserves its whole prompt
at admission, so only decodes run out of blocks); the bytes moved must be 2·L·K·D·itemsize per
transferred token; an abort while a load is in flight frees every block on both sides.
"""

import dataclasses
import functools
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jaxinfer as ji  # noqa: E402
from jaxinfer.config import preset  # noqa: E402
from jaxinfer.distributed.disagg import Disaggregated  # noqa: E402
from jaxinfer.speculative import heads  # noqa: E402
from tests.helpers import random_params  # noqa: E402

CFG = preset("tiny-llama").replace(num_heads=8, num_kv_heads=2, head_dim=16, eos_token_id=None)
S = 4
ECFG = ji.EngineConfig(
    block_size=S,
    num_blocks=21,  # 20 usable blocks: the decode side must preempt
    max_num_seqs=6,
    max_num_batched_tokens=32,
    long_prefill_threshold=8,  # prompts take several prefill steps (room for a forced preemption)
    min_token_bucket=32,
    min_block_bucket=8,
    min_seq_bucket=8,
)
MAX_TOKENS = 8


def _prompts():
    rng = np.random.RandomState(11)
    shared = rng.randint(0, CFG.vocab_size, 2 * S + 1).tolist()
    return [
        (shared if i % 2 else []) + rng.randint(0, CFG.vocab_size, int(rng.randint(4, 11))).tolist()
        for i in range(8)
    ] + [shared + [7, 7, 7], shared[: 2 * S]]  # a full-block-aligned prompt: no tail to recompute


PROMPTS = _prompts()
SAMPLING = {
    "greedy": [ji.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)] * len(PROMPTS),
    "seeded": [
        ji.SamplingParams(temperature=0.9, top_k=20, seed=50 + i, max_tokens=MAX_TOKENS)
        for i in range(len(PROMPTS))
    ],
    # The decode side penalizes by a history whose prompt and first token came from the prefill.
    "penalized": [
        ji.SamplingParams(
            temperature=0.9,
            top_k=20,
            seed=50 + i,
            max_tokens=MAX_TOKENS,
            repetition_penalty=1.5,
            presence_penalty=1.0,
            logit_bias={3: 2.0},
        )
        for i in range(len(PROMPTS))
    ],  # fmt: skip
}


@functools.cache
def _params():
    return random_params(CFG, seed=4)


@functools.cache
def _colocated(kind: str):
    return [o.token_ids for o in ji.Engine(CFG, _params(), ECFG).generate(PROMPTS, SAMPLING[kind])]


def _meshes():
    devs = np.asarray(jax.devices())
    return jax.sharding.Mesh(devs[:2], ("tp",)), jax.sharding.Mesh(devs[2:], ("tp",))


def _disagg(**kw) -> Disaggregated:
    pm, dm = _meshes()
    return Disaggregated(
        CFG, _params(), dataclasses.replace(ECFG, mesh=pm), dataclasses.replace(ECFG, mesh=dm), **kw
    )


def _run(d: Disaggregated, sps, preempt_prefill=False) -> list[list[int]]:
    rids = [d.add_request(p, sp) for p, sp in zip(PROMPTS, sps)]
    tokens = {r: [] for r in rids}
    forced = 0
    while d.has_unfinished():
        for e in d.step():
            tokens[e.request_id] += e.new_token_ids
        sched = d.prefill.engine.scheduler
        mid = [s for s in sched.running if s.in_prefill and s.num_computed > 0]
        if preempt_prefill and mid and forced < 2:
            sched.preempt(mid[0].seq_id)  # recomputed later, from its prefix-cached blocks
            forced += 1
    if preempt_prefill:
        assert forced == 2
    return [tokens[r] for r in rids]


@pytest.mark.parametrize("kind", ["greedy", "seeded", "penalized"])
def test_tokens_equal_colocated(kind):
    d = _disagg()
    got = _run(d, SAMPLING[kind], preempt_prefill=True)
    want = _colocated(kind)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"request {i}"
    assert all(len(g) == MAX_TOKENS for g in got)
    pe, de = d.prefill.engine, d.decode.engine
    assert pe.num_preemptions >= 2 and de.num_preemptions > 0
    assert pe.allocator.prefix_cache_hits > 0 and de.allocator.prefix_cache_hits > 0
    assert d.decode.blocks_skipped > 0  # decode-side prefix hits were not transferred
    # bytes = 2 · L · K · D · itemsize · tokens moved, tokens = full prompt blocks not skipped
    moved_tokens = (sum(len(p) // S for p in PROMPTS) - d.decode.blocks_skipped) * S
    c = CFG
    assert (
        d.connector.bytes_moved == 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * moved_tokens
    )
    assert d.connector.num_loads == len(PROMPTS)
    assert pe.allocator.num_used_blocks == 0 and de.allocator.num_used_blocks == 0
    assert d.connector.num_pending() == 0
    # Both engines kept their sub-meshes: prefill on devices 0-1, decode on 2-3.
    devs = jax.devices()
    assert de.cache.k.sharding.device_set == set(devs[2:])
    assert pe.cache.k.sharding.device_set == set(devs[:2])


def test_seeded_is_not_greedy():
    assert _colocated("seeded") != _colocated("greedy")
    assert _colocated("penalized") != _colocated("seeded")


def test_ttft_parts_sum_to_ttft():
    d = _disagg()
    _run(d, SAMPLING["greedy"])
    for rid in d.prefill.timings:
        tm = d.timings(rid)
        parts = tm.parts
        assert set(parts) == {"queue", "prefill", "transfer", "first_decode"}
        assert all(v >= 0 for v in parts.values())
        assert sum(parts.values()) == pytest.approx(tm.ttft, abs=1e-9)


def test_abort_during_transfer_frees_both_sides():
    d = _disagg()
    sps = SAMPLING["greedy"]
    rids = [d.add_request(p, sp) for p, sp in zip(PROMPTS, sps)]
    tokens = {r: [] for r in rids}
    aborted = None
    while d.has_unfinished():
        for e in d.step():
            tokens[e.request_id] += e.new_token_ids
        if aborted is None and d.decode.loading():
            aborted = d.decode.loading()[0]
            used = d.decode.allocator.num_used_blocks
            assert used > 0 and d.connector.num_pending() > 0
            assert d.abort(aborted)
            assert d.decode.allocator.num_used_blocks < used  # its staged blocks freed
            assert aborted not in d.decode.loading()
            assert not d.abort(aborted)
    assert aborted is not None
    assert d.prefill.engine.allocator.num_used_blocks == 0
    assert d.decode.engine.allocator.num_used_blocks == 0
    assert d.connector.num_pending() == 0
    want = _colocated("greedy")
    for i, r in enumerate(rids):
        if r != aborted:
            assert tokens[r] == want[i], f"request {i}"
        else:
            assert tokens[r] == []


def test_refusals():
    pm, dm = _meshes()
    with pytest.raises(ValueError, match="enable_prefix_caching=True"):
        Disaggregated(
            CFG, _params(), dataclasses.replace(ECFG, mesh=pm),
            dataclasses.replace(ECFG, mesh=dm, enable_prefix_caching=False),
        )  # fmt: skip
    with pytest.raises(ValueError, match="block_size"):
        Disaggregated(CFG, _params(), ECFG, dataclasses.replace(ECFG, block_size=8))
    hcfg = heads.head_config_for(CFG, "eagle")
    spec = ji.SpeculativeConfig(drafter=heads.Head(hcfg, heads.init_eagle(hcfg, jax.random.key(0))))
    with pytest.raises(ValueError, match="draft model or drafter head is not supported"):
        Disaggregated(CFG, _params(), ECFG, dataclasses.replace(ECFG, speculative=spec))
    d = _disagg()
    with pytest.raises(ValueError, match="n=2"):
        d.add_request([1, 2, 3], ji.SamplingParams(n=2, max_tokens=3))
