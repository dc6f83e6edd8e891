"""A learned drafter head: its config (frozen, static under jit), the `Head` pair of config and
params, pairing validation against a target, and save / load.

A head is trained for one target: it reads that target's hidden states (size E, from its last
layer) and drafts through that target's embedding and frozen LM head (vocabulary V). The config
records the target's hidden size, vocabulary and layer count, and `check_pairing` refuses a head
whose recorded target differs from the one it is paired with, naming the field.

Files (`save_head` / `load_head`): `head_config.json` and `head.safetensors` (flat keys, "/"
joined), in one folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from jaxinfer.config import ModelConfig

HEAD_KINDS = ("medusa", "eagle")
CONFIG_FILE = "head_config.json"
WEIGHTS_FILE = "head.safetensors"


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """What a drafter head is and which target it was trained for."""

    kind: str  # "medusa" | "eagle"
    target_hidden_size: int  # E of the target whose features the head reads
    target_vocab_size: int  # V of the target whose LM head the head drafts through
    target_num_layers: int  # L of that target (its last layer's output is the feature)
    num_medusa_heads: int = 4  # K (medusa): head k predicts the token k+1 past the target's next
    # EAGLE's one decoder layer: attention and MLP shapes (hidden size = target_hidden_size).
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    # Draft vocabulary: the head drafts only among the N most frequent tokens (its params hold
    # their ids), mapped back to the full vocabulary; None drafts over all V.
    draft_vocab_size: int | None = None
    # EAGLE-3's fused features: the outputs of these target layers (0-based, increasing, the
    # last layer last), concatenated, normed and projected to E when observed
    # (`eagle.fuse_features`); None reads the last layer's output alone (EAGLE-1).
    feature_layers: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.kind not in HEAD_KINDS:
            raise ValueError(f"HeadConfig.kind={self.kind!r}; expected one of {HEAD_KINDS}")
        for name in ("target_hidden_size", "target_vocab_size", "target_num_layers",
                     "num_medusa_heads", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"HeadConfig.{name}={value!r}; expected a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"HeadConfig.num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        n = self.draft_vocab_size
        if n is not None and not (isinstance(n, int) and 1 <= n <= self.target_vocab_size):
            raise ValueError(
                f"HeadConfig.draft_vocab_size={n!r}; expected None or an int in "
                f"[1, {self.target_vocab_size}]"
            )
        if self.feature_layers is not None:
            self._check_feature_layers()

    def _check_feature_layers(self):
        layers, last = self.feature_layers, self.target_num_layers - 1
        if isinstance(layers, list):  # as JSON gives it back; a tuple keeps the config hashable
            object.__setattr__(self, "feature_layers", layers := tuple(layers))
        ok = isinstance(layers, tuple) and all(
            isinstance(i, int) and not isinstance(i, bool) for i in layers
        )
        if not ok or len(layers) < 2 or list(layers) != sorted(set(layers)) or layers[0] < 0:
            raise ValueError(
                f"HeadConfig.feature_layers={layers!r}; expected None or 2+ increasing layer "
                f"indices >= 0"
            )
        if layers[-1] != last:
            raise ValueError(
                f"HeadConfig.feature_layers={layers!r} must end with the target's last layer "
                f"({last}): the head's output is read as that layer's"
            )
        if self.kind != "eagle":
            raise ValueError(f"HeadConfig.feature_layers is for eagle heads, not {self.kind!r}")

    @property
    def return_hidden(self) -> bool | tuple[int, ...]:
        """What the target's forward returns for this head: `forward(..., return_hidden=...)`."""
        return self.feature_layers or True

    @property
    def layer_config(self) -> ModelConfig:
        """EAGLE's decoder layer as a one-layer ModelConfig (for the shared layer functions)."""
        return ModelConfig(
            vocab_size=self.target_vocab_size,
            hidden_size=self.target_hidden_size,
            num_layers=1,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
        )


def head_config_for(cfg: ModelConfig, kind: str, **overrides) -> HeadConfig:
    """A HeadConfig for target `cfg`; EAGLE's layer copies the target's layer shapes."""
    base = dict(
        kind=kind,
        target_hidden_size=cfg.hidden_size,
        target_vocab_size=cfg.vocab_size,
        target_num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
    )
    base.update(overrides)
    return HeadConfig(**base)


@dataclasses.dataclass(frozen=True)
class Head:
    """A drafter head: pass it as `draft=` to `ji.speculative.generate` or as
    `ji.SpeculativeConfig(drafter=...)`.

    `ngram_first` (a drafting option, not saved with the head): 0 drafts every row with the
    head; n >= 1 makes it the hybrid drafter of `drafters.prefer_ngram`: a row whose last n or
    more committed tokens recur earlier takes the n-gram (prompt-lookup) proposal instead, e.g.
    `dataclasses.replace(head, ngram_first=2)`. It must not exceed the run's `ngram_max`.
    """

    cfg: HeadConfig
    params: dict  # medusa.init_medusa / eagle.init_eagle layout
    ngram_first: int = 0

    def __post_init__(self):
        n = self.ngram_first
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"Head.ngram_first must be an int >= 0, got {n!r}")


def check_pairing(hcfg: HeadConfig, cfg: ModelConfig) -> None:
    """Raises ValueError naming each target field where `hcfg` was trained for another target."""
    pairs = (
        ("hidden_size", hcfg.target_hidden_size, cfg.hidden_size),
        ("vocab_size", hcfg.target_vocab_size, cfg.vocab_size),
        ("num_layers", hcfg.target_num_layers, cfg.num_layers),
    )
    bad = [f"{name} {mine} (target has {theirs})" for name, mine, theirs in pairs if mine != theirs]
    if bad:
        raise ValueError(
            f"{hcfg.kind} head was trained for another target: its target " + ", ".join(bad)
        )


def _flatten(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = np.asarray(v)
    return out


def _unflatten(flat: dict[str, np.ndarray]) -> dict:
    tree: dict = {}
    for key, v in flat.items():
        node = tree
        *parents, leaf = key.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = jnp.asarray(v)
    return tree


def save_head(path: str | os.PathLike, head: Head, dtype=None) -> None:
    """Writes `head_config.json` and `head.safetensors` into folder `path` (created).

    dtype: stores the floating params in this dtype (float16 halves a shipped head); `load_head`
    turns them back into float32, the dtype heads run in. Integer params are kept as they are.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    flat = _flatten(head.params)
    if dtype is not None:
        flat = {k: v.astype(dtype) if np.issubdtype(v.dtype, np.floating) else v
                for k, v in flat.items()}  # fmt: skip
    save_file(flat, str(path / WEIGHTS_FILE))
    (path / CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(head.cfg), indent=2))


def load_head(path: str | os.PathLike, target: ModelConfig | None = None) -> Head:
    """Reads a head written by `save_head`; with `target`, checks the pairing (ValueError)."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise ValueError(f"{str(path)!r} holds no {CONFIG_FILE}: not a drafter head folder")
    hcfg = HeadConfig(**json.loads((path / CONFIG_FILE).read_text()))
    if target is not None:
        check_pairing(hcfg, target)
    flat = {k: v.astype(np.float32) if np.issubdtype(v.dtype, np.floating) else v
            for k, v in load_file(str(path / WEIGHTS_FILE)).items()}  # fmt: skip
    return Head(hcfg, jax.tree.map(jnp.asarray, _unflatten(flat)))
