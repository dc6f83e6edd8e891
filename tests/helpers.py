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


def poison_logits(module, jitted: str, jit_kwargs: dict, monkeypatch, mark: int, value: float):
    """Makes `forward` (in the module that defines `module.<jitted>`) return `value` for every
    logits row whose last input token is `mark`, and replaces the jitted `module.<jitted>` by a
    fresh jit of the same function, so that it traces the patched forward (jax caches traces by
    function object)."""
    import sys
    import types

    core = getattr(module, jitted)
    core = getattr(core, "__wrapped__", core)
    home = sys.modules[core.__module__]  # where the jitted function is defined reads `forward`
    real = home.__dict__.get("_real_forward", home.forward)
    monkeypatch.setattr(home, "_real_forward", real, raising=False)

    def forward(params, cfg, meta, cache, **kw):
        logits, cache = real(params, cfg, meta, cache, **kw)  # [N, V]
        hit = meta.tokens[meta.logits_indices] == mark  # [N]
        return jnp.where(hit[:, None], value, logits), cache

    monkeypatch.setattr(home, "forward", forward)
    fresh = types.FunctionType(core.__code__, core.__globals__, core.__name__, core.__defaults__)
    fresh.__kwdefaults__ = core.__kwdefaults__
    monkeypatch.setattr(module, jitted, jax.jit(fresh, **jit_kwargs))
