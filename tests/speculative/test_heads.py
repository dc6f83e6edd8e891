"""Learned drafter heads (Medusa, EAGLE-style, EAGLE with a draft vocabulary) in the speculative
loop: greedy and coupled token identity with plain `ji.generate`, the chi-square test of
rejection sampling against the target's distribution (with a negative control against the head's
own q), the EAGLE paged step against its dense training form, save / load, and refusal of a head
trained for another target.

Heads are random (exactness holds for any drafter); the target and prompts are test_loop's, so
the plain-generation references are shared.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer.sampling import SamplingBatch, process_logits
from jaxinfer.speculative import heads, loop
from jaxinfer.speculative.drafters import catch_up_batch, ngram_lookup, prefer_ngram
from tests.speculative.test_loop import (
    CFG,
    PROMPTS,
    SAMPLED,
    _chi2_pvalue,
    _declared,
    _greedy_requests,
    _target,
)

KINDS = ("medusa", "eagle", "eagle-vocab")
DRAFT_VOCAB = 48  # of the tiny model's vocabulary
FUSED = (0, 1)  # EAGLE-3's fused features: both layers of the tiny target


@functools.cache
def _head(kind: str) -> heads.Head:
    key = jax.random.key(5)
    if kind == "medusa":
        hc = heads.head_config_for(CFG, "medusa", num_medusa_heads=4)
        return heads.Head(hc, heads.init_medusa(hc, key, std=1.0))  # q far from p
    extra = {"draft_vocab_size": DRAFT_VOCAB} if kind == "eagle-vocab" else {}
    if kind == "eagle-fused":
        extra = {"feature_layers": FUSED}
    hc = heads.head_config_for(CFG, "eagle", intermediate_size=48, **extra)
    hp = heads.init_eagle(hc, key, std=0.2)
    if kind == "eagle-vocab":
        hp["vocab_ids"] = jnp.asarray(
            np.random.RandomState(0).permutation(CFG.vocab_size)[:DRAFT_VOCAB], jnp.int32
        )
    return heads.Head(hc, hp)


@functools.cache
def _spec(kind, acceptance, temperature):
    sps = _greedy_requests()[0] if temperature == 0 else SAMPLED
    return ji.speculative.generate(
        _target(), _head(kind), PROMPTS, sps, gamma=3, acceptance=acceptance
    )


def _features(rp, hcfg, tp, tokens):
    """What the head reads at each position of `tokens [B, S]`: `[B, S, E]` (fused or last)."""
    _, hidden = ji.model.decoder.forward_dense(tp, CFG, tokens, return_hidden=hcfg.return_hidden)
    return heads.fuse_features(rp, hcfg, hidden)


@pytest.mark.parametrize("kind", [*KINDS, "eagle-fused"])
def test_greedy_equals_plain_generate(kind):
    _, ref, _ = _greedy_requests()
    outs = _spec(kind, "rejection", 0)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert [o.finish_reason for o in outs] == [r.finish_reason for r in ref]
    for o in outs:
        assert o.num_proposed == 3 * o.num_cycles
        assert sum(o.accepted_histogram) == o.num_cycles


@pytest.mark.parametrize("kind", [*KINDS, "eagle-fused"])
def test_coupled_sampling_equals_plain_generate(kind):
    ref = ji.generate(CFG, _target()[1], PROMPTS, SAMPLED)
    outs = _spec(kind, "coupled", 0.8)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]


def _head_q(kind, seq, sp):
    """The head's q `[V]` for its first draft after `seq` (dense: features of the prefix)."""
    cfg, tp = _target()
    head = _head(kind)
    rp = heads.pair(head, cfg, tp)
    _, hidden = ji.model.decoder.forward_dense(tp, cfg, jnp.asarray([seq]), return_hidden=True)
    if kind == "medusa":  # head 0 drafts the token after seq from the feature of seq[-2]
        logits = heads.medusa_logits(rp, head.cfg, hidden[0, -2], 1)[0]
    else:  # row t reads (token t, feature t-1) and drafts token t+1
        prev = jnp.concatenate([jnp.zeros_like(hidden[:, :1]), hidden[:, :-1]], axis=1)
        feat = heads.eagle_dense(rp, head.cfg, jnp.asarray([seq]), prev)[0, -1]
        logits = heads.feature_logits(rp, head.cfg, feat)
    x = process_logits(logits[None], SamplingBatch.from_params([sp]))
    return np.asarray(jax.nn.softmax(x, axis=-1), np.float64)[0]


@pytest.mark.parametrize("kind", KINDS)
def test_rejection_sampling_follows_the_target_distribution(kind):
    """The first cycle's first token over 128 seeds, given the prefill's token, against the exact
    target distribution (chi-square, significance 1e-3); negative control: the same counts are
    rejected against the head's own q, which the draft was sampled from."""
    n = 128
    sps = [ji.SamplingParams(temperature=1.0, top_k=3, max_tokens=2, seed=s) for s in range(n)]
    prompt = PROMPTS[0]
    outs = ji.speculative.generate(_target(), _head(kind), [prompt] * n, sps, gamma=3)
    first = np.array([o.token_ids[0] for o in outs])
    second = np.array([o.token_ids[1] for o in outs])
    a = np.bincount(first).argmax()
    counts = np.bincount(second[first == a], minlength=CFG.vocab_size)
    assert counts.sum() >= 40
    seq = prompt + [int(a)]
    p = _declared(CFG, _target()[1], seq, sps[0])
    assert _chi2_pvalue(counts, p) > 1e-3
    q = _head_q(kind, seq, sps[0])
    assert _chi2_pvalue(counts, q) < 1e-3
    if kind == "eagle-vocab":  # q lives on the draft vocabulary only
        outside = np.setdiff1d(
            np.arange(CFG.vocab_size), np.asarray(_head(kind).params["vocab_ids"])
        )
        assert np.all(q[outside] == 0)


# ------------------------------------------------------------------ hybrid: `ngram_first`


def _hybrid(kind, first):
    return dataclasses.replace(_head(kind), ngram_first=first)


@pytest.mark.parametrize("kind, first", [("eagle", 1), ("medusa", 2)])
def test_hybrid_greedy_and_coupled_equal_plain_generate(kind, first):
    _, ref, _ = _greedy_requests()
    sps = _greedy_requests()[0]
    outs = ji.speculative.generate(_target(), _hybrid(kind, first), PROMPTS, sps, gamma=3)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert [o.finish_reason for o in outs] == [r.finish_reason for r in ref]
    ref = ji.generate(CFG, _target()[1], PROMPTS, SAMPLED)
    outs = ji.speculative.generate(
        _target(), _hybrid(kind, first), PROMPTS, SAMPLED, gamma=3, acceptance="coupled"
    )
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]


def test_hybrid_draft_phase_takes_the_ngram_rows():
    """One draft phase after the prefill: rows whose last token recurs (a prompt that holds the
    whole vocabulary) hold `ngram_lookup`'s proposal and a one-hot q; the other row (7 tokens,
    which the first generated token is not among) holds exactly the head's drafts and q."""
    rng = np.random.RandomState(3)
    every = [rng.permutation(CFG.vocab_size).tolist() for _ in range(2)]
    prompts = [every[0], [1, 2, 3, 4, 5, 6, 7], every[1] + every[1][:3]]
    sp = ji.SamplingParams(temperature=0, max_tokens=4)

    def draft(head):
        prep = loop.prepare_run(_target(), head, prompts, sp, 3, "rejection", 16, "auto", 3)
        state = loop.prefill_run(prep)
        _, tokens, q = loop.draft_phase(prep.tparams, prep.dparams, state, prep.inputs,
                                        plan=prep.plan)  # fmt: skip
        return state, np.asarray(tokens), np.asarray(q)

    state, mine, q_mine = draft(_head("eagle"))
    _, tokens, q = draft(_hybrid("eagle", 1))
    ngram, length = ngram_lookup(state.hist, state.cur, gamma=3, max_n=3)
    use = np.asarray(length) >= 1
    assert use[: len(prompts)].tolist() == [True, False, True]
    np.testing.assert_array_equal(tokens[use], np.asarray(ngram)[use])
    np.testing.assert_array_equal(q[use], np.eye(CFG.vocab_size)[np.asarray(ngram)[use]])
    np.testing.assert_array_equal(tokens[~use], mine[~use])
    np.testing.assert_array_equal(q[~use], q_mine[~use])


@pytest.mark.parametrize("kind, first", [("eagle", 2), ("medusa", 1)])
def test_hybrid_skips_the_head_without_changing_a_draft(kind, first):
    """Cycles where every live row takes the n-gram's do not run the head (EAGLE only catches its
    cache up): cycle by cycle, the loop's draft phase equals the head drafting every cycle and
    `prefer_ngram` after it (tokens and q of every live row), in cycles of both kinds and in
    head cycles that follow skipped ones, whose drafts read the rows the catch-up wrote."""
    sp = ji.SamplingParams(temperature=0, max_tokens=40)
    prep = loop.prepare_run(_target(), _hybrid(kind, first), PROMPTS, sp, 3, "rejection", 16,
                            "auto", 3)  # fmt: skip
    every_cycle = dataclasses.replace(prep.plan, ngram_first=0)  # the head drafts every cycle
    a = b = loop.prefill_run(prep)
    skipped = []
    while not np.all(np.asarray(a.done)):
        live = ~np.asarray(a.done)
        _, length = ngram_lookup(a.hist, a.cur, gamma=3, max_n=3)
        skipped.append(bool(np.all(np.asarray(length)[live] >= first)))
        a2, ta, qa = loop.draft_phase(prep.tparams, prep.dparams, a, prep.inputs, plan=prep.plan)
        b2, tb, qb = loop.draft_phase(prep.tparams, prep.dparams, b, prep.inputs,
                                      plan=every_cycle)  # fmt: skip
        tb, qb, _ = prefer_ngram(tb, qb, b.hist, b.cur, max_n=3, min_match=first)
        np.testing.assert_array_equal(np.asarray(ta)[live], np.asarray(tb)[live])
        np.testing.assert_array_equal(np.asarray(qa)[live], np.asarray(qb)[live])
        a, _ = loop.verify_phase(
            prep.tparams, prep.dparams, ta, qa, a2, prep.inputs, plan=prep.plan
        )
        b, _ = loop.verify_phase(
            prep.tparams, prep.dparams, tb, qb, b2, prep.inputs, plan=prep.plan
        )
    assert (True, False) in set(zip(skipped, skipped[1:])), skipped  # a head cycle after a skip


@pytest.mark.parametrize("kind", ["eagle", "eagle-vocab", "eagle-fused"])
def test_eagle_paged_catch_up_matches_dense(kind):
    """The draft's first step (prefill of the prompt, catch-up of 3 committed positions with real
    features) gives the dense training form's logits at the last position."""
    cfg, tp = _target()
    head = _head(kind)
    rp = heads.pair(head, cfg, tp)
    seq = PROMPTS[1][:20]
    hidden = _features(rp, head.cfg, tp, jnp.asarray([seq]))
    prev = jnp.concatenate([jnp.zeros_like(hidden[:, :1]), hidden[:, :-1]], axis=1)
    want = heads.feature_logits(
        rp, head.cfg, heads.eagle_dense(rp, head.cfg, jnp.asarray([seq]), prev)
    )
    # Paged: rows 0..16 as the prefill writes them, then the catch-up of rows 17..19.
    bs, c = 8, 32
    tables = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
    feats = jnp.zeros((1, c, cfg.hidden_size)).at[0, :20].set(hidden[0])
    hist = jnp.zeros((1, c), jnp.int32).at[0, :20].set(jnp.asarray(seq))
    cache = ji.cache.paged.init_cache(head.cfg.layer_config, 5, bs)
    pre = catch_up_batch(hist, jnp.asarray([16]), jnp.asarray([0]), tables, bs, width=17)
    seqs = jnp.zeros(pre.tokens.shape[0], jnp.int32)
    _, cache = heads.eagle_paged(
        rp,
        head.cfg,
        pre,
        cache,
        heads.eagle.previous_features(feats, seqs, pre.positions),
        "reference",
    )
    batch = catch_up_batch(hist, jnp.asarray([19]), jnp.asarray([17]), tables, bs, width=4)
    zeros = jnp.zeros(batch.tokens.shape[0], jnp.int32)
    prevs = heads.eagle.previous_features(feats, zeros, batch.positions)
    out, _ = heads.eagle_paged(rp, head.cfg, batch, cache, prevs, "reference")
    got = heads.feature_logits(rp, head.cfg, out[batch.logits_indices])[0]
    live = np.isfinite(np.asarray(want[0, 19]))
    np.testing.assert_allclose(np.asarray(got)[live], np.asarray(want[0, 19])[live], atol=1e-4)
    assert np.array_equal(np.isfinite(np.asarray(got)), live)


@pytest.mark.parametrize("kind", ["eagle", "eagle-fused"])
def test_eagle_chain_matches_a_drafting_cycle(kind):
    """`eagle_dense_chain` (the training form of a cycle) gives, at step k and position c + k,
    the logits drafting gives at its k-th draft after a catch-up ending at c, when every draft
    is the real next token; feeding `eagle_dense` its own predictions (the context rows
    predicted too) does not."""
    cfg, tp = _target()
    head = _head(kind)
    rp = heads.pair(head, cfg, tp)
    seq = PROMPTS[1][:24]
    gamma, c, bs, cap = 4, 17, 8, 32
    toks = jnp.asarray([seq])
    hidden = _features(rp, head.cfg, tp, toks)
    prev = jnp.concatenate([jnp.zeros_like(hidden[:, :1]), hidden[:, :-1]], axis=1)
    chain = heads.eagle.eagle_dense_chain(rp, head.cfg, toks, prev, gamma)
    np.testing.assert_allclose(  # step 0 is the plain training form
        chain[0], heads.eagle_dense(rp, head.cfg, toks, prev), atol=1e-5
    )
    # Drafting: rows 0..c-3 written first, then a cycle whose catch-up writes c-2..c.
    tables = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
    feats = jnp.zeros((1, cap, cfg.hidden_size)).at[0, :c].set(hidden[0, :c])
    hist = jnp.zeros((1, cap), jnp.int32).at[0, : c + 1].set(toks[0, : c + 1])
    cache = ji.cache.paged.init_cache(head.cfg.layer_config, 5, bs)
    pre = catch_up_batch(hist, jnp.asarray([c - 3]), jnp.asarray([0]), tables, bs, width=c - 2)
    zeros = jnp.zeros(pre.tokens.shape[0], jnp.int32)
    prevs = heads.eagle.previous_features(feats, zeros, pre.positions)
    _, cache = heads.eagle_paged(rp, head.cfg, pre, cache, prevs, "reference")
    real = toks[0]

    def pick(logits, j):  # the real next token, and the logits as "q"
        return real[c + 1 + j][None], logits

    _, drafted, logits = heads.draft_eagle(
        rp, head.cfg, cache, feats, hist, jnp.asarray([c]), jnp.asarray([c - 2]), tables, pick,
        gamma=gamma, block_size=bs, backend="reference",
    )  # fmt: skip
    assert np.array_equal(np.asarray(drafted[0]), np.asarray(real[c + 1 : c + 1 + gamma]))
    naive, fed = [], prev
    for _ in range(gamma):  # the old unrolled form: every row fed the last step's prediction
        out = heads.eagle_dense(rp, head.cfg, toks, fed)
        naive.append(out)
        fed = jnp.concatenate([jnp.zeros_like(out[:, :1]), out[:, :-1]], axis=1)
    for k in range(gamma):
        want = heads.feature_logits(rp, head.cfg, chain[k][0, c + k])
        np.testing.assert_allclose(np.asarray(logits[0, k]), np.asarray(want), atol=1e-4)
        old = heads.feature_logits(rp, head.cfg, naive[k][0, c + k])
        gap = np.abs(np.asarray(old) - np.asarray(logits[0, k])).max()
        assert (gap < 1e-4) == (k == 0), (k, gap)


def test_the_loop_stores_the_features_the_head_reads():
    """After the prefill and after every verification, the loop's feature store holds at each
    committed position what the head reads there: EAGLE-3's fused features of the committed
    text (`fuse_features` of the named layers' outputs), as training computes them."""
    cfg, tp = _target()
    head = _head("eagle-fused")
    sp = ji.SamplingParams(temperature=0, max_tokens=24)
    prep = loop.prepare_run(_target(), head, PROMPTS, sp, 3, "rejection", 16, "auto", 3)
    state = loop.prefill_run(prep)
    for _ in range(5):
        cur, hist = np.asarray(state.cur), np.asarray(state.hist)
        for b in range(len(PROMPTS)):  # positions below cur hold committed tokens
            want = _features(prep.dparams, head.cfg, tp, jnp.asarray(hist[b : b + 1, : cur[b]]))
            got = np.asarray(state.dcache.feats[b, : cur[b]])
            np.testing.assert_allclose(got, np.asarray(want[0]), atol=1e-4, rtol=0)
        state, t, q = loop.draft_phase(prep.tparams, prep.dparams, state, prep.inputs,
                                       plan=prep.plan)  # fmt: skip
        state, _ = loop.verify_phase(prep.tparams, prep.dparams, t, q, state, prep.inputs,
                                     plan=prep.plan)  # fmt: skip
    n = len(PROMPTS)  # every cycle committed >= 1 token a sequence
    assert np.all(np.asarray(state.cur)[:n] >= np.asarray(prep.prompt_lens)[:n] + 5)


def test_fused_feature_heads_are_checked():
    """feature_layers: increasing layers ending with the target's last, EAGLE only, params that
    match, and a saved head loads back with them (a tuple: the config stays hashable)."""
    for bad, match in [((1, 0), "increasing"), ((1,), "2\\+ increasing"), ((0, 0, 1), "increasing"),
                       ((-1, 1), ">= 0"), ((0, 2), "must end with the target's last layer \\(1\\)"),
                       (("0", 1), "increasing")]:  # fmt: skip
        with pytest.raises(ValueError, match=f"feature_layers=.*{match}"):
            heads.head_config_for(CFG, "eagle", feature_layers=bad)
    with pytest.raises(ValueError, match="feature_layers is for eagle heads, not 'medusa'"):
        heads.head_config_for(CFG, "medusa", feature_layers=FUSED)
    fused, plain = _head("eagle-fused"), _head("eagle")
    with pytest.raises(ValueError, match="fuse has shape None, expected \\(128, 64\\)"):
        ji.speculative.generate(_target(), heads.Head(fused.cfg, plain.params), PROMPTS[:1])
    with pytest.raises(ValueError, match="hold fuse but HeadConfig.feature_layers is None"):
        ji.speculative.generate(_target(), heads.Head(plain.cfg, fused.params), PROMPTS[:1])


def test_fused_head_save_load_round_trip(tmp_path):
    head = _head("eagle-fused")
    heads.save_head(tmp_path / "h", head)
    back = heads.load_head(tmp_path / "h", CFG)
    assert back.cfg == head.cfg and back.cfg.feature_layers == FUSED and hash(back.cfg)
    assert jax.tree.structure(back.params) == jax.tree.structure(head.params)
    for a, b in zip(jax.tree.leaves(head.params), jax.tree.leaves(back.params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_save_load_round_trip(tmp_path):
    head = _head("eagle-vocab")
    heads.save_head(tmp_path / "h", head)
    back = heads.load_head(tmp_path / "h", CFG)
    assert back.cfg == head.cfg
    for a, b in zip(jax.tree.leaves(head.params), jax.tree.leaves(back.params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
        assert np.asarray(a).dtype == np.asarray(b).dtype


def test_save_in_float16_loads_as_float32(tmp_path):
    head = _head("eagle-vocab")
    heads.save_head(tmp_path / "h", head, dtype=np.float16)
    back = heads.load_head(tmp_path / "h", CFG)
    pairs = list(zip(jax.tree.leaves(head.params), jax.tree.leaves(back.params)))
    for a, b in pairs:
        a, b = np.asarray(a), np.asarray(b)
        if np.issubdtype(a.dtype, np.floating):  # rounded through float16, returned as float32
            assert b.dtype == np.float32
            assert np.array_equal(b, a.astype(np.float16).astype(np.float32))
        else:  # the draft vocabulary's ids stay exact
            assert b.dtype == a.dtype and np.array_equal(a, b)
    assert any(not np.issubdtype(np.asarray(a).dtype, np.floating) for a, _ in pairs)


@pytest.mark.parametrize(
    "change, field",
    [({"hidden_size": 48, "num_heads": 3, "num_kv_heads": 1}, "hidden_size"),
     ({"vocab_size": 100}, "vocab_size"),
     ({"num_layers": 5}, "num_layers")],
)  # fmt: skip
@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_head_for_another_target_is_refused(tmp_path, kind, change, field):
    other = CFG.replace(**change)
    hc = heads.head_config_for(other, kind)
    init = heads.init_medusa if kind == "medusa" else heads.init_eagle
    head = heads.Head(hc, init(hc, jax.random.key(0)))
    with pytest.raises(ValueError, match=f"trained for another target.*{field}"):
        ji.speculative.generate(_target(), head, PROMPTS[:1], _greedy_requests()[0][0], gamma=2)
    heads.save_head(tmp_path / kind, head)
    with pytest.raises(ValueError, match=field):
        heads.load_head(tmp_path / kind, CFG)


def test_bad_head_input_raises():
    with pytest.raises(ValueError, match="num_medusa_heads=4"):
        ji.speculative.generate(_target(), _head("medusa"), PROMPTS[:1], gamma=5)
    with pytest.raises(ValueError, match="kind='tree'"):
        heads.head_config_for(CFG, "tree")
    with pytest.raises(ValueError, match="draft_vocab_size"):
        heads.head_config_for(CFG, "eagle", draft_vocab_size=CFG.vocab_size + 1)
    hc = heads.head_config_for(CFG, "eagle", draft_vocab_size=8)
    with pytest.raises(ValueError, match="ngram_first=3 exceeds ngram_max=2"):
        ji.speculative.generate(_target(), _hybrid("eagle", 3), PROMPTS[:1], gamma=2, ngram_max=2)
    with pytest.raises(ValueError, match="Head.ngram_first must be an int >= 0, got True"):
        heads.Head(_head("eagle").cfg, _head("eagle").params, ngram_first=True)
    bad = heads.Head(hc, heads.init_eagle(hc, jax.random.key(0)))  # no vocab_ids
    with pytest.raises(ValueError, match="vocab_ids"):
        ji.speculative.generate(_target(), bad, PROMPTS[:1], gamma=2)


@pytest.mark.parametrize("fmt", ["w8a16", "q8_0"])
def test_draft_vocabulary_of_a_narrow_target_head(fmt):
    """A target whose LM head is quantized (int8 per channel, or GGUF's grouped Q8_0) in the CPU
    layout: the draft vocabulary's head gives the logits of the dequantized head's columns (the
    int8 rows keep their scales)."""
    cfg, tp = _target()
    head = _head("eagle-vocab")
    ids = np.asarray(head.params["vocab_ids"])
    w = jnp.asarray(np.random.RandomState(3).randn(cfg.hidden_size, cfg.vocab_size), jnp.float32)
    if fmt == "w8a16":
        qw = ji.quant.rtn.quantize_int8(w)
    else:
        q = jnp.clip(jnp.round(w * 20), -127, 127).astype(jnp.int8)
        s = jnp.full((cfg.hidden_size // 32, cfg.vocab_size), 0.05, jnp.float32)
        qw = ji.qtensor.Int8Weight(q, s, False, tuple(w.shape), 32)
    dense = np.asarray(ji.qtensor.dequantize(qw, jnp.float32))
    laid = ji.model.params.cpu_layout(dict(ji.inference_layout(tp), lm_head=qw))
    assert not isinstance(laid["lm_head"], jax.Array)  # int8 rows or column blocks
    rp = heads.pair(head, cfg, laid)
    x = jnp.asarray(np.random.RandomState(4).randn(2, cfg.hidden_size), jnp.float32)
    want = np.asarray(x) @ dense[:, ids]
    np.testing.assert_allclose(np.asarray(ji.ops.linear(x, rp["lm_w"])), want, rtol=1e-5, atol=1e-4)
