"""What the engine streams (`StreamOutput`) and returns (`RequestOutput`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

from jaxinfer.requests import GenerationOutput


@dataclasses.dataclass(frozen=True)
class StreamOutput:
    """New tokens of one sample of a request after a step."""

    request_id: Hashable
    sample_index: int  # 0 .. n-1
    new_token_ids: list[int]
    finished: bool  # this sample finished
    finish_reason: str | None  # "stop", "length", "abort" or "error" once finished
    request_finished: bool  # every sample of the request finished
    error: str | None = None  # with finish_reason "error": what failed (the exception's message)
    # With SamplingParams.logprobs: per new token (its logprob, ((id, logprob), ...) top-k).
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] | None = None


@dataclasses.dataclass(frozen=True)
class RequestOutput(GenerationOutput):
    """One request's result: `token_ids` / `finish_reason` of sample 0, and every sample.

    A failed request (see `Engine.step`) has finish_reason "error" and `error` its message;
    `token_ids` holds what it streamed before the failure.
    """

    request_id: Hashable = None
    samples: tuple[GenerationOutput, ...] = ()  # [n] in sample order; samples[0] is the above
