"""Tests of the host scheduler: invariants at every step of long random simulations against a fake
model that reads its "K/V" back through the block tables, plus deterministic policy checks."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest

from jaxinfer.cache.allocator import NULL_BLOCK, BlockAllocator
from jaxinfer.engine import (
    FinishReason,
    Request,
    Schedule,
    Scheduler,
    SchedulerConfig,
    SeqStatus,
)

VOCAB = 23
MOD = (1 << 61) - 1


@dataclasses.dataclass(frozen=True)
class Params:
    """The sampling fields the scheduler reads (SamplingParams has more)."""

    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1


def kv_mix(prev: int, token: int, pos: int) -> int:
    """The fake model's K/V of a token: a function of the previous position's K/V, so it encodes
    the whole prefix, as real K/V does."""
    return (prev * 1_000_003 + token * 31 + pos + 1) % MOD


def fake_sample(last_kv: int, sample_index: int) -> int:
    return (last_kv + 7919 * sample_index) % VOCAB


def reference(prompt: list[int], sample_index: int, p: Params) -> tuple[list[int], FinishReason]:
    """What the fake model generates for one sequence run alone, without any cache."""
    kv = 0
    tokens = list(prompt)
    for pos, t in enumerate(tokens):
        kv = kv_mix(kv, t, pos)
    out = []
    while True:
        nxt = fake_sample(kv, sample_index)
        out.append(nxt)
        if nxt in p.stop_token_ids:
            return out, FinishReason.STOP
        if len(out) == p.max_tokens:
            return out, FinishReason.LENGTH
        kv = kv_mix(kv, nxt, len(tokens))
        tokens.append(nxt)


class FakeDevice:
    """Applies a Schedule to a numpy KV cache and samples, like the engine's jitted step."""

    def __init__(self, allocator: BlockAllocator):
        self.alloc = allocator
        self.S = allocator.block_size
        self.kv = np.full((allocator.num_blocks, self.S), -1, np.int64)  # [num_blocks, S]
        self.sample_index: dict[int, int] = {}  # seq id -> index of the sample in its request

    def slot(self, table, pos):
        return table[pos // self.S], pos % self.S

    def step(self, schedule: Schedule, live: set[int]) -> dict[int, list[int]]:
        for src, dst in schedule.block_copies:
            self.kv[dst] = self.kv[src]
        for s in schedule.seqs:
            for i, t in enumerate(s.token_ids):
                pos = s.start_pos + i
                prev = self.kv[self.slot(s.block_table, pos - 1)] if pos else 0
                assert prev != -1, f"seq {s.seq_id} reads position {pos - 1}, never written"
                b, off = self.slot(s.block_table, pos)
                if s.seq_id in live:  # a sequence aborted after scheduling writes freed blocks
                    assert self.alloc.refcount(b) == 1, f"write into shared block {b}"
                self.kv[b, off] = kv_mix(int(prev), t, pos)
        sampled = {}
        for s in schedule.seqs:
            if s.sample:
                last = int(self.kv[self.slot(s.block_table, s.start_pos + len(s.token_ids) - 1)])
                for sid in s.sample_seq_ids:
                    sampled[sid] = [fake_sample(last, self.sample_index[sid])]
        return sampled


def check_allocator(alloc: BlockAllocator) -> None:
    holders = collections.Counter(b for sid in alloc.seq_ids() for b in alloc.block_table(sid))
    assert all(alloc.refcount(b) == holders[b] for b in range(alloc.num_blocks))
    assert alloc.num_free_blocks + len(holders) == alloc.num_blocks - 1


def check_schedule(sched: Scheduler, sc: Schedule, cfg: SchedulerConfig) -> None:
    S = sched.allocator.block_size
    ids = [s.seq_id for s in sc.seqs]
    assert len(ids) == len(set(ids)), "a sequence scheduled twice"
    assert sc.num_batched_tokens == sum(len(s.token_ids) for s in sc.seqs)
    assert sc.num_batched_tokens <= cfg.max_num_batched_tokens
    assert len(sched.running) <= sched.num_seats_used <= cfg.max_num_seqs
    assert not set(sc.preempted_seq_ids) & set(ids)
    running = {seq.seq_id: seq for seq in sched.running}
    for s in sc.seqs:
        seq = running[s.seq_id]
        q, end = len(s.token_ids), s.start_pos + len(s.token_ids)
        assert q >= 1 and s.start_pos == seq.num_computed
        assert s.token_ids == seq.token_ids[s.start_pos : end]
        assert len(s.block_table) * S >= end and NULL_BLOCK not in s.block_table
        assert s.block_table == sched.allocator.block_table(s.seq_id)[: len(s.block_table)]
        assert s.sample == (end == len(seq.token_ids)) == bool(s.sample_seq_ids)
        if not cfg.enable_chunked_prefill:
            assert end == len(seq.token_ids), "a prompt split without chunked prefill"
        elif cfg.long_prefill_threshold and seq.in_prefill:
            assert q <= cfg.long_prefill_threshold


def _state(sched: Scheduler, rid) -> str:
    seqs = [s for s in sched.sequences(rid) if not s.is_finished]
    if any(s.status is SeqStatus.PREEMPTED for s in seqs):
        return "preempted"
    if any(s.status is SeqStatus.RUNNING and s.in_prefill for s in seqs):
        return "prefill"
    if any(s.status is SeqStatus.RUNNING for s in seqs):
        return "decode"
    return "waiting"


def _signature(sched: Scheduler):
    """Everything rollback must restore, as plain values."""
    seqs = sorted(
        (s.seq_id, s.num_computed, s.status, s.finish_reason, s.prefill_end, s.forked,
         tuple(s.token_ids))
        for s in sched._seqs.values()
    )  # fmt: skip
    return (
        [s.seq_id for s in sched.waiting],
        [s.seq_id for s in sched.running],
        seqs,
        {r: [s.seq_id for s in v] for r, v in sched._requests.items()},
        dict(sched._seq_ids),
        sched.num_preemptions,
        sched.allocator.snapshot(),
    )


def _failed_step(sched: Scheduler, rng) -> None:
    """A step that fails after schedule(): before the device, or inside update() after its
    k-th mark_computed; rollback must restore the state exactly."""
    before = _signature(sched)
    sc = sched.schedule()
    if rng.random() < 0.5 and sc.seqs:
        calls = [0]
        fail_at = int(rng.integers(1, len(sc.seqs) + 1))
        real = sched.allocator.mark_computed

        def failing(*args):
            calls[0] += 1
            if calls[0] == fail_at:
                raise RuntimeError("injected")
            real(*args)

        sched.allocator.mark_computed = failing
        sampled = {sid: [0] for s in sc.seqs for sid in s.sample_seq_ids}
        try:
            sched.update(sc, sampled)
        except RuntimeError:
            pass
        finally:
            del sched.allocator.mark_computed
    sched.rollback()
    assert _signature(sched) == before


def simulate(budget: int, chunked: bool, caching: bool, seed: int, fail_p: float = 0.0):
    S = 4
    # Longest request: P + M <= max_len (and P + M - 1 <= budget for whole prompts). The pool
    # holds the longest request plus two blocks, so that concurrent requests must preempt.
    max_len = 30 if chunked or budget >= 30 else budget + 1
    num_blocks = -(-max_len // S) + 3
    threshold = 6 if chunked and budget > 8 else None
    cfg = SchedulerConfig(4, budget, chunked, threshold)
    alloc = BlockAllocator(num_blocks, S, enable_prefix_caching=caching)
    sched = Scheduler(cfg, alloc)
    device = FakeDevice(alloc)
    rng = np.random.default_rng(seed)
    bases = [rng.integers(0, VOCAB, 9).tolist() for _ in range(2)]

    arrivals = []
    for i in range(60):
        if max_len == 30:
            p, m = int(rng.integers(1, 21)), int(rng.integers(1, 11))
        else:  # the whole recompute (prompt + generated) must fit the budget
            p = int(rng.integers(1, budget + 1))
            m = int(rng.integers(1, budget - p + 2))
        prompt = rng.integers(0, VOCAB, p).tolist()
        if rng.random() < 0.5:
            prompt[: min(p, 9)] = bases[int(rng.integers(2))][: min(p, 9)]
        stop = (int(rng.integers(VOCAB)),) if rng.random() < 0.3 else ()
        n = int(rng.choice([1, 1, 1, 2, 3]))
        arrivals.append((int(rng.integers(0, 60)), Request(f"r{i}", prompt, Params(m, stop, n))))
    infeasible = [  # too many blocks, too many parallel samples, too long without chunking
        Request("big", [1] * 40, Params(10)),
        Request("wide", [1], Params(1, n=5)),
    ]
    if not chunked:
        infeasible.append(Request("long", [1] * budget, Params(2)))
    for i, r in enumerate(infeasible):
        arrivals.append((5 * i, r))
    arrivals.sort(key=lambda a: a[0])

    outputs: dict[int, list[int]] = collections.defaultdict(list)
    reasons: dict[int, FinishReason] = {}
    seq_ids: dict[str, tuple[int, ...]] = {}
    requests = {}
    refused, aborted = set(), set()
    abort_states = collections.Counter()
    step = 0

    def maybe_abort(p_abort):
        if rng.random() >= p_abort or len(aborted) >= 12:
            return
        by_state = collections.defaultdict(list)
        for rid in seq_ids:
            if rid not in aborted and sched.sequences(rid):
                by_state[_state(sched, rid)].append(rid)
        if by_state:  # the state aborted least so far, to cover all four
            state = min(sorted(by_state), key=lambda k: abort_states[k])
            rid = by_state[state][int(rng.integers(len(by_state[state])))]
            assert sched.abort(rid)
            assert sched.sequences(rid) == [] and not any(alloc.has_seq(i) for i in seq_ids[rid])
            aborted.add(rid)
            abort_states[state] += 1

    while arrivals or sched.has_unfinished():
        while arrivals and arrivals[0][0] <= step:
            req = arrivals.pop(0)[1]
            try:
                seq_ids[req.request_id] = sched.add_request(req)
            except ValueError as e:
                assert req.request_id in ("big", "wide", "long"), e
                refused.add(req.request_id)
                continue
            requests[req.request_id] = req
            for j, sid in enumerate(seq_ids[req.request_id]):
                device.sample_index[sid] = j
        if not sched.has_unfinished():
            step = arrivals[0][0]
            continue
        maybe_abort(0.05)
        if rng.random() < fail_p:
            _failed_step(sched, rng)
        sc = sched.schedule()
        check_schedule(sched, sc, cfg)
        maybe_abort(0.02)  # between the schedule and its update
        live = {s.seq_id for s in sched.running}
        for out in sched.update(sc, device.step(sc, live)):
            outputs[out.seq_id] += out.new_token_ids
            if out.finished:
                reasons[out.seq_id] = out.finish_reason
        check_allocator(alloc)
        step += 1
        assert step < 20_000, "no progress"

    assert refused == {r.request_id for r in infeasible}
    for rid, req in requests.items():
        for j, sid in enumerate(seq_ids[rid]):
            want, why = reference(req.prompt_token_ids, j, req.sampling_params)
            if rid in aborted:
                assert outputs[sid] == want[: len(outputs[sid])]
            else:
                assert (outputs[sid], reasons[sid]) == (want, why), (rid, j)
    assert alloc.seq_ids() == [] and alloc.num_used_blocks == 0
    assert alloc.num_free_blocks == alloc.num_blocks - 1
    check_allocator(alloc)
    return sched, alloc, abort_states, len(requests) - len(aborted), step


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-cache"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
@pytest.mark.parametrize("budget", [1, 7, 256])
def test_random_simulation(budget, chunked, caching):
    """Each run checks the step invariants, exact outputs and the final pool state; across seeds
    the runs must also have exercised preemption, copy-on-write, prefix hits and aborts in every
    state wherever the configuration allows them."""
    totals = collections.Counter()
    abort_states = collections.Counter()
    for seed in range(4):
        sched, alloc, aborts, n_done, _ = simulate(
            budget, chunked, caching, seed=100 * budget + seed
        )
        assert n_done >= 40
        abort_states += aborts
        totals.update(
            preemptions=sched.num_preemptions,
            cow=alloc.num_cow_copies,
            hits=alloc.prefix_cache_hits,
            queries=alloc.prefix_cache_queries,
        )
    if budget > 1 or chunked:  # with budget 1 and whole prompts only 1-token requests fit
        assert totals["cow"] > 0 and (totals["hits"] > 0) == caching
    if budget > 1:  # budget 1 runs one sequence (or one forked group) at a time
        assert totals["preemptions"] > 0
        assert set(abort_states) == {"waiting", "prefill", "decode", "preempted"}, abort_states
    assert (totals["queries"] > 0) == caching


@pytest.mark.parametrize("budget,chunked,caching", [(7, True, True), (256, False, True)])
def test_rollback_restores_the_state_before_schedule(budget, chunked, caching):
    """Issue 15 cause 1 (the scheduler part): a step failing anywhere after schedule() is undone
    exactly by rollback(), and the run then gives exactly the reference outputs."""
    for seed in range(2):
        sched, alloc, *_ = simulate(budget, chunked, caching, seed=seed, fail_p=0.2)
        assert sched.num_preemptions > 0


def test_rollback_keeps_requests_added_or_aborted_while_pending():
    sched, alloc, dev = _setup(12, 2, max_num_seqs=4, max_num_batched_tokens=64, caching=True)
    _add(sched, dev, "a", [1, 2, 3], max_tokens=4)
    _run_step(sched, dev)
    sched.schedule()
    _add(sched, dev, "b", [4, 5], max_tokens=2)
    assert sched.abort("a")
    sched.rollback()
    assert [s.request_id for s in sched.waiting] == ["b"] and not sched.running
    assert sched.sequences("a") == [] and alloc.num_used_blocks == 0
    with pytest.raises(RuntimeError, match="pending"):
        sched.rollback()
    _run_step(sched, dev)
    assert [s.request_id for s in sched.running] == ["b"]


# ------------------------------------------------------------------- deterministic policy


def _run_step(sched, device):
    sc = sched.schedule()
    outs = sched.update(sc, device.step(sc, {s.seq_id for s in sched.running}))
    return sc, outs


def _setup(num_blocks, S, **cfg):
    alloc = BlockAllocator(num_blocks, S, enable_prefix_caching=cfg.pop("caching", False))
    sched = Scheduler(SchedulerConfig(**cfg), alloc)
    return sched, alloc, FakeDevice(alloc)


def _add(sched, device, rid, prompt, **params):
    ids = sched.add_request(Request(rid, prompt, Params(**params)))
    device.sample_index.update({sid: j for j, sid in enumerate(ids)})
    return ids


def test_preemption_takes_the_newest_running_and_requeues_it_first():
    sched, alloc, dev = _setup(6, 2, max_num_seqs=4, max_num_batched_tokens=64)
    a = _add(sched, dev, "a", [1, 2], max_tokens=4)[0]  # 1 block; its next token needs a new one
    b = _add(sched, dev, "b", [3, 4, 5], max_tokens=4)[0]  # 2 blocks, room in the last
    c = _add(sched, dev, "c", [6, 7, 8], max_tokens=4)[0]
    d = _add(sched, dev, "d", [9], max_tokens=1)[0]
    sc, _ = _run_step(sched, dev)
    assert [s.seq_id for s in sc.seqs] == [a, b, c] and alloc.num_free_blocks == 0
    sc, _ = _run_step(sched, dev)
    assert sc.preempted_seq_ids == [c] and [s.seq_id for s in sc.seqs] == [a, b]
    c_seq = sched.waiting[0]
    assert c_seq.seq_id == c and c_seq.status is SeqStatus.PREEMPTED and c_seq.num_computed == 0
    assert [s.seq_id for s in sched.waiting] == [c, d]  # no admission in a preempting step
    while not any(s.seq_id == c for s in sc.seqs):
        sc, _ = _run_step(sched, dev)
    s = next(s for s in sc.seqs if s.seq_id == c)
    assert s.start_pos == 0 and s.token_ids == [6, 7, 8, c_seq.output_token_ids[0]]


def test_without_chunked_prefill_a_prompt_is_scheduled_whole():
    sched, _, dev = _setup(
        40, 4, max_num_seqs=4, max_num_batched_tokens=8, enable_chunked_prefill=False
    )
    a = _add(sched, dev, "a", list(range(6)), max_tokens=2)[0]
    b = _add(sched, dev, "b", list(range(5)), max_tokens=2)[0]
    sc, _ = _run_step(sched, dev)
    assert [(s.seq_id, len(s.token_ids)) for s in sc.seqs] == [(a, 6)]
    sc, _ = _run_step(sched, dev)
    assert [(s.seq_id, len(s.token_ids)) for s in sc.seqs] == [(a, 1), (b, 5)]


def test_chunked_prefill_puts_decodes_first_then_prefills_then_admissions():
    sched, _, dev = _setup(40, 4, max_num_seqs=4, max_num_batched_tokens=4)
    a = _add(sched, dev, "a", [1, 2, 3], max_tokens=3)[0]
    b = _add(sched, dev, "b", list(range(10)), max_tokens=3)[0]
    c = _add(sched, dev, "c", [5], max_tokens=3)[0]
    steps = [[(s.seq_id, s.start_pos, len(s.token_ids)) for s in _run_step(sched, dev)[0].seqs]]
    steps.append([(s.seq_id, s.start_pos, len(s.token_ids)) for s in _run_step(sched, dev)[0].seqs])
    steps.append([(s.seq_id, s.start_pos, len(s.token_ids)) for s in _run_step(sched, dev)[0].seqs])
    assert steps == [
        [(a, 0, 3), (b, 0, 1)],
        [(a, 3, 1), (b, 1, 3)],
        [(a, 4, 1), (b, 4, 3)],  # c waits: FCFS behind the budget
    ]
    sc, _ = _run_step(sched, dev)
    assert [(s.seq_id, s.start_pos, len(s.token_ids)) for s in sc.seqs] == [(b, 7, 3), (c, 0, 1)]


def test_long_prefill_threshold_caps_prefill_chunks():
    sched, _, dev = _setup(
        40, 4, max_num_seqs=4, max_num_batched_tokens=64, long_prefill_threshold=5
    )
    a = _add(sched, dev, "a", list(range(12)), max_tokens=1)[0]
    b = _add(sched, dev, "b", list(range(3)), max_tokens=1)[0]
    sc, _ = _run_step(sched, dev)
    assert [(s.seq_id, len(s.token_ids)) for s in sc.seqs] == [(a, 5), (b, 3)]


def test_parallel_sampling_forks_after_prefill_and_copies_on_first_append():
    sched, alloc, dev = _setup(20, 4, max_num_seqs=4, max_num_batched_tokens=64)
    ids = _add(sched, dev, "r", [1, 2, 3, 4, 5], max_tokens=3, n=3)
    sc, outs = _run_step(sched, dev)
    assert len(sc.seqs) == 1 and sc.seqs[0].sample_seq_ids == ids
    assert [o.seq_id for o in outs] == list(ids) and sched.num_seats_used == 3
    tables = [alloc.block_table(i) for i in ids]
    assert tables[0] == tables[1] == tables[2] and [alloc.refcount(b) for b in tables[0]] == [3, 3]
    sc, _ = _run_step(sched, dev)  # each appends into the shared partial block
    assert [src for src, _ in sc.block_copies] == [tables[0][1]] * 2  # the last one writes in place
    assert {alloc.block_table(i)[0] for i in ids} == {tables[0][0]}
    assert len({alloc.block_table(i)[1] for i in ids}) == 3
    while sched.has_unfinished():
        _run_step(sched, dev)
    assert alloc.num_used_blocks == 0


def test_prefix_cache_skips_cached_prompt_tokens():
    sched, alloc, dev = _setup(20, 4, caching=True, max_num_seqs=4, max_num_batched_tokens=64)
    prompt = list(range(9))
    _add(sched, dev, "a", prompt, max_tokens=2)
    while sched.has_unfinished():
        _run_step(sched, dev)
    _add(sched, dev, "b", prompt, max_tokens=2)
    sc, _ = _run_step(sched, dev)
    assert (sc.seqs[0].start_pos, sc.seqs[0].token_ids) == (8, [8])
    assert alloc.prefix_cache_hits == 8


def test_abort_frees_blocks_in_every_state():
    sched, alloc, dev = _setup(9, 2, max_num_seqs=4, max_num_batched_tokens=3)
    _add(sched, dev, "decode", [1, 2], max_tokens=8)
    _add(sched, dev, "prefill", [3, 4, 5, 6], max_tokens=8)
    _add(sched, dev, "waiting", [7], max_tokens=8)
    _run_step(sched, dev)
    assert sched.sequences("prefill")[0].in_prefill
    assert sched.sequences("waiting")[0].status is SeqStatus.WAITING
    assert not sched.sequences("decode")[0].in_prefill
    for rid in ("prefill", "waiting", "decode"):
        assert sched.abort(rid) and sched.sequences(rid) == []
    assert not sched.abort("decode") and not sched.abort("nope")
    assert alloc.num_used_blocks == 0 and not sched.has_unfinished()


def test_abort_of_a_preempted_request():
    sched, alloc, dev = _setup(6, 2, max_num_seqs=4, max_num_batched_tokens=64)
    _add(sched, dev, "a", [1, 2], max_tokens=4)
    _add(sched, dev, "b", [3, 4, 5], max_tokens=4)
    c = _add(sched, dev, "c", [6, 7, 8], max_tokens=4)[0]
    _run_step(sched, dev)
    sc, _ = _run_step(sched, dev)
    assert sc.preempted_seq_ids == [c] and sched.sequences("c")[0].status is SeqStatus.PREEMPTED
    assert sched.abort("c") and [s.seq_id for s in sched.waiting] == []
    while sched.has_unfinished():
        _run_step(sched, dev)
    assert alloc.num_used_blocks == 0 and alloc.num_free_blocks == 5


def test_stop_token_is_kept_and_finishes_the_sequence():
    sched, _, dev = _setup(20, 4, max_num_seqs=4, max_num_batched_tokens=64)
    want, _ = reference([1, 2, 3], 0, Params(max_tokens=10))
    sid = _add(sched, dev, "r", [1, 2, 3], max_tokens=10, stop_token_ids=(want[2],))[0]
    got = []
    while sched.has_unfinished():
        for o in _run_step(sched, dev)[1]:
            got += o.new_token_ids
            last = o
    assert got == want[: want.index(want[2]) + 1] and last.seq_id == sid
    assert last.finish_reason is FinishReason.STOP and last.request_finished


def test_admission_refuses_requests_that_never_fit():
    sched, _, _ = _setup(
        10, 4, max_num_seqs=2, max_num_batched_tokens=16, enable_chunked_prefill=False
    )
    with pytest.raises(
        ValueError, match=r"30 prompt \+ 10 max_tokens need 10 KV blocks.* 9 usable"
    ):
        sched.add_request(Request("a", [0] * 30, Params(10)))
    with pytest.raises(ValueError, match="n=3.*max_num_seqs is 2"):
        sched.add_request(Request("b", [0], Params(1, n=3)))
    with pytest.raises(ValueError, match="= 17 tokens.*max_num_batched_tokens 16"):
        sched.add_request(Request("c", [0] * 10, Params(8)))
    sched.add_request(Request("d", [0] * 10, Params(6)))
    with pytest.raises(ValueError, match="already live"):
        sched.add_request(Request("d", [0], Params(1)))


def test_update_checks_its_inputs():
    sched, _, dev = _setup(20, 4, max_num_seqs=4, max_num_batched_tokens=64)
    sid = _add(sched, dev, "r", [1, 2], max_tokens=2)[0]
    sc = sched.schedule()
    with pytest.raises(RuntimeError, match="before update"):
        sched.schedule()
    with pytest.raises(ValueError, match="missing"):
        sched.update(sc, {})
    with pytest.raises(ValueError, match="unexpected"):
        sched.update(sc, {sid: [1], 99: [1]})
    with pytest.raises(ValueError, match="last schedule"):
        sched.update(Schedule([], [], [], 0), {sid: [1]})
    assert sched.update(sc, {sid: [1]})[0].new_token_ids == [1]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=-1), "max_num_batched_tokens"),
        (dict(long_prefill_threshold=0), "long_prefill_threshold"),
        (dict(enable_chunked_prefill=False, long_prefill_threshold=4), "needs enable_chunked"),
    ],
)
def test_scheduler_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kwargs)


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ([], Params(1), "empty"),
        ([1, -2], Params(1), r"ints in \[0, 2\*\*31 - 1\]"),
        ("abc", Params(1), "sequence of ints"),
        ([1], Params(0), "max_tokens"),
        ([1], Params(1, n=0), "n must be"),
        ([1], object(), "max_tokens"),
    ],
)
def test_request_validation(prompt, params, match):
    with pytest.raises(ValueError, match=match):
        Request("r", prompt, params)
