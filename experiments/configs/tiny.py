"""A tiny config for tests and smoke runs: compiles and trains in seconds on one CPU core."""

from __future__ import annotations

from jaxinfer.config import ModelConfig
from jaxinfer.data import BOS_ID, DEFAULT_VOCAB_SIZE, EOS_ID
from jaxinfer.train import TrainConfig

MODEL = ModelConfig(
    vocab_size=DEFAULT_VOCAB_SIZE,  # the real tokenizer, so tiny runs use the real data path
    hidden_size=32,  # tiny: tests check mechanics, not quality
    num_layers=2,  # 2, so the layer scan and stacking are exercised
    num_heads=2,
    num_kv_heads=1,  # GQA grouping exercised
    head_dim=16,
    intermediate_size=64,
    max_position_embeddings=64,
    tie_word_embeddings=True,
    dtype="float32",
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)


def get_config() -> TrainConfig:
    return TrainConfig(
        name="tiny",
        model=MODEL,
        seq_len=32,
        batch_size=4,
        steps=20,
        peak_lr=1e-2,  # high, so the loss visibly drops within 20 steps
        warmup_steps=4,
        min_lr_ratio=0.1,
        weight_decay=0.1,
        seed=0,
        log_every=2,
        eval_every=10,
        val_tokens=512,
        eval_batch_size=4,
        checkpoint_every=5,
        keep_checkpoints=2,
    )
