"""What `ji.generate` computes besides the tokens: decode iterations, prefill padding, the layout.

The bugs these guard against cost time, not correctness: a loop that runs to the `max_new` bucket
after every sequence reached its max_tokens, prompts padded to twice their length, and the
decode-loop weight layout copied at every call.
"""

import gc
import importlib

import jax
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer.model import params as params_mod
from jaxinfer.model.params import cpu_layout, inference_layout, lm_head, remembered_loop_layout
from tests.helpers import random_params

generate_mod = importlib.import_module("jaxinfer.generate")
CFG = ji.preset("tiny-llama").replace(eos_token_id=None)


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, seed=3)


@pytest.fixture
def spy(monkeypatch):
    """Records the decode-iteration count `_generate_core` returns."""
    seen = []
    core = generate_mod._generate_core

    def wrapped(*args, **kwargs):
        out = core(*args, **kwargs)
        seen.append(int(out[-1]))
        return out

    monkeypatch.setattr(generate_mod, "_generate_core", wrapped)
    return seen


@pytest.mark.parametrize("max_tokens", [[1], [9], [3, 9], [5, 2, 7]])
def test_the_loop_stops_when_every_sequence_reached_max_tokens(params, spy, max_tokens):
    sps = [ji.SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    prompts = [[1 + i, 2, 3] for i in range(len(sps))]
    outs = ji.generate(CFG, params, prompts, sps)
    assert [len(o.token_ids) for o in outs] == max_tokens
    # The prefill samples the first token; each loop iteration one more, so the loop runs
    # max(max_tokens) - 1 times (the counter starts at 1), not up to the max_new bucket (8, 16).
    assert spy == [max(max_tokens)]


def test_the_loop_stops_at_stop_tokens_too(params, spy):
    free = ji.generate(CFG, params, [[4, 5, 6]], ji.SamplingParams(temperature=0, max_tokens=12))
    stop = free[0].token_ids[3]
    sp = ji.SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop])
    out = ji.generate(CFG, params, [[4, 5, 6]], sp)[0]
    assert out.token_ids == free[0].token_ids[: free[0].token_ids.index(stop) + 1]
    assert spy[-1] == len(out.token_ids)


@pytest.mark.parametrize(
    "n, want", [(1, 16), (16, 16), (17, 32), (100, 128), (128, 128), (129, 144), (200, 208),
                (256, 256), (257, 288), (1000, 1024), (1025, 1152)],
)  # fmt: skip
def test_prompt_bucket_values(n, want):
    assert generate_mod.prompt_bucket(n) == want


def test_prompt_bucket_bounds_padding_and_honours_the_minimum():
    sizes = [generate_mod.prompt_bucket(n) for n in range(1, 5000)]
    assert all(s >= n for n, s in enumerate(sizes, 1))
    assert all(s <= max(16, 1.125 * n) or s <= 128 for n, s in enumerate(sizes, 1))
    assert sorted(sizes) == sizes  # monotone: a longer prompt never gets a smaller program
    assert len(set(sizes[128:1024])) == 8 * 3  # 8 sizes an octave from 129 to 1024
    assert generate_mod.prompt_bucket(200, minimum=512) == 512
    assert generate_mod.prompt_bucket(200, minimum=300) >= 300


@pytest.mark.parametrize(
    "lens, max_tokens, want_m, want_prefill",
    [([200], 64, 32, 16), ([20, 30], 5, 4, 4), ([200] * 8, 64, 32, 32), ([3], 300, 32, 1)],
)  # fmt: skip
def test_the_prefill_tables_stop_at_the_blocks_its_rows_can_reach(
    params, lens, max_tokens, want_m, want_prefill
):
    """The decode tables hold the capacity (prompt + max_tokens); the prefill's only the blocks
    that T padded rows can reach, the same prefix of each sequence's blocks, so one 200-token
    prompt of a 264-token capacity reads 16 blocks in its prefill, not 32. Greedy tokens equal
    the step-by-step argmax either way (test_generate), checked here against the full table."""
    from jaxinfer.requests import prompt_batch

    prompts = [[1 + i % 50] * n for i, n in enumerate(lens)]
    sp = [ji.SamplingParams(temperature=0, max_tokens=max_tokens)] * len(lens)
    batch = prompt_batch(prompts, sp, 16, capacity=max(lens) + max_tokens)
    got = np.asarray(batch.meta.block_tables)
    assert batch.tables.shape[1] == want_m and got.shape[1] == want_prefill
    assert (got[: len(lens)] == batch.tables[: len(lens), :want_prefill]).all()
    assert want_prefill * 16 >= max(lens)


def test_a_trimmed_prefill_table_gives_the_full_tables_logits(params):
    """The prefill's logits with its trimmed table equal those with the decode's full table."""
    from jaxinfer.cache.metadata import SeqChunk, build_metadata
    from jaxinfer.model.decoder import forward
    from jaxinfer.requests import prompt_batch

    prompts = [[7] * 40, [9] * 13]
    sp = [ji.SamplingParams(temperature=0, max_tokens=200)] * 2
    batch = prompt_batch(prompts, sp, 16, capacity=240)
    assert batch.meta.block_tables.shape[1] < batch.tables.shape[1]
    chunks = [SeqChunk(p, 0, batch.tables[i]) for i, p in enumerate(prompts)]
    full, _ = build_metadata(
        chunks, 16, num_tokens=batch.meta.tokens.shape[0], num_seqs=2,
        max_blocks=batch.tables.shape[1], num_logits=2,
    )  # fmt: skip

    def on_device(meta):
        return ji.BatchMetadata(*(jax.numpy.asarray(x) for x in meta.__dict__.values()))

    nb = 1 + batch.tables.size
    a, _ = forward(params, CFG, on_device(batch.meta), ji.init_cache(CFG, nb, 16))
    b, _ = forward(params, CFG, on_device(full), ji.init_cache(CFG, nb, 16))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_remembered_layout_is_made_once_and_equals_cpu_layout():
    p = random_params(CFG, seed=5)
    a = remembered_loop_layout(p, "cpu")
    assert remembered_loop_layout(p, "cpu") is a  # the same arrays: no second copy
    ref = cpu_layout(p)
    assert jax.tree.structure(a) == jax.tree.structure(ref)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert remembered_loop_layout(a, "cpu") is a  # already laid out: passed through
    other = random_params(CFG, seed=6)
    b = remembered_loop_layout(other, "cpu")
    assert b is not a
    np.testing.assert_array_equal(np.asarray(b["lm_head"].dense()), np.asarray(lm_head(other)))
    assert len(b["layers"]) == CFG.num_layers
    # A copy of the dict with one leaf replaced is another model: never served the old layout.
    changed = dict(other, final_norm=other["final_norm"] * 2)
    c = remembered_loop_layout(changed, "cpu")
    np.testing.assert_array_equal(np.asarray(c["final_norm"]), np.asarray(changed["final_norm"]))
    del p, a, b, c, other, changed
    gc.collect()
    assert params_mod._REMEMBERED == []  # released with the stored params


def test_generate_reuses_the_layout_and_matches_the_stored_params(params):
    sp = ji.SamplingParams(temperature=0, max_tokens=6)
    prompts = [[1, 2, 3], [7] * 20]
    want = ji.generate(CFG, inference_layout(params), prompts, sp)  # laid out again from there
    got = ji.generate(CFG, params, prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert params_mod._REMEMBERED[0][2] is remembered_loop_layout(params, "cpu")
