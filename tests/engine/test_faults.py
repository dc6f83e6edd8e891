"""The engine under faults (issue 15): a failed step fails only its own requests and leaves the
scheduler and allocator as they were; non-finite logits fail only their request; a soak of random
valid and invalid requests leaks nothing.

Every engine here has one batch shape (block size 4, T = 16 tokens, B = 8 rows, M = 16 blocks),
so the jitted step compiles once for the whole file (plus the poisoned copies below).
"""

from __future__ import annotations

import collections
import dataclasses
import sys

import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer.engine import Engine, EngineConfig, SeqStatus
from tests.helpers import poison_logits, random_params

engine_mod = sys.modules["jaxinfer.engine.engine"]

CFG = ji.preset("tiny-llama").replace(eos_token_id=None)
ECFG = EngineConfig(
    block_size=4,
    num_blocks=25,  # 24 usable blocks = 96 slots for 8 rows: the workloads below preempt
    max_num_seqs=8,
    max_num_batched_tokens=16,  # = min_token_bucket: T is always 16
    long_prefill_threshold=8,  # prompts up to 20 tokens: chunked prefill mixed with decodes
    backend="reference",
    min_token_bucket=16,
    min_block_bucket=16,
    min_seq_bucket=8,
)
STEP_JIT = dict(static_argnames=("cfg", "backend"), donate_argnames=("cache",))


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, seed=7)


# ------------------------------------------------------------------------------ driving


@dataclasses.dataclass
class Run:
    tokens: dict  # (request, sample) -> streamed tokens
    reasons: dict  # (request, sample) -> finish reason
    errors: dict  # request -> error message
    failed_steps: list  # (fault kind, requests of the failed step, whether it preempted)
    steps: int


def _drive(engine: Engine, workload, inject=None, failed_steps=None) -> Run:
    """Adds each request at its arrival step and steps until all finish; `inject(engine, step)`
    arms at most one fault for the coming step and returns its kind (or None)."""
    run = Run({}, {}, {}, [] if failed_steps is None else failed_steps, 0)
    pending = collections.deque(sorted(workload, key=lambda w: w[0]))
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= run.steps:
            _, rid, prompt, sp = pending.popleft()
            engine.add_request(prompt, sp, request_id=rid)
        failures = engine.num_failed_steps
        kind = inject(engine, run.steps) if inject else None
        try:
            outs = engine.step()
        finally:
            _disarm(engine)
        if engine.num_failed_steps > failures:
            scheduled = {s.request_id for s in engine.last_schedule.seqs}
            run.failed_steps.append((kind, scheduled, bool(engine.last_schedule.preempted_seq_ids)))
            # A failed step streams errors only, one per unfinished sample of its requests.
            assert {o.request_id for o in outs} == scheduled
            assert all(o.finish_reason == "error" and not o.new_token_ids for o in outs)
        for o in outs:
            key = (o.request_id, o.sample_index)
            assert key not in run.reasons, "output after the finish"
            run.tokens.setdefault(key, []).extend(o.new_token_ids)
            if o.finished:
                run.reasons[key] = o.finish_reason
                assert o.request_finished or o.finish_reason != "error"
            assert (o.error is not None) == (o.finish_reason == "error")
            if o.error is not None:
                run.errors[o.request_id] = o.error
        engine.allocator.check_invariants()
        run.steps += 1
        assert run.steps < 2000, "no progress"
    return run


class _Armed:
    """One-shot faults: each patch removes itself when it fires; `_disarm` removes the rest."""

    patches: list = []


def _disarm(engine: Engine) -> None:
    for obj, name, old in _Armed.patches:
        if old is None:
            obj.__dict__.pop(name, None)
        else:
            setattr(obj, name, old)
    _Armed.patches = []


def _arm(obj, name, make, instance: bool) -> None:
    old = None if instance else getattr(obj, name)
    real = getattr(obj, name)
    _Armed.patches.append((obj, name, old))
    setattr(obj, name, make(real))


def _inject(kind: str, engine: Engine, rng) -> None:
    msg = f"injected fault ({kind})"

    def raising(real):
        def f(*a, **k):
            raise RuntimeError(msg)

        return f

    if kind == "build":  # host batch building
        _arm(engine, "_build", raising, instance=True)
    elif kind == "device":  # the jitted step refuses to run (the cache survives)
        _arm(engine_mod, "_step", raising, instance=False)
    elif kind == "device-after":  # the step ran, consumed the donated cache, then failed

        def after(real):
            def f(*a, **k):
                real(*a, **k)
                raise RuntimeError(msg)

            return f

        _arm(engine_mod, "_step", after, instance=False)
    elif kind == "update":  # partway through update(), after the device wrote this step's K/V
        k = 1 if rng is None else int(rng.integers(1, 3))

        def partway(real):
            calls = [0]

            def f(*a, **kw):
                calls[0] += 1
                if calls[0] == k:
                    raise RuntimeError(msg)
                return real(*a, **kw)

            return f

        _arm(engine.allocator, "mark_computed", partway, instance=True)
    elif kind == "update-on-preemption":  # as "update", in a step that preempted

        def on_preemption(real):
            def f():
                schedule = real()
                if schedule.preempted_seq_ids:
                    _inject("update", engine, rng)
                return schedule

            return f

        _arm(engine.scheduler, "schedule", on_preemption, instance=True)
    else:
        raise ValueError(kind)


KINDS = ("build", "device", "update", "device-after")


def _workload(seed: int, n_requests: int):
    """Mixed requests arriving over time: shared prefixes, long prompts (chunked), greedy and
    seeded sampling, n = 1..3, a few stop ids."""
    rng = np.random.default_rng(seed)
    bases = [rng.integers(0, CFG.vocab_size, 12).tolist() for _ in range(3)]
    out = []
    for i in range(n_requests):
        p = int(rng.integers(2, 21))
        prompt = rng.integers(0, CFG.vocab_size, p).tolist()
        if rng.random() < 0.5:
            k = int(rng.integers(4, 13))
            prompt = bases[int(rng.integers(3))][:k] + prompt[: max(1, p - k)]
        sampled = rng.random() < 0.5
        sp = ji.SamplingParams(
            temperature=float(rng.choice([0.7, 1.0])) if sampled else 0.0,
            top_k=int(rng.choice([0, 20])),
            top_p=float(rng.choice([1.0, 0.9])),
            max_tokens=int(rng.integers(3, 13)),
            seed=int(rng.integers(0, 2**31 - 1)),
            n=int(rng.choice([1, 1, 1, 2, 3])),
            stop_token_ids=(int(rng.integers(CFG.vocab_size)),) if rng.random() < 0.3 else (),
        )
        out.append((int(rng.integers(0, 205)), f"r{i}", prompt, sp))
    return out


# -------------------------------------------------------------------------------- tests


def test_fault_injection_fails_only_the_failed_steps_requests(params):
    """Acceptance (issue 15 cause 1): across ~200 steps of a mixed workload a step fails at
    random, on the host (batch building, update) or on the device (before the call, or after it
    consumed the donated cache). Every request outside a failed step finishes with exactly the
    tokens of the fault-free run; the failed ones report the error, having streamed a prefix of
    their fault-free tokens; no block leaks and the allocator's invariants hold throughout."""
    workload = _workload(seed=0, n_requests=80)
    ref_engine = Engine(CFG, params, ECFG)
    ref = _drive(ref_engine, workload)
    assert 200 <= ref.steps <= 300 and not ref.errors
    assert ref_engine.num_preemptions > 0 and ref_engine.allocator.prefix_cache_hits > 0
    assert ref_engine.allocator.num_cow_copies > 0

    rng = np.random.default_rng(1)
    fault_steps = set(rng.choice(np.arange(5, 190), 8, replace=False).tolist())
    kinds = iter(KINDS * 3)

    def inject(engine, step):
        if step in fault_steps:
            kind = next(kinds)
        elif sum(k == "update-on-preemption" for k, *_ in got_failed) < 3:
            kind = "update-on-preemption"  # fires only if the step preempts
        else:
            return None
        _inject(kind, engine, rng)
        return kind

    engine = Engine(CFG, params, ECFG)
    got_failed = []
    got = _drive(engine, workload, inject, got_failed)
    fired = [k for k, *_ in got.failed_steps]
    assert set(fired) == {*KINDS, "update-on-preemption"}, fired  # every kind of fault happened
    # A step that preempted failed after the device wrote into its victims' blocks: the
    # victims recompute (their tokens are checked below with everyone else's).
    assert any(k == "update-on-preemption" and pre for k, _, pre in got.failed_steps)
    failed = set().union(*(rids for _, rids, _ in got.failed_steps))
    assert set(got.errors) == failed
    assert all(e.startswith("injected fault") for e in got.errors.values())
    survivors = 0
    for _, rid, _, sp in workload:
        for j in range(sp.n):
            key = (rid, j)
            want = (ref.tokens[key], ref.reasons[key])
            have = (got.tokens.get(key, []), got.reasons[key])
            if rid in failed and have[1] == "error":
                assert have[0] == want[0][: len(have[0])], key
            else:
                assert have == want, key
        survivors += rid not in failed
    assert survivors >= 20 and len(failed) >= 8
    assert engine.num_failed_steps == len(got.failed_steps)
    assert engine.allocator.num_used_blocks == 0 and not engine.allocator.seq_ids()
    engine.allocator.check_invariants()
    m = engine.metrics()
    assert m.num_aborted == len(failed) and m.num_completed == len(workload) - len(failed)
    assert engine.num_preemptions > 0


def test_failed_step_outputs_and_generate(params):
    """The output contract: StreamOutput(error=..., finished, "error"); RequestOutput.error; the
    engine serves the next requests; an abort during a failure leaves nothing behind."""
    engine = Engine(CFG, params, ECFG)
    sp = ji.SamplingParams(temperature=0, max_tokens=4)
    want = engine.generate([[1, 2, 3], [4, 5, 6]], sp)
    engine.add_request([1, 2, 3], dataclasses.replace(sp, n=2), request_id="a")
    _inject("device", engine, None)
    try:
        outs = engine.step()
    finally:
        _disarm(engine)
    assert [(o.request_id, o.sample_index) for o in outs] == [("a", 0), ("a", 1)]
    for o in outs:
        assert (o.finished, o.finish_reason, o.request_finished) == (True, "error", True)
        assert o.error == "injected fault (device)" and o.new_token_ids == []
    assert not engine.has_unfinished() and engine.allocator.num_used_blocks == 0
    assert not engine.abort("a")
    # generate(): the failed request's RequestOutput carries the error; later calls are clean.
    _inject("build", engine, None)
    try:
        outs = engine.generate([[1, 2, 3], [4, 5, 6]], sp)
    finally:
        _disarm(engine)
    assert [o.finish_reason for o in outs] == ["error", "error"]
    assert all(o.error == "injected fault (build)" for o in outs)
    assert all(s.error == o.error for o in outs for s in o.samples)
    again = engine.generate([[1, 2, 3], [4, 5, 6]], sp)
    assert [o.token_ids for o in again] == [o.token_ids for o in want]
    assert all(o.error is None for o in again)
    assert engine.allocator.num_used_blocks == 0
    engine.allocator.check_invariants()


def test_victim_of_a_failed_step_recomputes_what_the_step_overwrote(params):
    """A step that preempts V hands V's freed blocks to A; the device writes A's new K/V into one
    of them and the step then fails. Rolled back, V holds that block again, overwritten: V must
    recompute (be preempted again), or its next tokens attend to A's K/V."""
    ecfg = dataclasses.replace(ECFG, num_blocks=5, enable_prefix_caching=False)  # 4 blocks
    rng = np.random.default_rng(3)
    a_prompt = rng.integers(0, CFG.vocab_size, 4).tolist()
    v_prompt = rng.integers(0, CFG.vocab_size, 11).tolist()  # 3 blocks, the last one 3/4 full
    sp = ji.SamplingParams(temperature=0, max_tokens=4)
    want = Engine(CFG, params, ecfg).generate([v_prompt], sp)[0].token_ids
    engine = Engine(CFG, params, ecfg)
    engine.add_request(a_prompt, sp, request_id="A")  # 1 block; its first decode needs another
    engine.add_request(v_prompt, sp, request_id="V")
    got = [t for o in engine.step() if o.request_id == "V" for t in o.new_token_ids]
    assert engine.allocator.num_free_blocks == 0
    v_seq = engine.scheduler.sequences("V")[0].seq_id
    v_blocks = engine.allocator.block_table(v_seq)
    _inject("update", engine, None)
    try:
        outs = engine.step()
    finally:
        _disarm(engine)
    assert engine.num_failed_steps == 1 and [o.request_id for o in outs] == ["A"]
    failed = engine.last_schedule
    assert failed.preempted_seq_ids == [v_seq] and failed.seqs[0].block_table[-1] in v_blocks
    # Rolled back, V would hold its blocks again; one was overwritten, so V recomputes. (Its
    # greedy tokens alone may not show one overwritten slot of twelve: hence the state check.)
    (v,) = engine.scheduler.sequences("V")
    assert v.status is SeqStatus.PREEMPTED and not engine.allocator.has_seq(v_seq)
    while engine.has_unfinished():
        got += [t for o in engine.step() if o.request_id == "V" for t in o.new_token_ids]
    assert got == want
    assert engine.allocator.num_used_blocks == 0


def test_non_finite_logits_fail_only_their_request(params, monkeypatch):
    """Issue 15 cause 6 (sampling half): a NaN / Inf logits row ends its request with an error
    naming the non-finite logits, instead of token 0 forever; the others are unaffected."""
    sp = ji.SamplingParams(temperature=0, max_tokens=5)
    prompts = [[5, 6, 7], [9, 10, 99], [11, 12], [13, 99]]
    want = Engine(CFG, params, ECFG).generate(prompts, sp)
    poison_logits(engine_mod, "_step", STEP_JIT, monkeypatch, 99, float("nan"))
    engine = Engine(CFG, params, ECFG)
    sps = [sp, sp, dataclasses.replace(sp, temperature=1.0, seed=3), dataclasses.replace(sp, n=2)]
    got = engine.generate(prompts, sps)
    for i in (1, 3):
        assert (got[i].finish_reason, got[i].token_ids) == ("error", [])
        assert "non-finite logits" in got[i].error and f"request {got[i].request_id!r}" in (
            got[i].error
        )
        assert all(s.finish_reason == "error" for s in got[i].samples)
    assert got[0].token_ids == want[0].token_ids and got[0].error is None
    ref_sampled = Engine(CFG, params, ECFG).generate([prompts[2]], sps[2])[0]
    assert got[2].token_ids == ref_sampled.token_ids
    assert engine.allocator.num_used_blocks == 0
    engine.allocator.check_invariants()
    # Mid-decode: a generated token fed back that poisons its row.
    mark = want[0].token_ids[1]
    poison_logits(engine_mod, "_step", STEP_JIT, monkeypatch, mark, float("inf"))
    engine = Engine(CFG, params, ECFG)
    rid = engine.add_request(prompts[0], sp)
    stream = []
    while engine.has_unfinished():
        stream += engine.step()
    assert [t for o in stream for t in o.new_token_ids] == want[0].token_ids[:2]
    assert stream[-1].finish_reason == "error" and "non-finite" in stream[-1].error
    assert stream[-1].request_id == rid and engine.allocator.num_used_blocks == 0


# ---------------------------------------------------------------------------------- soak


def _pick(rng, values):
    return values[int(rng.integers(len(values)))]  # as given: rng.choice would make them numpy


def _random_request(rng, used_ids):
    """(prompt, sampling kwargs, request id, the field an invalid request names, or None)."""
    V = CFG.vocab_size
    prompt = rng.integers(0, V, int(rng.integers(1, 7))).tolist()
    kw = dict(
        temperature=float(rng.choice([0.0, 0.8])),
        max_tokens=int(rng.integers(1, 4)),
        seed=int(rng.integers(0, 1000)),
        n=int(rng.choice([1, 1, 2])),
    )
    rid = None
    bad = None
    r = rng.random()
    if r < 0.35:  # one invalid field, of the engine's or of SamplingParams'
        bad = str(rng.choice(
            ["temperature", "top_p", "top_k", "max_tokens", "seed", "n", "stop_token_ids",
             "stop_vocab", "prompt_vocab", "prompt_empty", "prompt_float", "n_rows", "pool",
             "request_id"]
        ))  # fmt: skip
        if bad == "temperature":
            kw["temperature"] = _pick(rng, [-1.0, np.nan, np.inf, True])
        elif bad == "top_p":
            kw["top_p"] = _pick(rng, [0.0, 1.5, np.float32("nan")])
        elif bad == "top_k":
            kw["top_k"] = _pick(rng, [-1, 2**40, True, 2.0])
        elif bad == "max_tokens":
            kw["max_tokens"] = _pick(rng, [0, 2**31, 2.5, np.bool_(True)])
        elif bad == "seed":
            kw["seed"] = _pick(rng, [-1, 2**40, "3"])
        elif bad == "n":
            kw["n"] = _pick(rng, [0, 2**40])
        elif bad == "stop_token_ids":
            kw["stop_token_ids"] = (2**40,)
        elif bad == "stop_vocab":
            kw["stop_token_ids"] = (V + int(rng.integers(0, 5)),)
        elif bad == "prompt_vocab":
            prompt = prompt + [V]
        elif bad == "prompt_empty":
            prompt = []
        elif bad == "prompt_float":
            prompt = [1.5, 2.0]
        elif bad == "n_rows":
            kw["n"] = ECFG.max_num_seqs + 1
        elif bad == "pool":
            kw["max_tokens"] = ECFG.kv_slots
        elif bad == "request_id":
            if not used_ids:
                bad = None
            else:
                rid = used_ids[int(rng.integers(len(used_ids)))]
    elif r < 0.45:
        kw.update(
            temperature=np.float32(0.5), top_p=np.float32(0.9), top_k=np.int64(5),
            max_tokens=np.int32(2), stop_token_ids=(np.int64(3),),
        )  # fmt: skip
    return prompt, kw, rid, bad


# The words an error for each invalid field must contain.
NAMES = {
    "stop_vocab": "stop_token_ids",
    "prompt_vocab": "vocabulary",
    "prompt_empty": "prompt",
    "prompt_float": "prompt",
    "n_rows": "n=",
    "pool": "max_tokens",
    "request_id": "request id",
}


def test_soak_random_requests_abort_and_step(params):
    """Acceptance: 2,000 random requests, valid and invalid, through add_request / abort / step:
    invalid ones are refused at add_request (or at SamplingParams) with a ValueError naming the
    field, valid ones finish, and no block leaks."""
    rng = np.random.default_rng(5)
    engine = Engine(CFG, params, ECFG)
    valid, refused, aborted, finished = [], collections.Counter(), set(), {}
    live: list = []
    for _ in range(2000):
        prompt, kw, rid, bad = _random_request(rng, valid)
        try:
            sp = ji.SamplingParams(**kw)
            rid = engine.add_request(prompt, sp, request_id=rid)
        except ValueError as e:
            assert bad is not None, (e, prompt, kw)
            assert NAMES.get(bad, bad) in str(e), (bad, str(e))
            refused[bad] += 1
        else:
            assert bad is None, (bad, prompt, kw)
            valid.append(rid)
            live.append(rid)
        if live and rng.random() < 0.05:
            victim = live.pop(int(rng.integers(len(live))))
            if engine.abort(victim):
                aborted.add(victim)
        if rng.random() < 0.6:
            for o in engine.step():
                assert o.finish_reason != "error", o
                if o.request_finished:
                    finished[o.request_id] = o.finish_reason
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_finished:
                finished[o.request_id] = o.finish_reason
    assert set(finished) | aborted == set(valid) and not set(finished) & aborted
    assert set(finished.values()) <= {"stop", "length"}
    assert len(refused) >= 14 and sum(refused.values()) > 500 and len(valid) > 1000
    assert engine.allocator.num_used_blocks == 0 and not engine.allocator.seq_ids()
    engine.allocator.check_invariants()
    m = engine.metrics()
    assert m.num_requests == len(valid) and m.num_completed == len(finished)
