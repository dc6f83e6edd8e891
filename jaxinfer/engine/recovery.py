"""Undoing a failed engine step (see `Engine.step`): the scheduler rolls back, and K/V the step
may have overwritten are recomputed (preemption by recompute) or forgotten by the prefix cache.

Functions of the engine's state rather than methods, so the step's transaction reads in one place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from jaxinfer.distributed.engine_mesh import new_cache
from jaxinfer.engine.cycles import new_draft_cache
from jaxinfer.engine.scheduler import Schedule

if TYPE_CHECKING:
    from jaxinfer.engine.engine import Engine


def written_blocks(schedule: Schedule, block_size: int) -> set[int]:
    """Blocks a step writes K/V into: its sequences' blocks from the first computed position on
    (copy-on-write destinations among them)."""
    written = {dst for _, dst in schedule.block_copies}
    for s in schedule.seqs:
        written.update(s.block_table[s.start_pos // block_size :])
    return written


def undo(engine: Engine, schedule: Schedule) -> None:
    """Rolls the scheduler back and recomputes the K/V the failed step may have spoilt.

    The rolled-back state refers to the K/V of before the step. The step wrote (or may have
    written) only the blocks its sequences compute into and the copies' destinations: before
    the step those were free, cached (evictable), held by a sequence the step preempted, or
    the scheduled sequences' own uncomputed slots. So the preempted sequences holding a
    written block are preempted again (recompute), and `forget_written` takes the written
    blocks out of the prefix cache once the failed requests freed theirs. If the cache itself
    is gone (donated to a device call that failed), everything is recomputed on a new cache.
    """
    engine.scheduler.rollback()
    if not engine._touched_device:
        return  # nothing reached the device: the state before the step is exact
    if not cache_alive(engine.cache) or (
        engine.dcache is not None and not cache_alive(engine.dcache)
    ):
        if engine.dcache is not None:  # the drafter's cache shares the block ids: both go
            engine.dcache = new_draft_cache(engine)
        engine.cache = new_cache(engine)  # on the engine's mesh, as at construction
        for seq in engine.scheduler.running:
            engine.scheduler.preempt(seq.seq_id)
        engine.allocator.reset_prefix_cache()  # no block is held now: every entry goes
        return
    written = written_blocks(schedule, engine.config.block_size)
    for sid in schedule.preempted_seq_ids:
        if engine.allocator.has_seq(sid) and written & set(engine.allocator.block_table(sid)):
            engine.scheduler.preempt(sid)


def forget_written(engine: Engine, schedule: Schedule) -> None:
    """Takes the blocks a failed step wrote out of the prefix cache (after `undo` and the
    failed requests' aborts, no table holds one)."""
    if not engine._touched_device:
        return
    written = written_blocks(schedule, engine.config.block_size)
    if any(engine.allocator.refcount(b) for b in written):
        # Not expected (see `undo`); recompute everything rather than trust a stale block.
        for seq in engine.scheduler.running:
            engine.scheduler.preempt(seq.seq_id)
    engine.allocator.invalidate(sorted(written))


def cache_alive(cache) -> bool:
    """Whether the cache arrays exist and hold no error (a failed call may consume them)."""
    try:
        leaves = jax.tree.leaves(cache)
        if any(x.is_deleted() for x in leaves):
            return False
        jax.block_until_ready(leaves)
        return True
    except Exception:
        return False
