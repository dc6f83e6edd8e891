"""Training configs, one file per setting; each module's `get_config()` returns a TrainConfig.

from experiments.configs import get_config
tc = get_config("target")          # "target" | "draft" | "tiny"
"""

from __future__ import annotations

import importlib

from jaxinfer.train import TrainConfig

NAMES = ("target", "draft", "tiny")


def get_config(name: str) -> TrainConfig:
    """The TrainConfig of a named setting.

    Args:
      name: one of `NAMES`.

    Returns:
      The config; override fields with `.replace(...)`.
    """
    if name not in NAMES:
        raise ValueError(f"unknown config {name!r}; expected one of {NAMES}")
    return importlib.import_module(f"experiments.configs.{name}").get_config()
