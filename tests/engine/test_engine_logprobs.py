"""`SamplingParams.logprobs` in the engine: the sampled token's log-probability and the top-k,
against a dense scoring pass of the same tokens."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer.engine import Engine, EngineConfig
from tests.helpers import random_params

CFG = ji.preset("tiny-llama").replace(eos_token_id=None)
ECFG = EngineConfig(
    block_size=4, num_blocks=33, max_num_seqs=4, max_num_batched_tokens=64, backend="reference",
    min_block_bucket=16, min_seq_bucket=4,
)  # fmt: skip


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, seed=3)


def _stream(engine, prompts, sps):
    for i, (p, sp) in enumerate(zip(prompts, sps)):
        engine.add_request(p, sp, request_id=i)
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault((o.request_id, o.sample_index), []).append(o)
    return outs


def test_logprobs_match_scoring_and_only_where_asked(params):
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, CFG.vocab_size, n).tolist() for n in (5, 9, 3)]
    sps = [
        ji.SamplingParams(temperature=0, max_tokens=6, logprobs=3),
        ji.SamplingParams(temperature=0.9, max_tokens=6, seed=4, logprobs=0, n=2),
        ji.SamplingParams(temperature=0, max_tokens=6),  # no logprobs in the same batches
    ]
    outs = _stream(Engine(CFG, params, ECFG), prompts, sps)
    for (rid, _), group in outs.items():
        ids = [t for o in group for t in o.new_token_ids]
        lps = [e for o in group for e in (o.logprobs or [])]
        if sps[rid].logprobs is None:
            assert not lps
            continue
        assert len(lps) == len(ids)
        seq = prompts[rid] + ids
        logits = ji.score(CFG, params, np.asarray([seq], np.int32))[0]
        want = np.asarray(jax.nn.log_softmax(logits, -1))  # [S, V]
        P = len(prompts[rid])
        for k, (tok, (lp, top)) in enumerate(zip(ids, lps)):
            row = want[P - 1 + k]
            np.testing.assert_allclose(lp, row[tok], atol=1e-4)
            assert len(top) == sps[rid].logprobs
            np.testing.assert_allclose(
                [v for _, v in top], np.sort(row)[::-1][: len(top)], atol=1e-4
            )
            assert [t for t, _ in top] == list(np.argsort(-row)[: len(top)])


def test_logprobs_do_not_change_the_tokens(params):
    prompt = list(range(3, 12))
    sp = ji.SamplingParams(temperature=0.8, max_tokens=8, seed=9)
    plain = Engine(CFG, params, ECFG).generate([prompt], sp)[0].token_ids
    outs = _stream(Engine(CFG, params, ECFG), [prompt], [ji.SamplingParams(
        temperature=0.8, max_tokens=8, seed=9, logprobs=2)])  # fmt: skip
    assert [t for o in outs[(0, 0)] for t in o.new_token_ids] == plain


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_invalid_logprobs(bad):
    with pytest.raises(ValueError, match="logprobs"):
        ji.SamplingParams(logprobs=bad)
