"""Tests for jaxinfer.eval against numpy on tiny random models."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jaxinfer import eval as jeval
from jaxinfer.config import ModelConfig
from jaxinfer.scoring import score
from tests.helpers import random_params

CFG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    intermediate_size=64,
    max_position_embeddings=32,
    tie_word_embeddings=True,
)
OTHER = CFG.replace(num_layers=1, intermediate_size=32)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, seed=0, std=0.3)


@pytest.fixture(scope="module")
def windows():
    # 7 windows with batch_size 3 below: the last batch is padded, and the padding must not count.
    return np.random.default_rng(0).integers(0, CFG.vocab_size, size=(7, 17)).astype(np.int32)


@pytest.fixture(scope="module")
def numpy_reference(params, windows):
    logits = np.asarray(score(CFG, params, windows[:, :-1]))  # [N, S, V]
    log_p = _log_softmax(logits)
    targets = windows[:, 1:]
    nll = -np.mean(np.take_along_axis(log_p, targets[..., None], -1))
    acc = np.mean(np.argmax(logits, -1) == targets)
    return nll, acc, log_p


def test_perplexity_matches_numpy(params, windows, numpy_reference):
    nll, _, _ = numpy_reference
    stats = jeval.lm_stats(CFG, params, windows, batch_size=3)
    assert stats.num_tokens == windows.shape[0] * 16
    assert stats.nll == pytest.approx(nll, rel=1e-5)
    assert jeval.perplexity(CFG, params, windows, batch_size=3) == pytest.approx(
        math.exp(nll), rel=1e-5
    )
    # A trained-looking model is not needed: a random one with std 0.3 is far from uniform.
    assert abs(nll - math.log(CFG.vocab_size)) > 0.05


def test_top1_accuracy_matches_numpy(params, windows, numpy_reference):
    _, acc, _ = numpy_reference
    assert jeval.top1_accuracy(CFG, params, windows, batch_size=3) == pytest.approx(acc, abs=1e-12)


def test_stream_input_equals_its_windows(params):
    stream = np.random.default_rng(1).integers(0, CFG.vocab_size, size=100).astype(np.int32)
    from jaxinfer.data import eval_windows

    want = jeval.lm_stats(CFG, params, eval_windows(stream, 16, 90), batch_size=4)
    got = jeval.lm_stats(CFG, params, stream, seq_len=16, max_tokens=90, batch_size=4)
    assert got == want and got.num_tokens == 5 * 16


def test_batch_size_does_not_change_results(params, windows):
    a = jeval.lm_stats(CFG, params, windows, batch_size=7)
    b = jeval.lm_stats(CFG, params, windows, batch_size=2)
    assert a.nll == pytest.approx(b.nll, rel=1e-6) and a.accuracy == b.accuracy


def test_unigram_baseline_by_hand():
    train = np.array([3, 3, 3, 1, 0, 3], np.int32)  # counts: 0:1, 1:1, 2:0, 3:4; N = 6
    vocab = 4
    windows = np.array([[9, 3, 2], [9, 0, 3]], np.int32)  # targets 3, 2, 0, 3; first column unused
    p = {0: 2 / 10, 1: 2 / 10, 2: 1 / 10, 3: 5 / 10}  # (count + 1) / (N + V)
    want_nll = -(math.log(p[3]) * 2 + math.log(p[2]) + math.log(p[0])) / 4
    stats = jeval.unigram_stats(train, windows, vocab)
    assert stats.nll == pytest.approx(want_nll, rel=1e-12)
    assert stats.accuracy == pytest.approx(0.5)  # the most frequent token, 3, is 2 of 4 targets
    assert stats.num_tokens == 4
    np.testing.assert_allclose(
        np.exp(jeval.unigram_log_probs(train, vocab)), [0.2, 0.2, 0.1, 0.5], rtol=1e-12
    )


def test_agreement_with_itself_is_one(params, windows):
    stats = jeval.pair_stats((CFG, params), (CFG, params), windows, batch_size=3)
    assert stats.agreement == 1.0
    assert stats.kl == pytest.approx(0.0, abs=1e-6)


def test_agreement_and_kl_with_another_model_match_numpy(params, windows, numpy_reference):
    _, _, log_p = numpy_reference
    other = random_params(OTHER, seed=3, std=0.3)
    log_q = _log_softmax(np.asarray(score(OTHER, other, windows[:, :-1])))
    want_agree = np.mean(np.argmax(log_p, -1) == np.argmax(log_q, -1))
    want_kl = np.mean(np.sum(np.exp(log_p) * (log_p - log_q), -1))
    stats = jeval.pair_stats((CFG, params), (OTHER, other), windows, batch_size=3)
    assert stats.agreement == pytest.approx(want_agree, abs=1e-12)
    assert stats.agreement < 1.0  # negative control: different models disagree somewhere
    assert stats.kl == pytest.approx(want_kl, rel=1e-4)
    assert jeval.greedy_agreement((CFG, params), (OTHER, other), windows) == stats.agreement


@pytest.mark.parametrize(
    "tokens, match",
    [
        (np.zeros((2, 40), np.int32), "max_position_embeddings"),
        (np.full((2, 5), 64, np.int32), "outside the vocabulary"),
        (np.zeros((2, 1), np.int32), "windows"),
        (np.zeros((2, 5), np.float32), "integer"),
    ],
)
def test_bad_tokens_raise(params, tokens, match):
    with pytest.raises(ValueError, match=match):
        jeval.lm_stats(CFG, params, tokens)


def test_standard_windows_budget():
    w = jeval.standard_windows()
    assert w.shape == ((jeval.EVAL_TOKENS - 1) // jeval.EVAL_SEQ_LEN, jeval.EVAL_SEQ_LEN + 1)
    assert w[0, 0] == 0  # the test stream starts with <|bos|>
    np.testing.assert_array_equal(w[1:, 0], w[:-1, -1])  # consecutive windows share one token
