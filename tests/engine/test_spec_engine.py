"""Speculative decoding inside the engine (issue 16): greedy and coupled token identity with plain
generation under preemption, prefix caching and chunked prefill; exact rejection sampling (a
chi-square test with a negative control); the cycle log adds up; bad configurations are refused.

The tiny shipped pair (`target`, `draft`) shares a tokenizer; the chi-square test uses two random
models of vocabulary 8, whose declared distribution is computed exactly by scoring.
"""

from __future__ import annotations

import sys

import jax
import numpy as np
import pytest
from jax.scipy.stats import chi2

import jaxinfer as ji
from experiments.engine_cycles import read_engine_log, summarize_engine_log
from jaxinfer.engine import Engine, EngineConfig, SpeculativeConfig
from tests.helpers import random_params

SIGNIFICANCE = 1e-3  # of the chi-square test and its negative control


@pytest.fixture(scope="module")
def pair():
    cfg, params = ji.load_checkpoint(ji.models.path("target"))
    dcfg, dparams = ji.load_checkpoint(ji.models.path("draft"))
    return (cfg, params), (dcfg, dparams)


def _prompts(cfg):
    rng = np.random.default_rng(0)
    shared = rng.integers(3, cfg.vocab_size, 8).tolist()  # two full blocks: prefix cache hits
    return [
        shared + rng.integers(3, cfg.vocab_size, 3).tolist(),
        rng.integers(3, cfg.vocab_size, 13).tolist(),
        shared + rng.integers(3, cfg.vocab_size, 6).tolist(),
        rng.integers(3, cfg.vocab_size, 5).tolist(),
    ]


def _ecfg(spec, chunk=16, **kw):
    return EngineConfig(
        block_size=4,
        num_blocks=14,  # 13 blocks = 52 slots for 4 requests of up to 26 tokens: preemption
        max_num_seqs=4,
        max_num_batched_tokens=max(16, chunk),
        long_prefill_threshold=chunk,
        min_token_bucket=16,
        min_block_bucket=16,
        min_seq_bucket=4,
        speculative=spec,
        **kw,
    )


# ------------------------------------------------------------------------------ greedy


@pytest.fixture(scope="module")
def greedy_ref(pair):
    (cfg, params), _ = pair
    sp = ji.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return sp, [o.token_ids for o in ji.generate(cfg, params, _prompts(cfg), sp)]


@pytest.mark.parametrize(
    "drafter, gamma, chunk",
    [
        ("ngram", 1, 1),
        ("ngram", 3, 7),
        ("ngram", "auto", 64),
        ("model", 1, 7),
        ("model", 3, 64),
        ("model", "auto", 1),
    ],
)
def test_greedy_equals_generate_under_preemption(pair, greedy_ref, drafter, gamma, chunk):
    (cfg, params), dm = pair
    prompts = _prompts(cfg)
    sp, want = greedy_ref
    spec = SpeculativeConfig(
        drafter="ngram" if drafter == "ngram" else dm,
        num_speculative_tokens=gamma,
        max_gamma=2 if gamma == "auto" else None,
    )
    engine = Engine(cfg, params, _ecfg(spec, chunk))
    got = engine.generate(prompts, sp)
    assert [o.token_ids for o in got] == want  # request by request
    assert engine.num_preemptions > 0
    assert engine.allocator.prefix_cache_hits > 0
    assert engine.spec_counters.proposed > 0
    engine.allocator.check_invariants()
    assert engine.allocator.num_used_blocks == 0


def test_stop_token_and_n_forks_stay_exact(pair):
    """A stop token inside an accepted run cuts the commit there; n > 1 forks speculate alone."""
    (cfg, params), dm = pair
    prompts = _prompts(cfg)[:2]
    plain = ji.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = [o.token_ids for o in ji.generate(cfg, params, prompts, plain)]
    stop = ref[0][5]  # a token the greedy run emits mid-way
    sp = ji.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=(stop,))
    want = [o.token_ids for o in ji.generate(cfg, params, prompts, sp)]
    engine = Engine(cfg, params, _ecfg(SpeculativeConfig(drafter=dm, num_speculative_tokens=3)))
    got = engine.generate(prompts, sp)
    assert [o.token_ids for o in got] == want and got[0].finish_reason == "stop"
    fork = ji.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=2)
    (out,) = engine.generate(prompts[1:], fork)
    assert [s.token_ids for s in out.samples] == [ref[1][:10]] * 2


def test_failed_draft_after_donation_rebuilds_both_caches(pair, greedy_ref, monkeypatch):
    """The model drafter's jitted call consumes its donated cache, then the step fails: the
    step's requests fail with the error, the engine rebuilds the drafter's cache beside the
    target's, and serves the same prompts again token for token."""
    (cfg, params), dm = pair
    prompts = _prompts(cfg)
    sp, want = greedy_ref
    engine = Engine(cfg, params, _ecfg(SpeculativeConfig(drafter=dm, num_speculative_tokens=3)))
    spec_mod = sys.modules["jaxinfer.engine.speculation"]
    real, calls = spec_mod._draft_model, []

    def fails_once_after_running(dparams, dcache, *a, **k):
        calls.append(1)
        out = real(dparams, dcache, *a, **k)
        if len(calls) == 3:
            for x in jax.tree.leaves(dcache):  # what donation does where the backend donates
                if not x.is_deleted():
                    x.delete()
            raise RuntimeError("injected draft fault")
        return out

    monkeypatch.setattr(spec_mod, "_draft_model", fails_once_after_running)
    got = engine.generate(prompts, sp)
    assert engine.num_failed_steps == 1
    failed = [o for o in got if o.finish_reason == "error"]
    assert failed and all(o.error == "injected draft fault" for o in failed)
    for o, w in zip(got, want):
        if o.finish_reason != "error":
            assert o.token_ids == w
        else:
            assert o.token_ids == w[: len(o.token_ids)]
    assert not any(x.is_deleted() for x in jax.tree.leaves(engine.dcache))
    assert engine.allocator.num_used_blocks == 0
    again = engine.generate(prompts, sp)
    assert [o.token_ids for o in again] == want
    assert engine.spec_counters.accepted > 0
    engine.allocator.check_invariants()


# ----------------------------------------------------------------------------- coupled


def test_coupled_sampling_equals_plain_sampling(pair):
    (cfg, params), dm = pair
    prompts = _prompts(cfg)
    sps = [
        ji.SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=s)
        for s in range(len(prompts))
    ]
    want = [o.token_ids for o in ji.generate(cfg, params, prompts, sps)]
    spec = SpeculativeConfig(drafter=dm, num_speculative_tokens=3, acceptance="coupled")
    engine = Engine(cfg, params, _ecfg(spec, 7))
    assert [o.token_ids for o in engine.generate(prompts, sps)] == want
    assert engine.spec_counters.accepted > 0


# --------------------------------------------------------------------------- rejection

TINY = ji.preset("tiny-llama").replace(vocab_size=8, eos_token_id=None)


def _joint(params, prompt, temperature):
    """The declared law of the first two generated tokens `[V, V]` (exact, by scoring)."""
    v = TINY.vocab_size
    seqs = np.array([prompt + [a] for a in range(v)], np.int32)  # [V, P+1]
    logits = np.asarray(ji.score(TINY, params, seqs), np.float64) / temperature
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return p[0, -2][:, None] * p[:, -1]  # p(a) p(b | a)


def _pvalue(counts: np.ndarray, law: np.ndarray) -> float:
    expected = counts.sum() * law.reshape(-1)
    obs = counts.reshape(-1).astype(np.float64)
    if np.any(obs[expected == 0] > 0):
        return 0.0
    big = expected >= 5
    obs, exp = np.append(obs[big], obs[~big].sum()), np.append(expected[big], expected[~big].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    return float(chi2.sf(np.sum((obs - exp) ** 2 / exp), len(obs) - 1))


def check_rejection_chi_square(tparams, drafter, tmp_path) -> None:
    """The committed (t1, t2) of 2000 seeds at T = 1 on `TINY` follow the declared joint law;
    t2 is the γ = 1 cycle's commit (an accepted draft or the correction). Negative control: the
    drafted tokens themselves (a speculation that accepted everything) follow q, and the same
    test must reject them. Shared with the head drafters' test."""
    prompt, temperature, num = [1, 2, 3, 4, 5], 1.0, 2000
    law = _joint(tparams, prompt, temperature)
    log = str(tmp_path / "cycles.jsonl")
    spec = SpeculativeConfig(drafter=drafter, num_speculative_tokens=1)
    engine = Engine(
        TINY,
        tparams,
        EngineConfig(
            block_size=4, num_blocks=256, max_num_seqs=64, max_num_batched_tokens=128,
            min_token_bucket=128, min_block_bucket=4, min_seq_bucket=64, speculative=spec,
            cycle_log=log,
        ),
    )  # fmt: skip
    sps = [ji.SamplingParams(temperature=temperature, max_tokens=3, seed=s) for s in range(num)]
    outs = engine.generate([prompt] * num, sps)
    counts = np.zeros((8, 8), np.int64)
    for o in outs:
        counts[o.token_ids[0], o.token_ids[1]] += 1
    assert _pvalue(counts, law) > SIGNIFICANCE
    # Negative control: t1 with the draft proposed for position 2 in its speculative cycle.
    first = {o.request_id: o.token_ids[0] for o in outs}
    wrong = np.zeros((8, 8), np.int64)
    for rec in read_engine_log(log):
        if rec["gamma"] == 1:
            wrong[first[rec["request_id"]], rec["proposed"][0]] += 1
    assert wrong.sum() > num // 2
    assert _pvalue(wrong, law) < SIGNIFICANCE
    assert 0 < engine.spec_counters.accepted < engine.spec_counters.proposed


def test_rejection_sampling_is_exact_chi_square(tmp_path):
    """`check_rejection_chi_square` with a random draft model."""
    tparams = random_params(TINY, seed=1, std=0.6)
    dparams = random_params(TINY, seed=2, std=0.6)
    check_rejection_chi_square(tparams, (TINY, dparams), tmp_path)


# --------------------------------------------------------------------------- cycle log


def test_cycle_log_adds_up(pair, greedy_ref, tmp_path):
    (cfg, params), dm = pair
    prompts = _prompts(cfg)
    log = str(tmp_path / "cycles.jsonl")
    spec = SpeculativeConfig(drafter=dm, num_speculative_tokens=3)
    engine = Engine(cfg, params, _ecfg(spec, 7, cycle_log=log), detokenize=lambda ids: str(ids))
    sp, want = greedy_ref
    outs = engine.generate(prompts, sp)
    assert [o.token_ids for o in outs] == want
    records = read_engine_log(log)
    for o in outs:
        mine = [r for r in records if r["request_id"] == o.request_id]
        assert [t for r in mine for t in r["committed"]] == o.token_ids
        assert all(r["text"] == str(r["committed"]) for r in mine)
    summary = summarize_engine_log(records)
    c = engine.spec_counters
    assert (summary["cycles"], summary["proposed"], summary["accepted"]) == (
        c.cycles,
        c.proposed,
        c.accepted,
    )
    assert summary["accepted_by_position"] == c.accepted_at.tolist()
    assert summary["reached_by_position"] == c.reached.tolist()
    assert all(r["draft_ms"] >= 0 and r["verify_ms"] > 0 for r in records)


def test_controller_warm_up_fills_the_table_and_picks_a_measured_gamma(pair):
    from jaxinfer.engine.cycles import warm_up

    (cfg, params), _ = pair
    spec = SpeculativeConfig(num_speculative_tokens="auto", max_gamma=2)
    engine = Engine(cfg, params, _ecfg(spec))
    warm_up(engine, batch_sizes=(1, 4))
    for b in (1, 4):
        gamma, pred = engine.controller.choose(b)
        assert all(p is not None and p > 0 for p in pred.values()), pred
        assert gamma == max(pred, key=pred.get)


def test_controller_probes_out_of_gamma_zero_and_follows_recent_acceptance():
    """Drafts that all fail drive "auto" to γ = 0; a probe every 32nd step keeps drafting, so
    when drafts start to succeed (a new workload) the controller goes back to speculating. It
    reads recent acceptance: the old failures decay instead of outvoting the new cycles."""
    import collections

    from jaxinfer.engine import cycles

    counters = cycles.SpecCounters(3)
    ctl = cycles.GammaController(3, None, counters)
    for g in range(4):  # a step costs 1 + 0.3 γ ms at B = 1: γ > 0 pays only if drafts land
        ctl.times[ctl.key(g, 1)] = collections.deque([1e-3 * (1 + 0.3 * g)])

    def run(steps: int, accept: bool) -> list[int]:
        chosen = []
        for _ in range(steps):
            g, pred = ctl.choose(1)
            assert set(pred) == {0, 1, 2, 3}
            counters.add(g, g if accept else 0)
            chosen.append(g)
        return chosen

    failing = run(320, accept=False)
    assert failing[-256:].count(0) == 256 - 256 // cycles._PROBE_EVERY  # γ = 0 but the probes
    probes = [i for i, g in enumerate(failing) if g > 0][-3:]
    assert np.diff(probes).tolist() == [cycles._PROBE_EVERY] * 2
    landing = run(400, accept=True)
    assert all(g == 3 for g in landing[-200:]), landing  # back to full speculation
    assert counters.alpha()[0] > 0.9  # the recent cycles, not the 300-odd failures before
    assert counters.accepted_at[0] < counters.reached[0]  # the totals keep every cycle
    fixed = cycles.GammaController(3, 0, cycles.SpecCounters(3))
    assert {fixed.choose(1)[0] for _ in range(100)} == {0}  # a fixed γ never probes


def test_controller_cells_are_compiled_shapes():
    """A table cell is (γ, padded B, padded T): rows of one B bucket whose steps run different
    T buckets are priced apart (16 rows at γ = 4 run T = 80, padded to 128; 12 rows 60, to 64)."""
    from jaxinfer.engine import cycles
    from jaxinfer.engine.buckets import pad_tokens

    ctl = cycles.GammaController(
        4, None, cycles.SpecCounters(4), lambda t: pad_tokens(t, (1, 4, 8, 16))
    )
    assert ctl.key(4, 16) == (4, 16, 128) and ctl.key(4, 12) == (4, 16, 64)
    assert ctl.key(4, 13) == (4, 16, 128) and ctl.key(0, 3) == (0, 4, 4)
    for rows, seconds in ((16, 9.0), (16, 0.30), (12, 9.0), (16, 0.32), (12, 0.21), (13, 0.31)):
        ctl.observe(4, rows, seconds)  # the first of each cell compiles: dropped
    assert ctl.step_time(4, 16) == pytest.approx(0.31) and ctl.step_time(4, 12) == 0.21
    assert ctl.step_time(4, 8) is None


# ---------------------------------------------------------------------------- bad input


def test_bad_configuration_is_a_value_error(pair):
    (cfg, params), (dcfg, dparams) = pair
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="above max_gamma"):
        SpeculativeConfig(num_speculative_tokens=5, max_gamma=4)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens="many")
    with pytest.raises(ValueError, match="needs a model"):
        SpeculativeConfig(drafter="model")
    with pytest.raises(ValueError, match="acceptance"):
        SpeculativeConfig(acceptance="greedy")
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(speculative="ngram")
    other = dcfg.replace(vocab_size=dcfg.vocab_size // 2)
    small = jax.tree.map(lambda x: x, random_params(other, seed=0))
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(cfg, params, EngineConfig(speculative=SpeculativeConfig(drafter=(other, small))))
    engine = Engine(cfg, params, EngineConfig(speculative=SpeculativeConfig()))
    with pytest.raises(ValueError, match="logprobs"):
        engine.add_request([1, 2, 3], ji.SamplingParams(logprobs=2))


def test_controller_times_whole_steps(pair, tmp_path):
    """The controller's table holds each decode-only step's whole time (host work included), so
    every observation exceeds that step's draft + verify time in the cycle log; only steps in
    which every row drafts the step's γ are timed."""
    (cfg, params), _ = pair
    log = str(tmp_path / "cycles.jsonl")
    spec = SpeculativeConfig(drafter="ngram", num_speculative_tokens=2)
    engine = Engine(cfg, params, _ecfg(spec, 16, cycle_log=log))
    seen = []
    observe = engine.controller.observe
    engine.controller.observe = lambda g, b, s: (seen.append((engine.num_steps, g, b, s)),
                                                 observe(g, b, s))  # fmt: skip
    sp = ji.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine.generate(_prompts(cfg)[:2], sp)
    records = read_engine_log(log)
    assert len(seen) >= 5  # decode-only steps of two requests
    for step, g, b, s in seen:
        mine = [r for r in records if r["step"] == step]
        assert all(r["gamma"] == g for r in mine) and b == mine[0]["batch_size"]
        assert s > (mine[0]["draft_ms"] + mine[0]["verify_ms"]) / 1e3
    # Steps in which one row's γ was cut short (its request near max_tokens) and another's was
    # not are not timed: they are smaller steps than (γ, B) and would price it low.
    by_step: dict = {}
    for r in records:
        by_step.setdefault(r["step"], set()).add(r["gamma"])
    mixed = {step for step, gs in by_step.items() if len(gs) > 1}
    assert mixed and not mixed & {step for step, *_ in seen}
