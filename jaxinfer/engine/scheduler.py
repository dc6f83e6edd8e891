"""Host-side continuous-batching scheduler: waiting/running queues -> one `Schedule` per step.

The scheduler only touches host state (the `BlockAllocator` and the sequences) and returns a plain
`Schedule`; the engine turns it into batch metadata, applies the block copies, runs one jitted step
and hands the sampled tokens back to `update`. Every `schedule()` must be followed by `update()`,
or by `rollback()`, which returns the scheduler and its allocator to their state before the
`schedule()` (the engine's undo of a step that failed).

Policy, per step, under `max_num_seqs` batch rows and `max_num_batched_tokens` tokens:

1. running sequences that decode, oldest first (a decode that needs a block and finds none
   preempts the newest running sequence not yet scheduled this step, possibly itself);
2. running sequences whose prefill is unfinished (chunked prefill only), oldest first;
3. waiting sequences, first come first served, while blocks, rows and tokens last; none in a step
   that preempted. The head of the queue blocks the rest (strict FCFS).

Preemption is by recompute: the victim's blocks are freed and it goes back to the front of the
waiting queue with its generated tokens appended to what it must recompute (prefix caching may find
most of them again). Without chunked prefill a prefill is scheduled whole or not at all.

A request with `n > 1` prefills once; the step that computes the prompt's last token samples n
tokens from its logits (`ScheduledSeq.sample_seq_ids`), and `update` forks the other n - 1
sequences, which share every block; the first append into the shared partial block copies it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Mapping, Sequence

from jaxinfer.cache.allocator import BlockAllocator, NoFreeBlocksError
from jaxinfer.engine.request import FinishReason, Request, SeqStatus, SequenceState
from jaxinfer.engine.schedule import (  # noqa: F401  (the step's types, re-exported)
    Schedule,
    ScheduledSeq,
    SchedulerConfig,
    SchedulerState,
    SeqOutput,
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    """Continuous-batching scheduler over a `BlockAllocator` (see the module docstring).

    Args:
      config: the scheduling limits.
      allocator: the page manager of the KV cache the engine's step reads and writes.
    """

    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator):
        self.config = config
        self.allocator = allocator
        self._waiting: collections.deque[SequenceState] = collections.deque()
        self._running: list[SequenceState] = []  # admission order, oldest first
        self._seqs: dict[int, SequenceState] = {}  # live sequences
        self._requests: dict[Hashable, list[SequenceState]] = {}  # live requests
        self._seq_ids: dict[Hashable, tuple[int, ...]] = {}  # live request -> its n seq ids
        self._next_seq_id = 0
        self._pending: Schedule | None = None
        self._before: SchedulerState | None = None  # the state before the pending schedule()
        self._between: list[tuple] = []  # add_request / abort calls since then, for rollback
        self.num_preemptions = 0

    # ------------------------------------------------------------------------------- views

    @property
    def running(self) -> tuple[SequenceState, ...]:
        return tuple(self._running)

    @property
    def waiting(self) -> tuple[SequenceState, ...]:
        return tuple(self._waiting)

    @property
    def num_seats_used(self) -> int:
        """Batch rows held by running sequences, counting the forks a prefill will make."""
        return sum(seq.num_seats for seq in self._running)

    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting)

    def sequence(self, seq_id: int) -> SequenceState:
        """A live sequence by id."""
        return self._seqs[seq_id]

    def sequences(self, request_id: Hashable) -> list[SequenceState]:
        """The sequences of a live request, finished ones included ([] once it is done)."""
        return list(self._requests.get(request_id, ()))

    # --------------------------------------------------------------------------- requests

    def add_request(self, request: Request) -> tuple[int, ...]:
        """Queues a request; returns the ids its n sequences will have (the first prefills).

        Raises:
          ValueError: the id is live already, or the request could never be scheduled: it needs
            more blocks than the whole pool, more rows than max_num_seqs, or (without chunked
            prefill) a longer prefill than the token budget.
        """
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already live")
        cfg, S = self.config, self.allocator.block_size
        P, M, n = request.num_prompt_tokens, request.max_tokens, request.n
        usable = self.allocator.num_blocks - 1
        if _cdiv(P + M, S) > usable:
            raise ValueError(
                f"request {rid!r} can never fit: {P} prompt + {M} max_tokens need "
                f"{_cdiv(P + M, S)} KV blocks of {S} slots, the pool has {usable} usable blocks"
            )
        if n > cfg.max_num_seqs:
            raise ValueError(
                f"request {rid!r} asks for n={n} parallel samples but max_num_seqs is "
                f"{cfg.max_num_seqs}"
            )
        if not cfg.enable_chunked_prefill and P + M - 1 > cfg.max_num_batched_tokens:
            raise ValueError(
                f"request {rid!r} can never be scheduled without chunked prefill: {P} prompt + "
                f"{M} max_tokens - 1 = {P + M - 1} tokens to (re)compute in one step exceed "
                f"max_num_batched_tokens {cfg.max_num_batched_tokens}"
            )
        ids = tuple(range(self._next_seq_id, self._next_seq_id + n))
        self._next_seq_id += n
        self._queue(request, ids)
        if self._before is not None:
            self._between.append(("add", request, ids))
        return ids

    def _queue(self, request: Request, ids: tuple[int, ...]) -> None:
        seq = SequenceState(ids[0], request, 0, list(request.prompt_token_ids))
        self._seqs[seq.seq_id] = seq
        self._requests[request.request_id] = [seq]
        self._seq_ids[request.request_id] = ids
        self._waiting.append(seq)

    def abort(self, request_id: Hashable) -> bool:
        """Frees every sequence of a request in any state; False if it is not live."""
        seqs = self._requests.get(request_id)
        if seqs is None:
            return False
        if self._before is not None:
            self._between.append(("abort", request_id))
        for seq in [s for s in seqs if not s.is_finished]:
            if seq.status is SeqStatus.RUNNING:
                self.allocator.free(seq.seq_id)
                self._running.remove(seq)
            elif seq.status in (SeqStatus.WAITING, SeqStatus.PREEMPTED):
                self._waiting.remove(seq)
            seq.finish(FinishReason.ABORT)
            self._retire(seq)
        return True

    # --------------------------------------------------------------------------- schedule

    def schedule(self, lookahead: Callable[[SequenceState], int] | None = None) -> Schedule:
        """Decides the next step (see the module docstring for the policy).

        Args:
          lookahead: speculation: the γ wanted for a decoding sequence. Each decode then takes
            1 + γ tokens of the budget (γ cut to the budget left, to max_tokens and to the free
            blocks: speculation never preempts), and `ScheduledSeq.num_lookahead` says γ.
        """
        if self._pending is not None or self._before is not None:
            raise RuntimeError(
                "schedule() called again before update() or rollback() of the previous step "
                "(an update() that raised needs rollback())"
            )
        self._before = self._save_state()
        self._between = []
        cfg = self.config
        chunked = cfg.enable_chunked_prefill
        cap = cfg.long_prefill_threshold or cfg.max_num_batched_tokens
        budget = cfg.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        scheduled: set[int] = set()
        copies: list[tuple[int, int]] = []
        preempted: list[int] = []

        # 1. Decodes, oldest first.
        for seq in list(self._running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING or seq.in_prefill:
                continue  # preempted above, or a prefill (phase 2)
            q = seq.num_uncomputed
            if q > budget and not chunked:
                continue
            if not self._reserve_slots(seq, scheduled, copies, preempted):
                continue  # preempted itself
            q = min(q, budget)
            g = self._lookahead(seq, q, budget - q, lookahead)
            out.append(self._scheduled(seq, q, g))
            scheduled.add(seq.seq_id)
            budget -= q + g

        # 2. Unfinished prefills (their slots were reserved at admission), oldest first.
        for seq in list(self._running):
            if budget == 0:
                break
            if seq.seq_id in scheduled or not seq.in_prefill:
                continue
            q = seq.num_uncomputed
            if chunked:
                q = min(q, budget, cap)
            elif q > budget:
                continue
            out.append(self._scheduled(seq, q))
            scheduled.add(seq.seq_id)
            budget -= q

        # 3. Admissions, first come first served; none in a step that had to preempt.
        while self._waiting and budget > 0 and not preempted:
            seq = self._waiting[0]
            if self.num_seats_used + seq.num_seats > cfg.max_num_seqs:
                break
            tokens = seq.token_ids
            if not chunked:
                cached = len(self.allocator.match_prefix(tokens)) * self.allocator.block_size
                if len(tokens) - cached > budget:
                    break
            if not self.allocator.can_allocate(tokens):
                break
            seq.num_computed = self.allocator.allocate(seq.seq_id, tokens)
            self._waiting.popleft()
            seq.prefill_end = len(tokens)
            seq.status = SeqStatus.RUNNING
            self._running.append(seq)
            q = seq.num_uncomputed
            if chunked:
                q = min(q, budget, cap)
            out.append(self._scheduled(seq, q))
            scheduled.add(seq.seq_id)
            budget -= q

        schedule = Schedule(
            seqs=out,
            block_copies=copies,
            preempted_seq_ids=preempted,
            num_batched_tokens=cfg.max_num_batched_tokens - budget,
        )
        self._pending = schedule
        return schedule

    def _reserve_slots(
        self,
        seq: SequenceState,
        scheduled: set[int],
        copies: list[tuple[int, int]],
        preempted: list[int],
    ) -> bool:
        """Reserves KV slots for the sequence's new tokens, preempting as needed.

        Returns False if the sequence had to preempt itself.
        """
        new = seq.token_ids[self.allocator.num_tokens(seq.seq_id) :]
        if not new:
            return True
        while True:
            try:
                copies.extend(self.allocator.append_slots(seq.seq_id, new))
                return True
            except NoFreeBlocksError:
                # Newest running sequence not yet scheduled; `seq` itself qualifies.
                victim = next(s for s in reversed(self._running) if s.seq_id not in scheduled)
                self._preempt(victim)
                preempted.append(victim.seq_id)
                if victim is seq:
                    return False

    def _lookahead(self, seq: SequenceState, q: int, budget: int, want) -> int:
        """The γ of a decode (0 if not speculating), its lookahead blocks reserved."""
        single = seq.sample_index > 0 or seq.forked or seq.request.n == 1
        if want is None or q != 1 or not single:
            return 0
        remaining = seq.request.max_tokens - seq.num_output_tokens  # tokens it may still commit
        g = min(want(seq), budget, remaining - 1, self.allocator.lookahead_capacity(seq.seq_id))
        if g <= 0:
            return 0
        self.allocator.reserve_lookahead(seq.seq_id, g)
        return g

    def _preempt(self, seq: SequenceState) -> None:
        self.allocator.free(seq.seq_id)
        self._running.remove(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.PREEMPTED
        self._waiting.appendleft(seq)  # newest preempted first, so the front stays FCFS
        self.num_preemptions += 1

    def _scheduled(self, seq: SequenceState, q: int, lookahead: int = 0) -> ScheduledSeq:
        start = seq.num_computed
        end = start + q
        sample = end == len(seq.token_ids)
        sample_ids: tuple[int, ...] = ()
        if sample:
            ids = self._seq_ids[seq.request_id]
            sample_ids = ids if seq.sample_index == 0 and not seq.forked else (seq.seq_id,)
        span = _cdiv(end + lookahead, self.allocator.block_size)
        table = self.allocator.block_table(seq.seq_id)[:span]
        return ScheduledSeq(
            seq_id=seq.seq_id,
            request_id=seq.request_id,
            token_ids=seq.token_ids[start:end],
            start_pos=start,
            block_table=table,
            sample=sample,
            sample_seq_ids=sample_ids,
            num_lookahead=lookahead,
        )

    # ----------------------------------------------------------------------------- update

    def update(self, schedule: Schedule, sampled: Mapping[int, Sequence[int]]) -> list[SeqOutput]:
        """Applies a step's results: advances computed counts, appends sampled tokens, forks
        n > 1 requests after their prefill, applies stop conditions and frees finished sequences.

        Args:
          schedule: the schedule returned by the last `schedule()`.
          sampled: seq id -> tokens sampled for it (usually one), for every id in the
            `sample_seq_ids` of the scheduled sequences; ids of sequences aborted since the
            schedule are ignored.

        Returns:
          One `SeqOutput` per sequence that received tokens, in schedule order.
        """
        if schedule is not self._pending:
            raise ValueError("update() needs the Schedule returned by the last schedule() call")
        live = [s for s in schedule.seqs if self._is_live(s.seq_id)]
        expected = {sid for s in live for sid in s.sample_seq_ids}
        # The usual step gets exactly the expected ids; anything else gets the full check.
        if sampled.keys() != expected or not all(len(t) for t in sampled.values()):
            all_sampling = {sid for s in schedule.seqs for sid in s.sample_seq_ids}
            got = set(sampled)
            missing = sorted(expected - got)
            unexpected = sorted(got - all_sampling)
            empty = sorted(sid for sid in expected & got if len(sampled[sid]) == 0)
            if missing or unexpected or empty:
                raise ValueError(
                    f"sampled tokens must cover exactly the sampling sequences of the schedule: "
                    f"missing {missing}, unexpected {unexpected}, empty {empty}"
                )
        self._pending = None

        outputs: list[SeqOutput] = []
        for s in live:
            seq = self._seqs[s.seq_id]
            seq.num_computed += len(s.token_ids)
            self.allocator.mark_computed(seq.seq_id, seq.num_computed)
            if not s.sample:
                continue
            targets = [seq]
            if len(s.sample_seq_ids) > 1:
                targets += [
                    self._fork(seq, cid, j) for j, cid in enumerate(s.sample_seq_ids[1:], 1)
                ]
                seq.forked = True
            for target in targets:
                new = target.append_tokens(sampled[target.seq_id])
                if s.num_lookahead and not target.is_finished:
                    # The accepted drafts' K/V are in the lookahead slots: reserve those slots
                    # (the last token, a correction or bonus, is computed next step).
                    self.allocator.append_slots(target.seq_id, new[:-1])
                    target.num_computed += len(new) - 1
                    self.allocator.mark_computed(target.seq_id, target.num_computed)
                    self.allocator.trim_lookahead(target.seq_id)
                if target.is_finished:
                    self.allocator.free(target.seq_id)
                    self._running.remove(target)
                    self._retire(target)
                outputs.append(
                    SeqOutput(
                        request_id=target.request_id,
                        seq_id=target.seq_id,
                        new_token_ids=new,
                        finished=target.is_finished,
                        finish_reason=target.finish_reason,
                        request_finished=target.request_id not in self._requests,
                    )
                )
        self._before, self._between = None, []  # committed: nothing to roll back to
        return outputs

    # --------------------------------------------------------------------------- rollback

    def rollback(self) -> None:
        """Undoes the pending `schedule()` and whatever of its `update()` ran: the queues, the
        sequences and the allocator return to their state before `schedule()`, the preemption
        count included; requests added or aborted since stay added or aborted. For a step that
        failed; the next `schedule()` may run at once.

        The K/V a failed step wrote stay on the device; the caller decides what they spoil
        (blocks the step wrote: `Schedule` lists them, see the engine).
        """
        if self._before is None:
            raise RuntimeError("rollback() needs a pending schedule()")
        st, self._before, self._pending = self._before, None, None
        self._waiting = collections.deque(st.waiting)
        self._running = list(st.running)
        self._seqs = dict(st.seqs)
        self._requests = {r: list(s) for r, s in st.requests.items()}
        self._seq_ids = dict(st.seq_ids)
        self.num_preemptions = st.num_preemptions
        for seq, num_computed, status, reason, prefill_end, forked, length in st.fields:
            seq.num_computed, seq.status, seq.finish_reason = num_computed, status, reason
            seq.prefill_end, seq.forked = prefill_end, forked
            del seq.token_ids[length:]  # a step only appends tokens
        self.allocator.restore_state(st.allocator)
        between, self._between = self._between, []
        for call in between:  # requests added or aborted while the step was pending
            if call[0] == "add":
                self._queue(call[1], call[2])
            else:
                self.abort(call[1])

    def _save_state(self) -> SchedulerState:
        # O(sequences + blocks): token lists are kept by length (a step only appends to them).
        return SchedulerState(
            waiting=list(self._waiting),
            running=list(self._running),
            seqs=dict(self._seqs),
            requests={r: list(s) for r, s in self._requests.items()},
            seq_ids=dict(self._seq_ids),
            num_preemptions=self.num_preemptions,
            fields=[
                (
                    s,
                    s.num_computed,
                    s.status,
                    s.finish_reason,
                    s.prefill_end,
                    s.forked,
                    len(s.token_ids),
                )
                for s in self._seqs.values()
            ],  # fmt: skip
            allocator=self.allocator.save_state(),
        )

    def preempt(self, seq_id: int) -> None:
        """Preempts a running sequence by recompute (its blocks are freed; it waits at the front
        of the queue to recompute its prompt and generated tokens). Not while a step is pending.
        """
        if self._before is not None:
            raise RuntimeError("preempt() between schedule() and update()")
        if not self._is_live(seq_id):
            raise ValueError(f"sequence {seq_id!r} is not running")
        self._preempt(self._seqs[seq_id])

    def _is_live(self, seq_id: int) -> bool:
        seq = self._seqs.get(seq_id)
        return seq is not None and seq.status is SeqStatus.RUNNING

    def _fork(self, parent: SequenceState, child_id: int, sample_index: int) -> SequenceState:
        self.allocator.fork(parent.seq_id, child_id)
        child = SequenceState(
            seq_id=child_id,
            request=parent.request,
            sample_index=sample_index,
            token_ids=list(parent.token_ids),
            num_computed=parent.num_computed,
            status=SeqStatus.RUNNING,
            prefill_end=parent.prefill_end,
            forked=True,
        )
        self._seqs[child_id] = child
        self._requests[parent.request_id].append(child)
        self._running.append(child)
        return child

    def _retire(self, seq: SequenceState) -> None:
        """Forgets a finished sequence, and its request once no sequence of it is live."""
        del self._seqs[seq.seq_id]
        rid = seq.request_id
        # The forks exist once the parent sampled, and the parent cannot finish before that
        # unless aborted: all created sequences finished means the request is done.
        if all(s.is_finished for s in self._requests[rid]):
            del self._requests[rid]
            del self._seq_ids[rid]
