"""Medusa heads (Cai et al. 2024): K residual blocks on the target's last hidden state, no cache.

The target's hidden state h_t at position t (last layer, before the final norm) predicts token
t+1 through the target's own head. Head k (k = 0..K-1) maps h_t to a feature
`h_t + SiLU(h_t W_k + b_k)` whose logits, through the target's frozen final norm and LM head,
predict token t+2+k. In a cycle the last committed token sits at `cur` and the target has
computed features up to `cur − 1`, so the γ ≤ K drafts for positions cur+1..cur+γ all come from
h_{cur−1}: head j drafts position cur+1+j. The heads do not see each other's drafts, so
each draft's q is its head's distribution alone — a valid proposal for exact rejection sampling,
which needs only that d_j was sampled from the q it is judged with.

Zero-initialised W_k, b_k make every head the identity, as in the paper (each starts as the
target's own next-token prediction); `init_medusa(std > 0)` gives random heads for tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.speculative.heads.config import HeadConfig
from jaxinfer.speculative.heads.lm import feature_logits


def init_medusa(hcfg: HeadConfig, key: jax.Array, std: float = 0.0) -> dict:
    """Medusa params: `w [K, E, E]`, `b [K, E]` (normal(0, std); 0 is the paper's init)."""
    k, e = hcfg.num_medusa_heads, hcfg.target_hidden_size
    return {
        "w": std * jax.random.normal(key, (k, e, e), jnp.float32),  # [K, E, E]
        "b": jnp.zeros((k, e), jnp.float32),  # [K, E]
    }


def medusa_features(hp: dict, h: jax.Array, num: int | None = None) -> jax.Array:
    """`h [..., E]` -> the first `num` (default K) heads' features `[..., num, E]`."""
    w, b = hp["w"][:num], hp["b"][:num]  # [n, E, E], [n, E]
    hf = h.astype(jnp.float32)
    return hf[..., None, :] + jax.nn.silu(jnp.einsum("...e,kef->...kf", hf, w) + b)


def medusa_logits(rp: dict, hcfg: HeadConfig, h: jax.Array, num: int | None = None):
    """`h [..., E]` -> logits `[..., num, V]`: head k predicts the token 2+k past h's position."""
    return feature_logits(rp, hcfg, medusa_features(rp["head"], h, num))


def draft_medusa(rp: dict, hcfg: HeadConfig, feats: jax.Array, cur: jax.Array, pick, *, gamma: int):
    """γ drafts for positions cur+1..cur+γ from h_{cur−1}.

    Args:
      rp: runtime params (`lm.pair`).
      hcfg: the head's config (static).
      feats: `[B, C, E]` target features by position.
      cur: `[B]` int32 position of the last committed token (>= 1: the prompt is non-empty).
      pick: the loop's token choice, `pick(logits [B, V], j) -> (tokens [B], q [B, V])`.
      gamma: drafts, <= K.

    Returns:
      (tokens `[B, γ]` int32, q `[B, γ, V]` float32).
    """
    b = cur.shape[0]
    return draft_medusa_from(rp, hcfg, feats[jnp.arange(b), cur - 1], pick, gamma=gamma)


def draft_medusa_from(rp: dict, hcfg: HeadConfig, h: jax.Array, pick, *, gamma: int):
    """γ drafts from the features `h [B, E]` of position cur − 1 -> (tokens `[B, γ]`, q
    `[B, γ, V]`); `draft_medusa` gathers h from the loop's features, the engine from its pool."""
    logits = medusa_logits(rp, hcfg, h, gamma)  # [B, γ, V]
    toks, qs = [], []
    for j in range(gamma):  # γ is small and static; each pick keys its noise by j
        t, q = pick(logits[:, j], j)
        toks.append(t)
        qs.append(q)
    return jnp.stack(toks, axis=1), jnp.stack(qs, axis=1)
