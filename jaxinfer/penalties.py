"""Repetition, frequency and presence penalties and the logit bias, as a pure function of the
logits and each row's token history.

    x = logits + bias                                   # logit_bias (OpenAI)
    x = where(seen, where(x > 0, x / r, x * r), x)      # repetition_penalty r, prompt + output
    x = x - f * counts - p * (counts > 0)               # frequency f, presence p: output only

`seen [B, V]` marks the tokens of a row's prompt and output, `counts [B, V]` counts those of its
output: the rules of vLLM's sampler (transformers' `RepetitionPenaltyLogitsProcessor` is the same
repetition rule over its `input_ids`). The result is what `sampling.sample` receives, so
temperature, top-k, top-p and min-p act on penalized logits and greedy rows take the penalized
argmax; logprobs stay those of the model.

Two ways to get the history on the device: `ji.generate` carries `(counts, seen)` through its
decode loop and adds each sampled token (`add_tokens`); the engine sends each sampled row's
tokens so far as a padded `[B, H]` array (`history_counts`), and its speculative verification
adds the drafts before each verified position (`with_drafts`). All of it runs only for batches
with a penalized row (`SamplingParams.penalized`), so other batches compile and run as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.cache.metadata import bucket
from jaxinfer.sampling import SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyBatch:
    """Per-row penalty settings as device arrays (padding rows: no penalty, no bias)."""

    presence: jax.Array  # [B] float32
    frequency: jax.Array  # [B] float32
    repetition: jax.Array  # [B] float32 (1 = off)
    bias_ids: jax.Array  # [B, K] int32 token ids; padding entries hold V (dropped)
    bias: jax.Array  # [B, K] float32

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], vocab_size: int, pad_to: int | None = None
    ) -> PenaltyBatch:
        """Stacks per-request settings; K is the longest logit_bias bucketed to a power of two.

        Token ids of `logit_bias` must lie in the vocabulary (`validate_requests` checks it).
        """
        b = max(len(params), pad_to or 0)
        k = bucket(max((len(sp.logit_bias) for sp in params), default=0), 1)
        ids = np.full((b, k), vocab_size, np.int32)
        bias = np.zeros((b, k), np.float32)
        for r, sp in enumerate(params):
            row_ids, row_bias = sp.logit_bias_arrays
            ids[r, : len(row_ids)], bias[r, : len(row_ids)] = row_ids, row_bias
        pad = [0.0] * (b - len(params))
        return cls(
            presence=np.array([sp.presence_penalty for sp in params] + pad, np.float32),
            frequency=np.array([sp.frequency_penalty for sp in params] + pad, np.float32),
            repetition=np.array(
                [sp.repetition_penalty for sp in params] + [1.0] * len(pad), np.float32
            ),  # fmt: skip
            bias_ids=ids,
            bias=bias,
        )

    def take(self, idx: jax.Array) -> PenaltyBatch:
        """Rows `idx`."""
        return jax.tree.map(lambda x: x[idx], self)


def history_counts(
    history: jax.Array, num_prompt: jax.Array, vocab_size: int
) -> tuple[jax.Array, jax.Array]:
    """`(counts, seen)` of padded token histories.

    Args:
      history: `[B, H]` int32 each row's prompt then output tokens; entries < 0 are padding.
      num_prompt: `[B]` int32 how many leading entries of a row are its prompt.
      vocab_size: V.

    Returns:
      counts `[B, V]` int32 occurrences in the output; seen `[B, V]` bool tokens of prompt or
      output.
    """
    b, h = history.shape
    valid = history >= 0  # [B, H]
    ids = jnp.where(valid, history, vocab_size)  # [B, H] padding -> V, dropped below
    is_out = valid & (jnp.arange(h)[None, :] >= num_prompt[:, None])  # [B, H]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, h))
    counts = jnp.zeros((b, vocab_size), jnp.int32).at[rows, ids].add(is_out, mode="drop")
    seen = jnp.zeros((b, vocab_size), jnp.bool_).at[rows, ids].set(True, mode="drop")
    return counts, seen


def add_tokens(
    counts: jax.Array, seen: jax.Array, tokens: jax.Array, live: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """`(counts, seen)` after each live row emitted `tokens [B]` (`live [B]` bool)."""
    rows = jnp.arange(tokens.shape[0])
    counts = counts.at[rows, tokens].add(live.astype(counts.dtype))
    seen = seen.at[rows, tokens].max(live)
    return counts, seen


def with_drafts(
    counts: jax.Array, seen: jax.Array, draft: jax.Array, live: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """`(counts, seen)` at each of the G = γ + 1 positions a speculative step verifies.

    Position j conditions on the committed history and drafts 0..j-1, so it counts them as
    output: what plain decoding would have counted there had those drafts been sampled. A
    position is used only if every draft before it was accepted, so this is exact.

    Args:
      counts: `[R, V]` int32 and seen `[R, V]` bool of the committed history.
      draft: `[R, G-1]` int32 drafted tokens; live `[R, G-1]` bool which of them exist.

    Returns:
      counts `[R, G, V]` int32, seen `[R, G, V]` bool.
    """
    oh = jax.nn.one_hot(draft, counts.shape[-1], dtype=counts.dtype) * live[..., None]
    cum = jnp.cumsum(oh, axis=1)  # [R, G-1, V] drafts 0..j
    start = jnp.zeros_like(counts)[:, None]  # [R, 1, V]: position 0 follows no draft
    cum = jnp.concatenate([start, cum], axis=1)  # [R, G, V] drafts 0..j-1
    return counts[:, None] + cum, seen[:, None] | (cum > 0)


def apply_penalties(
    logits: jax.Array, pb: PenaltyBatch, counts: jax.Array, seen: jax.Array
) -> jax.Array:
    """The penalized logits `[B, V]` float32 (see the module docstring for the rule).

    Args:
      logits: `[B, V]` the model's logits.
      pb: `[B]` rows of settings.
      counts: `[B, V]` int32 occurrences of each token in a row's output.
      seen: `[B, V]` bool tokens of a row's prompt or output.
    """
    b = logits.shape[0]
    x = jnp.asarray(logits, jnp.float32)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], pb.bias_ids.shape)  # [B, K]
    x = x.at[rows, pb.bias_ids].add(pb.bias, mode="drop")
    r = pb.repetition[:, None]  # [B, 1]
    x = jnp.where(seen, jnp.where(x > 0, x / r, x * r), x)
    c = counts.astype(jnp.float32)
    return x - pb.frequency[:, None] * c - pb.presence[:, None] * (c > 0)
