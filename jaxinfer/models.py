"""The models shipped with the package in `jaxinfer/assets/models/<name>/` (HF directories).

    import jaxinfer as ji
    cfg, params = ji.load_checkpoint(ji.models.path("target"))

"target" is the embedded default model (~3.8 M parameters, Python source), "draft" its distilled
speculative-decoding draft (~0.9 M). Each directory holds config.json, model.safetensors,
tokenizer.json, generation_config.json and the training record (train_config.json,
loss_curve.jsonl, loss_curve.png, results.json); they are built by `experiments/train.py`.
"""

from __future__ import annotations

from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent / "assets" / "models"


def names() -> list[str]:
    """The shipped model names, sorted: folders of `assets/models` that hold a config.json."""
    if not MODELS_DIR.is_dir():
        return []
    return sorted(p.name for p in MODELS_DIR.iterdir() if (p / "config.json").is_file())


def path(name: str) -> str:
    """The HF directory of a shipped model.

    Args:
      name: one of `names()`.

    Returns:
      The directory as a string (loadable by `jaxinfer.load_checkpoint` and by transformers).
    """
    available = names()
    if name not in available:
        raise ValueError(f"unknown model {name!r}; shipped models: {available}")
    return str(MODELS_DIR / name)
