"""The disaggregated simulator on a tiny config: the same tokens as the colocated simulator,
request by request, and TTFT that contains the KV transfer (latency + bytes / bandwidth, the
bytes 2 · L · K · D · itemsize per moved token)."""

import math

import pytest

import jaxinfer as ji
from jaxinfer.config import preset
from jaxinfer.engine.sim import LinearStepTime, SimRequest, Simulator
from jaxinfer.engine.sim_disagg import DisaggSimulator, KVLink, kv_bytes_per_token
from tests.engine.test_sim import _workload as sim_workload

CFG = preset("tiny-llama")
S = 4
CONFIG = ji.EngineConfig(
    block_size=S, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=32, token_buckets="pow2"
)
MODEL = LinearStepTime(c0=2e-3, c1=1e-4, c2=3e-5)


def _workload(rate):
    """test_sim's workload (shared prefix: decode-side prefix hits), one output of 1 token."""
    return sim_workload(4, rate, outputs=(12, 5, 9, 16, 1, 10, 4, 13))


def test_kv_bytes_per_token_is_the_connectors_count():
    L, K, D = CFG.num_layers, CFG.num_kv_heads, CFG.head_dim
    assert kv_bytes_per_token(CFG) == 2 * L * K * D * 4  # float32
    assert kv_bytes_per_token(preset("llama2-7b")) == 2 * 32 * 32 * 128 * 2  # bf16: 512 KiB
    assert kv_bytes_per_token(CFG, itemsize=1) == 2 * L * K * D


@pytest.mark.parametrize("rate", [math.inf, 30.0])
def test_disaggregated_tokens_equal_colocated_and_ttft_holds_the_transfer(rate):
    reqs = _workload(rate)
    colo = Simulator(CONFIG, MODEL).run(reqs)
    per_token = kv_bytes_per_token(CFG)
    link = KVLink(bandwidth=1e6, latency_s=0.25)  # slow: the transfer dominates TTFT
    res = DisaggSimulator(CONFIG, CONFIG, MODEL, MODEL, link, per_token).run(reqs)
    got, want = res.summary(), colo.summary()
    assert got.total_output_tokens == want.total_output_tokens == sum(r.max_tokens for r in reqs)
    for r in reqs:
        rec, crec = res.metrics.requests[r.request_id], colo.metrics.requests[r.request_id]
        assert rec.num_output_tokens == crec.num_output_tokens == r.max_tokens
        assert rec.completed
    # Bytes: the full prompt blocks the decode side did not hold (here it holds none: every
    # request's blocks are allocated before the first load lands and registers them).
    moved = sum(res.bytes_moved.values())
    full = sum(len(r.prompt_token_ids) // S for r in reqs if r.max_tokens > 1)
    assert res.blocks_skipped == 0
    assert moved == (full - res.blocks_skipped) * S * per_token
    for r in reqs:
        tm = res.timings[r.request_id]
        assert tm.arrival <= tm.prefill_start < tm.prefill_done <= tm.loaded <= tm.first_token
        assert sum(tm.parts.values()) == pytest.approx(tm.ttft)
        assert res.metrics.requests[r.request_id].ttft == pytest.approx(tm.ttft)
        if r.max_tokens == 1:  # finished at prefill: nothing moves
            assert r.request_id not in res.bytes_moved and tm.parts["transfer"] == 0
            continue
        transfer = link.latency_s + res.bytes_moved[r.request_id] / link.bandwidth
        assert tm.parts["transfer"] >= transfer - 1e-12
        # The prefill side alone reaches t0 no later than the colocated engine's TTFT path
        # plus waiting; the client's TTFT holds the transfer on top of the prefill.
        assert tm.ttft >= (tm.prefill_done - tm.arrival) + transfer
    # A faster link shortens TTFT and leaves the tokens as they are.
    fast = DisaggSimulator(CONFIG, CONFIG, MODEL, MODEL, KVLink(1e12), per_token).run(reqs)
    assert fast.summary().ttft.p50 < got.ttft.p50 - 0.2
    assert fast.summary().total_output_tokens == got.total_output_tokens


def test_blocks_the_decode_side_holds_are_not_moved():
    shared = list(range(10, 22))  # three full blocks
    reqs = [SimRequest(0.0, shared + [1, 2], 6, request_id="a"),
            SimRequest(5.0, shared + [3, 4, 5, 6, 7], 6, request_id="b")]  # fmt: skip
    per_token = kv_bytes_per_token(CFG)
    link = KVLink(1e6, 0.01)
    res = DisaggSimulator(CONFIG, CONFIG, MODEL, MODEL, link, per_token).run(reqs)
    assert res.blocks_skipped == 3
    assert res.bytes_moved == {"a": 3 * S * per_token, "b": (4 - 3) * S * per_token}
    tb = res.timings["b"]
    assert tb.parts["transfer"] >= link.latency_s + S * per_token / link.bandwidth - 1e-12


def test_refuses_bad_deployments():
    per_token = kv_bytes_per_token(CFG)
    link = KVLink(1e9)
    with pytest.raises(ValueError, match="block_size=8 != decode block_size=4"):
        DisaggSimulator(ji.EngineConfig(block_size=8, token_buckets="pow2"), CONFIG, MODEL,
                        MODEL, link, per_token)  # fmt: skip
    no_cache = ji.EngineConfig(block_size=S, enable_prefix_caching=False, token_buckets="pow2")
    with pytest.raises(ValueError, match="enable_prefix_caching=True"):
        DisaggSimulator(CONFIG, no_cache, MODEL, MODEL, link, per_token)
    with pytest.raises(ValueError, match="bandwidth=0"):
        KVLink(0)
    with pytest.raises(ValueError, match="latency_s=-1"):
        KVLink(1e9, -1)
    sim = DisaggSimulator(CONFIG, CONFIG, MODEL, MODEL, link, per_token)
    with pytest.raises(ValueError, match="n=2"):
        sim.run([SimRequest(0.0, [1, 2, 3], 4, request_id="a", n=2)])
    # A decode pool that cannot hold a request's prompt blocks: refused, not a hang.
    tiny_pool = ji.EngineConfig(block_size=S, num_blocks=3, token_buckets="pow2")
    with pytest.raises(RuntimeError, match="decode pool cannot make progress"):
        DisaggSimulator(CONFIG, tiny_pool, MODEL, MODEL, link, per_token).run(
            [SimRequest(0.0, list(range(1, 30)), 4, request_id="a")]
        )
