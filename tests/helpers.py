"""Shared test helpers: random models with every parameter perturbed (so tests can fail)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.model.params import init_params


def random_params(cfg: ModelConfig, seed: int = 0, std: float = 0.08) -> dict:
    """init_params with norms and biases perturbed away from 1 / 0."""
    params = init_params(cfg, jax.random.key(seed), std=std)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed + 1000), len(leaves))
    out = []
    for (path, x), k in zip(leaves, keys):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            x = x + 0.2 * jax.random.normal(k, x.shape, x.dtype)
        elif name.endswith("['bq']") or name.endswith("['bk']") or name.endswith("['bv']"):
            x = x + 0.1 * jax.random.normal(k, x.shape, x.dtype)
        out.append(x)
    return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(x) for x in out])
