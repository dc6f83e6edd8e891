"""Speculative decoding inside the engine's step: draft, then verify every request in one forward.

A step with speculation (`EngineConfig.speculative`):

1. `Scheduler.schedule(lookahead=...)` gives each decoding request a γ (`num_lookahead`), 1 + γ
   tokens of the step's budget and KV slots for its γ draft positions (`reserve_lookahead`).
2. **draft** (`_draft_model`, `_draft_ngram` or a head's `head_drafting._draft`, one jitted
   call; heads: see `head_drafting.py`): the n-gram drafter matches the request's history
   (`drafters.ngram_propose`; a head with `ngram_first` takes its proposal for the rows where
   the suffix recurs, `drafters.prefer_ngram`, and is not run when every row does); the model
   drafter runs one ragged forward that mirrors the step's prefill chunks and plain decodes
   into its own cache and, for each drafting request, feeds its last two committed tokens,
   then γmax − 1 one-token steps (`cache.metadata.decode_batch`, tokens chosen by the loop's
   `make_pick`). Only the `[B, γ]` draft ids come back to the host.
3. **verify** (`_verify`, one jitted call): the target's one ragged forward over prefill chunks,
   plain decodes and each drafting request's γ + 1 positions (`logits="all"`), then acceptance on
   the device: the target's own token at every verified position (`sampling.sample`: greedy, or
   the Gumbel noise of `ji.generate` — the coupled mode, `acceptance._match_target`), or exact
   rejection sampling (`acceptance._rejection_sample_with_noise`) for sampled rows in "rejection"
   mode. Penalties, the logit bias and the masks act on every verified position, with the drafts
   before it counted in its history (`penalties.with_drafts`, `penalties.tails_at_drafts`).
   Each request commits 1..γ+1 tokens; `Scheduler.update` cuts them at stop tokens and
   max_tokens, and rejected slots are overwritten by later writes.

The draft model's cache shares the target's block tables: the same block ids index a second
cache array of the draft's shape. Allocation, prefix caching, copy-on-write, preemption and the
failed-step recompute then hold for both caches at once, with no second allocator to keep in
step; the price is that the draft cache has as many blocks as the target's (it is small). One
gap: after a full accept the draft has not seen its last draft token; it catches up next step
(it re-feeds the token before the last), but a block registered in the prefix cache in between
holds one stale draft slot. That can only lower the draft's acceptance, never change the output.

Shapes: R sample rows, G = γmax + 1 verified positions, Bd drafting rows, V vocabulary.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.cache.metadata import (
    BatchMetadata,
    SeqChunk,
    bucket,
    build_metadata,
    decode_batch,
    finite_rows,
)
from jaxinfer.cache.paged import PagedKVCache
from jaxinfer.config import ModelConfig
from jaxinfer.engine import head_drafting
from jaxinfer.engine.buckets import pad_tokens
from jaxinfer.engine.step import Penalties, padded_shape, penalty_inputs
from jaxinfer.model.decoder import forward
from jaxinfer.penalties import apply_at_drafts, history_counts, output_tail
from jaxinfer.sampling import SamplingBatch, probs, sample
from jaxinfer.speculative.acceptance import (
    _leading_true,
    _noise,
    _rejection_sample_with_noise,
)
from jaxinfer.speculative.drafters import ngram_propose, ngram_rows, take_ngram
from jaxinfer.speculative.noise import ACCEPT_TAG, cycle_keys, make_pick


@functools.partial(jax.jit, static_argnames=("gamma", "max_n"))
def _draft_ngram(hist: jax.Array, cur: jax.Array, *, gamma: int, max_n: int) -> jax.Array:
    """`hist [Bd, C]`, `cur [Bd]` -> draft ids `[Bd, γ]` (q is their one-hot)."""
    return ngram_propose(hist, cur, gamma=gamma, max_n=max_n)


@functools.partial(jax.jit, static_argnames=("gamma", "max_n", "min_match", "vocab_size"))
def _ngram_rows(hist, cur, *, gamma: int, max_n: int, min_match: int, vocab_size: int):
    """The hybrid's n-gram side: (proposals `[Bd, γ]`, their one-hot q `[Bd, γ, V]`, `[Bd]` bool:
    the rows that take them; `drafters.ngram_rows`)."""
    ngram, use = ngram_rows(hist, cur, gamma=gamma, max_n=max_n, min_match=min_match)
    return ngram, jax.nn.one_hot(ngram, vocab_size, dtype=jnp.float32), use


_take_ngram = jax.jit(take_ngram)  # a head's drafts and q, the n-gram's in the rows that use it


@functools.partial(
    jax.jit,
    static_argnames=("dcfg", "backend", "gamma", "block_size", "acceptance"),
    donate_argnames=("dcache",),
)
def _draft_model(
    dparams: dict,
    dcache: PagedKVCache,
    meta: BatchMetadata,  # the mirrored step: prefill chunks, plain decodes, [t_{n-1}, t_n]
    first_rows: jax.Array,  # [Bd] logits row of each drafting request in `meta`
    sb: SamplingBatch,  # [Bd]
    cur: jax.Array,  # [Bd] int32 position n of each request's last committed token
    tables: jax.Array,  # [Bd, Md] int32, lookahead blocks included, null-padded
    index: jax.Array,  # [Bd] int32 sample index: forks of an n > 1 request draft their own noise
    *,
    dcfg: ModelConfig,
    backend: str,
    gamma: int,
    block_size: int,
    acceptance: str,
) -> tuple[tuple[jax.Array, jax.Array], PagedKVCache]:
    """γ draft tokens per drafting request and their q: `([Bd, γ], [Bd, γ, V]), dcache`."""
    pick = make_pick(sb, cur, acceptance, index)
    logits, dcache = forward(dparams, dcfg, meta, dcache, backend=backend)  # [N, V]
    tok, q = pick(logits[first_rows], 0)  # d_1 at position n + 1

    def step(carry, j):
        dcache, tok = carry
        batch = decode_batch(tok, cur + j, tables, block_size)  # d_j at position n + j
        logits, dcache = forward(dparams, dcfg, batch, dcache, backend=backend)
        new, q = pick(logits, j)
        return (dcache, new), (new, q)

    (dcache, _), (toks, qs) = jax.lax.scan(step, (dcache, tok), jnp.arange(1, gamma))
    tokens = jnp.concatenate([tok[:, None], jnp.moveaxis(toks, 0, 1)], axis=1)  # [Bd, γ]
    q_all = jnp.concatenate([q[:, None], jnp.moveaxis(qs, 0, 1)], axis=1)  # [Bd, γ, V]
    return (tokens, q_all), dcache


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "backend", "acceptance", "return_hidden"),
    donate_argnames=("cache",),
)
def _verify(
    params: dict,
    cache: PagedKVCache,
    meta: BatchMetadata,  # T tokens; drafting requests' chunks return every row's logits
    rows: jax.Array,  # [R, G] int32 logits row of each verified position (padded: repeats)
    sb: SamplingBatch,  # [R]
    pos: jax.Array,  # [R, G] int32 position each verified position's token takes
    index: jax.Array,  # [R] int32 sample index
    draft: jax.Array,  # [R, G-1] int32 drafted tokens (0 past γ)
    q: jax.Array | None,  # [Bd, G-1, V] draft distributions (rejection mode), or None
    q_row: jax.Array,  # [R] int32 row of q (-1: not drafting)
    gam: jax.Array,  # [R] int32 γ of each row (0: plain decode / prefill)
    pen: Penalties | None = None,  # only for a batch with a penalized row
    *,
    cfg: ModelConfig,
    backend: str,
    acceptance: str,
    return_hidden: bool | tuple[int, ...] = False,
):
    """The target's forward and acceptance: `((tokens [R, G] (-1 rows: non-finite), n [R]), cache)`
    and, with return_hidden, the rows' features `[T, E]` (`[T, n·E]`: n layers) as a third
    element (head drafters).

    The first `n[r]` of `tokens[r]` are committed (1 <= n <= γ + 1).
    """
    logits, cache, *hidden = forward(
        params, cfg, meta, cache, backend=backend, return_hidden=return_hidden
    )  # [N, V]
    r, g = rows.shape
    x = logits[rows.reshape(-1)]  # [R·G, V]
    finite = finite_rows(x.reshape(r, g, -1))  # [R]
    flat = jnp.repeat(jnp.arange(r), g)  # [R·G] the sample row of each position
    flat_sb = sb.take(flat)
    live = jnp.arange(g - 1)[None, :] < gam[:, None]  # [R, G-1] drafted positions
    if pen is not None:  # each position's history holds the drafts before it (`with_drafts`)
        hist = history_counts(pen.history, pen.num_prompt, x.shape[-1])  # [R, V] x2
        tail = output_tail(pen.history, pen.num_prompt, pen.pb.tail_width)  # [R, P]
        x = apply_at_drafts(x.reshape(r, g, -1), pen.pb, *hist, tail, draft, live)
        x = x.reshape(r * g, -1)
    # The target's own token at every position: exactly what plain decoding samples there.
    target = sample(x, flat_sb, pos.reshape(-1), jnp.repeat(index, g)).reshape(r, g)
    n = _leading_true((draft == target[:, :-1]) & live) + 1  # [R]
    tokens = target
    if acceptance == "rejection" and q is not None:
        use = (sb.temperature > 0) & (gam > 0)  # [R] sampled rows that drafted

        def rejection():
            p = probs(x, flat_sb).reshape(r, g, -1)  # [R, G, V]
            qr = jnp.where(live[..., None], q[jnp.maximum(q_row, 0)], 0.0)  # [R, G-1, V]
            keys = cycle_keys(sb, pos[:, 0] - 1, ACCEPT_TAG)  # per request and cycle start
            keys = jax.vmap(jax.random.fold_in)(keys, index)  # forks draw their own
            u, gumbel = _noise(keys, g - 1, p.shape[-1])
            # Past γ: always reject with q = 0, so position γ samples from p (the bonus).
            u = jnp.where(live, u, 2.0)
            rt, rn = _rejection_sample_with_noise(p, qr, draft, u, gumbel)
            return jnp.where(use[:, None], rt, tokens), jnp.where(use, rn, n)

        tokens, n = jax.lax.cond(jnp.any(use), rejection, lambda: (tokens, n))
    return ((jnp.where(finite[:, None], tokens, -1), n), cache, *hidden)


# ------------------------------------------------------------------------------ host side


def build_mirror(engine, schedule, spec_idx: list[int], bd: int, gmax: int):
    """The model drafter's first forward (see the module docstring) and its decode tables."""
    cfg = engine.config
    S = cfg.block_size
    spec = set(spec_idx)
    chunks = []
    for i, s in enumerate(schedule.seqs):
        if i in spec:
            prev = engine.scheduler.sequence(s.seq_id).token_ids[s.start_pos - 1]
            table = s.block_table[: -(-(s.start_pos + 1) // S)]
            chunks.append(SeqChunk([prev, s.token_ids[0]], s.start_pos - 1, table, "last"))
        else:
            chunks.append(SeqChunk(s.token_ids, s.start_pos, s.block_table, "none"))
    t = pad_tokens(sum(len(c.token_ids) for c in chunks), engine.token_buckets)
    b = bucket(len(chunks), cfg.min_seq_bucket)
    md = bucket(max(-(-(schedule.seqs[i].start_pos + gmax) // S) for i in spec_idx), 1)
    longest = max(len(s.block_table) for s in schedule.seqs)  # lookahead blocks included
    m = bucket(max(longest, md), cfg.min_block_bucket)
    meta, owner = build_metadata(chunks, S, num_tokens=t, num_seqs=b, max_blocks=m, num_logits=bd)
    row_of = {c: r for r, c in enumerate(owner.tolist()) if c >= 0}
    first = np.zeros(bd, np.int32)
    tables = np.zeros((bd, m), np.int32)  # null block 0 past each table: harmless writes
    for k, i in enumerate(spec_idx):
        first[k] = row_of[i]
        tb = schedule.seqs[i].block_table
        tables[k, : len(tb)] = tb
    return meta, first, tables


def history(engine, schedule, spec_idx: list[int], bd: int) -> np.ndarray:
    """`[Bd, C]` committed tokens of each drafting request (the n-gram drafter's input)."""
    toks = [engine.scheduler.sequence(schedule.seqs[i].seq_id).token_ids for i in spec_idx]
    c = bucket(max(len(t) for t in toks), 16)
    hist = np.zeros((bd, c), np.int32)
    for k, t in enumerate(toks):
        hist[k, : len(t)] = t
    return hist


@functools.partial(jax.jit, static_argnames=("dcfg", "backend"), donate_argnames=("dcache",))
def _mirror(dparams, dcache, meta, *, dcfg, backend):
    """A step with no drafting request: the draft cache still records the step's K/V."""
    _, dcache = forward(dparams, dcfg, meta, dcache, backend=backend)
    return dcache


def run(engine, schedule) -> tuple[dict[int, tuple[list[int], int]], dict]:
    """Drafts and verifies one step (module docstring).

    Returns:
      (seq id -> (committed tokens, [-1] for non-finite logits; position of the first), the
      step's record: per sample row its γ, proposed ids and accepted count; draft / verify ms).
    """
    spec = engine.spec
    cfg = engine.config
    S = cfg.block_size
    seqs = schedule.seqs
    spec_idx = [i for i, s in enumerate(seqs) if s.num_lookahead > 0]
    # The step's γ (rows cut below it mask the rest): one compilation per γ, not per cut.
    gstep = engine._gamma if spec_idx else 0
    bd = bucket(max(len(spec_idx), 1), cfg.min_seq_bucket)
    k_of = {i: k for k, i in enumerate(spec_idx)}
    t0 = time.perf_counter()
    q = None
    dtok = np.zeros((bd, gstep), np.int32)
    sps_d = [engine._live[seqs[i].request_id].sampling for i in spec_idx]
    dm = engine.draft_model
    ngram_rows = set()
    head_ran = False  # a head drafter drafted this step (the hybrid skips it when it can)
    cur = np.zeros(bd, np.int32)  # position n of each drafting request's last committed token
    cur[: len(spec_idx)] = [seqs[i].start_pos for i in spec_idx]
    if engine.draft_head is not None:
        if spec_idx:
            first = spec.draft_head.ngram_first
            use = np.zeros(bd, bool)
            if first:  # the hybrid drafter: prompt lookup where the suffix recurs
                ng, ng_q, use = _ngram_rows(
                    history(engine, schedule, spec_idx, bd), cur, gamma=gstep,
                    max_n=spec.ngram_max, min_match=first, vocab_size=engine.cfg.vocab_size,
                )  # fmt: skip
                use = np.asarray(use)
                ngram_rows = {seqs[i].seq_id for k, i in enumerate(spec_idx) if use[k]}
            if use[: len(spec_idx)].all():  # no row drafts from the head: its drafting is
                d, q = ng, ng_q  # skipped (`_observe` rewrites every row it would write)
            else:
                d, q = head_drafting.draft(engine, schedule, spec_idx, bd, gstep)
                if first:
                    d, q = _take_ngram(d, q, ng, use)
                head_ran = True
            dtok = np.asarray(d)
    elif dm is not None:
        if spec_idx:
            meta, first, tables = build_mirror(engine, schedule, spec_idx, bd, gstep)
            sbd = SamplingBatch.from_params(sps_d, pad_to=bd)
            dindex = np.zeros(bd, np.int32)
            dindex[: len(spec_idx)] = [engine._sample_index[seqs[i].seq_id] for i in spec_idx]
            (d, q), engine.dcache = _draft_model(
                dm[1], engine.dcache, meta, first, sbd, cur, tables, dindex, dcfg=dm[0],
                backend=cfg.backend, gamma=gstep, block_size=S, acceptance=spec.acceptance,
            )  # fmt: skip
            dtok = np.asarray(d)
        else:
            chunks = [SeqChunk(s.token_ids, s.start_pos, s.block_table, "none") for s in seqs]
            meta, _ = build_metadata(
                chunks, S, num_tokens=pad_tokens(schedule.num_batched_tokens, engine.token_buckets),
                num_seqs=bucket(len(seqs), cfg.min_seq_bucket),
                max_blocks=bucket(max(len(s.block_table) for s in seqs), cfg.min_block_bucket),
                num_logits=1,
            )  # fmt: skip
            engine.dcache = _mirror(dm[1], engine.dcache, meta, dcfg=dm[0], backend=cfg.backend)
            jax.block_until_ready(engine.dcache)
    elif spec_idx:
        d = _draft_ngram(history(engine, schedule, spec_idx, bd), cur, gamma=gstep,
                         max_n=spec.ngram_max)  # fmt: skip
        if spec.acceptance == "rejection":
            q = jax.nn.one_hot(d, engine.cfg.vocab_size, dtype=jnp.float32)  # [Bd, γ, V]
        dtok = np.asarray(d)
    t1 = time.perf_counter()

    # The target's batch: drafting requests verify [t_n, d_1 .. d_γ] with every row's logits.
    chunks = []
    for i, s in enumerate(seqs):
        if s.num_lookahead:
            toks = list(s.token_ids) + dtok[k_of[i], : s.num_lookahead].tolist()
            chunks.append(SeqChunk(toks, s.start_pos, s.block_table, "all"))
        else:
            chunks.append(
                SeqChunk(s.token_ids, s.start_pos, s.block_table, "last" if s.sample else "none")
            )
    sample_rows = [(i, sid) for i, s in enumerate(seqs) for sid in s.sample_seq_ids]  # [R]
    n_logits = sum(
        len(c.token_ids) if c.logits == "all" else int(c.logits == "last") for c in chunks
    )
    t, b, m = padded_shape(schedule, cfg, engine.token_buckets)  # as a plain step's
    meta, owner = build_metadata(
        chunks, S, num_tokens=t, num_seqs=b, max_blocks=m, num_logits=bucket(n_logits, b)
    )
    rows_of: dict[int, list[int]] = {}
    for r, c in enumerate(owner.tolist()):
        if c >= 0:
            rows_of.setdefault(c, []).append(r)
    g = gstep + 1
    rows = np.zeros((b, g), np.int32)
    pos = np.zeros((b, g), np.int32)
    draft = np.zeros((b, gstep), np.int32)
    gam = np.zeros(b, np.int32)
    q_row = np.full(b, -1, np.int32)
    index = np.zeros(b, np.int32)
    for r, (i, sid) in enumerate(sample_rows):
        s = seqs[i]
        lst = rows_of[i]
        rows[r] = [lst[min(j, len(lst) - 1)] for j in range(g)]
        pos[r] = s.start_pos + len(s.token_ids) + np.arange(g)
        index[r] = engine._sample_index[sid]
        if s.num_lookahead:
            gam[r] = s.num_lookahead
            draft[r, : s.num_lookahead] = dtok[k_of[i], : s.num_lookahead]
            q_row[r] = k_of[i]
    sps = [engine._live[seqs[i].request_id].sampling for i, _ in sample_rows]
    sb = SamplingBatch.from_params(sps, pad_to=b)
    pen = None
    if any(sp.penalized for sp in sps):  # histories up to each row's first verified position
        states = [engine.scheduler.sequence(seqs[i].seq_id) for i, _ in sample_rows]
        pen = penalty_inputs(engine.cfg, sps, states, pos[:, 0], b)
    engine.step_shapes[(t, b, m, g)] += 1
    heads = engine.draft_head is not None
    (tokens, n), engine.cache, *hidden = _verify(
        engine.params, engine.cache, meta, rows, sb, pos, index, draft, q, q_row, gam, pen,
        cfg=engine.cfg, backend=cfg.backend, acceptance=spec.acceptance,
        return_hidden=engine.draft_head[0].return_hidden if heads else False,
    )  # fmt: skip
    if heads:
        head_drafting.observe(engine, meta, hidden[0])
    tokens, n = np.asarray(tokens), np.asarray(n)
    if heads:
        jax.block_until_ready(engine.dcache)  # the step includes the pool's update
    t2 = time.perf_counter()
    out = {}
    record = {"draft_ms": 1e3 * (t1 - t0), "verify_ms": 1e3 * (t2 - t1), "rows": {}}
    for r, (_, sid) in enumerate(sample_rows):
        if tokens[r, 0] < 0:
            out[sid] = ([-1], int(pos[r, 0]))
        else:
            out[sid] = (tokens[r, : n[r]].tolist(), int(pos[r, 0]))
        record["rows"][sid] = (int(gam[r]), draft[r, : gam[r]].tolist(), int(n[r]) - 1)
    record["ngram_rows"] = ngram_rows  # seq ids that took the hybrid's n-gram proposal
    record["head_ran"] = head_ran
    record["batch_size"] = len(seqs)
    record["num_tokens"] = schedule.num_batched_tokens
    return out, record
