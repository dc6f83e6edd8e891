"""The scheduler's data: its limits (`SchedulerConfig`), one step's work (`Schedule` of
`ScheduledSeq`s), its streamed result (`SeqOutput`) and the state `Scheduler.rollback` restores.

Plain host dataclasses: the scheduler (scheduler.py) fills them, the engine reads them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

from jaxinfer.engine.request import FinishReason, SequenceState


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling limits.

    Args:
      max_num_seqs: running sequences at once (rows of the step's batch).
      max_num_batched_tokens: tokens computed per step over all sequences; bounds step latency.
      enable_chunked_prefill: split prompts across steps and mix them with decodes. Without it a
        prompt is scheduled whole, so every request needs prompt + max_tokens - 1 <= the budget
        (the longest recompute after a preemption).
      long_prefill_threshold: with chunked prefill, at most this many prefill tokens per sequence
        per step, so one long prompt cannot take the whole budget; None: no cap.
    """

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    long_prefill_threshold: int | None = None

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"SchedulerConfig.{name} must be an int >= 1, got {v!r}")
        t = self.long_prefill_threshold
        if t is not None:
            if not isinstance(t, int) or isinstance(t, bool) or t < 1:
                raise ValueError(
                    f"SchedulerConfig.long_prefill_threshold must be None or an int >= 1, got {t!r}"
                )
            if not self.enable_chunked_prefill:
                raise ValueError(
                    "SchedulerConfig.long_prefill_threshold needs enable_chunked_prefill=True "
                    f"(a prompt is otherwise scheduled whole), got threshold {t}"
                )


@dataclasses.dataclass(frozen=True)
class ScheduledSeq:
    """What one sequence computes in a step."""

    seq_id: int
    request_id: Hashable
    token_ids: list[int]  # [q_len] tokens whose K/V are written this step
    start_pos: int  # position of token_ids[0] = tokens already in the KV cache
    block_table: list[int]  # [cdiv(start_pos + q_len, S)] physical blocks for positions 0..end
    sample: bool  # sample from the logits of the last token
    sample_seq_ids: tuple[int, ...]  # one sampled token each, from those logits; () if not sample
    # Speculation: γ draft positions after token_ids (a decode only), slots in block_table; the
    # engine verifies token_ids + γ drafts and `update` gets 1..γ+1 tokens for the sequence.
    num_lookahead: int = 0


@dataclasses.dataclass
class Schedule:
    """One step's work. Apply `block_copies` (in order) before running the step."""

    seqs: list[ScheduledSeq]  # [B] at most max_num_seqs, no sequence twice
    block_copies: list[tuple[int, int]]  # (src, dst) whole-block copies, all layers
    preempted_seq_ids: list[int]  # preempted this step (blocks already freed)
    num_batched_tokens: int  # sum of len(token_ids) <= max_num_batched_tokens

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclasses.dataclass(frozen=True)
class SeqOutput:
    """New tokens of one sequence after a step (streaming)."""

    request_id: Hashable
    seq_id: int
    new_token_ids: list[int]
    finished: bool  # this sequence finished
    finish_reason: FinishReason | None
    request_finished: bool  # every sequence of the request finished


@dataclasses.dataclass(frozen=True)
class SchedulerState:
    """What `Scheduler.rollback` restores (see `Scheduler._save_state`)."""

    waiting: list[SequenceState]
    running: list[SequenceState]
    seqs: dict[int, SequenceState]
    requests: dict[Hashable, list[SequenceState]]
    seq_ids: dict[Hashable, tuple[int, ...]]
    num_preemptions: int
    fields: list[tuple]  # per live sequence: it, num_computed, status, reason, prefill_end,
    # forked, len(token_ids)
    allocator: object  # BlockAllocator.save_state()
