"""Learned drafter heads (Medusa, EAGLE-style, EAGLE with a draft vocabulary or with EAGLE-3's fused
features) inside the engine (issue 17, on issue 16's engine speculation): greedy and coupled token
identity with plain generation under preemption, prefix caching and chunked prefill; the drafts are
the head's own (each cycle's first draft equals the dense head's argmax over the committed history,
so the engine's feature pool and head cache hold what they should after prefix hits, preemption and
copy-on-write); exact rejection sampling by a chi-square test with a negative control; bad
configurations refused by name.

Heads are random: exactness holds for any drafter, and the first-draft check needs no training.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from experiments.engine_cycles import read_engine_log
from jaxinfer.engine import Engine, EngineConfig, SpeculativeConfig
from jaxinfer.model.decoder import forward_dense
from jaxinfer.speculative import heads
from jaxinfer.speculative.drafters import ngram_lookup
from tests.engine.test_spec_engine import TINY, _ecfg, _prompts, check_rejection_chi_square
from tests.helpers import random_params

KINDS = ("medusa", "eagle", "eagle-vocab")


@functools.cache
def _target():
    return ji.load_checkpoint(ji.models.path("target"))


def _make_head(cfg, kind: str, seed: int = 5, std: float | None = None) -> heads.Head:
    key = jax.random.key(seed)
    if kind == "medusa":
        hc = heads.head_config_for(cfg, "medusa", num_medusa_heads=4)
        return heads.Head(hc, heads.init_medusa(hc, key, std=0.3 if std is None else std))
    n = min(48, cfg.vocab_size // 2)
    extra = {"draft_vocab_size": n} if kind == "eagle-vocab" else {}
    if kind == "eagle-fused":  # EAGLE-3: a middle layer's output and the last one's
        extra = {"feature_layers": (cfg.num_layers // 2, cfg.num_layers - 1)}
    hc = heads.head_config_for(cfg, "eagle", intermediate_size=48, **extra)
    hp = heads.init_eagle(hc, key, std=0.2 if std is None else std)
    if kind == "eagle-vocab":
        perm = np.random.RandomState(0).permutation(cfg.vocab_size)[:n]
        hp["vocab_ids"] = jnp.asarray(perm, jnp.int32)
    return heads.Head(hc, hp)


@functools.cache
def _head(kind: str) -> heads.Head:
    return _make_head(_target()[0], kind)


@functools.cache
def _greedy_ref():
    cfg, params = _target()
    sp = ji.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return sp, [o.token_ids for o in ji.generate(cfg, params, _prompts(cfg), sp)]


def _dense_first_logits(cfg, tparams, head: heads.Head, seq: list[int]) -> np.ndarray:
    """The head's logits `[P, V]` from the dense forms (features of `seq [P]` by
    `forward_dense`): row p is what its first draft in a cycle at cur = p must be the argmax of,
    for every prefix of `seq` at once (both forms are causal)."""
    rp = heads.pair(head, cfg, tparams)
    want = head.cfg.return_hidden
    _, hidden = forward_dense(tparams, cfg, jnp.asarray([seq]), return_hidden=want)
    hidden = heads.fuse_features(rp, head.cfg, hidden)  # [1, P, E]
    if head.cfg.kind == "medusa":  # all drafts from h_{cur−1}; head 0 drafts position cur + 1
        h = jnp.concatenate([jnp.zeros_like(hidden[0, :1]), hidden[0, :-1]])  # row p: h_{p−1}
        logits = heads.medusa_logits(rp, head.cfg, h, 1)[:, 0]
    else:  # row t reads (token t, feature t − 1)
        prev = jnp.concatenate([jnp.zeros_like(hidden[:, :1]), hidden[:, :-1]], axis=1)
        feat = heads.eagle_dense(rp, head.cfg, jnp.asarray([seq]), prev)[0]
        logits = heads.feature_logits(rp, head.cfg, feat)
    return np.asarray(logits, np.float64)


# ------------------------------------------------------------------------------ greedy


@pytest.mark.parametrize(
    "kind, gamma, chunk",
    [
        ("medusa", 3, 7),
        ("eagle", 1, 1),
        ("eagle", 3, 7),
        ("eagle-vocab", 2, 64),
        ("eagle-fused", 2, 7),
    ],  # fmt: skip
)
def test_greedy_equals_generate_and_drafts_are_the_heads(kind, gamma, chunk, tmp_path):
    cfg, params = _target()
    prompts = _prompts(cfg)
    sp, want = _greedy_ref()
    log = str(tmp_path / "cycles.jsonl")
    head = _head(kind)
    spec = SpeculativeConfig(drafter=head, num_speculative_tokens=gamma)
    engine = Engine(cfg, params, _ecfg(spec, chunk, cycle_log=log))
    got = engine.generate(prompts, sp)
    assert [o.token_ids for o in got] == want  # request by request
    assert engine.num_preemptions > 0
    assert engine.allocator.prefix_cache_hits > 0
    engine.allocator.check_invariants()
    assert engine.allocator.num_used_blocks == 0
    # Each drafting cycle's first draft is the head's greedy choice after the committed history.
    checked = _check_first_drafts(log, cfg, params, head, got, prompts)
    assert checked == {True: 0, False: engine.spec_counters.cycles}
    assert engine.spec_counters.cycles > 10


def _check_first_drafts(log, cfg, params, head, outs, prompts, ngram_max=3) -> dict[bool, int]:
    """Asserts that every drafting cycle's first draft in the cycle log is the dense head's
    argmax (within 1e-4 of its max logit) after that sample's committed history, and that the
    histories rebuilt from the log are the outputs; returns the cycles checked by source (True:
    the n-gram's). With a hybrid
    head (`ngram_first`), the log's n-gram rows must instead hold `ngram_lookup`'s proposal
    and a match of at least ngram_first tokens, and the head's rows a shorter one."""
    hist, full, dense = {}, {}, {}
    counts = {True: 0, False: 0}
    for o, p in zip(outs, prompts):
        for j, s in enumerate(o.samples):
            hist[o.request_id, j] = list(p)
            full[o.request_id, j] = list(p) + list(s.token_ids)
    for rec in read_engine_log(log):
        key = rec["request_id"], rec["sample_index"]
        seq = hist[key]
        assert seq == full[key][: len(seq)], (rec["step"], key)  # the log replays the output
        if rec["gamma"] > 0:
            counts[rec["ngram"]] += 1
            if head.ngram_first:  # which source the row took, and the n-gram's proposal
                h = jnp.asarray([seq], jnp.int32)
                tok, n = ngram_lookup(h, jnp.asarray([len(seq) - 1]), gamma=rec["gamma"],
                                      max_n=ngram_max)  # fmt: skip
                assert rec["ngram"] == (int(n[0]) >= head.ngram_first), (rec["step"], int(n[0]))
                if rec["ngram"]:
                    assert rec["proposed"] == np.asarray(tok[0]).tolist(), rec["step"]
                    seq.extend(rec["committed"])
                    continue
            else:
                assert not rec["ngram"]
            if key not in dense:  # one dense pass a sample: every cycle reads a prefix of it
                dense[key] = _dense_first_logits(cfg, params, head, full[key])
            logits = dense[key][len(seq) - 1]
            d = rec["proposed"][0]
            assert logits[d] >= logits.max() - 1e-4, (rec["step"], d, int(logits.argmax()))
        seq.extend(rec["committed"])
    for key, seq in hist.items():
        assert seq == full[key], key
    return counts


@pytest.mark.parametrize("kind, first", [("eagle", 1), ("medusa", 1)])
def test_hybrid_head_is_exact_and_takes_the_ngram_where_the_suffix_recurs(kind, first, tmp_path):
    """`Head.ngram_first`: greedy output equals `ji.generate` under preemption, prefix caching
    and chunking; each cycle's drafts are the n-gram's where the suffix of `first`+ tokens
    recurs, the head's elsewhere, and both sources occur."""
    cfg, params = _target()
    prompts = _prompts(cfg)
    sp, want = _greedy_ref()
    log = str(tmp_path / "cycles.jsonl")
    head = dataclasses.replace(_head(kind), ngram_first=first)
    spec = SpeculativeConfig(drafter=head, num_speculative_tokens=3)
    engine = Engine(cfg, params, _ecfg(spec, 7, cycle_log=log))
    got = engine.generate(prompts, sp)
    assert [o.token_ids for o in got] == want
    assert engine.num_preemptions > 0
    engine.allocator.check_invariants()
    checked = _check_first_drafts(log, cfg, params, head, got, prompts)
    assert sum(checked.values()) == engine.spec_counters.cycles
    assert min(checked.values()) > 0, checked  # both sources drafted
    _check_head_ran(log, both=False)


def _check_head_ran(log: str, both: bool) -> None:
    """The head drafted in exactly the steps where some drafting row did not take the n-gram's
    (`head_ran`); with `both`, steps of each kind occurred."""
    steps = collections.defaultdict(list)
    for rec in read_engine_log(log):
        if rec["gamma"] > 0:
            steps[rec["step"]].append(rec)
    ran = {k: recs[0]["head_ran"] for k, recs in steps.items()}
    assert ran == {k: not all(r["ngram"] for r in recs) for k, recs in steps.items()}
    if both:
        assert set(ran.values()) == {False, True}, ran


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_hybrid_skips_the_head_when_every_row_takes_the_ngram(kind, tmp_path):
    """One request on a prompt that repeats itself: steps in which its row takes the n-gram's
    proposal do not run the head. Output equals `ji.generate`, and every head draft, including
    those right after skipped steps, is still the dense head's argmax after the committed
    history (the pool's rows are rewritten by `_observe`, not by the draft)."""
    cfg, params = _target()
    p = np.random.default_rng(1).integers(3, cfg.vocab_size, 6).tolist()
    prompts = [p + p + p[:3]]
    sp = ji.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    log = str(tmp_path / "cycles.jsonl")
    head = dataclasses.replace(_head(kind), ngram_first=1)
    engine = Engine(cfg, params, _ecfg(SpeculativeConfig(drafter=head, num_speculative_tokens=3),
                                       7, cycle_log=log))  # fmt: skip
    got = engine.generate(prompts, sp)
    assert got[0].token_ids == ji.generate(cfg, params, prompts, sp)[0].token_ids
    _check_first_drafts(log, cfg, params, head, got, prompts)
    _check_head_ran(log, both=True)


def test_n_forks_and_copy_on_write_stay_exact(tmp_path):
    """n = 2 forks share the prompt's blocks (copy-on-write copies the pool's blocks too) and
    each speculates on its own, from its own features."""
    cfg, params = _target()
    prompts = [_prompts(cfg)[1]]  # 13 tokens: the forks share a partly filled last block
    plain = ji.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ref = ji.generate(cfg, params, prompts, plain)[0].token_ids
    log = str(tmp_path / "cycles.jsonl")
    head = _head("eagle")
    spec = SpeculativeConfig(drafter=head, num_speculative_tokens=2)
    engine = Engine(cfg, params, _ecfg(spec, 7, cycle_log=log))
    fork = ji.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=2)
    outs = engine.generate(prompts, fork)
    assert [s.token_ids for s in outs[0].samples] == [ref] * 2
    assert sum(_check_first_drafts(log, cfg, params, head, outs, prompts).values()) > 4


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_coupled_sampling_equals_plain_sampling(kind):
    cfg, params = _target()
    prompts = _prompts(cfg)
    sps = [
        ji.SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=s)
        for s in range(len(prompts))
    ]
    want = [o.token_ids for o in ji.generate(cfg, params, prompts, sps)]
    spec = SpeculativeConfig(drafter=_head(kind), num_speculative_tokens=3, acceptance="coupled")
    engine = Engine(cfg, params, _ecfg(spec, 7))
    assert [o.token_ids for o in engine.generate(prompts, sps)] == want
    assert engine.spec_counters.proposed > 0


# --------------------------------------------------------------------------- rejection


@pytest.mark.parametrize("kind, first", [("medusa", 0), ("eagle", 0), ("eagle", 1)])
def test_rejection_sampling_is_exact_chi_square(kind, first, tmp_path):
    """test_spec_engine's chi-square test with a head on the vocabulary-8 target; with
    `ngram_first=1` the rows whose first token occurs in the prompt draft by n-gram (q one-hot),
    the others by the head, in the same steps."""
    tparams = random_params(TINY, seed=1, std=0.6)
    head = dataclasses.replace(_make_head(TINY, kind, seed=3, std=1.0), ngram_first=first)
    check_rejection_chi_square(tparams, head, tmp_path)
    sources = {r["ngram"] for r in read_engine_log(str(tmp_path / "cycles.jsonl"))}
    assert sources == ({False, True} if first else {False})


# ---------------------------------------------------------------------------- bad input


def test_bad_head_configuration_is_a_value_error():
    cfg, params = _target()
    medusa = _head("medusa")  # K = 4 heads
    with pytest.raises(ValueError, match="max_gamma=5 exceeds the medusa head's num_medusa_heads"):
        SpeculativeConfig(drafter=medusa, num_speculative_tokens=5)
    other = _make_head(cfg.replace(hidden_size=cfg.hidden_size * 2), "eagle")
    with pytest.raises(ValueError, match="hidden_size"):
        Engine(cfg, params, EngineConfig(speculative=SpeculativeConfig(drafter=other)))
    with pytest.raises(ValueError, match="ngram_first=4 exceeds ngram_max=3"):
        SpeculativeConfig(drafter=dataclasses.replace(_head("eagle"), ngram_first=4))
    with pytest.raises(ValueError, match="Head.ngram_first must be an int >= 0, got -1"):
        dataclasses.replace(_head("eagle"), ngram_first=-1)
    bad = heads.Head({"kind": "eagle"}, {})
    with pytest.raises(ValueError, match="HeadConfig"):
        SpeculativeConfig(drafter=bad)
    with pytest.raises(ValueError, match="drafter='head'|expected 'ngram'"):
        SpeculativeConfig(drafter="head")
