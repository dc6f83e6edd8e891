"""The serving workloads (`jaxinfer.engine.workload.make_requests`): random ids or text windows."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jaxinfer.engine.workload import WORKLOADS, make_requests


def _is_window(stream: np.ndarray, piece: list[int]) -> bool:
    k = len(piece)
    windows = np.lib.stride_tricks.sliding_window_view(stream, k)
    return bool((windows == np.asarray(piece)).all(axis=1).any())


@pytest.mark.parametrize("name", WORKLOADS)
def test_text_prompts_are_windows_with_the_random_lengths(name):
    max_len, vocab = 128, 500
    stream = np.random.default_rng(1).integers(0, vocab, 3000)
    rand = make_requests(name, 16, max_len, vocab, 2.0, seed=3)
    text = make_requests(name, 16, max_len, vocab, 2.0, seed=3, text=stream)
    assert [len(r.prompt) for r in text] == [len(r.prompt) for r in rand]
    assert [(r.arrival, r.max_tokens) for r in text] == [(r.arrival, r.max_tokens) for r in rand]
    shared = max_len // 4 if name == "shared_prefix" else 0
    for r in text:
        assert r.prompt[:shared] == stream[:shared].tolist()  # the shared system prompt
        assert _is_window(stream, r.prompt[shared:])  # the rest: one contiguous window
    assert len({tuple(r.prompt) for r in text}) == len(text)  # seeded offsets differ


def test_random_prompts_unchanged_by_the_text_option():
    """Random workloads stay those of earlier runs (first ids of seed 0, recorded before)."""
    r = make_requests("sharegpt", 5, 128, 4096, 2.0, 0)
    assert [len(x.prompt) for x in r] == [42, 57, 96, 42, 28]
    assert r[0].prompt[:5] == [2446, 2219, 4063, 1225, 2271]
    assert make_requests("sharegpt", 3, 128, 4096, math.inf, 0)[2].arrival == 0.0


def test_bad_text_is_refused_by_name():
    with pytest.raises(ValueError, match=r"text: expected a 1-D stream of >= 2 \* max_len = 256"):
        make_requests("sharegpt", 2, 128, 500, 1.0, 0, text=np.arange(100))
    with pytest.raises(ValueError, match=r"text: ids must be in \[0, 500\), got \[0, 999\]"):
        make_requests("sharegpt", 2, 128, 500, 1.0, 0, text=np.arange(1000))
    with pytest.raises(ValueError, match="text: expected a 1-D stream"):
        make_requests("sharegpt", 2, 128, 500, 1.0, 0, text=np.zeros((2, 400), np.int32))
