"""Requests and per-sequence state, as the host scheduler sees them.

A `Request` is what a client submits: a prompt and sampling parameters. The scheduler only reads
three of those parameters (`max_tokens`, `stop_token_ids`, `n`) and passes the object through
untouched, so any object with these attributes works (`jaxinfer.sampling.SamplingParams` in the
engine, a small dataclass in tests). A request with `n > 1` becomes n `SequenceState`s: the first
prefills the prompt, the others are forked from it after the prefill and share its KV blocks.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from jaxinfer.checks import INT32_MAX, as_int


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # submitted, never scheduled
    RUNNING = "running"  # holds KV blocks; scheduled every step it fits
    PREEMPTED = "preempted"  # blocks freed; waits to recompute prompt + generated tokens
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # sampled a stop token (kept in the output)
    LENGTH = "length"  # reached max_tokens
    ABORT = "abort"  # aborted by the client


@dataclasses.dataclass(eq=False)
class Request:
    """A generation request.

    Args:
      request_id: a hashable id, unique among live requests.
      prompt_token_ids: the prompt, at least one token id.
      sampling_params: any object with `max_tokens` (int >= 1), `stop_token_ids` (ints, or None)
        and optionally `n` (int >= 1, default 1); other fields are opaque to the scheduler.
      arrival_time: when the request arrived, in the caller's clock (seconds).
    """

    request_id: Hashable
    prompt_token_ids: list[int]  # [P]
    sampling_params: Any
    arrival_time: float = 0.0
    # The last `num_generated` prompt tokens were generated earlier for this request (a
    # disaggregated decode side continues what the prefill side sampled): penalties count them
    # as output. Everything else treats them as prompt.
    num_generated: int = 0

    def __post_init__(self):
        rid = self.request_id
        prompt = self.prompt_token_ids
        try:
            if isinstance(prompt, (str, bytes)):
                raise TypeError
            # A numpy or jax array converts in one transfer, not one per token.
            prompt = np.asarray(prompt).tolist() if hasattr(prompt, "__array__") else list(prompt)
            if not isinstance(prompt, list):
                raise TypeError  # a 0-d array
        except TypeError:
            raise ValueError(
                f"request {rid!r}: prompt_token_ids must be a sequence of ints, "
                f"got {type(self.prompt_token_ids).__name__}"
            ) from None
        if len(prompt) == 0:
            raise ValueError(f"request {rid!r}: prompt_token_ids is empty")
        ids = [as_int(t) for t in prompt]
        if not all(t is not None and 0 <= t <= INT32_MAX for t in ids):
            raise ValueError(
                f"request {rid!r}: prompt_token_ids must be ints in [0, 2**31 - 1], got {prompt!r}"
            )
        self.prompt_token_ids = ids
        sp = self.sampling_params
        for name in ("max_tokens", "stop_token_ids"):
            if not hasattr(sp, name):
                raise ValueError(
                    f"request {rid!r}: sampling_params needs a {name!r} attribute; "
                    f"got {type(sp).__name__}"
                )
        max_tokens = as_int(sp.max_tokens)
        if max_tokens is None or not 1 <= max_tokens <= INT32_MAX:
            raise ValueError(
                f"request {rid!r}: max_tokens must be an int in [1, 2**31 - 1], got "
                f"{sp.max_tokens!r}"
            )
        n = as_int(getattr(sp, "n", 1))
        if n is None or not 1 <= n <= INT32_MAX:
            raise ValueError(
                f"request {rid!r}: n must be an int in [1, 2**31 - 1], got {getattr(sp, 'n', 1)!r}"
            )
        g = as_int(self.num_generated)
        if g is None or not 0 <= g < len(ids):
            raise ValueError(
                f"request {rid!r}: num_generated must be an int in [0, {len(ids) - 1}] (fewer "
                f"than the prompt's {len(ids)} tokens), got {self.num_generated!r}"
            )
        self.num_generated = g
        stop = () if sp.stop_token_ids is None else tuple(sp.stop_token_ids)
        if not all(as_int(t) is not None for t in stop):
            raise ValueError(f"request {rid!r}: stop_token_ids must be ints, got {stop!r}")

    @functools.cached_property  # read for every sampled token, like stop_token_ids
    def max_tokens(self) -> int:
        return as_int(self.sampling_params.max_tokens)

    @functools.cached_property  # read for every sampled token; sampling_params is not mutated
    def stop_token_ids(self) -> frozenset[int]:
        stop = self.sampling_params.stop_token_ids
        return frozenset() if stop is None else frozenset(as_int(t) for t in stop)

    @property
    def n(self) -> int:
        return as_int(getattr(self.sampling_params, "n", 1))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclasses.dataclass(eq=False)
class SequenceState:
    """One sampled continuation of a request, with the scheduler's bookkeeping.

    `token_ids[:num_computed]` have their K/V in the cache; the rest are computed in coming steps.
    A decoding sequence has exactly one uncomputed token: the one sampled last step.
    """

    seq_id: int
    request: Request
    sample_index: int  # 0 for the sequence that prefills; 1..n-1 for its forks
    token_ids: list[int]  # [P + generated] prompt then generated tokens
    num_computed: int = 0  # tokens whose K/V are in the cache
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    prefill_end: int = 0  # len(token_ids) at the last admission: below it, the step is a prefill
    forked: bool = False  # the prefilling sequence of an n > 1 request has forked its siblings

    @property
    def request_id(self) -> Hashable:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.request.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.request.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prefill_end

    @property
    def num_seats(self) -> int:
        """Batch rows this sequence reserves: n for a prefilling parent that will fork, else 1."""
        if self.sample_index == 0 and not self.forked:
            return self.request.n
        return 1

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def append_tokens(self, new_token_ids: Sequence[int]) -> list[int]:
        """Appends sampled tokens up to the first stop condition.

        Stops after a stop token (which is kept) or when the output reaches `max_tokens`; sets
        `status` and `finish_reason` then. Tokens after the stop are dropped.

        Returns:
          The tokens actually appended.
        """
        accepted = []
        stop = self.request.stop_token_ids
        for t in new_token_ids:
            t = int(t)
            self.token_ids.append(t)
            accepted.append(t)
            if t in stop:
                self.finish(FinishReason.STOP)
                break
            if self.num_output_tokens >= self.request.max_tokens:
                self.finish(FinishReason.LENGTH)
                break
        return accepted

    def finish(self, reason: FinishReason) -> None:
        self.status = SeqStatus.FINISHED
        self.finish_reason = reason
