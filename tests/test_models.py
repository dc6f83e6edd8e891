"""Tests for the shipped models (jaxinfer/assets/models): they load in transformers and in
jaxinfer, agree on real text, ship the package tokenizer, and `jaxinfer.models` finds them."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import data, models
from jaxinfer.checkpoint import load_checkpoint
from jaxinfer.scoring import score

SHIPPED = ("draft", "target")  # the embedded default models the experiments rely on
LOGIT_ATOL = 1e-4  # float32 on both sides; the models are small, so errors stay ~1e-6
MAX_BYTES = 25 * 2**20  # all shipped models together
NUM_TOKENS = 192  # real text from the test split


@pytest.fixture(scope="module")
def test_text() -> str:
    return data.load_split("test")[0]


@pytest.fixture(scope="module")
def tokens(test_text) -> np.ndarray:
    ids = data.tokenize_documents(data.load_tokenizer(), [test_text])  # bos ... eos
    assert ids.shape[0] > NUM_TOKENS
    return ids[None, :NUM_TOKENS].astype(np.int32)  # [1, S]


def test_both_default_models_are_shipped():
    assert set(SHIPPED) <= set(models.names())
    total = sum(
        os.path.getsize(os.path.join(models.path(n), f))
        for n in models.asset_names()
        for f in os.listdir(models.path(n))
    )
    assert total <= MAX_BYTES, f"shipped models take {total / 2**20:.1f} MiB"


def test_names_and_path():
    names = models.names()
    assert names == sorted(names)
    assert set(models.asset_names()) <= set(names)
    assert set(models.asset_names("model")) | set(models.asset_names("head")) == set(
        models.asset_names()
    )
    for name in models.asset_names("model"):
        assert os.path.isfile(os.path.join(models.path(name), "config.json"))
    for name in models.asset_names("head"):
        assert os.path.isfile(os.path.join(models.path(name), "head_config.json"))
    with pytest.raises(ValueError, match="asset kind 'weights'"):
        models.asset_names("weights")
    with pytest.raises(ValueError, match="unknown model 'nope'.*shipped models"):
        models.path("nope")


@pytest.mark.parametrize("name", SHIPPED)
def test_model_dir_contents(name):
    path = models.path(name)
    for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert os.path.isfile(os.path.join(path, f)), f
    for f in ("train_config.json", "loss_curve.jsonl", "loss_curve.png"):
        assert os.path.isfile(os.path.join(path, f)), f
    cfg, _ = load_checkpoint(path)
    assert (cfg.bos_token_id, cfg.eos_token_id) == (data.BOS_ID, data.EOS_ID)
    assert cfg.hidden_size % 128 == 0 and cfg.intermediate_size % 128 == 0
    assert cfg.num_kv_heads < cfg.num_heads  # GQA / MQA
    with open(os.path.join(path, "generation_config.json")) as f:
        gen = json.load(f)
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (data.BOS_ID, data.EOS_ID)
    with open(os.path.join(path, "tokenizer.json")) as f, open(data.TOKENIZER_PATH) as g:
        assert json.load(f) == json.load(g)  # exactly the package tokenizer


@pytest.mark.parametrize("name", SHIPPED)
def test_transformers_logits_match_jaxinfer(name, tokens):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    path = models.path(name)
    cfg, params = load_checkpoint(path, dtype=jnp.float32)
    ours = np.asarray(score(cfg, params, tokens))  # [1, S, V]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.from_numpy(tokens).long()).logits.numpy()  # [1, S, V]
    assert theirs.shape == ours.shape == (1, NUM_TOKENS, cfg.vocab_size)
    np.testing.assert_allclose(ours, theirs, atol=LOGIT_ATOL, rtol=0)
    # A trained model, not a random one: it predicts real code far better than uniform.
    log_p = ours[0, :-1] - np.log(np.exp(ours[0, :-1]).sum(-1, keepdims=True))
    nll = -np.mean(np.take_along_axis(log_p, tokens[0, 1:, None], -1))
    assert nll < 0.7 * np.log(cfg.vocab_size)


@pytest.mark.parametrize("name", SHIPPED)
def test_transformers_tokenizer_matches(name, test_text):
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(models.path(name), "tokenizer.json")
    )
    ours = data.load_tokenizer()
    text = test_text[:4000]
    want = ours.encode(text, add_special_tokens=False).ids
    assert hf_tok.encode(text, add_special_tokens=False) == want
    assert hf_tok.decode(want) == text
    assert hf_tok.convert_tokens_to_ids(list(data.SPECIAL_TOKENS)) == [
        data.BOS_ID,
        data.EOS_ID,
        data.PAD_ID,
    ]
