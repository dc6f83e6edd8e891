"""The speculative loop against plain `ji.generate`: greedy and coupled token identity, the
top-k / top-p support of rejection sampling, batch invariance, stops, the cycle log, γ="auto".

Models: a random tiny-llama target; drafts are a smaller random model (1 layer, MQA; it
disagrees with the target almost always), the target itself (accepts everything), the target
with perturbed weights (accepts some, so sequences of a batch advance by different amounts), and
the model-free n-gram drafter. Runs share compilations: every test below uses the same three
prompts, max_tokens <= 16 and block size 16, so each (drafter, γ, acceptance mode) compiles once.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.stats import chi2

import jaxinfer as ji
from jaxinfer.sampling import SamplingBatch, process_logits
from jaxinfer.speculative import (
    choose_gamma,
    generate_with_log,
    loop,
    ngram_lookup,
    ngram_propose,
    prefer_ngram,
    read_cycle_log,
    speedup,
    summarize_log,
)
from tests.helpers import random_params

CFG = ji.preset("tiny-llama").replace(eos_token_id=None)
DCFG = ji.ModelConfig(
    vocab_size=CFG.vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
    head_dim=16, intermediate_size=64, max_position_embeddings=256,
)  # fmt: skip
PROMPTS = [
    np.random.RandomState(i).randint(0, CFG.vocab_size, n).tolist()
    for i, n in enumerate((9, 23, 14))
]
SAMPLED = [  # temperature 0.8 with top-k and top-p, one seed per request
    ji.SamplingParams(temperature=0.8, top_k=12, top_p=0.8, max_tokens=16, seed=s)
    for s in (3, 4, 5)
]


@functools.cache
def _models():
    tp = random_params(CFG, seed=7)
    leaves, treedef = jax.tree.flatten(tp)
    keys = jax.random.split(jax.random.key(11), len(leaves))
    perturbed = [x + 0.1 * x.std() * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return {
        "small": (DCFG, random_params(DCFG, seed=3)),
        "self": (CFG, tp),
        "perturbed": (CFG, jax.tree.unflatten(treedef, perturbed)),
        "ngram": "ngram",
    }


def _target():
    return _models()["self"]


@functools.cache
def _greedy_requests():
    """Greedy requests with a short max_tokens, a stop token inside a generation, and a plain one;
    and their plain `ji.generate` outputs."""
    free = ji.generate(CFG, _target()[1], PROMPTS, ji.SamplingParams(temperature=0, max_tokens=16))
    stop = free[1].token_ids[4]
    sps = [
        ji.SamplingParams(temperature=0, max_tokens=8),
        ji.SamplingParams(temperature=0, max_tokens=16, stop_token_ids=(stop,)),
        ji.SamplingParams(temperature=0, max_tokens=16),
    ]
    return sps, ji.generate(CFG, _target()[1], PROMPTS, sps), stop


@functools.cache
def _spec(drafter, gamma, acceptance, temperature):
    sps = _greedy_requests()[0] if temperature == 0 else SAMPLED
    return ji.speculative.generate(
        _target(), _models()[drafter], PROMPTS, sps, gamma=gamma, acceptance=acceptance
    )


_SLOW = pytest.mark.slow  # the fast n-gram case (γ = 3) covers the same code


@pytest.mark.parametrize(
    "drafter, gamma",
    [(d, g) for d in ("small", "self") for g in (1, 3, 5)]
    + [("ngram", 3), pytest.param("ngram", 1, marks=_SLOW), pytest.param("ngram", 5, marks=_SLOW)],
)
def test_greedy_equals_plain_generate(drafter, gamma):
    sps, ref, stop = _greedy_requests()
    outs = _spec(drafter, gamma, "rejection", 0)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert [o.finish_reason for o in outs] == [r.finish_reason for r in ref]
    # Stops and max_tokens hold exactly, also when a cycle commits past them.
    assert len(outs[0].token_ids) == 8 and outs[0].finish_reason == "length"
    assert outs[1].token_ids[-1] == stop and stop not in outs[1].token_ids[:-1]
    assert outs[1].finish_reason == "stop"
    assert len(outs[2].token_ids) == 16
    for o in outs:
        assert o.num_proposed == gamma * o.num_cycles
        assert sum(o.accepted_histogram) == o.num_cycles
        # Every cycle commits at least one token; the first comes from the prefill.
        assert o.num_cycles <= len(o.token_ids) - 1
    if drafter == "self":  # the draft is the target: every drafted token is accepted
        assert all(o.num_accepted == o.num_proposed for o in outs)
    if drafter == "small":
        assert sum(o.num_accepted for o in outs) < sum(o.num_proposed for o in outs)


def test_sequences_of_a_batch_advance_by_different_amounts():
    sps, ref, _ = _greedy_requests()
    outs = _spec("perturbed", 3, "rejection", 0)  # shares the "self" compilation
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    hists = {o.accepted_histogram for o in outs}
    assert len(hists) > 1, hists
    assert any(0 < o.num_accepted < o.num_proposed for o in outs)


@pytest.mark.parametrize("drafter", ["small", "self", "ngram"])
def test_coupled_sampling_equals_plain_generate(drafter):
    ref = ji.generate(CFG, _target()[1], PROMPTS, SAMPLED)
    outs = _spec(drafter, 3, "coupled", 0.8)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    if drafter == "self":  # same noise, same distributions: the draft is the target's sample
        assert all(o.num_accepted == o.num_proposed for o in outs)


_SCORE_LEN = 48  # every rescored sequence is padded to this length: one compilation


def _rescore(prompt, tokens):
    """Target logits `[n, V]` predicting each of `tokens` after `prompt` (dense forward)."""
    seq = list(prompt) + list(tokens)
    padded = np.asarray([seq + [0] * (_SCORE_LEN - len(seq))])  # causal: the tail is ignored
    return ji.score(CFG, _target()[1], padded)[0, len(prompt) - 1 : len(seq) - 1]


def _disallowed(prompt, tokens, sp):
    """Indices of `tokens` outside the target's top-k / top-p set at their positions."""
    logits = _rescore(prompt, tokens)  # [n, V]
    sb = SamplingBatch.from_params([sp] * len(tokens))
    x = np.asarray(process_logits(logits, sb))
    return np.flatnonzero(~np.isfinite(x[np.arange(len(tokens)), tokens]))


def test_rejection_sampling_emits_only_allowed_tokens():
    outs = _spec("small", 3, "rejection", 0.8)
    for prompt, o, sp in zip(PROMPTS, outs, SAMPLED):
        assert len(o.token_ids) == 16
        assert len(_disallowed(prompt, o.token_ids, sp)) == 0
    # Negative control: the least likely token at each position is outside the set.
    prompt, o, sp = PROMPTS[0], outs[0], SAMPLED[0]
    worst = np.argmin(np.asarray(_rescore(prompt, o.token_ids)), axis=-1)
    assert len(_disallowed(prompt, worst.tolist(), sp)) == len(worst)


def _chi2_pvalue(counts: np.ndarray, p: np.ndarray) -> float:
    """Goodness of fit of `counts [V]` to `p [V]`; 0 if a token with p = 0 was observed."""
    if np.any(counts[p == 0] > 0):
        return 0.0
    live = p > 0
    expected = counts.sum() * p[live]
    stat = float(np.sum((counts[live] - expected) ** 2 / expected))
    return float(chi2.sf(stat, live.sum() - 1))


def _declared(cfg, params, seq, sp):
    """The declared distribution `[V]` of the token after `seq` (dense rescoring)."""
    logits = ji.score(cfg, params, np.asarray([seq]))[:, -1]  # [1, V]
    x = process_logits(logits, SamplingBatch.from_params([sp]))
    return np.asarray(jax.nn.softmax(x, axis=-1), np.float64)[0]


def test_rejection_sampling_follows_the_target_distribution():
    """The first speculative token of 128 seeds, given the prefill's token, against the exact
    target distribution: a chi-square test at significance 1e-3. Negative control: the same
    counts must be rejected against the draft's distribution."""
    n = 128
    sps = [ji.SamplingParams(temperature=1.0, top_k=3, max_tokens=2, seed=s) for s in range(n)]
    prompt = PROMPTS[0]
    outs = ji.speculative.generate(_target(), _models()["small"], [prompt] * n, sps, gamma=3)
    first = np.array([o.token_ids[0] for o in outs])  # sampled by the prefill
    second = np.array([o.token_ids[1] for o in outs])  # the first cycle's first token
    a = np.bincount(first).argmax()
    counts = np.bincount(second[first == a], minlength=CFG.vocab_size)
    assert counts.sum() >= 40
    p = _declared(CFG, _target()[1], prompt + [int(a)], sps[0])
    assert _chi2_pvalue(counts, p) > 1e-3
    q = _declared(DCFG, _models()["small"][1], prompt + [int(a)], sps[0])
    assert _chi2_pvalue(counts, q) < 1e-3


def test_rejection_with_draft_equal_target_accepts_all_without_nan():
    outs = _spec("self", 3, "rejection", 0.8)
    for o in outs:
        assert o.num_accepted == o.num_proposed > 0
        assert all(0 <= t < CFG.vocab_size for t in o.token_ids)


def test_rejection_sampling_is_batch_invariant():
    batch = _spec("small", 3, "rejection", 0.8)
    alone = ji.speculative.generate(
        _target(), _models()["small"], [PROMPTS[1]], SAMPLED[1], gamma=3
    )
    assert alone[0].token_ids == batch[1].token_ids
    # A different seed gives a different sample (the comparison above can fail).
    other = ji.speculative.generate(
        _target(), _models()["small"], [PROMPTS[1]], SAMPLED[2], gamma=3
    )
    assert other[0].token_ids != batch[1].token_ids


def test_logging_mode_matches_fused_loop(tmp_path):
    fused = _spec("small", 3, "rejection", 0.8)
    path = os.path.join(tmp_path, "cycles.jsonl")
    logged, records = generate_with_log(
        _target(), _models()["small"], PROMPTS, SAMPLED, gamma=3, log_path=path
    )
    assert [o.token_ids for o in logged] == [o.token_ids for o in fused]
    assert [o.accepted_histogram for o in logged] == [o.accepted_histogram for o in fused]
    assert read_cycle_log(path) == records
    for i, o in enumerate(logged):
        assert sum(r.committed[i] for r in records) == len(o.token_ids) - 1
        assert sum(r.accepted[i] for r in records) == o.num_accepted
        assert sum(r.proposed[i] > 0 for r in records) == o.num_cycles
    for r in records:
        live = [p > 0 for p in r.proposed]
        assert r.batch_size == sum(live)
        assert all(0 <= a <= p for a, p in zip(r.accepted, r.proposed))
        assert all(c <= a + 1 for c, a in zip(r.committed, r.accepted))
        assert r.draft_ms > 0 and r.verify_ms > 0
    summary = summarize_log(records, t_plain=1e-3)
    assert summary["cycles"] == len(records)
    # In-sample, the chain model's MLE reproduces the measured tokens per cycle exactly.
    assert summary["predicted_tokens_per_cycle"] == pytest.approx(summary["tokens_per_cycle"])
    counts = [a for r in records for a, p in zip(r.accepted, r.proposed) if p]
    assert summary["tokens_per_cycle"] == pytest.approx(1 + np.mean(counts))


def test_choose_gamma_follows_the_speedup_model():
    sps, ref, _ = _greedy_requests()
    choice = choose_gamma(
        _target(), _models()["small"], PROMPTS, sps, candidates=(1, 3, 5),
        calibration_gammas=(1, 3),
    )  # fmt: skip
    recomputed = {
        g: speedup(choice.alpha, g, choice.t_plain, choice.t_draft, choice.verify_cost)
        for g in (1, 3, 5)
    }
    assert choice.speedups == pytest.approx(recomputed)
    assert choice.gamma == max(recomputed, key=lambda g: (recomputed[g], -g))
    assert choice.predicted_speedup == pytest.approx(recomputed[choice.gamma])
    outs = _spec("small", choice.gamma, "rejection", 0)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]


@pytest.mark.slow
def test_gamma_auto_end_to_end():
    sps, ref, _ = _greedy_requests()
    outs = ji.speculative.generate(_target(), _models()["small"], PROMPTS, sps, gamma="auto")
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]


def _compiles() -> tuple[int, int]:
    """Programs compiled by the fused loop's jitted prefill and loop (their own caches)."""
    return loop._prefill_jit._cache_size(), loop._loop_jit._cache_size()


def test_shapes_within_a_bucket_do_not_recompile():
    sps = _greedy_requests()[0]
    _spec("small", 3, "rejection", 0)
    before = _compiles()
    prompts = [p[:-2] + [1, 2] for p in PROMPTS]  # new tokens, same length buckets
    prompts[0] = prompts[0][:-1]  # and a different length
    ji.speculative.generate(_target(), _models()["small"], prompts, sps, gamma=3)
    assert _compiles() == before


def test_ngram_proposals():
    hist = jnp.array(
        [
            [5, 6, 7, 8, 5, 6, 7, 0, 0, 0],  # suffix 5 6 7 seen at 0..2: propose 8 5 6 7 8
            [1, 2, 3, 9, 2, 3, 4, 2, 3, 0],  # suffix 2 3: most recent earlier match ends at 5
            [1, 2, 3, 4, 5, 6, 0, 0, 0, 0],  # no match at any n: repeat the last token
            [4, 9, 9, 9, 9, 0, 0, 0, 0, 0],  # 9 9 9 matches ending at 3: period 1
        ],
        jnp.int32,
    )
    cur = jnp.array([6, 8, 5, 4], jnp.int32)
    propose = jax.jit(ngram_propose, static_argnames=("gamma", "max_n"))
    got = np.asarray(propose(hist, cur, gamma=5, max_n=3))
    np.testing.assert_array_equal(
        got,
        [[8, 5, 6, 7, 8], [4, 2, 3, 4, 2], [6, 6, 6, 6, 6], [9, 9, 9, 9, 9]],
    )
    _, length = ngram_lookup(hist, cur, gamma=5, max_n=3)
    np.testing.assert_array_equal(length, [3, 2, 0, 3])  # the suffix length that matched
    _, length = ngram_lookup(hist, cur, gamma=5, max_n=2)
    np.testing.assert_array_equal(length, [2, 2, 0, 2])


def test_prefer_ngram_takes_rows_whose_match_is_long_enough():
    """The hybrid: rows 0, 1 and 3 match 3, 2 and 3 tokens; with min_match 3 rows 0 and 3 take
    the n-gram's tokens and a one-hot q, rows 1 and 2 keep the drafter's tokens and q."""
    hist = jnp.array(
        [[5, 6, 7, 8, 5, 6, 7, 0, 0, 0], [1, 2, 3, 9, 2, 3, 4, 2, 3, 0],
         [1, 2, 3, 4, 5, 6, 0, 0, 0, 0], [4, 9, 9, 9, 9, 0, 0, 0, 0, 0]], jnp.int32,
    )  # fmt: skip
    cur = jnp.array([6, 8, 5, 4], jnp.int32)
    mine = jnp.full((4, 2), 11, jnp.int32)
    q = jax.nn.softmax(jax.random.normal(jax.random.key(0), (4, 2, 16)), axis=-1)
    tokens, q2, use = prefer_ngram(mine, q, hist, cur, max_n=3, min_match=3)
    np.testing.assert_array_equal(use, [True, False, False, True])
    np.testing.assert_array_equal(tokens, [[8, 5], [11, 11], [11, 11], [9, 9]])
    np.testing.assert_array_equal(q2[1:3], q[1:3])
    np.testing.assert_array_equal(q2[0], jax.nn.one_hot(jnp.array([8, 5]), 16))
    np.testing.assert_array_equal(q2[3], jax.nn.one_hot(jnp.array([9, 9]), 16))
    _, none, use = prefer_ngram(mine, None, hist, cur, max_n=3, min_match=1)
    assert none is None
    np.testing.assert_array_equal(use, [True, True, False, True])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(gamma=0), "gamma must be an int >= 1"),
        (dict(gamma=True), "gamma must be an int >= 1"),
        (dict(acceptance="typical"), "acceptance='typical'"),
        (dict(block_size=0), "block_size=0 is invalid"),
        (dict(block_size=True), "block_size=True is invalid"),
        (dict(draft=(CFG.replace(vocab_size=64), None)), "draft vocab_size 64 .* vocab_size 128"),
        (dict(draft="medusa"), "'ngram'"),
        (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
        (dict(prompts=[[1, 128]]), "token id 128 outside the vocabulary"),
        (
            dict(prompts=[[1] * 230], sampling=ji.SamplingParams(max_tokens=20), gamma=6),
            r"230 \+ max_tokens 20 \+ gamma 6 \+ 1 = 257 exceeds the position limit 256",
        ),
        (dict(sampling=[ji.SamplingParams()]), "1 SamplingParams for 3 prompts"),
    ],
)
def test_bad_input_raises(kwargs, match):
    args = dict(
        target=(CFG, None), draft="ngram", prompts=PROMPTS, sampling=None, gamma=3,
        acceptance="rejection",
    )  # fmt: skip
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        ji.speculative.generate(**args)
