"""Penalties, logit bias and masks: the device rule against a NumPy transcription of vLLM's
sampler, `ji.generate` against a step-by-step reference and against transformers' own
processors, and the SamplingParams boundary."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer import models
from jaxinfer.penalties import (
    PenaltyBatch,
    add_tokens,
    apply_at_drafts,
    apply_penalties,
    history_counts,
    output_tail,
    push_tail,
)
from tests.helpers import random_params

CFG = ji.preset("tiny-llama").replace(eos_token_id=None)
V = CFG.vocab_size


def reference_penalties(logits, prompt, output, sp, eos=None) -> np.ndarray:
    """One row, written out from vLLM's rule: bias, then repetition over prompt and output,
    then frequency and presence over the output, then allowed_token_ids, then bad_words_ids
    (vLLM v1's `apply_bad_words` over the output), then min_tokens (the stop tokens, eos
    included unless ignored, barred while the output is shorter)."""
    x = np.asarray(logits, np.float64).copy()
    for tid, b in sp.logit_bias:
        x[tid] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
    for t in set(output):
        n = output.count(t)
        x[t] -= sp.frequency_penalty * n + sp.presence_penalty
    if sp.allowed_token_ids is not None:
        x[[t for t in range(len(x)) if t not in sp.allowed_token_ids]] = -np.inf
    for w in sp.bad_words_ids:
        if len(w) - 1 <= len(output) and tuple(output[len(output) - len(w) + 1 :]) == w[:-1]:
            x[w[-1]] = -np.inf
    if len(output) < sp.min_tokens:
        x[list(_stops(sp, eos))] = -np.inf
    return x


def _stops(sp, eos) -> set[int]:
    return set(sp.stop_token_ids) | ({eos} if eos is not None and not sp.ignore_eos else set())


SETTINGS = [
    ji.SamplingParams(repetition_penalty=1.3),
    ji.SamplingParams(repetition_penalty=0.7, frequency_penalty=0.5),
    ji.SamplingParams(presence_penalty=-1.5, frequency_penalty=2.0, logit_bias={3: 5.0, 9: -80}),
    ji.SamplingParams(logit_bias=[(0, 1.5)]),
    # Masks: min_tokens beyond every output here (stop tokens always barred), and min_tokens 1
    # twice, over an empty output (barred) and a longer one (not).
    ji.SamplingParams(max_tokens=64, min_tokens=40, stop_token_ids=(4, 9)),
    *[ji.SamplingParams(min_tokens=1, stop_token_ids=(2,), allowed_token_ids=range(0, 40, 2))] * 2,
    ji.SamplingParams(),  # neutral: a padding-like row among penalized ones
]
EMPTY_OUTPUT_ROW = 5  # its history is its prompt alone


def test_apply_penalties_matches_reference():
    rng = np.random.RandomState(0)
    b, h = len(SETTINGS), 24
    logits = rng.randn(b, V).astype(np.float32) * 3
    hist = np.full((b, h), -1, np.int32)
    num_prompt = rng.randint(1, 12, b).astype(np.int32)
    rows = []
    for r in range(b):
        n = int(rng.randint(num_prompt[r] + 1, h + 1))
        n = int(num_prompt[r]) if r == EMPTY_OUTPUT_ROW else n
        hist[r, :n] = rng.randint(0, 12, n)  # a small id range, so tokens repeat
        rows.append((hist[r, : num_prompt[r]].tolist(), hist[r, num_prompt[r] : n].tolist()))
    pb = PenaltyBatch.from_params(SETTINGS, CFG, pad_to=b + 3)
    pad = np.zeros((3, V), np.float32)
    hist = jnp.asarray(np.concatenate([hist, np.full((3, h), -1, np.int32)]))
    num_prompt = jnp.asarray(np.concatenate([num_prompt, np.zeros(3, np.int32)]))
    counts, seen = history_counts(hist, num_prompt, V)
    tail = output_tail(hist, num_prompt, pb.tail_width)
    got = np.asarray(apply_penalties(np.concatenate([logits, pad]), pb, counts, seen, tail))
    for r, sp in enumerate(SETTINGS):
        want = reference_penalties(logits[r], *rows[r], sp)
        np.testing.assert_allclose(got[r], want, rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(got[b:], pad)  # padding rows: untouched
    assert np.isneginf(got[5, 2]) and np.isfinite(got[6, 2])  # min_tokens 1: empty output only
    assert np.isneginf(got[4, [4, 9]]).all() and np.isfinite(got[:4]).all()
    np.testing.assert_array_equal(got[b - 1], logits[b - 1])  # neutral settings: bit-identical


def test_add_tokens_equals_history_counts():
    """ji.generate's incremental counts and output tail equal the engine's of the whole history."""
    rng = np.random.RandomState(1)
    hist = rng.randint(0, 7, (3, 10)).astype(np.int32)
    num_prompt = np.array([2, 5, 10], np.int32)
    prompt_only = np.where(np.arange(10)[None] < num_prompt[:, None], hist, -1)
    counts, seen = history_counts(jnp.asarray(prompt_only), jnp.asarray(num_prompt), V)
    tail = jnp.full((3, 7), -1, jnp.int32)  # wider than rows 1 and 2's outputs
    for j in range(10):
        live = jnp.asarray(j >= num_prompt)
        counts, seen = add_tokens(counts, seen, jnp.asarray(hist[:, j]), live)
        tail = push_tail(tail, jnp.asarray(hist[:, j]), live)
    want_counts, want_seen = history_counts(jnp.asarray(hist), jnp.asarray(num_prompt), V)
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(want_counts))
    np.testing.assert_array_equal(np.asarray(seen), np.asarray(want_seen))
    assert int(counts.sum()) == 8 + 5  # output tokens only
    want_tail = output_tail(jnp.asarray(hist), jnp.asarray(num_prompt), 7)
    np.testing.assert_array_equal(np.asarray(tail), np.asarray(want_tail))
    np.testing.assert_array_equal(want_tail[0], hist[0, 3:])  # the last 7 of 8 outputs
    np.testing.assert_array_equal(want_tail[1], [-1, -1] + hist[1, 5:].tolist())
    np.testing.assert_array_equal(want_tail[2], [-1] * 7)  # no output


# ------------------------------------------------------------------------------ bad_words_ids


def _bad_words_rows(rng):
    """Histories of ids 0..4 (so random bans match) and bans per row: some built from the
    row's own output (they fire), some from its prompt and output together (they must not:
    vLLM reads the output only), random ones, one- to four-token bans mixed, a row without
    bans, and bans beside allowed_token_ids and min_tokens. Returns (settings, prompts,
    outputs)."""
    settings, prompts, outputs = [], [], []
    for r, n_out in enumerate([9, 1, 6, 5, 0, 12]):
        prompt = rng.randint(0, 5, int(rng.randint(2, 7))).tolist()
        out = rng.randint(0, 5, n_out).tolist()
        rand = [tuple(rng.randint(0, 5, int(rng.randint(2, 5))).tolist()) for _ in range(6)]
        kw = {}
        if r == 0:  # fire: the output's last 1, 2 and 3 tokens as prefixes; and one single
            bans = [(3,), (out[-1], 6), tuple(out[-2:]) + (7,), tuple(out[-3:]) + (8,), *rand]
        elif r == 1:  # prefixes straddling the prompt never fire; the output's own does
            bans = [(prompt[-1], out[0], 9), (prompt[-2], prompt[-1], out[0], 10), (out[0], 11)]
        elif r == 2:  # no bans
            bans, kw = [], dict(repetition_penalty=1.5, frequency_penalty=0.5)
        elif r == 3:  # beside the other masks
            bans = [(out[-1], 0), (out[-1], 2), (1,)]
            kw = dict(allowed_token_ids=range(0, 12, 2), min_tokens=9, stop_token_ids=(4,))
        elif r == 4:  # empty output: only single-token bans fire
            bans = [(12,), (prompt[-1], 13), *rand[:2]]
        else:
            bans = rand * 2 + [(out[-1], 14)]  # repeated bans: harmless
        settings.append(ji.SamplingParams(max_tokens=16, bad_words_ids=bans, **kw))
        prompts.append(prompt)
        outputs.append(out)
    return settings, prompts, outputs


def _histories(prompts, outputs, rows, width):
    """`[rows, width]` prompt then output, -1 padded, and `[rows]` prompt lengths."""
    hist = np.full((rows, width), -1, np.int32)
    num_prompt = np.zeros(rows, np.int32)
    for r, (p, o) in enumerate(zip(prompts, outputs)):
        hist[r, : len(p) + len(o)] = p + o
        num_prompt[r] = len(p)
    return jnp.asarray(hist), jnp.asarray(num_prompt)


def test_bad_words_match_reference():
    rng = np.random.RandomState(11)
    settings, prompts, outputs = _bad_words_rows(rng)
    b = len(settings) + 2  # two padding rows
    pb = PenaltyBatch.from_params(settings, CFG, pad_to=b)
    assert pb.bad_prefix.shape == (b, 16, 4) and pb.tail_width == 4  # 13 bans, prefixes <= 3
    hist, num_prompt = _histories(prompts, outputs, b, 24)
    counts, seen = history_counts(hist, num_prompt, V)
    logits = rng.randn(b, V).astype(np.float32) * 3
    got = np.asarray(
        apply_penalties(logits, pb, counts, seen, output_tail(hist, num_prompt, pb.tail_width))
    )
    for r, sp in enumerate(settings):
        want = reference_penalties(logits[r], prompts[r], outputs[r], sp)
        np.testing.assert_allclose(got[r], want, rtol=1e-6, atol=1e-5, err_msg=f"row {r}")
    np.testing.assert_array_equal(got[len(settings) :], logits[len(settings) :])  # padding
    # The cases fired as built: row 0's bans by the last 1, 2 and 3 outputs; of row 1's, only
    # the one inside its output.
    assert np.isneginf(got[0, [3, 6, 7, 8]]).all()
    assert set(np.flatnonzero(np.isneginf(got[1]))) == {11}
    assert np.isneginf(got[4, 12]) and np.isfinite(got[4, 13])
    assert np.isneginf(got[3, [0, 1, 2]]).all() and np.isfinite(got[3, [6, 8, 10]]).all()
    assert np.isneginf(got[5, 14])


def test_bad_words_at_drafts_match_reference():
    """Position j of a speculative step: the reference over the output plus drafts 0..j-1, so
    bans complete inside the drafts, across the committed output and the drafts, or not at all
    past a row's γ (positions never used)."""
    rng = np.random.RandomState(12)
    prompts = [[1, 2, 3], [4, 0], [2, 2, 2, 1]]
    outputs = [[5, 6], [7], []]
    draft = np.array([[8, 9, 10], [11, 12, 13], [14, 15, 16]], np.int32)  # [R, G-1]
    gam = np.array([3, 3, 1])
    settings = [
        ji.SamplingParams(bad_words_ids=[(6, 8), (6, 8, 20), (8, 9, 21), (9, 10, 22), (5, 6, 8, 9)],
                          frequency_penalty=1.0),
        ji.SamplingParams(bad_words_ids=[(7, 11, 12, 23), (0, 7, 24), (12, 25)]),
        ji.SamplingParams(bad_words_ids=[(14, 26), (1, 14, 27), (15, 28)], min_tokens=2,
                          stop_token_ids=(29,)),
    ]  # fmt: skip
    r, g = draft.shape[0], draft.shape[1] + 1
    pb = PenaltyBatch.from_params(settings, CFG)
    hist, num_prompt = _histories(prompts, outputs, r, 8)
    counts, seen = history_counts(hist, num_prompt, V)
    tail = output_tail(hist, num_prompt, pb.tail_width)
    logits = rng.randn(r, g, V).astype(np.float32)
    live = jnp.arange(g - 1)[None, :] < jnp.asarray(gam)[:, None]
    got = np.asarray(apply_at_drafts(logits, pb, counts, seen, tail, jnp.asarray(draft), live))
    for i, sp in enumerate(settings):
        for j in range(gam[i] + 1):
            out = outputs[i] + draft[i, :j].tolist()
            want = reference_penalties(logits[i, j], prompts[i], out, sp)
            np.testing.assert_allclose(got[i, j], want, rtol=1e-6, atol=1e-5, err_msg=(i, j))
    # Row 0: 8 at position 0; 20 and 9 at 1; 21 at 2; 22 at 3. Row 1: 25 and 23 at 2, never
    # 24 (its prefix straddles the prompt). Row 2: 26 at 1, never 27 (prompt), 28 past γ; the
    # stop token 29 while the output is shorter than min_tokens.
    neg = {(0, 0): [8], (0, 1): [20, 9], (0, 2): [21], (0, 3): [22], (1, 2): [25, 23],
           (2, 0): [29], (2, 1): [26, 29]}  # fmt: skip
    for i in range(r):
        for j in range(gam[i] + 1):
            assert set(np.flatnonzero(np.isneginf(got[i, j]))) == set(neg.get((i, j), [])), (i, j)


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, seed=7)


def _stepwise(params, prompt, sp, n, cfg=CFG) -> list[int]:
    """Greedy reference: rescore the growing sequence densely, penalize in NumPy, argmax; stop
    after a stop token (eos unless ignored), as the decode loops do."""
    seq = list(prompt)
    for _ in range(n):
        logits = np.asarray(ji.score(cfg, params, [seq]))[0, -1]
        x = reference_penalties(logits, list(prompt), seq[len(prompt) :], sp, cfg.eos_token_id)
        seq.append(int(np.argmax(x)))
        if seq[-1] in _stops(sp, cfg.eos_token_id):
            break
    return seq[len(prompt) :]


def test_generate_greedy_matches_stepwise_reference(params):
    rng = np.random.RandomState(2)
    # Prompts from a small id range and a random model that repeats itself: penalties bite.
    prompts = [rng.randint(0, 20, k).tolist() for k in (5, 17, 9)]
    sps = [
        ji.SamplingParams(temperature=0, max_tokens=14, repetition_penalty=1.8),
        ji.SamplingParams(temperature=0, max_tokens=14, frequency_penalty=1.5, logit_bias={7: 3}),
        ji.SamplingParams(temperature=0, max_tokens=14),  # unpenalized beside penalized rows
    ]
    outs = ji.generate(CFG, params, prompts, sps)
    plain = ji.generate(CFG, params, prompts, ji.SamplingParams(temperature=0, max_tokens=14))
    for p, sp, o in zip(prompts, sps, outs):
        assert o.token_ids == _stepwise(params, p, sp, 14)
    assert outs[2].token_ids == plain[2].token_ids
    assert outs[0].token_ids != plain[0].token_ids  # the penalty changed something
    # A strong presence penalty forbids repeats among the first tokens of a long output.
    sp = ji.SamplingParams(temperature=0, max_tokens=12, presence_penalty=2.0,
                           logit_bias={t: -100 for t in range(V) if t % 3})  # fmt: skip
    out = ji.generate(CFG, params, [prompts[0]], sp)[0].token_ids
    assert len(set(out)) == len(out) and all(t % 3 == 0 for t in out)


def test_generate_sampled_penalties_are_batch_invariant(params):
    rng = np.random.RandomState(3)
    prompts = [rng.randint(0, 20, k).tolist() for k in (4, 11, 23, 6)]
    sp = ji.SamplingParams(temperature=0.9, top_p=0.95, max_tokens=10, seed=5,
                           repetition_penalty=1.4, presence_penalty=0.5)  # fmt: skip
    batch = ji.generate(CFG, params, prompts, sp)
    for i in (0, 2):
        assert ji.generate(CFG, params, [prompts[i]], sp)[0].token_ids == batch[i].token_ids
    unpenalized = ji.generate(CFG, params, prompts, ji.SamplingParams(temperature=0.9,
                              top_p=0.95, max_tokens=10, seed=5))  # fmt: skip
    assert [o.token_ids for o in batch] != [o.token_ids for o in unpenalized]


def test_generate_min_tokens_holds_back_every_stop_token(params):
    """Eos and a second token biased to win every argmax: without min_tokens the output is eos
    at once; with it, exactly min_tokens other tokens come first, then the stop."""
    cfg = CFG.replace(eos_token_id=3)
    prompt = [5, 1, 9, 3, 12]
    base = dict(temperature=0, max_tokens=12, logit_bias={3: 100.0, 7: 90.0})
    sps = [
        ji.SamplingParams(**base),
        ji.SamplingParams(**base, min_tokens=5),
        ji.SamplingParams(**base, min_tokens=5, stop_token_ids=(7,)),
        ji.SamplingParams(**base, min_tokens=5, ignore_eos=True),  # eos is no stop: not barred
        ji.SamplingParams(**base, min_tokens=12),
    ]
    outs = ji.generate(cfg, params, [prompt] * len(sps), sps)
    want = [[3], [7] * 5 + [3], None, [3] * 12, [7] * 12]
    reasons = ["stop", "stop", "stop", "length", "length"]
    for sp, o, w, why in zip(sps, outs, want, reasons):
        assert o.token_ids == _stepwise(params, prompt, sp, 12, cfg), sp
        assert (w is None or o.token_ids == w) and o.finish_reason == why, (sp, o)
    third = outs[2].token_ids
    assert len(third) == 6 and third[-1] == 3 and not {3, 7} & set(third[:5])


def test_generate_allowed_token_ids(params):
    rng = np.random.RandomState(5)
    prompts = [rng.randint(0, 20, k).tolist() for k in (6, 13)]
    allowed = tuple(range(0, V, 5))
    sp = ji.SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=allowed,
                           repetition_penalty=1.3)  # fmt: skip
    outs = ji.generate(CFG, params, prompts, sp)
    plain = ji.generate(CFG, params, prompts, ji.SamplingParams(temperature=0, max_tokens=12))
    for p, o, q in zip(prompts, outs, plain):
        assert o.token_ids == _stepwise(params, p, sp, 12)
        assert set(o.token_ids) <= set(allowed) and not set(q.token_ids) <= set(allowed)
    # Sampled at a high temperature: only the three allowed ids ever come out, all of them.
    sps = [ji.SamplingParams(temperature=2.0, max_tokens=8, seed=s, allowed_token_ids=(1, 4, 9))
           for s in range(12)]  # fmt: skip
    got = {t for o in ji.generate(CFG, params, [prompts[0]] * 12, sps) for t in o.token_ids}
    assert got == {1, 4, 9}


def _contains(seq, w) -> bool:
    return any(tuple(seq[i : i + len(w)]) == w for i in range(len(seq) - len(w) + 1))


def test_generate_bad_words(params):
    """Greedy against the step-by-step reference: the model repeats itself (8, 95, 8, 8, ...),
    so bans of repeats fire again and again; a ban whose prefix is the prompt's last token
    does not fire (the output only), the one inside the output does; an unbanned row in the
    batch decodes as without bans."""
    rng = np.random.RandomState(6)
    prompts = [rng.randint(0, 20, k).tolist() for k in (7, 12, 5)]
    plain = ji.generate(CFG, params, prompts, ji.SamplingParams(temperature=0, max_tokens=14))
    assert [o.token_ids[:4] for o in plain] == [[8, 95, 8, 95], [110, 107, 46, 47],
                                                [14, 115, 115, 115]]  # fmt: skip
    assert prompts[1][-1] == 2
    bans = [
        [(8, 8), (95, 8, 95), (8, 95, 8, 95)],
        [(2, 110), (110, 107, 46), (47, 47), (47, 3, 47)],
        [],
    ]
    sps = [ji.SamplingParams(temperature=0, max_tokens=14, bad_words_ids=b) for b in bans]
    outs = ji.generate(CFG, params, prompts, sps)
    for p, sp, o in zip(prompts, sps, outs):
        assert o.token_ids == _stepwise(params, p, sp, 14)
        assert not any(_contains(o.token_ids, w) for w in sp.bad_words_ids), o.token_ids
    assert outs[0].token_ids[:3] == [8, 95, 8] and outs[0].token_ids[3] != 95
    assert outs[1].token_ids[:2] == [110, 107] and outs[1].token_ids[2] != 46  # (2, 110): off
    assert outs[2].token_ids == plain[2].token_ids
    # Sampled (three seeds): with 127 of the 128 tokens banned as repeats and the remaining one
    # outright, never the same token twice in a row and never token 0; without, repeats.
    ws = [(0,)] + [(t, t) for t in range(1, V)]
    sps = [ji.SamplingParams(temperature=0.3, max_tokens=14, seed=s, bad_words_ids=b)
           for b in (ws, ()) for s in range(3)]  # fmt: skip
    outs = [o.token_ids for o in ji.generate(CFG, params, [prompts[2]] * 6, sps)]
    assert not any(0 in o or _contains(o, (t, t)) for o in outs[:3] for t in range(V))
    assert all(any(a == b for a, b in zip(o, o[1:])) for o in outs[3:])


def test_transformers_penalties_and_masks():
    """Greedy with transformers' RepetitionPenaltyLogitsProcessor, single-token SequenceBias,
    MinNewTokensLengthLogitsProcessor, PrefixConstrainedLogitsProcessor and
    NoBadWordsLogitsProcessor on the shipped draft model, real text: the same tokens as
    ji.generate.

    transformers matches a ban's prefix against prompt and output, vLLM (and jaxinfer) against
    the output only: they differ only where the prefix straddles the prompt's end, so the bans
    here have first tokens that are not among the prompt's last len(w) - 1 (asserted)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from jaxinfer import data

    path = models.path("draft")
    cfg, p = ji.load_checkpoint(path, dtype=jnp.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    text = data.load_split("test")[1]
    prompt = data.tokenize_documents(data.load_tokenizer(), [text])[:48].tolist()
    plain = ji.generate(cfg, p, [prompt], ji.SamplingParams(temperature=0, max_tokens=32))
    bias = {plain[0].token_ids[3]: -8.0, 100: 4.0}
    stop = plain[0].token_ids[5]  # biased to win at once, held back by min_new_tokens
    even = list(range(0, cfg.vocab_size, 2))
    o = plain[0].token_ids
    # The first ban fires at position 1; the two- and three-token ones at 5 and 4 (the output
    # is plain greedy's until then).
    bad = [[(o[1],), (o[2], 100, 7)], [(o[4], o[5])], [(o[2], o[3], o[4])]]
    for ws in bad:
        assert all(w[0] not in prompt[len(prompt) - len(w) + 1 :] for w in ws if len(w) > 1), ws
    cases = [
        (ji.SamplingParams(temperature=0, max_tokens=32, repetition_penalty=1.5),
         {"repetition_penalty": 1.5}),
        (ji.SamplingParams(temperature=0, max_tokens=32, logit_bias=bias),
         {"sequence_bias": {(t,): b for t, b in bias.items()}}),
        (ji.SamplingParams(temperature=0, max_tokens=32, min_tokens=6, stop_token_ids=(stop,),
                           ignore_eos=True, logit_bias={stop: 30.0}),
         {"eos_token_id": stop, "min_new_tokens": 6, "sequence_bias": {(stop,): 30.0}}),
        (ji.SamplingParams(temperature=0, max_tokens=32, allowed_token_ids=even),
         {"prefix_allowed_tokens_fn": lambda batch, ids: even}),
        *[(ji.SamplingParams(temperature=0, max_tokens=32, bad_words_ids=ws),
           {"bad_words_ids": [list(w) for w in ws]}) for ws in bad],
    ]  # fmt: skip
    for sp, kw in cases:
        ours = ji.generate(cfg, p, [prompt], sp)[0].token_ids
        with torch.no_grad():  # the explicit mask: pad id 0 is also bos, which is no padding
            out = hf.generate(torch.tensor([prompt]), **{
                "attention_mask": torch.ones(1, len(prompt), dtype=torch.long),
                "do_sample": False, "max_new_tokens": 32, "min_new_tokens": 32,
                "eos_token_id": None, "pad_token_id": 0, **kw,
            })  # fmt: skip
        assert ours == out[0, len(prompt) :].tolist(), kw
        assert ours != plain[0].token_ids, kw  # each setting changes this greedy output


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(repetition_penalty=True), "repetition_penalty"),
        (dict(logit_bias={1: 101}), "logit_bias"),
        (dict(logit_bias={-2: 1}), "logit_bias"),
        (dict(logit_bias={"5": 1}), "logit_bias"),
        (dict(logit_bias=[(1, 1.0), (1, 2.0)]), "logit_bias"),
        (dict(logit_bias="7"), "logit_bias"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(min_tokens=1.5), "min_tokens"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=[3, -1]), "allowed_token_ids"),
        (dict(allowed_token_ids=5), "allowed_token_ids"),
        (dict(allowed_token_ids="ab"), "allowed_token_ids"),
        (dict(bad_words_ids=5), "bad_words_ids"),
        (dict(bad_words_ids=[5, 6]), "bad_words_ids"),  # a sequence of ids, not of sequences
        (dict(bad_words_ids=[[1], []]), "bad_words_ids"),
        (dict(bad_words_ids=[[1, -2]]), "bad_words_ids"),
        (dict(bad_words_ids=[[True]]), "bad_words_ids"),
        (dict(bad_words_ids=[[1.0]]), "bad_words_ids"),
        (dict(bad_words_ids=["ab"]), "bad_words_ids"),
        (dict(bad_words_ids="ab"), "bad_words_ids"),
        (dict(bad_words_ids=[[2**31]]), "bad_words_ids"),
        (dict(bad_words_ids={1: 2}), "bad_words_ids"),
        (dict(bad_words_ids=[[1]] * 257), "bad_words_ids"),  # MAX_BAD_WORDS
        (dict(bad_words_ids=[[1] * 33]), "bad_words_ids"),  # MAX_BAD_WORD_LEN
    ],
)
def test_bad_penalties_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        ji.SamplingParams(**kwargs)


def test_logit_bias_outside_the_vocabulary_is_refused(params):
    sp = ji.SamplingParams(logit_bias={V: 1.0})
    with pytest.raises(ValueError, match=rf"logit_bias has token id {V}, outside"):
        ji.generate(CFG, params, [[1, 2]], sp)
    # Stored sorted, whatever the input order: equal settings hash equal (compile caches).
    a = ji.SamplingParams(logit_bias={5: 1.0, 2: -1.0})
    assert a == ji.SamplingParams(logit_bias=[(2, -1), (5, 1)]) and a.penalized
    assert a.logit_bias == ((2, -1.0), (5, 1.0)) and not ji.SamplingParams().penalized


def test_masks_outside_the_model_are_refused(params):
    cfg = CFG.replace(eos_token_id=3)
    with pytest.raises(ValueError, match=rf"allowed_token_ids has token id {V}, outside"):
        ji.generate(cfg, params, [[1, 2]], ji.SamplingParams(allowed_token_ids=(1, V)))
    # min_tokens with nothing but stop tokens allowed could sample nothing: refused by name.
    for sp in (
        ji.SamplingParams(min_tokens=1, allowed_token_ids=(3,)),
        ji.SamplingParams(min_tokens=2, allowed_token_ids=(3, 7), stop_token_ids=(7,)),
    ):
        with pytest.raises(ValueError, match=r"allowed_token_ids .* are all stop tokens"):
            ji.generate(cfg, params, [[1, 2]], sp)
    ok = ji.SamplingParams(min_tokens=2, max_tokens=3, allowed_token_ids=(3,), ignore_eos=True)
    assert ji.generate(cfg, params, [[1, 2]], ok)[0].token_ids == [3, 3, 3]
    # Stored sorted and deduplicated; either mask turns the history on.
    a = ji.SamplingParams(allowed_token_ids=[9, 2, 9])
    assert a.allowed_token_ids == (2, 9) and a.penalized
    assert ji.SamplingParams(min_tokens=1).penalized


def test_bad_words_outside_the_model_are_refused(params):
    cfg = CFG.replace(eos_token_id=3)
    with pytest.raises(ValueError, match=rf"bad_words_ids has token id {V}, outside"):
        ji.generate(cfg, params, [[1, 2]], ji.SamplingParams(bad_words_ids=[(1,), (4, V, 2)]))
    # One-token bans of every allowed token, or of every token, leave nothing to sample.
    for sp in (
        ji.SamplingParams(allowed_token_ids=(5, 6), bad_words_ids=[(6,), (5,), (1, 7)]),
        ji.SamplingParams(bad_words_ids=[(t,) for t in range(V)]),
    ):
        with pytest.raises(ValueError, match=r"bad_words_ids \[\[.*\]\] ban every"):
            ji.generate(cfg, params, [[1, 2]], sp)
    # Before min_tokens, the stop tokens are barred too: bans of all the rest are refused.
    for sp in (
        ji.SamplingParams(min_tokens=1, allowed_token_ids=(3, 6), bad_words_ids=[(6,)]),
        ji.SamplingParams(min_tokens=1, bad_words_ids=[(t,) for t in range(V) if t != 3]),
    ):
        with pytest.raises(ValueError, match=r"bad_words_ids ban every token that is not a stop"):
            ji.generate(cfg, params, [[1, 2]], sp)
    # Multi-token bans of every allowed token are accepted (they depend on the output), and
    # so are bans that leave one token.
    ok = [
        ji.SamplingParams(max_tokens=3, allowed_token_ids=(5, 6), bad_words_ids=[(6,), (1, 5)]),
        ji.SamplingParams(max_tokens=3, temperature=0, bad_words_ids=[(t,) for t in range(1, V)]),
    ]
    outs = ji.generate(cfg, params, [[1, 2]] * 2, ok)
    assert outs[0].token_ids == [5, 5, 5] and outs[1].token_ids == [0, 0, 0]
    # Stored as tuples in order, from lists or arrays; None is no bans.
    a = ji.SamplingParams(bad_words_ids=np.array([[4, 2], [1, 3]]))
    assert a.bad_words_ids == ((4, 2), (1, 3)) and a.penalized
    assert a == ji.SamplingParams(bad_words_ids=[[4, 2], (1, 3)])
    assert ji.SamplingParams(bad_words_ids=None).bad_words_ids == ()
