"""Learned drafter heads (Medusa, EAGLE-style) inside the engine's step.

    head = ji.speculative.heads.load_head(ji.models.path("smollm2-135m-eagle"), cfg)
    ji.Engine(cfg, params, ji.EngineConfig(speculative=ji.SpeculativeConfig(drafter=head,
                                                                            num_speculative_tokens=3)))

**State** (`HeadPool`, the engine's `dcache`): `feats [NB, S, E]`, the target's last-layer
feature (before the final norm: what the head reads; EAGLE-3's fused feature for a head with
`feature_layers`) of every slot the target has written K/V into, indexed by the target's own
block tables; for EAGLE also the head's one-layer paged KV cache on the same blocks. Both are
written exactly where and when the target writes K/V — by
`_observe`, right after every verification, from the hidden states of the target's one forward
(no second pass) and through that step's own metadata. So prefix caching (a cached block holds
its features), copy-on-write (`copy_pool_blocks`), preemption by recompute and the failed-step
rebuild hold for the pool as for the target's cache, with one allocator; this is the draft
model's design (`speculation.py`) with the features as a second cache.

**EAGLE's rows.** The head's row at position p reads the token at p and the target feature of
p − 1. `_observe` scatters the step's features first; then every row gathers its previous
feature by slot (written this step, or by an earlier one), and the head writes its cache rows.
At a drafting step the last committed token t_cur has no feature yet (this step's verification
computes it), so the draft starts from (t_cur, h_{cur−1}) and feeds back its own predictions,
γ single-row steps (`eagle.eagle_feed`) that write rows cur..cur+γ−1; the verification's
`_observe` then rewrites rows cur..cur+γ from real features (those past the commit are stale and
overwritten before any read, like the target's rejected slots). **Medusa** drafts all γ from
h_{cur−1}, the newest feature the target has computed.

Shapes: NB blocks, S block size, E hidden, Bd drafting rows, T step rows, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.cache.metadata import BatchMetadata, bucket
from jaxinfer.cache.paged import PagedKVCache, copy_blocks, init_cache
from jaxinfer.sampling import SamplingBatch
from jaxinfer.speculative.drafters import row_seq
from jaxinfer.speculative.heads.config import HeadConfig
from jaxinfer.speculative.heads.eagle import eagle_feed, eagle_paged, fuse_features
from jaxinfer.speculative.heads.medusa import draft_medusa_from
from jaxinfer.speculative.noise import make_pick


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadPool:
    """A head drafter's state in the engine (module docstring)."""

    feats: jax.Array  # [NB, S, E] float32 target features by slot
    cache: PagedKVCache | None  # EAGLE's own cache (1 layer) on the same blocks; None: Medusa


def init_pool(hcfg: HeadConfig, num_blocks: int, block_size: int, platform: str) -> HeadPool:
    """An empty pool: zero features and, for EAGLE, an empty head cache."""
    feats = jnp.zeros((num_blocks, block_size, hcfg.target_hidden_size), jnp.float32)
    cache = None
    if hcfg.kind == "eagle":
        cache = init_cache(hcfg.layer_config, num_blocks, block_size, platform=platform)
    return HeadPool(feats, cache)


def copy_pool_blocks(pool: HeadPool, src: jax.Array, dst: jax.Array) -> HeadPool:
    """Copies whole blocks `src [n] -> dst [n]` of the features and the head cache."""
    feats = pool.feats.at[dst].set(pool.feats[src])
    cache = None if pool.cache is None else copy_blocks(pool.cache, src, dst)
    return HeadPool(feats, cache)


def _slots(tables: jax.Array, positions: jax.Array, block_size: int) -> jax.Array:
    """Flat slot of `positions [N]` in `tables [N, M]` (negative positions: slot 0, the null
    block; callers mask them)."""
    p = jnp.maximum(positions, 0)
    blocks = jnp.take_along_axis(tables, (p // block_size)[:, None], axis=1)[:, 0]
    return blocks * block_size + p % block_size


@functools.partial(
    jax.jit,
    static_argnames=("hcfg", "backend", "gamma", "block_size", "acceptance"),
    donate_argnames=("cache",),
)
def _draft(
    rp: dict,  # runtime head params (`heads.lm.pair`)
    feats: jax.Array,  # [NB, S, E]
    cache: PagedKVCache | None,  # EAGLE's head cache (donated); None: Medusa
    tok: jax.Array,  # [Bd] int32 t_cur, the last committed token
    cur: jax.Array,  # [Bd] int32 its position (>= 1: a decoding request has a computed prompt)
    tables: jax.Array,  # [Bd, Md] int32, lookahead blocks included, null-padded
    sb: SamplingBatch,  # [Bd]
    index: jax.Array,  # [Bd] int32 sample index
    *,
    hcfg: HeadConfig,
    backend: str,
    gamma: int,
    block_size: int,
    acceptance: str,
) -> tuple[tuple[jax.Array, jax.Array], PagedKVCache | None]:
    """γ drafts per drafting row and their q: `(([Bd, γ], [Bd, γ, V]), cache)`."""
    pick = make_pick(sb, cur, acceptance, index)
    flat = feats.reshape(-1, feats.shape[-1])  # [NB·S, E]
    h = flat[_slots(tables, cur - 1, block_size)]  # [Bd, E] h_{cur−1}
    if hcfg.kind == "medusa":
        return draft_medusa_from(rp, hcfg, h, pick, gamma=gamma), cache
    cache, tokens, q = eagle_feed(
        rp, hcfg, cache, tok, h, cur, tables, pick, jnp.arange(gamma, dtype=jnp.int32),
        block_size=block_size, backend=backend,
    )  # fmt: skip
    return (tokens, q), cache


@functools.partial(jax.jit, static_argnames=("hcfg", "backend"), donate_argnames=("pool",))
def _observe(
    rp: dict,
    pool: HeadPool,
    meta: BatchMetadata,  # the verification's metadata (T rows)
    hidden: jax.Array,  # [T, E] ([T, n·E] fused) the target's features of those rows
    *,
    hcfg: HeadConfig,
    backend: str,
) -> HeadPool:
    """Writes the step's features and (EAGLE) the head's cache rows of the step's slots."""
    nb, s, e = pool.feats.shape
    hidden = fuse_features(rp, hcfg, hidden)  # [T, E]
    flat = pool.feats.reshape(nb * s, e).at[meta.slot_mapping].set(hidden.astype(jnp.float32))
    cache = pool.cache
    if cache is not None:
        t = meta.tokens.shape[0]
        seq = jnp.minimum(row_seq(meta.query_start, t), meta.block_tables.shape[0] - 1)  # [T]
        prev = flat[_slots(meta.block_tables[seq], meta.positions - 1, s)]  # [T, E]
        prev = jnp.where((meta.positions > 0)[:, None], prev, 0.0)
        _, cache = eagle_paged(rp, hcfg, meta, cache, prev, backend)
    return HeadPool(flat.reshape(nb, s, e), cache)


# ------------------------------------------------------------------------------ host side


def draft(engine, schedule, spec_idx: list[int], bd: int, gamma: int):
    """The head's drafts for the step's drafting rows -> (tokens `[Bd, γ]`, q), on the device."""
    cfg = engine.config
    S = cfg.block_size
    hcfg, rp = engine.draft_head
    seqs = schedule.seqs
    md = bucket(max(len(seqs[i].block_table) for i in spec_idx), cfg.min_block_bucket)
    tok = np.zeros(bd, np.int32)
    cur = np.ones(bd, np.int32)  # padding rows read slot 0 and write into the null block
    tables = np.zeros((bd, md), np.int32)
    index = np.zeros(bd, np.int32)
    for k, i in enumerate(spec_idx):
        s = seqs[i]
        tok[k], cur[k] = s.token_ids[0], s.start_pos
        tables[k, : len(s.block_table)] = s.block_table
        index[k] = engine._sample_index[s.seq_id]
    sps = [engine._live[seqs[i].request_id].sampling for i in spec_idx]
    pool = engine.dcache
    (d, q), cache = _draft(
        rp, pool.feats, pool.cache, tok, cur, tables, SamplingBatch.from_params(sps, pad_to=bd),
        index, hcfg=hcfg, backend=cfg.backend, gamma=gamma, block_size=S,
        acceptance=engine.spec.acceptance,
    )  # fmt: skip
    engine.dcache = dataclasses.replace(pool, cache=cache)
    return d, q


def observe(engine, meta: BatchMetadata, hidden: jax.Array) -> None:
    """After the verification: the pool records the step (dispatched; not waited for)."""
    hcfg, rp = engine.draft_head
    engine.dcache = _observe(rp, engine.dcache, meta, hidden, hcfg=hcfg,
                             backend=engine.config.backend)  # fmt: skip
