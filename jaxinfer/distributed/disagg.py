"""Prefill/decode disaggregation: a prefill engine and a decode engine joined by a KV connector.

    d = Disaggregated(cfg, params, prefill=EngineConfig(mesh=a), decode=EngineConfig(mesh=b))
    tokens = d.generate(prompts, sampling)          # as one colocated Engine would give them

A request goes to the prefill engine with `max_tokens=1`: its prefill (chunked, prefix-cached,
preemptible like any engine's) ends by sampling the first token t0 at position P. Right after
that step `PrefillSide` copies the request's full prompt blocks (P // S of them) out of the pool
and `save`s them to the connector; the blocks themselves go back to the prefill pool with the
request (the prefix cache keeps them findable), so the copy is the prefill side's only hold.

`DecodeSide` then, before anything moves, allocates blocks for the request in its own pool under
a staging sequence (`allocate` of the prompt's full blocks + t0): blocks its prefix cache already
holds come back matched and are not transferred (`start_load(skip=matched)`); the others receive
the load. Once loaded they are registered in the decode prefix cache (`mark_computed`) and the
request is added to the decode engine as prompt + [t0] with `max_tokens - 1`: its admission finds
every full block cached, so it computes only the prompt's partial last block and t0 (at most S
tokens; the allocator keys full blocks only) and samples position P + 1 with the request's own
key, `fold_in(key(seed), P + 1)`, exactly as a colocated engine would. The staging hold ends
when the request is queued (the blocks are then the most recently used cached ones; were they
evicted before its admission, it would recompute its prompt: slower, same tokens). An abort frees
what each side holds: the prefill engine's request, the connector's copy and load, the staging
blocks, the decode engine's request.

TTFT is the time until the client sees t0, which the decode side emits with its first decode
step, and splits into queue (arrival to the first prefill step that schedules it), prefill (to
t0), transfer (to the blocks loaded) and first decode (to the end of the decode step that
consumed them): `Timings`.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Hashable

import jax

from jaxinfer.cache.allocator import NoFreeBlocksError
from jaxinfer.config import ModelConfig
from jaxinfer.distributed.connector import (
    KVConnector,
    MeshConnector,
    Prefilled,
    gather_blocks,
    scatter_blocks,
)
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.sampling import SamplingParams


@dataclasses.dataclass
class Timings:
    """One request's TTFT, in parts (seconds of the engines' clock); None until reached."""

    arrival: float
    prefill_start: float | None = None
    prefill_done: float | None = None
    loaded: float | None = None
    first_token: float | None = None

    @property
    def parts(self) -> dict[str, float]:
        """queue, prefill, transfer, first_decode; they sum to `ttft`."""
        t = [self.arrival, self.prefill_start, self.prefill_done, self.loaded, self.first_token]
        names = ("queue", "prefill", "transfer", "first_decode")
        return {n: b - a for n, a, b in zip(names, t, t[1:]) if a is not None and b is not None}

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


@dataclasses.dataclass(frozen=True)
class Event:
    """New tokens of a request (the disaggregated `StreamOutput`)."""

    request_id: Hashable
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None


class PrefillSide:
    """The prefill engine: runs prompts to their first token and saves their blocks."""

    def __init__(self, engine: Engine, connector: KVConnector):
        self.engine, self.connector = engine, connector
        self.clock = engine.clock
        self.timings: dict[Hashable, Timings] = {}
        self._sampling: dict[Hashable, SamplingParams] = {}
        self._prompts: dict[Hashable, list[int]] = {}

    def add_request(self, prompt, sp: SamplingParams, rid: Hashable, arrival: float) -> None:
        if sp.n != 1:
            raise ValueError(f"request {rid!r}: n={sp.n}; disaggregated serving expects n=1")
        if sp.logprobs is not None:
            raise ValueError(f"request {rid!r}: logprobs={sp.logprobs}; expected None")
        self.engine.add_request(prompt, dataclasses.replace(sp, max_tokens=1), rid, arrival)
        self._sampling[rid] = sp
        self._prompts[rid] = [int(t) for t in prompt]
        self.timings[rid] = Timings(arrival)

    def step(self) -> list[Event]:
        """One prefill step; saves the blocks of every request that got its first token.

        Returns:
          Events of requests that finished at prefill (t0 a stop token, or max_tokens 1).
        """
        start = self.clock()
        outs = self.engine.step()
        now = self.clock()
        schedule = self.engine.last_schedule
        for s in schedule.seqs:
            tm = self.timings.get(s.request_id)
            if tm is not None and tm.prefill_start is None:
                tm.prefill_start = start
        tables = {s.request_id: s.block_table for s in schedule.seqs if s.sample}
        events = []
        for o in outs:
            sp = self._sampling.pop(o.request_id)
            tm = self.timings[o.request_id]
            tm.prefill_done = now
            if o.finish_reason == "error" or not o.new_token_ids:
                self._prompts.pop(o.request_id, None)
                events.append(Event(o.request_id, [], True, o.finish_reason))
                continue
            t0 = o.new_token_ids[0]
            if o.finish_reason == "stop" or sp.max_tokens == 1:  # done: nothing to decode
                self._prompts.pop(o.request_id)
                tm.loaded = tm.first_token = now
                events.append(Event(o.request_id, [t0], True, o.finish_reason))
                continue
            self._save(o.request_id, tables[o.request_id], t0, sp, now)
        return events

    def _save(self, rid, table, t0: int, sp: SamplingParams, now: float) -> None:
        prompt = self._prompts.pop(rid)
        nb = len(prompt) // self.engine.config.block_size
        blocks = gather_blocks(self.engine.cache, list(table[:nb]))
        info = Prefilled(rid, tuple(prompt), int(t0), nb, dataclasses.asdict(sp), now)
        self.connector.save(info, blocks)

    def abort(self, rid: Hashable) -> None:
        self.engine.abort(rid)
        self._sampling.pop(rid, None)
        self._prompts.pop(rid, None)
        self.connector.request_finished(rid)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()


class DecodeSide:
    """The decode engine: allocates, loads and continues requests the prefill side saved."""

    def __init__(self, engine: Engine, connector: KVConnector):
        if not engine.config.enable_prefix_caching:
            raise ValueError(
                "the decode engine needs EngineConfig.enable_prefix_caching=True: loaded blocks "
                "reach its requests through the prefix cache"
            )
        self.engine, self.connector = engine, connector
        self.clock = engine.clock
        self.allocator = engine.allocator
        self._waiting: list[Prefilled] = []  # saved, no blocks allocated yet
        self._loading: dict[Hashable, tuple[Prefilled, int, int]] = {}  # info, stage id, skip
        self._first: dict[Hashable, int] = {}  # t0 to emit with the first decode output
        self._stage_ids = itertools.count(-1, -1)  # negative: never a scheduler seq id
        self.loaded_at: dict[Hashable, float] = {}
        self.first_token_at: dict[Hashable, float] = {}
        self.blocks_skipped = 0  # full blocks found in the decode prefix cache, not moved
        self.skipped: dict[Hashable, int] = {}  # per request

    def start_loads(self) -> None:
        """Allocates blocks for newly saved requests (FCFS) and starts their loads."""
        self._waiting += self.connector.ready()
        S = self.engine.config.block_size
        while self._waiting:
            info = self._waiting[0]
            stage = next(self._stage_ids)
            tokens = list(info.prompt[: info.num_blocks * S]) + [info.first_token]
            try:
                skip = self.allocator.allocate(stage, tokens) // S
            except NoFreeBlocksError:
                break  # retried next step, once blocks are free
            self._waiting.pop(0)
            self.blocks_skipped += skip
            self.skipped[info.request_id] = skip
            self.connector.start_load(info.request_id, skip)
            self._loading[info.request_id] = (info, stage, skip)

    def finish_loads(self, wait: bool = True) -> list[Event]:
        """Writes the blocks of started loads and hands their requests to the engine.

        Args:
          wait: wait for every started load; False: only those that have arrived, so a decode
            loop never stalls its running requests on a transfer (the two-process form).
        """
        events: list[Event] = []
        S = self.engine.config.block_size
        for rid, (info, stage, skip) in list(self._loading.items()):
            if not wait and not self.connector.load_arrived(rid):
                continue
            blocks = self.connector.wait_for_load(rid)
            table = self.allocator.block_table(stage)
            self.engine.cache = scatter_blocks(
                self.engine.cache, blocks, table[skip : info.num_blocks]
            )
            self.allocator.mark_computed(stage, info.num_blocks * S)
            self.connector.request_finished(rid)
            del self._loading[rid]
            sp = SamplingParams(**{**info.sampling, "max_tokens": info.sampling["max_tokens"] - 1})
            self.engine.add_request([*info.prompt, info.first_token], sp, rid, num_generated=1)
            # The hold ends here: the blocks stay in the prefix cache, most recently used, so
            # the request's admission (normally the next decode step) finds them. Keeping the
            # hold until then could deadlock a small pool: held blocks of requests queued
            # behind a preempted one that needs them.
            self.allocator.free(stage)
            self._first[rid] = info.first_token
            self.loaded_at[rid] = self.clock()
        return events

    def step(self) -> list[Event]:
        """One decode step; t0 goes out with a request's first decode output."""
        if not self.engine.has_unfinished():
            return []
        outs = self.engine.step()
        now = self.clock()
        events = []
        for o in outs:
            new = list(o.new_token_ids)
            if o.request_id in self._first:
                new = [self._first.pop(o.request_id)] + new
                self.first_token_at[o.request_id] = now
            events.append(Event(o.request_id, new, o.request_finished, o.finish_reason))
        return events

    def abort(self, rid: Hashable) -> None:
        self._waiting = [i for i in self._waiting if i.request_id != rid]
        if rid in self._loading:
            self.allocator.free(self._loading.pop(rid)[1])
        self._first.pop(rid, None)
        self.connector.request_finished(rid)
        self.engine.abort(rid)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._loading or self.engine.has_unfinished())

    def loading(self) -> list[Hashable]:
        """Requests whose load has started and not finished."""
        return list(self._loading)


class Disaggregated:
    """A prefill engine and a decode engine (disjoint meshes) in one process, one connector.

    Args:
      cfg, params: the model (each side shards it on its own mesh).
      prefill, decode: each side's EngineConfig (its `mesh` names its devices); the decode
        side needs prefix caching.
      connector: None: a `MeshConnector` onto the decode cache's layout.
      clock: both sides' clock.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        params: dict,
        prefill: EngineConfig,
        decode: EngineConfig,
        connector: KVConnector | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if prefill.block_size != decode.block_size:
            raise ValueError(
                f"prefill block_size={prefill.block_size} != decode block_size="
                f"{decode.block_size}: blocks move whole"
            )
        spec = decode.speculative
        if spec is not None and (spec.draft_model is not None or spec.draft_head is not None):
            raise ValueError(
                "decode EngineConfig.speculative with a draft model or drafter head is not "
                "supported: the connector moves the target's KV blocks only, not the drafter's "
                "cache or features; expected drafter='ngram'"
            )
        p_engine = Engine(cfg, params, prefill, clock=clock)
        d_engine = Engine(cfg, params, decode, clock=clock)
        if connector is None:
            connector = MeshConnector(jax.tree.map(lambda x: x.sharding, d_engine.cache))
        self.connector = connector
        self.prefill = PrefillSide(p_engine, connector)
        self.decode = DecodeSide(d_engine, connector)
        self.clock = clock
        self._ids = itertools.count()
        self._live: set[Hashable] = set()

    def add_request(self, prompt, sampling: SamplingParams, request_id=None, arrival=None):
        rid = f"req-{next(self._ids)}" if request_id is None else request_id
        arrival = self.clock() if arrival is None else arrival
        self.prefill.add_request(prompt, sampling, rid, arrival)
        self._live.add(rid)
        return rid

    def abort(self, request_id: Hashable) -> bool:
        if request_id not in self._live:
            return False
        self.prefill.abort(request_id)
        self.decode.abort(request_id)
        self._live.discard(request_id)
        return True

    def step(self) -> list[Event]:
        """Finish loads -> decode step -> prefill step (saves) -> allocate and start loads."""
        events = self.decode.finish_loads()
        events += self.decode.step()
        events += self.prefill.step()
        self.decode.start_loads()
        for e in events:
            if e.finished:
                self._live.discard(e.request_id)
        return events

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def timings(self, rid: Hashable) -> Timings:
        tm = dataclasses.replace(self.prefill.timings[rid])
        tm.loaded = self.decode.loaded_at.get(rid, tm.loaded)
        tm.first_token = self.decode.first_token_at.get(rid, tm.first_token)
        return tm

    def generate(self, prompts, sampling) -> list[list[int]]:
        """Runs the prompts to completion; returns each request's tokens (t0 first)."""
        if isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(prompts)
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, sampling)]
        tokens: dict[Hashable, list[int]] = {r: [] for r in rids}
        while self.has_unfinished():
            for e in self.step():
                if e.request_id in tokens:
                    tokens[e.request_id] += e.new_token_ids
        return [tokens[r] for r in rids]
