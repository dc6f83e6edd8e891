"""An EAGLE-style feature drafter (Li et al. 2024): one decoder layer that extrapolates the
target's features, with its own paged KV cache, drafting through the target's frozen LM head.

Which features: the output of the target's last decoder layer, before the final norm — the
vector the LM head reads, so a predicted feature turns into logits through the target's own
final norm and head with no extra parameters, and it is what `forward(..., return_hidden=True)`
returns at no extra cost. (EAGLE-3 fuses low, middle and high layers; one layer is the
EAGLE-1 choice and needs nothing from the target's forward but its last activations.) With
`HeadConfig.feature_layers` the head reads EAGLE-3's fused features instead: the forward returns
those layers' outputs (the last layer last), and `fuse_features` norms each and projects their
concatenation to E where the features are observed, so every state downstream (the loop's and the
engine's feature stores, the catch-up) keeps `[.., E]` rows, and the head's own predictions stay
in the last layer's space (the regression target) and feed back in place of the fused row.

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
from jaxinfer.model.attention import paged_attention_block, project_qkv
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
    params = {"fc": fc, "feat_norm": jnp.ones((e,), jnp.float32), "layer": layer}
    if hcfg.feature_layers is not None:  # EAGLE-3: [n·E] -> E, each layer normed first
        n = len(hcfg.feature_layers)
        params["fuse_norm"] = jnp.ones((n, e), jnp.float32)
        kf = jax.random.fold_in(key, len(shapes))
        params["fuse"] = std * jax.random.normal(kf, (n * e, e), jnp.float32)
    return params


def fuse_features(rp: dict, hcfg: HeadConfig, hidden: jax.Array) -> jax.Array:
    """The target's features as the head reads them: `hidden [..., n·E]` (the outputs of
    `hcfg.feature_layers`, concatenated) -> `[..., E]`; `hidden [..., E]` as it is for a head of
    the last layer alone."""
    if hcfg.feature_layers is None:
        return hidden
    hp = rp["head"]
    n, e = len(hcfg.feature_layers), hcfg.target_hidden_size
    lead = hidden.shape[:-1]
    parts = hidden.astype(jnp.float32).reshape(*lead, n, e)
    parts = rms_norm(parts, hp["fuse_norm"], hcfg.rms_norm_eps)  # [..., n, E]
    return linear(parts.reshape(*lead, n * e), hp["fuse"])  # [..., E]


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


def _later(x: jax.Array, n: int) -> jax.Array:
    """`x [B, S, ...]` moved n positions later along S (row t holds row t − n), zeros first."""
    if n == 0:
        return x
    return jnp.concatenate([jnp.zeros_like(x[:, :n]), x[:, :-n]], axis=1)


def eagle_dense_chain(
    rp: dict, hcfg: HeadConfig, tokens: jax.Array, prev_feat: jax.Array, steps: int
) -> list[jax.Array]:
    """Training form of a whole drafting cycle, attention as drafting sees it (EAGLE-3's
    "training-time test"): `tokens [B, S]`, `prev_feat [B, S, E]` (the target's feature of each
    row's previous position) -> `steps` predictions ĥ `[B, S, E]`.

    Step k's row at position t is the k-th single-row step of a cycle whose catch-up ended at
    c = t − k: it reads (token t, step k−1's ĥ at t − 1; step 0: the target's feature), and it
    attends to what the head's cache holds then: step 0's rows at positions <= c (written from
    the target's real features) and step j's row at c + j for j = 1..k (written by the cycle's
    own earlier steps). Feeding a step its own predictions everywhere instead (`eagle_dense` on
    shifted ĥ) would make the context rows predicted too, which drafting never sees. Rows with
    t < k have no such cycle: their outputs are defined but meaningless (mask them in a loss).
    Step 0 equals `eagle_dense`."""
    lcfg, lp = hcfg.layer_config, rp["head"]["layer"]
    b, s = tokens.shape
    kh, d = lcfg.num_kv_heads, lcfg.head_dim
    g = lcfg.num_heads // kh
    positions = jnp.broadcast_to(jnp.arange(s), (b, s))
    i, j = jnp.arange(s)[:, None], jnp.arange(s)[None, :]
    keys, values, preds, prev = [], [], [], prev_feat
    for k in range(steps):
        x = _input(rp, hcfg, tokens, prev)  # [B, S, E]
        h = rms_norm(x, lp["attn_norm"], lcfg.rms_norm_eps)
        q, key, value = project_qkv(h, lp, lcfg, positions)  # [B, S, H, D], [B, S, K, D] x 2
        keys.append(key.astype(jnp.float32))
        values.append(value.astype(jnp.float32))
        qg = q.astype(jnp.float32).reshape(b, s, kh, g, d) / jnp.sqrt(jnp.float32(d))
        ctx = jnp.einsum("bskgd,btkd->bkgst", qg, keys[0])  # [B, K, G, S, S] step 0's rows
        ctx = jnp.where(j <= i - k, ctx, -jnp.inf)
        chain = [_later(keys[m], k - m) for m in range(1, k + 1)]  # row t: step m at t − k + m
        own = [jnp.einsum("bskgd,bskd->bkgs", qg, c)[..., None] for c in chain]  # [B, K, G, S, 1]
        p = jax.nn.softmax(jnp.concatenate([ctx, *own], axis=-1), axis=-1)  # [B, K, G, S, S + k]
        out = jnp.einsum("bkgst,btkd->bskgd", p[..., :s], values[0])  # [B, S, K, G, D]
        for m in range(1, k + 1):
            pm = jnp.moveaxis(p[..., s + m - 1], 3, 1)[..., None]  # [B, S, K, G, 1]
            out = out + pm * _later(values[m], k - m)[:, :, :, None, :]
        attn = linear(out.reshape(b, s, lcfg.num_heads * d).astype(x.dtype), lp["wo"])
        preds.append(mlp_block(x + attn, lp, lcfg))
        prev = _later(preds[-1], 1)
    return preds


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
