"""Repetition, frequency and presence penalties, the logit bias and the token masks
(`allowed_token_ids`, `bad_words_ids`, `min_tokens`), as a pure function of the logits and each
row's history.

    x = logits + bias                                   # logit_bias (OpenAI)
    x = where(seen, where(x > 0, x / r, x * r), x)      # repetition_penalty r, prompt + output
    x = x - f * counts - p * (counts > 0)               # frequency f, presence p: output only
    x = where(allowed, x, -inf)                         # allowed_token_ids (vLLM)
    x = where(banned, -inf, x)                          # bad_words_ids (vLLM's bad_words)
    x = where(stop & (sum(counts) < min_tokens), -inf, x)   # min_tokens (vLLM)

`seen [B, V]` marks the tokens of a row's prompt and output, `counts [B, V]` counts those of its
output: the rules of vLLM's sampler (transformers' `RepetitionPenaltyLogitsProcessor` is the same
repetition rule over its `input_ids`). `banned` is vLLM v1's `apply_bad_words` over the output:
for each banned sequence w of length L, w[-1] is banned where the output's last L - 1 tokens
are w[:-1] (always where L = 1); it reads `tail [B, P]`, the output's last P tokens, P the
longest w[:-1] of the batch (`output_tail`). `stop` marks a row's stop tokens (its
`stop_token_ids` and the model's eos unless `ignore_eos`), so a row cannot stop before it
generated `min_tokens` tokens; the count is the output's length, drafts before a verified
position included. The result is what `sampling.sample` receives, so temperature, top-k, top-p
and min-p act on penalized logits and greedy rows take the penalized argmax; logprobs stay those
of the model.

Two ways to get the history on the device: `ji.generate` carries `(counts, seen, tail)` through
its decode loop and adds each sampled token (`add_tokens`, `push_tail`); the engine sends each
sampled row's tokens so far as a padded `[B, H]` array (`history_counts`, `output_tail`), and
speculative verification adds the drafts before each verified position (`with_drafts`,
`tails_at_drafts`). All of it runs only for batches with a penalized row
(`SamplingParams.penalized`), so other batches compile and run as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.cache.metadata import bucket
from jaxinfer.config import ModelConfig
from jaxinfer.sampling import SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyBatch:
    """Per-row penalty settings as device arrays (padding rows: no penalty, no bias, no mask)."""

    presence: jax.Array  # [B] float32
    frequency: jax.Array  # [B] float32
    repetition: jax.Array  # [B] float32 (1 = off)
    bias_ids: jax.Array  # [B, K] int32 token ids; padding entries hold V (dropped)
    bias: jax.Array  # [B, K] float32
    min_tokens: jax.Array  # [B] int32 (0 = off)
    stop_ids: jax.Array  # [B, S] int32 stop tokens barred before min_tokens; V: padding
    restrict: jax.Array  # [B] bool: only allowed_ids may be sampled
    allowed_ids: jax.Array  # [B, A] int32; V: padding
    # bad_words_ids: ban w of row r is bad_prefix[r, w] (w[:-1] right-aligned; V before it:
    # any token, so one-token bans always match) then bad_last[r, w].
    bad_prefix: jax.Array  # [B, W, P] int32; V: any token
    bad_last: jax.Array  # [B, W] int32 the banned token where the prefix matches; V: padding

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        cfg: ModelConfig,
        pad_to: int | None = None,
    ) -> PenaltyBatch:
        """Stacks per-request settings; K, S, A, W and P are the longest row's, bucketed to
        powers of two. The model's `cfg` gives the vocabulary and its eos (a stop token of every row
        without `ignore_eos`).

        Token ids must lie in the vocabulary (`validate_requests` checks them).
        """
        b = max(len(params), pad_to or 0)
        vocab_size, eos_token_id = cfg.vocab_size, cfg.eos_token_id

        def table(rows: list) -> np.ndarray:  # ragged id lists -> [b, width] padded with V
            out = np.full((b, bucket(max(map(len, rows), default=0), 1)), vocab_size, np.int32)
            for r, ids in enumerate(rows):
                out[r, : len(ids)] = ids
            return out

        ids = table([sp.logit_bias_arrays[0] for sp in params])
        bias = np.zeros(ids.shape, np.float32)
        for r, sp in enumerate(params):
            bias[r, : len(sp.logit_bias)] = sp.logit_bias_arrays[1]

        def barred(sp: SamplingParams) -> list[int]:  # the stop tokens min_tokens holds back
            if not sp.min_tokens:
                return []
            eos = () if sp.ignore_eos or eos_token_id is None else (eos_token_id,)
            return sorted(set(sp.stop_token_ids).union(eos))

        # bad_words_ids: W bans of up to P + 1 tokens per row (`SamplingParams.bad_words_arrays`).
        bans = [sp.bad_words_arrays for sp in params]
        w = bucket(max(len(last) for _, last in bans), 1)
        p = bucket(max(pre.shape[1] for pre, _ in bans), 1)
        bad_prefix = np.full((b, w, p), vocab_size, np.int32)
        bad_last = np.full((b, w), vocab_size, np.int32)
        for r, (pre, last) in enumerate(bans):
            bad_prefix[r, : len(last), p - pre.shape[1] :] = np.where(pre < 0, vocab_size, pre)
            bad_last[r, : len(last)] = last

        pad = [0.0] * (b - len(params))
        return cls(
            presence=np.array([sp.presence_penalty for sp in params] + pad, np.float32),
            frequency=np.array([sp.frequency_penalty for sp in params] + pad, np.float32),
            repetition=np.array(
                [sp.repetition_penalty for sp in params] + [1.0] * len(pad), np.float32
            ),  # fmt: skip
            bias_ids=ids,
            bias=bias,
            min_tokens=np.array([sp.min_tokens for sp in params] + [0] * len(pad), np.int32),
            stop_ids=table([barred(sp) for sp in params]),
            restrict=np.array(
                [sp.allowed_token_ids is not None for sp in params] + [False] * len(pad)
            ),  # fmt: skip
            allowed_ids=table([sp.allowed_token_ids_array for sp in params]),
            bad_prefix=bad_prefix,
            bad_last=bad_last,
        )

    @property
    def tail_width(self) -> int:
        """P: the output tokens the bad_words_ids rule reads (`output_tail`)."""
        return self.bad_prefix.shape[-1]

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


def output_tail(history: jax.Array, num_prompt: jax.Array, width: int) -> jax.Array:
    """The last `width` output tokens of padded token histories, oldest first.

    Args:
      history: `[B, H]` int32 each row's prompt then output tokens, then padding (< 0).
      num_prompt: `[B]` int32 how many leading entries of a row are its prompt.
      width: P.

    Returns:
      `[B, P]` int32: the output's last P tokens right-aligned, -1 where it has fewer.
    """
    n = jnp.sum(history >= 0, axis=-1)  # [B] tokens in each row
    at = n[:, None] - width + jnp.arange(width)[None, :]  # [B, P] history index of each slot
    tail = jnp.take_along_axis(history, jnp.clip(at, 0, history.shape[1] - 1), axis=-1)
    return jnp.where(at >= num_prompt[:, None], tail, -1)


def push_tail(tail: jax.Array, tokens: jax.Array, live: jax.Array) -> jax.Array:
    """`tail [B, P]` after each live row emitted `tokens [B]` (`live [B]` bool)."""
    pushed = jnp.concatenate([tail[:, 1:], tokens[:, None]], axis=1)
    return jnp.where(live[:, None], pushed, tail)


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


def tails_at_drafts(tail: jax.Array, draft: jax.Array) -> jax.Array:
    """`tail` at each of the G = γ + 1 positions a speculative step verifies: position j's
    output ends with drafts 0..j-1 (as `with_drafts`; a position past a row's γ is never used).

    Args:
      tail: `[R, P]` int32 the committed output's last P tokens (`output_tail`).
      draft: `[R, G-1]` int32 drafted tokens.

    Returns:
      `[R, G, P]` int32.
    """
    p, g = tail.shape[1], draft.shape[1] + 1
    ext = jnp.concatenate([tail, draft], axis=1)  # [R, P + G-1]
    return ext[:, jnp.arange(g)[:, None] + jnp.arange(p)[None, :]]  # slot k of j: ext[j + k]


def apply_penalties(
    logits: jax.Array, pb: PenaltyBatch, counts: jax.Array, seen: jax.Array, tail: jax.Array
) -> jax.Array:
    """The penalized and masked logits `[B, V]` float32 (the rule: the module docstring).

    Args:
      logits: `[B, V]` the model's logits.
      pb: `[B]` rows of settings.
      counts: `[B, V]` int32 occurrences of each token in a row's output.
      seen: `[B, V]` bool tokens of a row's prompt or output.
      tail: `[B, P]` int32 the last P = `pb.tail_width` tokens of a row's output, -1 where it
        has fewer (`output_tail`).
    """
    x = jnp.asarray(logits, jnp.float32)
    x = x.at[_rows(pb.bias_ids), pb.bias_ids].add(pb.bias, mode="drop")
    r = pb.repetition[:, None]  # [B, 1]
    x = jnp.where(seen, jnp.where(x > 0, x / r, x * r), x)
    c = counts.astype(jnp.float32)
    x = x - pb.frequency[:, None] * c - pb.presence[:, None] * (c > 0)
    allowed = _mask(pb.allowed_ids, x.shape)  # [B, V]
    x = jnp.where(pb.restrict[:, None] & ~allowed, -jnp.inf, x)
    x = jnp.where(_mask(_banned(pb, tail, x.shape[-1]), x.shape), -jnp.inf, x)
    early = jnp.sum(counts, axis=-1) < pb.min_tokens  # [B] fewer outputs than min_tokens
    return jnp.where(early[:, None] & _mask(pb.stop_ids, x.shape), -jnp.inf, x)


def apply_at_drafts(
    logits: jax.Array,
    pb: PenaltyBatch,
    counts: jax.Array,
    seen: jax.Array,
    tail: jax.Array,
    draft: jax.Array,
    live: jax.Array,
) -> jax.Array:
    """`apply_penalties` at the G = γ + 1 positions a speculative step verifies.

    Args:
      logits: `[R, G, V]` each row's logits at its verified positions.
      pb: `[R]` rows of settings.
      counts: `[R, V]` int32, seen `[R, V]` bool and tail `[R, P]` int32 of each row's
        committed history.
      draft: `[R, G-1]` int32 drafted tokens; live `[R, G-1]` bool which of them exist.

    Returns:
      `[R, G, V]` float32: position j penalized by the history plus drafts 0..j-1 (`with_drafts`,
      `tails_at_drafts`).
    """
    r, g, v = logits.shape
    counts, seen = with_drafts(counts, seen, draft, live)  # [R, G, V]
    tails = tails_at_drafts(tail, draft)  # [R, G, P]
    flat = (r * g, v)
    x = apply_penalties(
        logits.reshape(flat), pb.take(jnp.repeat(jnp.arange(r), g)),
        counts.reshape(flat), seen.reshape(flat), tails.reshape(r * g, -1),
    )  # fmt: skip
    return x.reshape(r, g, v)


def _banned(pb: PenaltyBatch, tail: jax.Array, vocab_size: int) -> jax.Array:
    """`[B, W]` int32 the token each ban of a row forbids after `tail [B, P]` (V: none)."""
    pre = pb.bad_prefix  # [B, W, P]
    match = jnp.all((pre == vocab_size) | (pre == tail[:, None, :]), axis=-1)  # [B, W]
    return jnp.where(match, pb.bad_last, vocab_size)


def _rows(ids: jax.Array) -> jax.Array:
    """The row index of every entry of `ids [B, K]`."""
    return jnp.broadcast_to(jnp.arange(ids.shape[0])[:, None], ids.shape)


def _mask(ids: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """`[B, V]` bool, True at each row's `ids [B, K]` (entries V: padding, dropped)."""
    return jnp.zeros(shape, jnp.bool_).at[_rows(ids), ids].set(True, mode="drop")
