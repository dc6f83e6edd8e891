"""ji.score: the dense forward's logits for token rows, and its input checks."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from tests.helpers import random_params

CFG = ji.preset("tiny-llama")


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, seed=11)


def test_matches_forward_dense(params):
    tokens = np.random.RandomState(0).randint(0, CFG.vocab_size, (2, 9))
    got = np.asarray(ji.score(CFG, params, tokens.tolist()))
    want = np.asarray(ji.forward_dense(params, CFG, jnp.asarray(tokens)))
    assert got.shape == (2, 9, CFG.vocab_size)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "tokens, match",
    [
        ([[1, 2, 3], [4]], r"rectangular \[B, S\] array; got rows of lengths \[1, 3\]"),
        ([1, 2, 3], r"non-empty \[B, S\] int array, got \(3,\)"),
        ([[]], r"non-empty \[B, S\] int array, got \(1, 0\)"),
        ([[1.0, 2.0]], r"int array"),
        ([[1, CFG.vocab_size]], f"token id {CFG.vocab_size} outside the vocabulary"),
        ([[-2, 1]], "token id -2 outside the vocabulary"),
        ([[1] * (CFG.max_position_embeddings + 1)], "exceeds max_position_embeddings"),
    ],
)
def test_bad_input_raises(params, tokens, match):
    with pytest.raises(ValueError, match=match):
        ji.score(CFG, params, tokens)
