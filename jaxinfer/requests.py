"""The request path shared by `ji.generate`, the speculative loop and the engine (host side).

A request is a prompt (token ids) and its `SamplingParams`. This module holds what every entry
point does with one before the device sees it:

* **validation** (`validate_requests`): prompts, vocabulary, position limits, one
  SamplingParams per prompt, raising ValueError naming the bad value;
* **stop rules** (`stop_ids`, `stop_table`): a request stops on its `stop_token_ids` and on the
  model's eos unless `ignore_eos`; the stop token is kept in the output;
* **prompt batches** (`prompt_batch`): the bucketed ragged prefill of a whole request batch over
  contiguous block tables, with each row's prompt length and max_tokens;
* **outputs** (`GenerationOutput`): one request's result, the base of the speculative and
  engine outputs.

Shapes: B sequences (bucketed), M blocks per sequence, S block size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from jaxinfer.cache.metadata import (
    BatchMetadata,
    SeqChunk,
    bucket,
    build_metadata,
    contiguous_block_tables,
)
from jaxinfer.checks import as_int
from jaxinfer.config import ModelConfig
from jaxinfer.sampling import SamplingParams

PAD_TO_KEYS = ("seqs", "tokens", "blocks", "new_tokens")


@dataclasses.dataclass(frozen=True)
class GenerationOutput:
    """One request's result."""

    token_ids: list[int]  # generated ids, prompt excluded, stop token included
    finish_reason: str  # "stop" (a stop token), "length" (max_tokens) or "error"
    # With "error": what failed, e.g. non-finite logits. Keyword-only, so subclasses
    # (SpeculativeOutput) may add fields without defaults.
    error: str | None = dataclasses.field(default=None, kw_only=True)


# ------------------------------------------------------------------------------ validation


def per_prompt_sampling(
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams | Sequence[SamplingParams] | None,
) -> list:
    """One sampling entry per prompt (None: defaults; one SamplingParams: shared by all).

    Raises ValueError if `prompts` is not a non-empty list or the lengths differ. The entries
    are not type-checked here (`validate_requests` and the engine name the bad index).
    """
    if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of token-id lists, got {prompts!r}")
    if sampling is None:
        sampling = SamplingParams()
    if isinstance(sampling, SamplingParams):
        sampling = [sampling] * len(prompts)
    try:
        sampling = list(sampling)
    except TypeError:
        raise ValueError(
            f"sampling must be a SamplingParams, a list of them or None, got {sampling!r}"
        ) from None
    if len(sampling) != len(prompts):
        raise ValueError(f"got {len(sampling)} SamplingParams for {len(prompts)} prompts")
    return sampling


def validate_requests(
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams | Sequence[SamplingParams] | None,
) -> list[SamplingParams]:
    """Checks prompts and sampling params; returns one SamplingParams per prompt.

    Raises ValueError naming the bad value: no prompts, an empty prompt, a token id outside the
    vocabulary, a stop token, logit_bias, allowed or banned token id outside the vocabulary,
    bans or min_tokens that leave nothing to sample (`check_sampling`), prompt + max_tokens beyond
    max_position_embeddings, a sampling list of the wrong length, n != 1. A prompt is a list,
    tuple, numpy or jax array of integer token ids.
    """
    sampling = per_prompt_sampling(prompts, sampling)
    for i, (p, sp) in enumerate(zip(prompts, sampling)):
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling[{i}] is {type(sp).__name__}, expected SamplingParams")
        if sp.n != 1:
            raise ValueError(f"sampling[{i}].n={sp.n}: ji.generate samples n=1; use ji.Engine")
        if (
            isinstance(p, str | bytes)
            or not isinstance(p, Sequence | np.ndarray | jax.Array)
            or getattr(p, "ndim", 1) == 0  # a 0-d array has no len()
            or len(p) == 0
        ):
            raise ValueError(f"prompt {i} is empty or not a list of token ids: {p!r}")
        try:
            arr = np.asarray(p)
        except ValueError:  # ragged: [1, [2]]
            raise ValueError(f"prompt {i} must be a flat list of ints, got {p!r}") from None
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(
                f"prompt {i} must be a flat list of ints, got shape {arr.shape} dtype {arr.dtype}"
            )
        bad = arr[(arr < 0) | (arr >= cfg.vocab_size)]
        if bad.size:
            raise ValueError(
                f"prompt {i} has token id {int(bad[0])} outside the vocabulary [0, "
                f"{cfg.vocab_size})"
            )
        check_sampling(cfg, sp, f"sampling[{i}].")
        if len(p) + sp.max_tokens > cfg.max_position_embeddings:
            raise ValueError(
                f"prompt {i}: length {len(p)} + max_tokens {sp.max_tokens} = "
                f"{len(p) + sp.max_tokens} exceeds max_position_embeddings "
                f"{cfg.max_position_embeddings}"
            )
    return sampling


def token_list(prompt) -> list[int]:
    """A validated prompt (list, tuple, numpy or jax array) as Python ints, in one transfer."""
    if hasattr(prompt, "__array__"):
        return np.asarray(prompt).tolist()
    return [int(t) for t in prompt]


def check_pad_to(pad_to: Mapping[str, int] | None) -> dict[str, int]:
    """`ji.generate`'s minimum padded sizes, validated: keys of PAD_TO_KEYS, ints >= 1."""
    pad_to = dict(pad_to or {})
    unknown = set(pad_to) - set(PAD_TO_KEYS)
    if unknown:
        raise ValueError(f"pad_to has unknown keys {sorted(unknown)}")
    for key, value in pad_to.items():
        v = as_int(value)  # numpy / jax ints too (jaxinfer.checks)
        if v is None or v < 1:
            raise ValueError(f"pad_to[{key!r}]={value!r} is invalid: expected an int >= 1")
        pad_to[key] = v
    return pad_to


class SamplingError(ValueError):
    """A SamplingParams the model cannot serve; `field` names the offending field."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def check_sampling(cfg: ModelConfig, sp: SamplingParams, where: str = "") -> None:
    """The checks of one SamplingParams that need the model (its vocabulary and eos).

    Raises SamplingError (a ValueError) naming `{where}{field}`: a stop token, logit_bias,
    allowed or banned token id outside the vocabulary, one-token bad_words_ids that ban every
    token allowed, or min_tokens with only stop tokens allowed (and not banned).

    Longer bans can still leave nothing to sample after some outputs (allowed (1, 2), banned
    (2,) and (1, 1)); that depends on the output and is not checked, as in vLLM.
    """
    v = cfg.vocab_size
    for field, ids in (
        ("stop_token_ids", sp.stop_token_ids),
        ("logit_bias", [t for t, _ in sp.logit_bias]),
        ("allowed_token_ids", sp.allowed_token_ids or ()),
        ("bad_words_ids", [t for w in sp.bad_words_ids for t in w]),
    ):
        beyond = [t for t in ids if t >= v]
        if beyond:
            raise SamplingError(
                field, f"{where}{field} has token id {beyond[0]}, outside the vocabulary [0, {v})"
            )
    # What may ever be sampled: the allowed tokens (None: all V) less the one-token bans.
    banned = {w[0] for w in sp.bad_words_ids if len(w) == 1}
    allowed = sp.allowed_token_ids
    left = None if allowed is None else set(allowed) - banned  # None: V - len(banned) tokens
    if (len(banned) >= v) if left is None else not left:
        what = "every token" if allowed is None else f"every allowed_token_ids {list(allowed)}"
        raise SamplingError(
            "bad_words_ids",
            f"{where}bad_words_ids {[list(w) for w in sp.bad_words_ids if len(w) == 1]} ban "
            f"{what}, so nothing may be sampled",
        )
    if sp.min_tokens:
        stops = set(stop_ids(cfg, sp))
        if allowed is not None and set(allowed) <= stops:
            raise SamplingError(
                "allowed_token_ids",
                f"{where}allowed_token_ids {list(allowed)} are all stop tokens, so nothing may "
                f"be sampled before min_tokens={sp.min_tokens}",
            )
        if (len(banned | stops) >= v) if left is None else left <= stops:
            raise SamplingError(
                "bad_words_ids",
                f"{where}bad_words_ids ban every token that is not a stop token {sorted(stops)}"
                f", so nothing may be sampled before min_tokens={sp.min_tokens}",
            )


# ------------------------------------------------------------------------------ stop rules


def stop_ids(cfg: ModelConfig, sp: SamplingParams) -> tuple[int, ...]:
    """The request's stop tokens, sorted: its stop_token_ids and the model's eos unless ignored."""
    stops = set(sp.stop_token_ids)
    if cfg.eos_token_id is not None and not sp.ignore_eos:
        stops.add(cfg.eos_token_id)
    return tuple(sorted(stops))


def stop_table(cfg: ModelConfig, sampling: Sequence[SamplingParams], rows: int) -> np.ndarray:
    """`[rows, n_stop]` int32 stop ids per request (eos unless ignore_eos), padded with -1."""
    stops = [stop_ids(cfg, sp) for sp in sampling]
    width = bucket(max([len(s) for s in stops] + [1]))
    table = np.full((rows, width), -1, np.int32)
    for i, s in enumerate(stops):
        table[i, : len(s)] = s
    return table


# ---------------------------------------------------------------------------- prompt batches


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """A validated request batch laid out for one ragged prefill (host-side numpy)."""

    meta: BatchMetadata  # the prefill: every prompt, B padded logits rows
    tables: np.ndarray  # [B, M] int32 contiguous blocks of each sequence (block 0: null)
    prompt_lens: np.ndarray  # [B] int32 (0 for padding rows)
    max_tokens: np.ndarray  # [B] int32 (0 for padding rows)
    n: int  # real requests (rows n..B-1 are padding)


def prompt_bucket(n: int, minimum: int = 16) -> int:
    """The padded token count of a prefill of `n` prompt tokens: a power of two up to 128, then the
    next multiple of 1/16 of the power of two above (8 sizes an octave, at most 12.5% padding).

    Prefill is compute-bound on the linears, so padding costs its share of the time (200 tokens
    padded to 256 cost 28% more); finer buckets than `bucket` trade a few more compilations.
    """
    n = max(int(n), int(minimum), 1)
    p = bucket(n)
    step = max(p // 16, 8)
    return p if p <= 128 else -(-n // step) * step


def new_tokens_bucket(sampling: Sequence[SamplingParams], minimum: int = 8) -> int:
    """The bucketed largest max_tokens of the batch (at least `minimum`, a power of two)."""
    return bucket(max(sp.max_tokens for sp in sampling), minimum)


def prompt_batch(
    prompts: Sequence[Sequence[int]],
    sampling: Sequence[SamplingParams],
    block_size: int,
    *,
    capacity: int,
    pad_to: Mapping[str, int] | None = None,
) -> PromptBatch:
    """The bucketed prefill of validated requests (`validate_requests`).

    Args:
      prompts: token-id lists.
      sampling: one SamplingParams per prompt.
      block_size: S.
      capacity: tokens each sequence's blocks must hold (prompt, generated tokens and whatever
        the caller writes past them); M = bucket(⌈capacity / S⌉).
      pad_to: minimum padded sizes ("seqs", "tokens", "blocks"; `check_pad_to`).

    Returns:
      The PromptBatch: B = bucket(#prompts), T = prompt_bucket(total prompt tokens, 16); its
      `tables` are `[B, M]`, the prefill metadata's `[B, min(M, bucket(⌈T / S⌉))]`.
    """
    pad_to = pad_to or {}
    n = len(prompts)
    b = bucket(n, pad_to.get("seqs", 1))
    lens = [len(p) for p in prompts]
    m = bucket(-(-capacity // block_size), pad_to.get("blocks", 1))
    tables = contiguous_block_tables(b, m)
    t = prompt_bucket(sum(lens), max(16, pad_to.get("tokens", 16)))
    # The prefill's tables stop at the blocks its T rows can reach (no prompt is longer than T):
    # its attention reads every block of its table (one chunk up to 512 keys), and a table sized
    # for the generated tokens too cost 1.14-1.16x the prefill of one 200-token prompt
    # (BENCHMARKS.md).
    # A function of the static T and M, so it adds no compilation.
    mp = min(m, bucket(-(-t // block_size)))
    chunks = [SeqChunk(token_list(p), 0, tables[i, :mp]) for i, p in enumerate(prompts)]
    meta, _ = build_metadata(
        chunks, block_size, num_tokens=t, num_seqs=b, max_blocks=mp, num_logits=b,
    )  # fmt: skip
    prompt_lens = np.zeros(b, np.int32)
    prompt_lens[:n] = lens
    max_tokens = np.zeros(b, np.int32)
    max_tokens[:n] = [sp.max_tokens for sp in sampling]
    return PromptBatch(meta, tables, prompt_lens, max_tokens, n)
