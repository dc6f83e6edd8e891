"""The engine's n > 1 forks draft with their own noise (`speculative.noise.make_pick`)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer.sampling import SamplingBatch
from jaxinfer.speculative.noise import make_pick

V, ROWS = 64, 8


@pytest.mark.parametrize("acceptance", ["rejection", "coupled"])
def test_forks_draft_their_own_noise(acceptance):
    # ROWS identical rows (same seed, position, logits); only the sample index differs.
    sb = SamplingBatch.from_params([ji.SamplingParams(temperature=1.0, seed=5)] * ROWS)
    cur = jnp.full(ROWS, 9, jnp.int32)
    logits = jnp.zeros((ROWS, V))  # uniform: every token equally likely

    def tokens(index):
        return np.asarray(make_pick(sb, cur, acceptance, index)(logits, 1)[0])

    base = np.asarray(make_pick(sb, cur, acceptance)(logits, 1)[0])
    assert len(set(base.tolist())) == 1  # shared noise: every row drafts the same token
    assert (tokens(jnp.zeros(ROWS, jnp.int32)) == base).all()  # index 0 is sample 0's noise
    forks = tokens(jnp.arange(ROWS, dtype=jnp.int32))
    assert forks[0] == base[0]
    # Under shared noise all 8 agree; with their own, 8 uniform draws over 64 tokens repeat
    # one value 8 times with probability 64^-7.
    assert len(set(forks.tolist())) > 1
