"""An EAGLE-style feature drafter (Li et al. 2024): one decoder layer that extrapolates the
target's features, with its own paged KV cache, drafting through the target's frozen LM head.

Which features: the output of the target's last decoder layer, before the final norm — the
vector the LM head reads, so a predicted feature turns into logits through the target's own
final norm and head with no extra parameters, and it is what `forward(..., return_hidden=True)`
returns at no extra cost. (EAGLE-3 fuses low, middle and high layers; one layer is the
EAGLE-1 choice and needs nothing from the target's forward but its last activations.)

The row at position t reads the target feature of position t−1 and the token at t:
`x = fc([embed(x_t) ; norm(h_{t−1})])`, then one Llama decoder layer (causal attention over the
head's own cache of earlier rows, MLP) gives ĥ_t, the prediction of h_t, whose logits draft
token t+1. A cycle whose last committed token sits at `cur`:

1. catch-up: the rows dlen..cur (1 to γ+1 of them: every position committed since the last
   cycle) are fed with the target's real features `feats[p−1]`, overwriting the entries the last
   cycle wrote from its own predictions; row cur's ĥ_cur drafts d_0 at cur+1;
2. γ−1 single-row steps: row cur+j reads (d_{j−1}, ĥ_{cur+j−1}), feeding back its own feature.

After verification the cache is exact up to cur (the rows fed real features), so `dlen` becomes
the old cur + 1.

Shapes: B sequences, T rows, E hidden, C positions per sequence, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.cache.metadata import BatchMetadata, decode_batch
from jaxinfer.cache.paged import PagedKVCache
from jaxinfer.model.attention import paged_attention_block
from jaxinfer.model.decoder import decoder_layer_dense, mlp_block
from jaxinfer.model.layers import rms_norm
from jaxinfer.ops.linear import linear
from jaxinfer.speculative.drafters import catch_up_batch, row_seq
from jaxinfer.speculative.heads.config import HeadConfig
from jaxinfer.speculative.heads.lm import feature_logits


def init_eagle(hcfg: HeadConfig, key: jax.Array, std: float = 0.02) -> dict:
    """EAGLE params: `fc [2E, E]`, `feat_norm [E]` and one decoder layer (no leading L axis)."""
    c = hcfg.layer_config
    e, f = c.hidden_size, c.intermediate_size
    hd, kd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"wq": (e, hd), "wk": (e, kd), "wv": (e, kd), "wo": (hd, e),
              "w_gate": (e, f), "w_up": (e, f), "w_down": (f, e), "fc": (2 * e, e)}  # fmt: skip
    keys = jax.random.split(key, len(shapes))
    w = {n: std * jax.random.normal(k, s, jnp.float32) for k, (n, s) in zip(keys, shapes.items())}
    fc = w.pop("fc")
    layer = dict(w, attn_norm=jnp.ones((e,), jnp.float32), mlp_norm=jnp.ones((e,), jnp.float32))
    return {"fc": fc, "feat_norm": jnp.ones((e,), jnp.float32), "layer": layer}


def _input(rp: dict, hcfg: HeadConfig, tokens: jax.Array, prev_feat: jax.Array) -> jax.Array:
    """`tokens [...]`, `prev_feat [..., E]` -> the layer's input `[..., E]`."""
    hp = rp["head"]
    e = rp["embed"][tokens].astype(jnp.float32)  # [..., E]
    f = rms_norm(prev_feat.astype(jnp.float32), hp["feat_norm"], hcfg.rms_norm_eps)
    return linear(jnp.concatenate([e, f], axis=-1), hp["fc"])  # [..., E]


def eagle_paged(
    rp: dict,
    hcfg: HeadConfig,
    batch: BatchMetadata,
    cache: PagedKVCache,
    prev_feat: jax.Array,  # [T, E] the feature of each row's previous position
    backend: str,
) -> tuple[jax.Array, PagedKVCache]:
    """The head over a ragged paged batch -> (predicted features `[T, E]`, cache)."""
    lcfg, lp = hcfg.layer_config, rp["head"]["layer"]
    x = _input(rp, hcfg, batch.tokens, prev_feat)  # [T, E]
    h = rms_norm(x, lp["attn_norm"], lcfg.rms_norm_eps)
    attn, cache = paged_attention_block(h, lp, lcfg, batch, cache, jnp.int32(0), backend)
    return mlp_block(x + attn, lp, lcfg, backend), cache


def eagle_dense(rp: dict, hcfg: HeadConfig, tokens: jax.Array, prev_feat: jax.Array):
    """Training form: `tokens [B, S]` from position 0, `prev_feat [B, S, E]` -> ĥ `[B, S, E]`."""
    x = _input(rp, hcfg, tokens, prev_feat)
    return decoder_layer_dense(x, rp["head"]["layer"], hcfg.layer_config)


def previous_features(feats: jax.Array, seq: jax.Array, positions: jax.Array) -> jax.Array:
    """`feats [B, C, E]` at position − 1 of each row (`seq [T]`, `positions [T]`); 0 at 0."""
    prev = feats[seq, jnp.maximum(positions - 1, 0)]  # [T, E]
    return jnp.where((positions > 0)[:, None], prev, 0)


def draft_eagle(
    rp: dict,
    hcfg: HeadConfig,
    cache: PagedKVCache,
    feats: jax.Array,  # [B, C, E] target features by position, exact up to cur − 1
    hist: jax.Array,  # [B, C] int32
    cur: jax.Array,  # [B] int32
    dlen: jax.Array,  # [B] int32 rows of the head's cache fed real features; cur − dlen <= γ
    tables: jax.Array,  # [B, M] int32
    pick,
    *,
    gamma: int,
    block_size: int,
    backend: str,
) -> tuple[PagedKVCache, jax.Array, jax.Array]:
    """γ drafts -> (cache, tokens `[B, γ]` int32, q `[B, γ, V]` float32); see the module doc."""
    feat, cache = eagle_catch_up(
        rp, hcfg, cache, feats, hist, cur, dlen, tables, gamma=gamma, block_size=block_size,
        backend=backend,
    )  # fmt: skip
    tok, q = pick(feature_logits(rp, hcfg, feat), 0)
    cache, toks, qs = eagle_feed(
        rp, hcfg, cache, tok, feat, cur, tables, pick, jnp.arange(1, gamma),
        block_size=block_size, backend=backend,
    )  # fmt: skip
    tokens = jnp.concatenate([tok[:, None], toks], axis=1)  # [B, γ]
    q_all = jnp.concatenate([q[:, None], qs], axis=1)  # [B, γ, V]
    return cache, tokens, q_all


def eagle_catch_up(
    rp: dict,
    hcfg: HeadConfig,
    cache: PagedKVCache,
    feats: jax.Array,  # [B, C, E] target features by position, exact up to cur − 1
    hist: jax.Array,  # [B, C] int32
    cur: jax.Array,  # [B] int32
    dlen: jax.Array,  # [B] int32; cur − dlen <= γ
    tables: jax.Array,  # [B, M] int32
    *,
    gamma: int,
    block_size: int,
    backend: str,
) -> tuple[jax.Array, PagedKVCache]:
    """Writes the cache rows dlen..cur from real features -> (ĥ_cur `[B, E]`, cache): the draft's
    first step, and all a cycle needs when no row drafts from the head (the hybrid's n-gram)."""
    batch = catch_up_batch(hist, cur, dlen, tables, block_size, width=gamma + 1)
    seq = row_seq(batch.query_start, batch.tokens.shape[0])  # [T]
    prev = previous_features(feats, seq, batch.positions)  # [T, E]
    out, cache = eagle_paged(rp, hcfg, batch, cache, prev, backend)
    return out[batch.logits_indices], cache


def eagle_feed(
    rp: dict,
    hcfg: HeadConfig,
    cache: PagedKVCache,
    tok: jax.Array,  # [B] int32 the token at position cur + js[0]
    feat: jax.Array,  # [B, E] the feature of the position before it
    cur: jax.Array,  # [B] int32
    tables: jax.Array,  # [B, M] int32
    pick,
    js: jax.Array,  # [n] int32 draft indices, consecutive
    *,
    block_size: int,
    backend: str,
) -> tuple[PagedKVCache, jax.Array, jax.Array]:
    """Single-row steps feeding the head its own drafts: step j writes the row of position
    cur + j from (token, previous feature), and its ĥ drafts index j (position cur + 1 + j).
    -> (cache, tokens `[B, n]`, q `[B, n, V]`). The loop starts at j = 1 (its catch-up drafted
    index 0); the engine starts at j = 0 from (t_cur, h_{cur−1})."""

    def step(carry, j):
        cache, tok, feat = carry
        batch = decode_batch(tok, cur + j, tables, block_size)  # the token at position cur + j
        feat, cache = eagle_paged(rp, hcfg, batch, cache, feat, backend)
        new, q = pick(feature_logits(rp, hcfg, feat), j)
        return (cache, new, feat), (new, q)

    (cache, _, _), (toks, qs) = jax.lax.scan(step, (cache, tok, feat), js)
    return cache, jnp.moveaxis(toks, 0, 1), jnp.moveaxis(qs, 0, 1)
