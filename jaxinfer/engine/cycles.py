"""Speculation bookkeeping of the engine: acceptance counters, the γ controller, the cycle log.

    engine = ji.Engine(cfg, params, ji.EngineConfig(speculative=ji.SpeculativeConfig(
        drafter="ngram", num_speculative_tokens="auto", max_gamma=4)))
    warm_up(engine, batch_sizes=(1, 2, 4, 8))   # optional: the step-time table before serving

**Counters** (`SpecCounters`): per drafting row and step, γ drafted and a accepted (before stop
/ max_tokens cuts). Position j (0-based) is *reached* when j <= a and *accepted* when j < a, so
`accepted[j] / reached[j]` is the conditional acceptance α_j of the chain model
(`speculative.speedup.expected_tokens_per_cycle`).

**Controller** (`GammaController`): picks γ in 0..max_gamma for the step, maximising the batch's
expected committed tokens per second, B · E[tokens | γ] / t(γ, B). t is a table of measured step
times (the whole `Engine.step`, host work included, not only draft + verify: the committed tokens
per second a client sees) keyed by (γ, padded B, padded T), refined online: a cell's first sample
(which includes compilation) is dropped, the estimate is the median of its last samples, and a
cell with no estimate yet is tried before any choice is made (exploration, once per cell), unless
`warm_up` measured it first over the compiled buckets. Only decode-only steps in which every
row drafts the step's γ are timed (a γ cut short near max_tokens makes a smaller step). α_j
comes from the counters with a prior (`SpecCounters.alpha`: 0.5 at position 0, then each
position's predecessor). The controller reads recent acceptance (each cycle's counts decay by
`_DECAY`, a window of ~100 cycles), so a change of workload shows. Once γ = 0 wins, nothing
drafts, and acceptance could never be seen to recover: so every `_PROBE_EVERY`-th step of a
run of γ = 0 choices drafts at the best γ > 0 instead (a probe: at most 1 step in 32, each
costing t(γ) - t(0)).

**Cycle log** (`EngineConfig.cycle_log`): one JSON line per sampled request per step (see
`CycleLog.write`); `experiments/engine_cycles.py` reads it back.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Callable

import numpy as np

from jaxinfer.cache.metadata import bucket
from jaxinfer.cache.paged import init_cache
from jaxinfer.engine.buckets import pad_tokens
from jaxinfer.engine.head_drafting import init_pool
from jaxinfer.model.params import check_params, loop_layout
from jaxinfer.sampling import SamplingParams
from jaxinfer.speculative.heads.lm import pair
from jaxinfer.speculative.speedup import expected_tokens_per_cycle

_WINDOW = 16  # step-time samples kept per cell
_DECAY = 0.99  # per drafting cycle, of the acceptance counts the controller reads
_PROBE_EVERY = 32  # in a run of γ = 0 choices, this step drafts (at the best γ > 0)


@dataclasses.dataclass
class SpecCounters:
    """Acceptance counters over a run (see the module docstring)."""

    max_gamma: int
    cycles: int = 0  # drafting (row, step) pairs
    proposed: int = 0  # draft tokens
    accepted: int = 0  # accepted draft tokens
    reached: np.ndarray = None  # [max_gamma] int64
    accepted_at: np.ndarray = None  # [max_gamma] int64

    def __post_init__(self):
        self.reached = np.zeros(self.max_gamma, np.int64)
        self.accepted_at = np.zeros(self.max_gamma, np.int64)
        self._recent = np.zeros((2, self.max_gamma))  # (reached, accepted), decayed

    def add(self, gamma: int, accepted: int) -> None:
        if gamma == 0:
            return
        self.cycles += 1
        self.proposed += gamma
        self.accepted += accepted
        j = np.arange(gamma)
        self.reached[:gamma] += j <= accepted
        self.accepted_at[:gamma] += j < accepted
        self._recent *= _DECAY
        self._recent[0, :gamma] += j <= accepted
        self._recent[1, :gamma] += j < accepted

    def alpha(self) -> np.ndarray:
        """Per-position α `[max_gamma]` of the recent cycles. Position 0 has a Beta(1, 1) prior;
        position j > 0 a prior of two pseudo-cycles at α_{j-1} (a position never reached
        predicts its predecessor's rate, not 0.5: with 0.5, drafts that all land would never
        lengthen γ past the positions already tried)."""
        reached, accepted = self._recent
        out = np.empty(self.max_gamma)
        prior = 0.5
        for j in range(self.max_gamma):
            out[j] = prior = (accepted[j] + 2.0 * prior) / (reached[j] + 2.0)
        return out


class GammaController:
    """γ per step: fixed, or "auto" (see the module docstring)."""

    def __init__(
        self,
        max_gamma: int,
        fixed: int | None,
        counters: SpecCounters,
        pad_tokens: Callable[[int], int] = bucket,
    ):
        self.max_gamma = max_gamma
        self.fixed = fixed
        self.counters = counters
        self.pad_tokens = pad_tokens  # a step's T -> the T it is compiled for (the engine's)
        self.times: dict[tuple[int, int, int], collections.deque] = {}
        self.seen: collections.Counter = collections.Counter()
        self.zero_run = 0  # consecutive choices of γ = 0
        self.probes = 0  # steps drafted by a probe

    def expected_tokens(self, gamma: int) -> float:
        if gamma == 0:
            return 1.0
        return expected_tokens_per_cycle(self.counters.alpha(), gamma)

    def key(self, gamma: int, batch: int) -> tuple[int, int, int]:
        """The table's cell of a decode step of `batch` rows each drafting γ: (γ, padded B,
        padded T). Rows sharing a B bucket can fall in two T buckets (16 rows at γ = 4 run
        T = 80, padded to 128; 12 rows run 60, padded to 64: 30% less time on SmolLM2)."""
        b = max(batch, 1)
        return gamma, bucket(b), self.pad_tokens(b * (1 + gamma))

    def step_time(self, gamma: int, batch: int) -> float | None:
        t = self.times.get(self.key(gamma, batch))
        return float(np.median(t)) if t else None

    def choose(self, batch: int) -> tuple[int, dict[int, float | None]]:
        """(γ for a step of `batch` decoding requests, predicted tokens/s per candidate γ)."""
        if self.fixed is not None:
            return self.fixed, {}
        pred: dict[int, float | None] = {}
        for g in range(self.max_gamma + 1):
            t = self.step_time(g, batch)
            pred[g] = None if t is None else max(batch, 1) * self.expected_tokens(g) / t
        unmeasured = [g for g, p in pred.items() if p is None]
        if unmeasured:
            return unmeasured[0], pred
        best = max(pred, key=lambda g: pred[g])
        self.zero_run = self.zero_run + 1 if best == 0 and self.max_gamma > 0 else 0
        if self.zero_run >= _PROBE_EVERY:  # draft once, so acceptance can be seen to recover
            self.zero_run = 0
            self.probes += 1
            return max(range(1, self.max_gamma + 1), key=lambda g: pred[g]), pred
        return best, pred

    def observe(self, gamma: int, batch: int, seconds: float) -> None:
        """A step of `batch` decoding requests at `gamma` took `seconds` (the whole step)."""
        key = self.key(gamma, batch)
        self.seen[key] += 1
        if self.seen[key] == 1:
            return  # the first run of a shape compiles
        self.times.setdefault(key, collections.deque(maxlen=_WINDOW)).append(seconds)


def _jsonable(x):
    try:
        json.dumps(x)
        return x
    except TypeError:
        return repr(x)


class CycleLog:
    """Appends one JSON line per sampled request per step to `path`."""

    def __init__(self, path: str, detokenize: Callable[[list[int]], str] | None = None):
        self.path = path
        self.detokenize = detokenize
        open(path, "w").close()

    def write(self, records: list[dict]) -> None:
        """Each record: step, request_id, sample_index, gamma, proposed, accepted, committed,
        ngram (the hybrid head drafter took the n-gram's proposal for this row), head_ran (a
        head drafter drafted in this step: the hybrid skips it when every row takes the
        n-gram's), text (with a detokenize callable), draft_ms, verify_ms, batch_size, num_tokens,
        gamma_chosen, predicted_tps ({γ: tokens/s or None} of the controller; {} if fixed)."""
        with open(self.path, "a") as f:
            for r in records:
                r = dict(r, request_id=_jsonable(r["request_id"]))
                if self.detokenize is not None:
                    r["text"] = self.detokenize(r["committed"])
                f.write(json.dumps(r) + "\n")


def init_speculation(engine, detokenize) -> None:
    """The engine's speculation state (`EngineConfig.speculative`): drafter cache, counters,
    controller, cycle log; all None without speculation."""
    spec = engine.spec = engine.config.speculative
    engine.dcache = engine.draft_model = engine.draft_head = None
    engine.spec_counters = engine.controller = engine.cycle_log = None
    engine._gamma, engine._predicted, engine._decoding = 0, {}, 0
    engine._observe = None  # (γ, batch) of a decode-only step, timed by Engine.step
    if spec is None:
        return
    spec.check_target(engine.cfg)
    if spec.draft_model is not None:
        dcfg, dparams = spec.draft_model
        check_params(dcfg, dparams)
        # The drafter runs on the target's layout policy (EngineConfig.layout).
        engine.draft_model = (
            dcfg,
            loop_layout(dparams, engine.platform) if engine.config.layout == "auto" else dparams,
        )
        engine.dcache = new_draft_cache(engine)
    if spec.draft_head is not None:  # (hcfg, runtime params over the target's frozen head)
        engine.draft_head = (spec.draft_head.cfg, pair(spec.draft_head, engine.cfg, engine.params))
        engine.dcache = new_draft_cache(engine)
    engine.spec_counters = SpecCounters(spec.max_gamma)
    fixed = None if spec.auto else spec.num_speculative_tokens
    engine.controller = GammaController(
        spec.max_gamma, fixed, engine.spec_counters,
        lambda t: pad_tokens(t, engine.token_buckets),
    )  # fmt: skip
    if engine.config.cycle_log is not None:
        engine.cycle_log = CycleLog(engine.config.cycle_log, detokenize)


def new_draft_cache(engine):
    """An empty paged cache for the model drafter, or a head drafter's `HeadPool`, with the
    target cache's block ids (see speculation.py: one allocator for both), on the engine's
    platform."""
    if engine.draft_head is not None:
        return init_pool(
            engine.draft_head[0], engine.config.num_blocks, engine.config.block_size,
            engine.platform,
        )  # fmt: skip
    dcfg = engine.config.speculative.draft_model[0]
    return init_cache(
        dcfg, engine.config.num_blocks, engine.config.block_size, platform=engine.platform
    )


def account(engine, schedule, record: dict, outs) -> None:
    """Counters, controller timings and the cycle log of a speculative step."""
    committed = {o.seq_id: o.new_token_ids for o in outs}
    gmax = max((s.num_lookahead for s in schedule.seqs), default=0)
    if all(len(s.token_ids) == 1 and s.sample and s.num_lookahead == gmax for s in schedule.seqs):
        # Decode-only steps in which every row drafts the step's γ: the shape (γ, B) the
        # controller predicts. A prefill chunk costs more; a row whose γ was cut (it is near
        # max_tokens or the budget) makes a smaller step, which would price (γ, B) low. The
        # engine times the whole step (host work included: on a small model it is most of the
        # step) and hands it to `controller.observe` when the step ends.
        engine._observe = (gmax, len(schedule.seqs))
    lines = []
    for sid, (gamma, proposed, accepted) in record["rows"].items():
        engine.spec_counters.add(gamma, accepted)
        if engine.cycle_log is not None and sid in engine._rid_of:
            lines.append(
                dict(
                    step=engine.num_steps,
                    request_id=engine._rid_of[sid],
                    sample_index=engine._sample_index[sid],
                    gamma=gamma,
                    proposed=proposed,
                    accepted=accepted,
                    committed=list(committed.get(sid, [])),
                    ngram=sid in record["ngram_rows"],
                    head_ran=record["head_ran"],
                    draft_ms=record["draft_ms"],
                    verify_ms=record["verify_ms"],
                    batch_size=record["batch_size"],
                    num_tokens=record["num_tokens"],
                    gamma_chosen=engine._gamma,
                    predicted_tps={str(g): v for g, v in engine._predicted.items()},
                )  # fmt: skip
            )
    if lines:
        engine.cycle_log.write(lines)


def warm_up(engine, batch_sizes=(1,), max_tokens: int | None = None) -> None:
    """Measures the controller's step-time table before serving: for every γ in 0..max_gamma
    and batch size, a scratch engine (same config, fixed γ, its own pool) decodes greedy dummy
    requests; its decode-step times fill `engine.controller`. Compiles those shapes, too.
    `max_tokens` (default 2 + 3 (max_gamma + 1)) leaves every γ at least two steps in which no
    row's γ is cut by the end of its request, even when every draft is accepted."""
    spec, ctl = engine.spec, engine.controller
    v = engine.cfg.vocab_size
    if max_tokens is None:
        max_tokens = 2 + 3 * (spec.max_gamma + 1)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for g in range(spec.max_gamma + 1):
        fixed = dataclasses.replace(spec, num_speculative_tokens=g)
        cfg = dataclasses.replace(engine.config, speculative=fixed, cycle_log=None)
        scratch = type(engine)(engine.cfg, engine.params, cfg)
        for b in batch_sizes:
            prompts = [[(7 * i + j) % v for j in range(8)] for i in range(b)]
            scratch.generate(prompts, sp)
        for key, times in scratch.controller.times.items():
            ctl.seen[key] += scratch.controller.seen[key]
            ctl.times.setdefault(key, collections.deque(maxlen=_WINDOW)).extend(times)
