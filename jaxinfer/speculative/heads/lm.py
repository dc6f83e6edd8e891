"""The frozen target pieces a head drafts through: its embedding, final norm and LM head, the
latter optionally cut to a draft vocabulary of N frequent tokens and mapped back to the full V.

`pair(head, cfg, tparams)` builds the head's runtime params once, outside any loop: the head's
own params under "head", the target's "embed" and "final_norm", and "lm_w", the LM head's
columns of the draft vocabulary (`[E, N]`, a contiguous copy, so a draft step reads N/V of the
head's bytes) or the whole `[E, V]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.model.layers import rms_norm
from jaxinfer.model.params import lm_head
from jaxinfer.ops.linear import linear
from jaxinfer.qtensor import ColumnBlocks, dequantize, is_quantized
from jaxinfer.speculative.heads.config import Head, HeadConfig, check_pairing
from jaxinfer.transposed import TransposedDense

NEG_INF = -jnp.inf


def check_head_params(hcfg: HeadConfig, params: dict) -> None:
    """Raises ValueError when the head's draft vocabulary ids disagree with its config."""
    n = hcfg.draft_vocab_size
    ids = params.get("vocab_ids")
    if n is None and ids is not None:
        raise ValueError("head params hold vocab_ids but HeadConfig.draft_vocab_size is None")
    if n is not None and (ids is None or tuple(ids.shape) != (n,)):
        got = None if ids is None else tuple(ids.shape)
        raise ValueError(f"head params vocab_ids has shape {got}, expected ({n},)")
    layers, fuse = hcfg.feature_layers, params.get("fuse")
    if layers is None and fuse is not None:
        raise ValueError("head params hold fuse but HeadConfig.feature_layers is None")
    if layers is not None:
        want = (len(layers) * hcfg.target_hidden_size, hcfg.target_hidden_size)
        got = None if fuse is None else tuple(fuse.shape)
        if got != want:
            raise ValueError(
                f"head params fuse has shape {got}, expected {want} for feature_layers={layers}"
            )


def pair(head: Head, cfg: ModelConfig, tparams: dict) -> dict:
    """Checks the head against target `cfg` (ValueError naming the field) -> runtime params."""
    check_pairing(head.cfg, cfg)
    check_head_params(head.cfg, head.params)
    w = lm_head(tparams)  # [E, V], or its TransposedDense [V, E] (the CPU layout)
    if head.cfg.draft_vocab_size is not None:
        ids = head.params["vocab_ids"]
        if isinstance(w, TransposedDense):  # [N, E] (and [E, N] where the head keeps [E, V])
            keep = None if w.w is None else jnp.take(w.w, ids, axis=1)
            scale = None if w.scale is None else jnp.take(w.scale, ids)  # an int8 head's rows
            w = TransposedDense(jnp.take(w.wt, ids, axis=0), keep, scale)
        else:  # a narrow head: its draft-vocabulary columns, dequantized (small: [E, N])
            w = w.whole() if isinstance(w, ColumnBlocks) else w
            w = jnp.take(dequantize(w, jnp.float32) if is_quantized(w) else w, ids, axis=1)
    return {
        "head": head.params,
        "embed": tparams["embed"],  # [V, E]
        "final_norm": tparams["final_norm"],  # [E]
        "lm_w": w,  # [E, N] or [E, V] (or TransposedDense [N, E] / [V, E])
    }


def feature_logits(rp: dict, hcfg: HeadConfig, feat: jax.Array) -> jax.Array:
    """A predicted target feature `[..., E]` -> float32 logits `[..., V]` over the full vocabulary
    (-inf outside the draft vocabulary)."""
    x = rms_norm(feat, rp["final_norm"], hcfg.rms_norm_eps)
    sub = linear(x, rp["lm_w"]).astype(jnp.float32)  # [..., N]
    if hcfg.draft_vocab_size is None:
        return sub
    full = jnp.full(sub.shape[:-1] + (hcfg.target_vocab_size,), NEG_INF, jnp.float32)
    return full.at[..., rp["head"]["vocab_ids"]].set(sub)
