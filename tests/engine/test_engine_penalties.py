"""Penalties, logit bias and the masks (min_tokens, allowed_token_ids, bad_words_ids) in the
engine: the same tokens as `ji.generate` under preemption, prefix caching and chunked prefill,
with and without speculation; forks penalized by their own histories; rejection sampling exact
against the penalized law. The step's history is rebuilt from the scheduler's sequences each
step, so these are the cases where it could go wrong: a recomputed (preempted) sequence, a
prompt split over chunks, a prompt served from the prefix cache, the n samples of one request,
a request resumed with `num_generated`, the drafts before a verified position."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer.engine import Engine, EngineConfig, SpeculativeConfig
from jaxinfer.penalties import PenaltyBatch, apply_penalties, history_counts, output_tail
from jaxinfer.sampling import SamplingBatch, process_logits
from tests.engine.test_spec_engine import _pvalue
from tests.helpers import random_params
from tests.test_penalties import _contains, reference_penalties

CFG = ji.preset("tiny-llama").replace(eos_token_id=None)
S = 4
MAX_TOKENS = 12
ECFG = EngineConfig(
    block_size=S,
    num_blocks=15,  # 56 slots for ten requests of up to 36 tokens: they preempt
    max_num_seqs=8,
    max_num_batched_tokens=256,
    backend="reference",
    min_token_bucket=16,
    min_block_bucket=16,
    min_seq_bucket=8,
)


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, seed=7)


def _workload():
    """Ten prompts from a small id range (tokens repeat, so penalties change the argmax), in
    pairs sharing a prefix of 0 to 2S + 3 tokens: the second of a pair hits the prefix cache."""
    rng = np.random.RandomState(4)
    prompts = []
    for shared in (0, S - 1, S, 2 * S + 3, 2 * S + 3):
        prefix = rng.randint(0, 24, shared).tolist()
        for _ in range(2):
            prompts.append(prefix + rng.randint(0, 24, rng.randint(3, 14)).tolist())
    return prompts


PROMPTS = _workload()


# Bans that bite the random model's greedy outputs (they change rows 5 and 7): one-, two- and
# three-token bans, beside allowed_token_ids in row 5. (14, 120) would bar row 7's first greedy
# token were the prompt's last token (14) read as output. Both fit W = 4, P = 2: few shapes.
BANS_5 = [(24, 24), (45, 24, 48), (6,)]
BANS_7 = [(78,), (45, 93), (93, 9, 114), (14, 120)]


def _settings(temperature: float) -> list[ji.SamplingParams]:
    """Per-request penalties of every kind, one request without any."""
    kinds = [
        dict(repetition_penalty=1.6),
        dict(frequency_penalty=1.2),
        dict(presence_penalty=1.5, logit_bias={5: 2.0}),
        dict(repetition_penalty=0.8, frequency_penalty=-0.5),
        dict(min_tokens=6, stop_token_ids=(5,), logit_bias={5: 30.0}),  # would stop at once
        dict(allowed_token_ids=tuple(range(0, 64, 3)), presence_penalty=0.5, bad_words_ids=BANS_5),
        dict(),
        dict(bad_words_ids=BANS_7),
    ]
    return [
        ji.SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0,
                          max_tokens=MAX_TOKENS, seed=30 + i, **kinds[i % len(kinds)])
        for i in range(len(PROMPTS))
    ]  # fmt: skip


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
@pytest.mark.parametrize("budget,prefix", [(1, True), (7, False), (256, True)])
def test_engine_matches_generate(params, temperature, budget, prefix):
    sps = _settings(temperature)
    ref = ji.generate(CFG, params, PROMPTS, sps, backend="reference")
    plain = ji.generate(CFG, params, PROMPTS, [dataclasses.replace(sp, presence_penalty=0,
                        frequency_penalty=0, repetition_penalty=1, logit_bias=(), min_tokens=0,
                        allowed_token_ids=None, bad_words_ids=()) for sp in sps],
                        backend="reference")  # fmt: skip
    # The penalties changed most outputs, so matching `ref` is not matching plain decoding.
    assert sum(r.token_ids != p.token_ids for r, p in zip(ref, plain)) >= 5
    held = ref[4].token_ids  # min_tokens: six tokens, then the stop token its bias favours
    assert len(held) == 7 and held[-1] == 5 and 5 not in held[:6]
    assert set(ref[5].token_ids) <= set(range(0, 64, 3))  # allowed_token_ids
    for i in (5, 7):  # bad_words_ids: no banned sequence in the output
        assert not any(_contains(ref[i].token_ids, w) for w in sps[i].bad_words_ids), i
    assert PROMPTS[7][-1] == 14 and (ref[7].token_ids[0] == 120) == (temperature == 0)
    if not temperature and budget == 1:  # ... where greedy decoding without the bans had one
        unbanned = ji.generate(CFG, params, [PROMPTS[i] for i in (5, 7)], [dataclasses.replace(
            sps[i], bad_words_ids=()) for i in (5, 7)], backend="reference")  # fmt: skip
        for i, u in zip((5, 7), unbanned):
            assert any(_contains(u.token_ids, w) for w in sps[i].bad_words_ids), i
    ecfg = dataclasses.replace(ECFG, max_num_batched_tokens=budget, enable_prefix_caching=prefix)
    engine = Engine(CFG, params, ecfg)
    outs = engine.generate(PROMPTS, sps)
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert o.token_ids == r.token_ids, f"request {i}"
    assert engine.num_preemptions > 0 or budget == 1
    if prefix:
        assert engine.allocator.prefix_cache_hits > 0
    assert engine.allocator.num_used_blocks == 0


def _dense_penalized_sample(params, prompt, sp, sample_index):
    """Sample `sample_index` of a request, scored without a cache: dense logits, the penalties
    of this sample's own history, then the engine's per-sample noise."""
    sb = SamplingBatch.from_params([sp])
    pb = PenaltyBatch.from_params([sp], CFG)
    seq = list(prompt)
    for _ in range(sp.max_tokens):
        logits = ji.forward_dense(params, CFG, jnp.asarray([seq]))[:, -1]  # [1, V]
        counts, seen = history_counts(
            jnp.asarray([seq]), jnp.asarray([len(prompt)]), CFG.vocab_size
        )
        tail = output_tail(jnp.asarray([seq]), jnp.asarray([len(prompt)]), pb.tail_width)
        x = process_logits(apply_penalties(logits, pb, counts, seen, tail), sb)[0]
        key = jax.random.fold_in(jax.random.key(sp.seed), sample_index)
        g = jax.random.gumbel(jax.random.fold_in(key, len(seq)), x.shape)
        seq.append(int(jnp.argmax(x + g)))
    return seq[len(prompt) :]


def test_forks_are_penalized_by_their_own_history(params):
    sp = ji.SamplingParams(temperature=1.0, max_tokens=8, seed=3, n=3, presence_penalty=2.0,
                           frequency_penalty=1.0)  # fmt: skip
    engine = Engine(CFG, params, ECFG)
    out = engine.generate([PROMPTS[1]], sp)[0]
    samples = [s.token_ids for s in out.samples]
    assert len({tuple(s) for s in samples}) == 3
    assert samples[0] == ji.generate(CFG, params, [PROMPTS[1]], dataclasses.replace(sp, n=1),
                                     backend="reference")[0].token_ids  # fmt: skip
    for j in (1, 2):
        assert samples[j] == _dense_penalized_sample(params, PROMPTS[1], sp, j), f"sample {j}"
    assert engine.allocator.num_used_blocks == 0


def test_logprobs_are_the_models_and_tokens_unchanged(params):
    sp = ji.SamplingParams(temperature=0, max_tokens=6, repetition_penalty=2.0, logprobs=2)
    engine = Engine(CFG, params, ECFG)
    out = engine.generate([PROMPTS[0]], sp)[0]
    ref = ji.generate(CFG, params, [PROMPTS[0]], dataclasses.replace(sp, logprobs=None),
                      backend="reference")[0]  # fmt: skip
    assert out.token_ids == ref.token_ids
    # The stream's logprobs are the model's: the chosen token's equals log_softmax of the raw
    # logits at its position, penalty or not.
    engine = Engine(CFG, params, ECFG)
    rid = engine.add_request(PROMPTS[0], sp)
    got = []
    while engine.has_unfinished():
        got += [lp for o in engine.step() if o.request_id == rid for lp in (o.logprobs or [])]
    seq = PROMPTS[0] + out.token_ids
    logits = ji.forward_dense(params, CFG, jnp.asarray([seq]))[0]  # [P + N, V]
    logp = np.asarray(jax.nn.log_softmax(logits, -1))
    for k, (chosen, _) in enumerate(got):
        pos = len(PROMPTS[0]) + k
        assert chosen == pytest.approx(logp[pos - 1, seq[pos]], abs=1e-4)


# ---------------------------------------------------------------------------- speculation


def _spec_ecfg(spec, budget):
    return dataclasses.replace(
        ECFG, speculative=spec, max_num_batched_tokens=max(16, budget),
        long_prefill_threshold=budget,
    )  # fmt: skip


@pytest.mark.parametrize(
    "drafter, gamma, budget",
    [("ngram", 1, 1), ("ngram", 3, 7), ("model", 3, 7), ("model", "auto", 64)],
)
def test_speculative_engine_matches_generate(params, drafter, gamma, budget):
    """Greedy: each verified position is penalized by the history that includes the drafts
    before it, so the committed tokens are plain penalized decoding's."""
    sps = _settings(0.0)
    ref = ji.generate(CFG, params, PROMPTS, sps, backend="reference")
    # The target itself as the draft model: it drafts without penalties, so it is right often
    # enough that positions after accepted drafts are verified.
    dm = (CFG, params) if drafter == "model" else "ngram"
    spec = SpeculativeConfig(drafter=dm, num_speculative_tokens=gamma,
                             max_gamma=3 if gamma == "auto" else None)  # fmt: skip
    engine = Engine(CFG, params, _spec_ecfg(spec, budget))
    outs = engine.generate(PROMPTS, sps)
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert o.token_ids == r.token_ids, f"request {i}"
    assert engine.spec_counters.accepted > 0 and engine.num_preemptions > 0
    assert engine.allocator.num_used_blocks == 0


# (request, i): ban plain greedy's tokens i and i + 1 of that request. In these cycles the
# n-gram drafter (γ = 3) proposes the pair whole, so the verified position of the second token
# follows the first as a draft of the same cycle.
DRAFTED_PAIRS = [(0, 4), (1, 5), (4, 1), (4, 6), (8, 9)]


@pytest.mark.parametrize("loop", ["engine", "standalone"])
def test_ngram_drafts_that_complete_a_ban_are_read(params, loop):
    """A ban whose prefix is a draft of the cycle that verifies its last token: only the tail
    extended by the drafts (`tails_at_drafts`) shows that the banned token follows it."""
    sp = ji.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    plain = ji.generate(CFG, params, PROMPTS, sp, backend="reference")
    prompts = [PROMPTS[k] for k, _ in DRAFTED_PAIRS]
    bans = [tuple(plain[k].token_ids[i : i + 2]) for k, i in DRAFTED_PAIRS]
    sps = [dataclasses.replace(sp, bad_words_ids=[ban]) for ban in bans]
    ref = ji.generate(CFG, params, prompts, sps, backend="reference")
    for (k, i), r in zip(DRAFTED_PAIRS, ref):  # each ban bites where plain had the pair
        assert r.token_ids[: i + 1] == plain[k].token_ids[: i + 1], k
        assert r.token_ids[i + 1] != plain[k].token_ids[i + 1], k
    if loop == "engine":
        spec = SpeculativeConfig(drafter="ngram", num_speculative_tokens=3)
        outs = Engine(CFG, params, _spec_ecfg(spec, 256)).generate(prompts, sps)
    else:
        outs = ji.speculative.generate((CFG, params), "ngram", prompts, sps, gamma=3,
                                       backend="reference")  # fmt: skip
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]


def test_speculative_coupled_sampling_matches_generate(params):
    sps = _settings(0.8)
    ref = ji.generate(CFG, params, PROMPTS, sps, backend="reference")
    spec = SpeculativeConfig(drafter=(CFG, params), num_speculative_tokens=2, acceptance="coupled")
    engine = Engine(CFG, params, _spec_ecfg(spec, 7))
    outs = engine.generate(PROMPTS, sps)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert engine.spec_counters.accepted > 0


TINY = ji.preset("tiny-llama").replace(vocab_size=8, eos_token_id=None)
SIGNIFICANCE = 1e-3


def _penalized_joint(params, prompt, sp) -> np.ndarray:
    """The declared law `[V, V]` of the first two tokens with `sp`'s penalties (exact)."""
    v = TINY.vocab_size
    seqs = np.array([prompt + [a] for a in range(v)], np.int32)  # [V, P+1]
    logits = np.asarray(ji.score(TINY, params, seqs), np.float64)

    def law(row, out):
        x = reference_penalties(row, prompt, out, sp) / sp.temperature
        p = np.exp(x - x.max())
        return p / p.sum()

    first = law(logits[0, -2], [])
    return np.stack([first[a] * law(logits[a, -1], [a]) for a in range(v)])


CHI_SQUARE_SETTINGS = {
    "penalties": dict(frequency_penalty=2.0, presence_penalty=1.0, repetition_penalty=1.5),
    # t1 from {0, 1, 4, 6} (stop token 2 barred by min_tokens), t2 from {0, 1, 2, 4, 6}.
    "masks": dict(allowed_token_ids=(0, 1, 2, 4, 6), min_tokens=1, stop_token_ids=(2,)),
    # This model's t1 is 1 (98%), then t2 is 5 (98%): (1, 5) spreads t2 over {1, 2, 7, 0}, the
    # law the cycle's rejection sampling must follow; (5, 1) must not fire at t1 (5 ends the
    # prompt, not the output). Never 3.
    "bad_words": dict(bad_words_ids=[(1, 5), (5, 1), (5, 6), (3,)]),
}


@pytest.mark.parametrize("kind", list(CHI_SQUARE_SETTINGS))
def test_speculative_rejection_sampling_with_penalties_chi_square(kind):
    """2000 seeds, γ = 1: the committed (t1, t2) follow the penalized (or masked) joint law
    (t2 is the cycle's commit), and fail the unpenalized one (the negative control)."""
    tparams = random_params(TINY, seed=1, std=0.6)
    dparams = random_params(TINY, seed=2, std=0.6)
    prompt, num = [1, 2, 3, 4, 5], 2000
    sp0 = ji.SamplingParams(temperature=1.0, max_tokens=3, **CHI_SQUARE_SETTINGS[kind])
    spec = SpeculativeConfig(drafter=(TINY, dparams), num_speculative_tokens=1)
    engine = Engine(
        TINY, tparams,
        EngineConfig(
            block_size=4, num_blocks=256, max_num_seqs=64, max_num_batched_tokens=128,
            min_token_bucket=128, min_block_bucket=4, min_seq_bucket=64, speculative=spec,
        ),
    )  # fmt: skip
    outs = engine.generate([prompt] * num, [dataclasses.replace(sp0, seed=s) for s in range(num)])
    counts = np.zeros((8, 8), np.int64)
    for o in outs:
        counts[o.token_ids[0], o.token_ids[1]] += 1
    neutral = dataclasses.replace(sp0, frequency_penalty=0, presence_penalty=0,
                                  repetition_penalty=1, allowed_token_ids=None,
                                  min_tokens=0, bad_words_ids=())  # fmt: skip
    assert _pvalue(counts, _penalized_joint(tparams, prompt, sp0)) > SIGNIFICANCE
    assert _pvalue(counts, _penalized_joint(tparams, prompt, neutral)) < SIGNIFICANCE
    assert 0 < engine.spec_counters.accepted < engine.spec_counters.proposed


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_standalone_speculative_loop_matches_generate(params, drafter):
    """`ji.speculative.generate`: greedy and coupled sampling with penalties commit plain
    penalized decoding's tokens (its cycle penalizes position j by the drafts before it)."""
    dm = (CFG, params) if drafter == "model" else "ngram"
    for temperature, acceptance in ((0.0, "rejection"), (0.8, "coupled")):
        sps = _settings(temperature)
        ref = ji.generate(CFG, params, PROMPTS, sps, backend="reference")
        outs = ji.speculative.generate((CFG, params), dm, PROMPTS, sps, gamma=3,
                                       acceptance=acceptance, backend="reference")  # fmt: skip
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref], temperature
        assert sum(o.num_accepted for o in outs) > 0


def test_num_generated_continues_a_request(params):
    """A request resumed from its prompt plus its first k tokens (`num_generated=k`, as the
    disaggregated decode side does) continues exactly as the request run whole: penalties count
    those k tokens as output, not prompt."""
    sp = ji.SamplingParams(temperature=0.7, seed=9, max_tokens=10, frequency_penalty=2.0,
                           presence_penalty=1.0)  # fmt: skip
    whole = ji.generate(CFG, params, [PROMPTS[3]], sp, backend="reference")[0].token_ids
    engine = Engine(CFG, params, ECFG)
    for k in (1, 3):
        rid = engine.add_request(PROMPTS[3] + whole[:k], dataclasses.replace(sp, max_tokens=10 - k),
                                 num_generated=k)  # fmt: skip
        out = []
        while engine.has_unfinished():
            out += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
        assert out == whole[k:], k
    # As prompt (num_generated=0) the same tokens are penalized differently.
    rid = engine.add_request(PROMPTS[3] + whole[:3], dataclasses.replace(sp, max_tokens=7))
    out = []
    while engine.has_unfinished():
        out += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
    assert out != whole[3:]
    # min_tokens counts the k resumed tokens as output too: the stop comes as early as whole.
    sp = ji.SamplingParams(temperature=0, max_tokens=10, min_tokens=4, stop_token_ids=(5,),
                           logit_bias={5: 50.0})  # fmt: skip
    whole = ji.generate(CFG, params, [PROMPTS[3]], sp, backend="reference")[0].token_ids
    assert len(whole) == 5 and whole[-1] == 5
    rid = engine.add_request(PROMPTS[3] + whole[:2], dataclasses.replace(sp, max_tokens=8),
                             num_generated=2)  # fmt: skip
    out = []
    while engine.has_unfinished():
        out += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
    assert out == whole[2:]
    # bad_words_ids read the k resumed tokens as output: (63, 107) fires after the second.
    sp = ji.SamplingParams(temperature=0, max_tokens=6, bad_words_ids=[(63, 107)])
    whole = ji.generate(CFG, params, [PROMPTS[3]], sp, backend="reference")[0].token_ids
    assert whole[:2] == [40, 63] and whole[2] != 107
    for k in (2, 0):  # resumed: as whole; as prompt (k = 0): the ban is off
        rid = engine.add_request(PROMPTS[3] + whole[:2], dataclasses.replace(sp, max_tokens=4),
                                 num_generated=k)  # fmt: skip
        out = []
        while engine.has_unfinished():
            out += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
        assert (out == whole[2:]) == (k == 2) and (out[0] == 107) == (k == 0), k
    for bad in (-1, len(PROMPTS[3]), 1.0):
        with pytest.raises(ValueError, match="num_generated must be an int"):
            engine.add_request(PROMPTS[3], sp, num_generated=bad)
    assert not engine.has_unfinished()
