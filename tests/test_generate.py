"""Generation: batch invariance, stop conditions, bucketing (compile counts), bad input."""

import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer.generate import DecodeState, _generate_core
from tests.helpers import poison_logits, random_params

CFG = ji.preset("tiny-llama").replace(eos_token_id=None)


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, seed=7)


def _prompts(n, seed=0, lo=1, hi=40):
    rng = np.random.RandomState(seed)
    return [rng.randint(0, CFG.vocab_size, rng.randint(lo, hi)).tolist() for _ in range(n)]


@pytest.mark.parametrize(
    "sp",
    [
        ji.SamplingParams(temperature=0, max_tokens=12),
        ji.SamplingParams(temperature=0.9, top_k=20, top_p=0.9, max_tokens=12, seed=11),
    ],
    ids=["greedy", "sampled"],
)
def test_batch_invariance(params, sp):
    prompts = _prompts(8, seed=1)
    target = prompts[3]
    alone = ji.generate(CFG, params, [target], sp)[0].token_ids
    order = np.random.RandomState(2).permutation(8)
    batch = ji.generate(CFG, params, [prompts[i] for i in order], sp)
    inside = batch[int(np.where(order == 3)[0][0])].token_ids
    assert alone == inside
    assert len(alone) == 12


def test_sampling_depends_on_seed_only(params):
    prompt = _prompts(1, seed=4)[0]
    a = ji.generate(CFG, params, [prompt], ji.SamplingParams(temperature=1.0, max_tokens=16))
    b = ji.generate(CFG, params, [prompt], ji.SamplingParams(temperature=1.0, max_tokens=16))
    c = ji.generate(
        CFG, params, [prompt], ji.SamplingParams(temperature=1.0, max_tokens=16, seed=1)
    )
    assert a[0].token_ids == b[0].token_ids
    assert a[0].token_ids != c[0].token_ids


def test_greedy_matches_stepwise_argmax(params):
    """The while_loop decode equals re-scoring the growing sequence with the dense forward."""
    prompt = _prompts(1, seed=5)[0]
    out = ji.generate(CFG, params, [prompt], ji.SamplingParams(temperature=0, max_tokens=10))
    seq = list(prompt)
    for _ in range(10):
        seq.append(int(np.argmax(np.asarray(ji.score(CFG, params, [seq]))[0, -1])))
    assert out[0].token_ids == seq[len(prompt) :]


def test_per_request_max_tokens_and_stop_tokens(params):
    prompts = _prompts(3, seed=6)
    greedy = ji.generate(CFG, params, prompts, ji.SamplingParams(temperature=0, max_tokens=20))
    stop_tok = greedy[1].token_ids[4]
    first_hit = greedy[1].token_ids.index(stop_tok)
    sps = [
        ji.SamplingParams(temperature=0, max_tokens=3),
        ji.SamplingParams(temperature=0, max_tokens=20, stop_token_ids=(stop_tok,)),
        ji.SamplingParams(temperature=0, max_tokens=20),
    ]
    outs = ji.generate(CFG, params, prompts, sps)
    assert outs[0].token_ids == greedy[0].token_ids[:3] and outs[0].finish_reason == "length"
    assert outs[1].token_ids == greedy[1].token_ids[: first_hit + 1]
    assert outs[1].finish_reason == "stop"
    assert outs[2].token_ids == greedy[2].token_ids


def test_eos_from_config_stops_unless_ignored(params):
    prompt = _prompts(1, seed=8)[0]
    free = ji.generate(CFG, params, [prompt], ji.SamplingParams(temperature=0, max_tokens=12))
    eos = free[0].token_ids[2]
    cfg = CFG.replace(eos_token_id=eos)
    stopped = ji.generate(cfg, params, [prompt], ji.SamplingParams(temperature=0, max_tokens=12))
    assert stopped[0].token_ids == free[0].token_ids[: free[0].token_ids.index(eos) + 1]
    ignored = ji.generate(
        cfg, params, [prompt], ji.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    assert ignored[0].token_ids == free[0].token_ids


def test_prompt_lengths_within_a_bucket_do_not_recompile(params):
    sp = ji.SamplingParams(temperature=0, max_tokens=5)
    ji.generate(CFG, params, [[1] * 20, [2] * 30], sp)  # 50 tokens -> T bucket 64, B 2
    before = _generate_core._cache_size()
    ji.generate(CFG, params, [[3] * 25, [4] * 33], sp)  # 58 tokens: same buckets
    ji.generate(CFG, params, [[5] * 17, [6] * 40], sp)
    assert _generate_core._cache_size() == before
    ji.generate(CFG, params, [[7] * 3, [8] * 4, [9] * 5], sp)  # B 3 -> bucket 4: new program
    assert _generate_core._cache_size() == before + 1


@pytest.mark.parametrize(
    "prompts, sp, match",
    [
        ([], None, "non-empty"),
        ([[1, 2], []], None, "prompt 1 is empty"),
        ([[1, 2, 128]], None, "token id 128 outside the vocabulary"),
        ([[1, -1]], None, "token id -1 outside the vocabulary"),
        ([[1] * 250], ji.SamplingParams(max_tokens=10), "exceeds max_position_embeddings 256"),
        ([[1], [2]], [ji.SamplingParams()], "1 SamplingParams for 2 prompts"),
        ([[1]], ji.SamplingParams(n=2), "n=2"),
        ("hello", None, "non-empty list"),
    ],
)
def test_bad_input_raises(params, prompts, sp, match):
    with pytest.raises(ValueError, match=match):
        ji.generate(CFG, params, prompts, sp)


@pytest.mark.parametrize("block_size", [0, -16, True, 2.5, "16"])
def test_bad_block_size_raises(params, block_size):
    with pytest.raises(ValueError, match=f"block_size={block_size!r} is invalid"):
        ji.generate(CFG, params, [[1, 2]], ji.SamplingParams(max_tokens=2), block_size=block_size)


def test_pad_to_fixes_shapes_across_batches(params):
    sp = ji.SamplingParams(temperature=0, max_tokens=6)
    pad = {"seqs": 4, "blocks": 4, "new_tokens": 16, "tokens": 64}
    ref = ji.generate(CFG, params, [[1, 2, 3]], sp)
    out = ji.generate(CFG, params, [[1, 2, 3]], sp, pad_to=pad)
    assert out[0].token_ids == ref[0].token_ids
    before = _generate_core._cache_size()
    ji.generate(CFG, params, [[4] * 9, [5] * 20, [6]], sp, pad_to=pad)
    ji.generate(CFG, params, [[7] * 30, [8] * 2], sp, pad_to=pad)
    # numpy and jax ints are ints (issue 15 cause 3): the same shapes, no new compilation.
    mixed = {k: (np.int64(v) if k == "seqs" else jnp.int32(v)) for k, v in pad.items()}
    ji.generate(CFG, params, [[7] * 30, [8] * 2], sp, pad_to=mixed)
    assert _generate_core._cache_size() == before
    with pytest.raises(ValueError, match="unknown keys"):
        ji.generate(CFG, params, [[1]], sp, pad_to={"batch": 4})
    for bad in (0, -4, 2.5, True, np.bool_(True), jnp.float32(4)):
        with pytest.raises(ValueError, match=re.escape(f"pad_to['seqs']={bad!r} is invalid")):
            ji.generate(CFG, params, [[1]], sp, pad_to={"seqs": bad})


def test_stop_id_beyond_the_vocabulary_is_refused(params):
    """Issue 15 cause 2: a stop id the model can never emit is a mistake, named."""
    sp = ji.SamplingParams(max_tokens=2, stop_token_ids=(3, CFG.vocab_size))
    with pytest.raises(ValueError, match=rf"stop_token_ids.*{CFG.vocab_size}.*vocabulary"):
        ji.generate(CFG, params, [[1, 2]], sp)


def test_jax_and_numpy_prompts_are_accepted(params):
    """Issue 15 cause 3: a jax.Array prompt works like a numpy array or a list."""
    import jax.numpy as jnp

    sp = ji.SamplingParams(temperature=0, max_tokens=3)
    want = ji.generate(CFG, params, [[5, 6, 7]], sp)[0].token_ids
    for p in (np.array([5, 6, 7]), jnp.array([5, 6, 7], jnp.int32), (5, 6, 7)):
        assert ji.generate(CFG, params, [p], sp)[0].token_ids == want
    with pytest.raises(ValueError, match="prompt 0"):
        ji.generate(CFG, params, [jnp.array([5.0, 6.0])], sp)


def _expected_with_poison(prompt, ref, mark):
    """ref's tokens up to the first one fed to the model that is `mark` (then an error)."""
    fed = [prompt[-1]] + ref.token_ids[:-1]  # the last token of each step's input
    for k, t in enumerate(fed):
        if t == mark:
            return ref.token_ids[:k], "error"
    return ref.token_ids, ref.finish_reason


def test_non_finite_logits_end_that_sequence_with_an_error(params, monkeypatch):
    """Issue 15 cause 6 (sampling half): a NaN / Inf row of logits is an error output for that
    sequence, not token 0 "length" forever; the batch's other sequences are unaffected."""
    gen = importlib.import_module("jaxinfer.generate")  # the attribute is the function

    static = dict(static_argnames=("cfg", "max_new", "block_size", "backend", "platform"))
    sp = ji.SamplingParams(temperature=0, max_tokens=6)
    prompts = [[5, 6, 7], [9, 10, 99], [11, 12]]
    want = ji.generate(CFG, params, prompts, sp)
    assert all(o.error is None for o in want)
    # At the prefill: the prompt of sequence 1 ends with 99.
    poison_logits(gen, "_generate_core", static, monkeypatch, 99, float("nan"))
    got = ji.generate(CFG, params, prompts, sp)
    assert (got[1].token_ids, got[1].finish_reason) == ([], "error")
    assert "non-finite logits" in got[1].error and "position 3" in got[1].error
    assert got[0] == want[0] and got[2] == want[2]
    # Mid-decode: once a sequence feeds a generated `mark` back, it stops there.
    mark = want[0].token_ids[2]
    poison_logits(gen, "_generate_core", static, monkeypatch, mark, float("inf"))
    got = ji.generate(CFG, params, prompts, sp)
    for p, g, w in zip(prompts, got, want):
        assert (g.token_ids, g.finish_reason) == _expected_with_poison(p, w, mark)
        assert (g.error is not None) == (g.finish_reason == "error")
    assert got[0].finish_reason == "error" and len(got[0].token_ids) <= 3


def test_decode_state_is_a_pytree_of_the_loops_arrays():
    """`DecodeState` (the while_loop carry) flattens to the cache's arrays, then one leaf per
    array field in order, and rebuilds from them; `step` is data, not static."""
    cfg = ji.preset("tiny-llama")
    cache = ji.init_cache(cfg, 3, 4)
    b, max_new = 2, 8
    fields = dict(
        last=jnp.array([3, 4], jnp.int32),
        lens=jnp.array([5, 6], jnp.int32),
        out=jnp.arange(b * max_new, dtype=jnp.int32).reshape(b, max_new),
        n_out=jnp.array([1, 2], jnp.int32),
        done=jnp.array([False, True]),
        stopped=jnp.array([False, True]),
        failed=jnp.array([True, False]),
        step=jnp.int32(7),
    )
    state = DecodeState(cache=cache, **fields)
    leaves, treedef = jax.tree.flatten(state)
    cache_leaves = jax.tree.leaves(cache)
    assert len(leaves) == len(cache_leaves) + len(fields)
    for got, want in zip(leaves, cache_leaves + list(fields.values()), strict=True):
        assert got is want
    doubled = jax.tree.map(lambda x: x * 2 if x.dtype == jnp.int32 else x, state)
    np.testing.assert_array_equal(doubled.lens, [10, 12])
    assert int(doubled.step) == 14
    back = jax.tree.unflatten(treedef, leaves)
    assert isinstance(back, DecodeState) and back.cache.platform == cache.platform
