"""The head drafters behind the loop's drafter interface: prefill, draft, observe.

The loop keeps a head's state in `SpecState.dcache` as a `HeadState`: the target's features by
position (what the head reads; written by the prefill and by every verification from the
`return_hidden` output of the target's one forward, so no second pass) and, for EAGLE, the
head's own paged KV cache on the target's block tables.

* `head_prefill` — after the target's prefill: stores the prompt's features and (EAGLE) writes
  the head's cache rows of the prompt.
* `head_draft` — γ tokens and their q, chosen by the loop's `pick`; `hybrid_draft` for a head
  with `ngram_first`.
* `head_observe` — after verification: stores the features of the γ+1 verified positions
  (those past the commit are stale and get overwritten by the next verification before any
  read: the heads read features only below `cur`).

`unpack_draft` turns the `draft=` argument of `ji.speculative.generate` — `(dcfg, dparams)`,
"ngram" or a `Head` — into what the loop's plan holds, validating it against the target.

Shapes: B sequences, C positions per sequence, E hidden, T rows, V vocabulary, γ drafts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.cache.metadata import BatchMetadata
from jaxinfer.cache.paged import PagedKVCache, init_cache
from jaxinfer.config import ModelConfig
from jaxinfer.speculative.drafters import ngram_rows, row_seq, take_ngram
from jaxinfer.speculative.heads.config import Head, HeadConfig
from jaxinfer.speculative.heads.eagle import (
    draft_eagle,
    eagle_catch_up,
    eagle_paged,
    fuse_features,
    previous_features,
)
from jaxinfer.speculative.heads.lm import pair
from jaxinfer.speculative.heads.medusa import draft_medusa

DRAFT_HELP = "(ModelConfig, params), 'ngram' or a ji.speculative.heads.Head"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadState:
    """A head drafter's carry in the loop."""

    feats: jax.Array  # [B, C, E] target features (last layer, pre-norm; or fused) by position
    cache: PagedKVCache | None  # EAGLE's own cache (1 layer), holds rows 0..dlen-1; None: Medusa


def head_prefill(
    rp: dict,
    hcfg: HeadConfig,
    meta: BatchMetadata,
    hidden: jax.Array,  # [T, E] ([T, n·E] fused) the target's prefill features, one per token
    num_seqs: int,
    capacity: int,
    num_blocks: int,
    block_size: int,
    backend: str,
    platform: str,  # resolved by the caller (`prepare_run`): the head cache's platform
) -> HeadState:
    """The head's state after the prompt (every sequence written from position 0)."""
    hidden = fuse_features(rp, hcfg, hidden)  # [T, E]
    t = hidden.shape[0]
    seq = row_seq(meta.query_start, t)  # [T]; padding rows -> num_seqs, dropped
    feats = jnp.zeros((num_seqs, capacity, hidden.shape[-1]), jnp.float32)
    feats = feats.at[seq, meta.positions].set(hidden.astype(jnp.float32), mode="drop")
    cache = None
    if hcfg.kind == "eagle":
        cache = init_cache(hcfg.layer_config, num_blocks, block_size, platform=platform)
        prev = previous_features(feats, jnp.minimum(seq, num_seqs - 1), meta.positions)
        _, cache = eagle_paged(rp, hcfg, meta, cache, prev, backend)  # rows 0..len-1
    return HeadState(feats=feats, cache=cache)


def head_draft(rp, hcfg: HeadConfig, hs: HeadState, hist, cur, dlen, tables, pick, *,
               gamma: int, block_size: int, backend: str):  # fmt: skip
    """γ drafts -> (state, tokens `[B, γ]` int32, q `[B, γ, V]` float32)."""
    if hcfg.kind == "medusa":
        tokens, q = draft_medusa(rp, hcfg, hs.feats, cur, pick, gamma=gamma)
        return hs, tokens, q
    cache, tokens, q = draft_eagle(
        rp, hcfg, hs.cache, hs.feats, hist, cur, dlen, tables, pick,
        gamma=gamma, block_size=block_size, backend=backend,
    )  # fmt: skip
    return dataclasses.replace(hs, cache=cache), tokens, q


def hybrid_draft(rp, hcfg: HeadConfig, hs: HeadState, hist, cur, dlen, tables, pick, done, *,
                 gamma: int, block_size: int, backend: str, max_n: int, min_match: int,
                 vocab_size: int):  # fmt: skip
    """`Head.ngram_first` = min_match: `head_draft` with the n-gram's proposal (q one-hot) in the
    rows whose last `min_match`+ tokens recur (`drafters.prefer_ngram`) -> (state, tokens, q);
    `head_draft` itself for min_match = 0.

    When every row not `done [B]` takes the n-gram's, the head does not draft: EAGLE only
    catches its cache up on the committed rows (`eagle_catch_up`), which is the part of a draft
    the next cycle reads; the rows its feedback steps would write lie past `cur` and are
    rewritten before any read, as after a rejection.
    """
    if not min_match:
        return head_draft(rp, hcfg, hs, hist, cur, dlen, tables, pick, gamma=gamma,
                          block_size=block_size, backend=backend)  # fmt: skip
    ngram, use = ngram_rows(hist, cur, gamma=gamma, max_n=max_n, min_match=min_match)

    def ngram_only(hs):
        if hcfg.kind == "eagle":
            _, cache = eagle_catch_up(
                rp, hcfg, hs.cache, hs.feats, hist, cur, dlen, tables, gamma=gamma,
                block_size=block_size, backend=backend,
            )  # fmt: skip
            hs = dataclasses.replace(hs, cache=cache)
        return hs, ngram, jax.nn.one_hot(ngram, vocab_size, dtype=jnp.float32)

    def with_head(hs):
        hs, tokens, q = head_draft(
            rp, hcfg, hs, hist, cur, dlen, tables, pick, gamma=gamma, block_size=block_size,
            backend=backend,
        )  # fmt: skip
        return hs, *take_ngram(tokens, q, ngram, use)

    return jax.lax.cond(jnp.all(use | done), ngram_only, with_head, hs)


def head_observe(rp, hcfg: HeadConfig, hs: HeadState, hidden: jax.Array, cur: jax.Array):
    """Stores the verified positions' features: `hidden [B, γ+1, E]` (`[B, γ+1, n·E]` of a head
    of fused features) at cur..cur+γ -> the new `HeadState`."""
    hidden = fuse_features(rp, hcfg, hidden)  # [B, γ+1, E]
    b, g1, _ = hidden.shape
    pos = cur[:, None] + jnp.arange(g1, dtype=jnp.int32)[None, :]  # [B, γ+1]
    rows = jnp.arange(b)[:, None]
    feats = hs.feats.at[rows, pos].set(hidden.astype(jnp.float32), mode="drop")
    return dataclasses.replace(hs, feats=feats)


def unpack_draft(draft, cfg: ModelConfig, tparams: dict, gamma: int):
    """`draft` -> (dcfg or None, dparams or runtime head params or None, HeadConfig or None).

    Raises ValueError naming the problem: an unknown kind, a vocabulary other than the
    target's, a head trained for another target, or γ above a Medusa head's K.
    """
    if isinstance(draft, Head):
        if not isinstance(draft.cfg, HeadConfig):
            raise ValueError(f"Head.cfg must be a HeadConfig, got {type(draft.cfg).__name__}")
        rp = pair(draft, cfg, tparams)
        if draft.cfg.kind == "medusa" and gamma > draft.cfg.num_medusa_heads:
            raise ValueError(
                f"gamma={gamma} exceeds the medusa head's num_medusa_heads="
                f"{draft.cfg.num_medusa_heads}: each head drafts one position"
            )
        return None, rp, draft.cfg
    if isinstance(draft, str):
        if draft != "ngram":
            raise ValueError(f"draft must be {DRAFT_HELP}, got {draft!r}")
        return None, None, None
    if not (isinstance(draft, tuple | list) and len(draft) == 2):
        raise ValueError(f"draft must be {DRAFT_HELP}, got {type(draft)}")
    dcfg, dparams = draft
    if not isinstance(dcfg, ModelConfig):
        raise ValueError(f"draft[0] must be a ModelConfig, got {type(dcfg).__name__}")
    if dcfg.vocab_size != cfg.vocab_size:
        raise ValueError(
            f"draft vocab_size {dcfg.vocab_size} differs from target vocab_size "
            f"{cfg.vocab_size}: speculative decoding needs one shared vocabulary"
        )
    return dcfg, dparams, None
