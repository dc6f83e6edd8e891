"""The speculative generation loop: a `lax.while_loop` of draft → verify → accept cycles.

One cycle, for every sequence of the batch at once:

1. **draft** — the drafter proposes γ tokens for positions cur+1..cur+γ, where `cur` is the
   position of the sequence's last committed token (`drafters.py`: a draft model over its own
   paged cache, or n-gram prompt lookup with no model).
2. **verify** — the target scores the γ+1 positions cur..cur+γ of every sequence in ONE ragged
   paged forward (q_len γ+1), writing their K/V into the target cache.
3. **accept** — `acceptance.py` decides per sequence how many tokens to commit (greedy at
   temperature 0, exact rejection sampling, or the coupled Gumbel mode); the commit is cut at the
   first stop token and at max_tokens. A sequence's length simply advances by what it committed:
   rejected positions are not rolled back, the next cycle overwrites their stale cache slots.

Randomness is per request and per position, never per batch: the draft and the rejection test of
the cycle that starts at position `cur` use `fold_in(fold_in(stream(seed), cur), tag)` (a stream
apart from the plain sampling keys, see `noise.SPEC_STREAM`); the coupled mode uses
`gumbel_noise(seed, position)`, the same noise as plain `ji.generate`, so its output is
token-identical to it. Temperature, top-k, top-p and min-p shape p and q identically
(`process_logits`).

Two drivers share the same phase functions: `generate` runs the fused `lax.while_loop` (one
compiled program per bucketed shape), `generate_with_log` calls a jitted draft phase and a jitted
verify+accept phase from a Python loop, times each with `block_until_ready` and records one
`CycleRecord` per cycle (`cycle_log.py`); `autotune.py` reads logs into the speedup model and
picks γ for `gamma="auto"`.

Shapes: B sequences (bucketed), V vocabulary, γ drafted tokens, C = M·S token capacity per
sequence, M blocks per sequence, S block size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.cache.metadata import BatchMetadata, is_stop, query_batch, start_flags
from jaxinfer.cache.paged import PagedKVCache, check_block_size, init_cache
from jaxinfer.config import ModelConfig
from jaxinfer.model.decoder import forward
from jaxinfer.model.params import check_params, loop_layout
from jaxinfer.ops.backend import resolve_backend, resolve_platform
from jaxinfer.penalties import PenaltyBatch, apply_at_drafts, history_counts, output_tail
from jaxinfer.requests import (
    GenerationOutput,
    new_tokens_bucket,
    prompt_batch,
    stop_table,
    validate_requests,
)
from jaxinfer.sampling import (
    SamplingBatch,
    SamplingParams,
    gumbel_noise,
    probs,
    process_logits,
    sample,
)
from jaxinfer.speculative.acceptance import coupled_accept, greedy_accept, rejection_sample
from jaxinfer.speculative.drafters import draft_with_model, ngram_propose
from jaxinfer.speculative.heads.config import HeadConfig
from jaxinfer.speculative.heads.drafter import (
    HeadState,
    head_observe,
    head_prefill,
    hybrid_draft,
    unpack_draft,
)
from jaxinfer.speculative.noise import ACCEPT_TAG, cycle_keys, make_pick

ACCEPTANCE_MODES = ("rejection", "coupled")


@dataclasses.dataclass(frozen=True)
class SpeculativeOutput(GenerationOutput):
    """One request's result with its speculative statistics."""

    num_cycles: int  # cycles the sequence took part in (its first token comes from prefill)
    num_accepted: int  # drafted tokens accepted, before truncation at a stop / max_tokens
    num_proposed: int  # drafted tokens proposed: γ per cycle
    accepted_histogram: tuple[int, ...]  # [γ+1] cycles that accepted k = 0..γ drafts

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / max(self.num_proposed, 1)


@dataclasses.dataclass(frozen=True)
class _SpecPlan:
    """The static plan of a speculative run: models, γ, acceptance mode, cache and kernel
    settings (hashable: one compilation per plan and shape bucket)."""

    cfg: ModelConfig
    dcfg: ModelConfig | None  # None: the n-gram drafter or a head
    gamma: int
    acceptance: str
    block_size: int
    backend: str  # concrete (resolved by `prepare_run`)
    platform: str  # "cpu", "gpu", ... resolved by `prepare_run`: loop layout and caches
    ngram_max: int
    head: HeadConfig | None = None  # a learned head drafter (heads/): Medusa or EAGLE
    ngram_first: int = 0  # the head's `Head.ngram_first` (0: the head drafts every row)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecInputs:
    """Per-call constants of a run."""

    tables: jax.Array  # [B, M] int32 each sequence's blocks, in both caches
    sb: SamplingBatch  # [B] rows
    stops: jax.Array  # [B, n_stop] int32, -1 padded
    max_tokens: jax.Array  # [B] int32 (0 for padding rows)
    # With a penalized request only (None otherwise): its rows and each row's prompt length.
    penalties: PenaltyBatch | None = None  # [B] rows
    prompt_lens: jax.Array | None = None  # [B] int32


def _penalized(logits: jax.Array, hist: jax.Array, upto: jax.Array, drafts, inputs: SpecInputs):
    """`logits [B, G, V]` with each row's penalties: position j's history is the committed
    tokens before `upto` (`hist [B, C]`) and `drafts [B, G-1]` 0..j-1 (`penalties.with_drafts`,
    `penalties.tails_at_drafts`). Without penalties, the logits as they are."""
    pb = inputs.penalties
    if pb is None:
        return logits
    h = jnp.where(jnp.arange(hist.shape[1])[None, :] < upto[:, None], hist, -1)  # [B, C]
    counts, seen = history_counts(h, inputs.prompt_lens, logits.shape[-1])  # [B, V]
    tail = output_tail(h, inputs.prompt_lens, pb.tail_width)  # [B, P]
    live = jnp.ones(drafts.shape, jnp.bool_)
    return apply_at_drafts(logits, pb, counts, seen, tail, drafts, live)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecState:
    """The loop carry: both caches and each sequence's progress."""

    tcache: PagedKVCache  # target cache: holds positions 0..cur-1 of each sequence
    dcache: PagedKVCache | HeadState | None  # draft cache (None: n-gram): holds 0..dlen-1
    hist: jax.Array  # [B, C] int32 committed tokens, prompt included
    cur: jax.Array  # [B] int32 position of the last committed token
    dlen: jax.Array  # [B] int32 positions in the draft cache; cur - dlen in {0, 1}
    n_out: jax.Array  # [B] int32 generated tokens so far
    done: jax.Array  # [B] bool
    stopped: jax.Array  # [B] bool finished on a stop token
    cycles: jax.Array  # [B] int32 cycles while live
    accept_hist: jax.Array  # [B, γ+1] int32 cycles that accepted k drafts
    step: jax.Array  # [] int32 cycles run


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CycleStats:
    """What one cycle did, per sequence (the raw material of a CycleRecord)."""

    live: jax.Array  # [B] bool the sequence took part
    accepted: jax.Array  # [B] int32 drafts accepted (before truncation)
    committed: jax.Array  # [B] int32 tokens committed (after truncation)


# ---------------------------------------------------------------------------------------------
# Phases (pure; jitted alone by the logging driver, fused by the while_loop driver).
# ---------------------------------------------------------------------------------------------


def _prefill(
    tparams, dparams, meta, hist, prompt_lens, inputs, *, cfg, dcfg, block_size, backend, platform,
    head=None,
) -> SpecState:  # fmt: skip
    """Writes every prompt into both caches and samples each first token (as `ji.generate`).

    Independent of γ and the acceptance mode (static: configs, block size, backend, platform), so
    every γ of a sweep shares one prefill compilation; `_start` adds the γ-shaped fields.
    """
    b, m = inputs.tables.shape
    tcache = init_cache(cfg, 1 + b * m, block_size, platform=platform)
    want = True if head is None else head.return_hidden  # hidden [T, n·E]: fused features
    logits, tcache, hidden = forward(
        tparams, cfg, meta, tcache, backend=backend, return_hidden=want
    )  # [B, V], cache, [T, E]
    x = _penalized(logits[:b, None], hist, prompt_lens, jnp.zeros((b, 0), jnp.int32), inputs)
    first = sample(x[:, 0], inputs.sb, prompt_lens)  # the token at position prompt_len
    dcache = None
    if head is not None:  # the head reads the prompt's features from this same forward
        dcache = head_prefill(
            dparams, head, meta, hidden, b, hist.shape[1], 1 + b * m, block_size, backend, platform
        )
    if dcfg is not None:
        dcache = init_cache(dcfg, 1 + b * m, block_size, platform=platform)
        _, dcache = forward(dparams, dcfg, meta, dcache, backend=backend)
    n_out, stopped, done = start_flags(first, inputs.max_tokens, inputs.stops)
    return SpecState(
        tcache=tcache,
        dcache=dcache,
        hist=hist.at[jnp.arange(b), prompt_lens].set(first),
        cur=prompt_lens,
        dlen=prompt_lens,
        n_out=n_out,
        done=done,
        stopped=stopped,
        cycles=jnp.zeros(b, jnp.int32),
        accept_hist=jnp.zeros((b, 0), jnp.int32),  # sized by _start
        step=jnp.int32(0),
    )


def _draft(tparams, dparams, state: SpecState, inputs: SpecInputs, *, plan: _SpecPlan):
    """Draft phase: `(state with the draft cache advanced, tokens [B, γ], q [B, γ, V])`."""
    del tparams  # same signature as _verify, so both drivers call the phases alike
    if plan.head is not None:
        pick = make_pick(inputs.sb, state.cur, plan.acceptance)
        dcache, tokens, q = hybrid_draft(  # `head_draft` when ngram_first is 0
            dparams, plan.head, state.dcache, state.hist, state.cur, state.dlen, inputs.tables,
            pick, state.done, gamma=plan.gamma, block_size=plan.block_size, backend=plan.backend,
            max_n=plan.ngram_max, min_match=plan.ngram_first, vocab_size=plan.cfg.vocab_size,
        )  # fmt: skip
        return dataclasses.replace(state, dcache=dcache), tokens, q
    if plan.dcfg is None:
        tokens = ngram_propose(state.hist, state.cur, gamma=plan.gamma, max_n=plan.ngram_max)
        q = jax.nn.one_hot(tokens, plan.cfg.vocab_size, dtype=jnp.float32)  # [B, γ, V]
        return state, tokens, q
    pick = make_pick(inputs.sb, state.cur, plan.acceptance)
    dcache, tokens, q = draft_with_model(
        dparams, plan.dcfg, state.dcache, state.hist, state.cur, state.dlen, inputs.tables,
        pick, gamma=plan.gamma, block_size=plan.block_size, backend=plan.backend,
    )  # fmt: skip
    return dataclasses.replace(state, dcache=dcache), tokens, q


def _accept(logits, draft_tokens, q, cur, sb: SamplingBatch, acceptance: str):
    """`logits [B, γ+1, V]` -> (tokens [B, γ+1], num_emitted [B]) per the rows' sampling."""
    b, g1, v = logits.shape
    greedy = sb.temperature <= 0  # [B]
    g_tok, g_n = greedy_accept(logits, draft_tokens)

    def mixed():
        rows = sb.take(jnp.repeat(jnp.arange(b), g1))  # [B·(γ+1)] one row per position
        flat = logits.reshape(b * g1, v)
        if acceptance == "coupled":
            x = process_logits(flat, rows).reshape(b, g1, v)
            pos = (cur[:, None] + 1 + jnp.arange(g1)[None, :]).reshape(-1)  # sampled positions
            g = gumbel_noise(rows.seed, pos, v).reshape(b, g1, v)
            s_tok, s_n = coupled_accept(x, draft_tokens, g)
        else:
            p = probs(flat, rows).reshape(b, g1, v)
            s_tok, s_n = rejection_sample(cycle_keys(sb, cur, ACCEPT_TAG), p, q, draft_tokens)
        return jnp.where(greedy[:, None], g_tok, s_tok), jnp.where(greedy, g_n, s_n)

    return jax.lax.cond(jnp.all(greedy), lambda: (g_tok, g_n), mixed)


def _verify(
    tparams, dparams, draft_tokens, q, state: SpecState, inputs: SpecInputs, *, plan: _SpecPlan
):
    """Verify + accept + commit: `(new state, CycleStats)`."""
    gamma = plan.gamma
    b, c = state.hist.shape
    rows = jnp.arange(b)
    g1 = gamma + 1
    last = state.hist[rows, state.cur]  # [B]
    tokens = jnp.concatenate([last[:, None], draft_tokens], axis=1)  # [B, γ+1]
    batch = query_batch(tokens, state.cur, inputs.tables, plan.block_size)  # cur..cur+γ
    want = True if plan.head is None else plan.head.return_hidden
    logits, tcache, hidden = forward(
        tparams, plan.cfg, batch, state.tcache, backend=plan.backend, return_hidden=want
    )
    logits = logits.reshape(b, g1, -1)  # [B, γ+1, V] predictions for positions cur+1..cur+γ+1
    dcache = state.dcache
    if plan.head is not None:  # the verified positions' features, from the same forward
        dcache = head_observe(dparams, plan.head, dcache, hidden.reshape(b, g1, -1), state.cur)
    logits = _penalized(logits, state.hist, state.cur + 1, draft_tokens, inputs)
    out, num_emitted = _accept(logits, draft_tokens, q, state.cur, inputs.sb, plan.acceptance)

    # Cut the commit at the first stop token and at max_tokens; finished rows commit nothing.
    slot = jnp.arange(g1)[None, :]  # [1, γ+1]
    stop_at = is_stop(out, inputs.stops) & (slot < num_emitted[:, None])  # [B, γ+1]
    has_stop = jnp.any(stop_at, axis=1)
    first_stop = jnp.argmax(stop_at, axis=1)
    live = ~state.done
    n = jnp.where(has_stop, jnp.minimum(num_emitted, first_stop + 1), num_emitted)
    n = jnp.where(live, jnp.minimum(n, inputs.max_tokens - state.n_out), 0)  # [B]
    write = jnp.where(slot < n[:, None], state.cur[:, None] + 1 + slot, c)  # c: dropped
    hist = state.hist.at[rows[:, None], write].set(out, mode="drop")
    n_out = state.n_out + n
    hit = live & has_stop & (first_stop < n)
    # The draft saw positions up to cur+γ-1: all of them valid after a full accept (then the
    # last draft and the bonus are new to it), up to the committed prefix otherwise. A head
    # re-reads every committed position with the target's real features: exact up to cur.
    dlen = state.cur + (1 if plan.head is not None else jnp.minimum(n, gamma))
    accepted = num_emitted - 1
    new = dataclasses.replace(
        state,
        tcache=tcache,
        dcache=dcache,
        hist=hist,
        cur=state.cur + n,
        dlen=jnp.where(live, dlen, state.dlen),
        n_out=n_out,
        done=state.done | hit | (n_out >= inputs.max_tokens),
        stopped=state.stopped | hit,
        cycles=state.cycles + live,
        accept_hist=state.accept_hist.at[rows, accepted].add(live.astype(jnp.int32)),
        step=state.step + 1,
    )
    return new, CycleStats(live=live, accepted=jnp.where(live, accepted, 0), committed=n)


def _run_loop(tparams, dparams, state: SpecState, inputs: SpecInputs, *, plan: _SpecPlan):
    tparams = loop_layout(tparams, plan.platform)  # sliced once, outside the cycle loop
    if plan.dcfg is not None:  # a draft model's too; a head's params as given
        dparams = loop_layout(dparams, plan.platform)
    # Each live cycle commits >= 1 token per live sequence, so max_tokens bounds the cycles.
    limit = jnp.max(inputs.max_tokens)

    def cond(st):
        # Stop when every sequence has hit a stop token or its max_tokens; the cycle bound is a
        # guard only.
        return ~jnp.all(st.done) & (st.step < limit)

    def body(st):
        st, tokens, q = _draft(tparams, dparams, st, inputs, plan=plan)
        st, _ = _verify(tparams, dparams, tokens, q, st, inputs, plan=plan)
        return st

    return jax.lax.while_loop(cond, body, state)


_prefill_jit = jax.jit(
    _prefill, static_argnames=("cfg", "dcfg", "block_size", "backend", "platform", "head")
)
# The two halves of a cycle, jitted alone for the host-driven, timed driver (cycle_log.py).
draft_phase = jax.jit(_draft, static_argnames=("plan",))
verify_phase = jax.jit(_verify, static_argnames=("plan",))
_loop_jit = jax.jit(_run_loop, static_argnames=("plan",))


# ---------------------------------------------------------------------------------------------
# Host side: validation, bucketing, the two drivers.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PreparedRun:
    """A validated, bucketed request batch: what both drivers start from (host side)."""

    plan: _SpecPlan
    tparams: dict
    dparams: dict | None
    meta: BatchMetadata
    hist: np.ndarray  # [B, C] int32 prompts
    prompt_lens: np.ndarray  # [B] int32
    inputs: SpecInputs
    n: int  # real requests


def _check_gamma(gamma) -> int:
    if isinstance(gamma, bool) or not isinstance(gamma, int | np.integer) or gamma < 1:
        raise ValueError(f"gamma must be an int >= 1 or 'auto', got {gamma!r}")
    return int(gamma)


def prepare_run(
    target, draft, prompts, sampling, gamma, acceptance, block_size, backend, ngram_max
) -> PreparedRun:
    """Validates a request batch (raising ValueError) and builds its bucketed inputs.

    Arguments as in `generate` (gamma an int). Shapes: B = bucket(#prompts); per sequence
    M = bucket(⌈(longest prompt + bucket(max_tokens, 8) + γ + 1) / S⌉) blocks, in each cache.
    """
    if not (isinstance(target, tuple | list) and len(target) == 2):
        raise ValueError(f"target must be (ModelConfig, params), got {type(target)}")
    cfg, tparams = target
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"target[0] must be a ModelConfig, got {type(cfg).__name__}")
    gamma = _check_gamma(gamma)
    block_size = check_block_size(block_size)
    if acceptance not in ACCEPTANCE_MODES:
        raise ValueError(f"acceptance={acceptance!r}; expected one of {ACCEPTANCE_MODES}")
    if isinstance(ngram_max, bool) or not isinstance(ngram_max, int) or ngram_max < 1:
        raise ValueError(f"ngram_max must be an int >= 1, got {ngram_max!r}")
    dcfg, dparams, head = unpack_draft(draft, cfg, tparams, gamma)
    sampling = validate_requests(cfg, prompts, sampling)
    limit = min(cfg.max_position_embeddings, (dcfg or head or cfg).max_position_embeddings)
    for i, (p, sp) in enumerate(zip(prompts, sampling)):
        need = len(p) + sp.max_tokens + gamma + 1
        if need > limit:
            raise ValueError(
                f"prompt {i}: length {len(p)} + max_tokens {sp.max_tokens} + gamma {gamma} + 1 "
                f"= {need} exceeds the position limit {limit} (max_position_embeddings of target "
                "and draft): a cycle verifies γ+1 positions past the last committed token"
            )
    check_params(cfg, tparams)
    if dcfg is not None:
        try:
            check_params(dcfg, dparams)
        except ValueError as e:
            raise ValueError(f"draft: {e}") from None
    max_new = new_tokens_bucket(sampling)
    capacity = max(len(p) for p in prompts) + max_new + gamma + 1
    batch = prompt_batch(prompts, sampling, block_size, capacity=capacity)
    b, m = batch.tables.shape
    hist = np.zeros((b, m * block_size), np.int32)
    for i, p in enumerate(prompts):
        hist[i, : len(p)] = p
    inputs = SpecInputs(
        tables=batch.tables,
        sb=SamplingBatch.from_params(sampling, pad_to=b),
        stops=stop_table(cfg, sampling, b),
        max_tokens=batch.max_tokens,
    )
    if any(sp.penalized for sp in sampling):
        pb = PenaltyBatch.from_params(sampling, cfg, pad_to=b)
        inputs = dataclasses.replace(inputs, penalties=pb, prompt_lens=batch.prompt_lens)
    platform = resolve_platform()  # once, here: the plan carries it into every jitted phase
    backend = resolve_backend(backend, platform)
    first = draft.ngram_first if head is not None else 0
    if first > ngram_max:
        raise ValueError(f"the head's ngram_first={first} exceeds ngram_max={ngram_max}")
    plan = _SpecPlan(
        cfg, dcfg, gamma, acceptance, block_size, backend, platform, ngram_max, head, first
    )
    return PreparedRun(plan, tparams, dparams, batch.meta, hist, batch.prompt_lens, inputs, batch.n)


def collect_outputs(prep: PreparedRun, state: SpecState) -> list[SpeculativeOutput]:
    """The real requests' outputs from a finished state (one device-to-host transfer)."""
    hist, n_out, stopped, cycles, ahist = jax.device_get(
        (state.hist, state.n_out, state.stopped, state.cycles, state.accept_hist)
    )
    ks = np.arange(ahist.shape[1])
    outs = []
    for i in range(prep.n):
        start = int(prep.prompt_lens[i])
        outs.append(
            SpeculativeOutput(
                token_ids=hist[i, start : start + n_out[i]].tolist(),
                finish_reason="stop" if stopped[i] else "length",
                num_cycles=int(cycles[i]),
                num_accepted=int(np.sum(ks * ahist[i])),
                num_proposed=int(cycles[i]) * prep.plan.gamma,
                accepted_histogram=tuple(int(x) for x in ahist[i]),
            )
        )
    return outs


def prefill_run(prep: PreparedRun) -> SpecState:
    """The jitted prefill of both caches: the state before the first cycle."""
    plan = prep.plan
    state = _prefill_jit(
        prep.tparams, prep.dparams, prep.meta, prep.hist, prep.prompt_lens, prep.inputs,
        cfg=plan.cfg, dcfg=plan.dcfg, block_size=plan.block_size, backend=plan.backend,
        platform=plan.platform, head=plan.head,
    )  # fmt: skip
    b = prep.hist.shape[0]
    return dataclasses.replace(state, accept_hist=jnp.zeros((b, plan.gamma + 1), jnp.int32))


def generate(
    target: tuple[ModelConfig, dict],
    draft: tuple[ModelConfig, dict] | str,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    gamma: int = 4,
    acceptance: str = "rejection",
    block_size: int = 16,
    backend: str = "auto",
    ngram_max: int = 3,
) -> list[SpeculativeOutput]:
    """Speculative generation: the whole request batch in one `lax.while_loop`.

    Args:
      target: (cfg, params) of the model whose distribution the output follows.
      draft: (cfg, params) of a draft model with the same vocabulary, "ngram" for
        prompt-lookup drafting (no model), or a `heads.Head` (Medusa or EAGLE-style) trained
        for this target.
      prompts: token-id lists of any lengths.
      sampling: one SamplingParams for all prompts, or one per prompt (as `ji.generate`).
      gamma: tokens drafted per cycle (`ji.speculative.generate`, in `autotune.py`, also takes
        "auto": γ chosen by the speedup model from a short calibration run).
      acceptance: "rejection" (exact rejection sampling; the output follows the declared
        distribution) or "coupled" (shared Gumbel noise; token-identical to `ji.generate` with
        the same seeds). Temperature-0 requests are greedy in both modes.
      block_size: tokens per KV block.
      backend: attention backend ("auto", "xla", "reference", "pallas", "pallas-interpret").
      ngram_max: longest suffix the n-gram drafter matches.

    Returns:
      One SpeculativeOutput per prompt, in order: token_ids, finish_reason and the cycle stats.
    """
    prep = prepare_run(
        target, draft, prompts, sampling, gamma, acceptance, block_size, backend, ngram_max
    )
    state = _loop_jit(prep.tparams, prep.dparams, prefill_run(prep), prep.inputs, plan=prep.plan)
    return collect_outputs(prep, state)
