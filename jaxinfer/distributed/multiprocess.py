"""Multi-process serving under `jax.distributed`: one controller per process, one SPMD step.

N processes each run `jax.distributed.initialize(coordinator, N, i)` (gloo collectives on CPUs),
after which `jax.devices()` lists every process's devices and a `Mesh` over them spans the
processes. Every process builds the same `Engine(..., EngineConfig(mesh=that mesh))` and calls
`step()` in lockstep: each runs the same jitted step on its own shards, and XLA's collectives
(the all-reduces after the row-parallel products) cross the processes.

The host scheduler's decisions must be identical on every process, or the processes would launch
different programs and deadlock in a collective. Two ways to get that: broadcast each step's
`Schedule` from process 0, or make the scheduler deterministic and give every process the same
inputs. jaxinfer does the second, because the scheduler already is a pure function of its
inputs: it reads no clock (arrival times only feed metrics), no randomness and no device state,
and its only inputs are the request stream (requests and aborts, in order, between steps) and the
sampled tokens of each step, which are the step's replicated output, bit-identical on every
process. A broadcast would add a host round trip through the coordinator to every step's
critical path and serialize a Python object per step; replication costs nothing per step. What
must be shared is the request stream, and only it: `broadcast_requests` sends process 0's
requests to all (the way an HTTP front end on process 0 would feed the others), and
`check_same_schedule` (a debugging aid, one small all-gather) proves the decisions equal.

Inputs that would break the determinism are refused by `check_replicable`: speculation with an
automatic γ, whose controller chooses from measured step times that differ between processes.
"""

from __future__ import annotations

import hashlib
import json

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.schedule import Schedule


def initialize(coordinator: str, num_processes: int, process_id: int) -> None:
    """`jax.distributed.initialize` on CPUs with gloo collectives, its arguments checked.

    Args:
      coordinator: "host:port" of process 0's coordination service.
      num_processes: N >= 1.
      process_id: this process, in [0, N).

    Raises:
      ValueError: a malformed address, N < 1 or an id outside [0, N).
    """
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"coordinator={coordinator!r}: expected 'host:port'")
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes={num_processes!r}: expected an int >= 1")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id!r}: expected an int in [0, {num_processes})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)


def broadcast_requests(requests: list | None) -> list:
    """Process 0's JSON-serialisable request list, on every process (others pass None)."""
    is_source = jax.process_index() == 0
    data = json.dumps(requests).encode() if is_source else b""
    n = int(multihost_utils.broadcast_one_to_all(np.array(len(data), np.int32)))
    buf = np.frombuffer(data, np.uint8) if is_source else np.zeros(n, np.uint8)
    buf = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return json.loads(buf.astype(np.uint8).tobytes().decode())


def schedule_digest(schedule: Schedule) -> int:
    """A 63-bit digest of every decision in a Schedule (sequences, chunks, blocks, copies)."""
    parts = [
        (s.seq_id, repr(s.request_id), s.token_ids, s.start_pos, s.block_table, s.sample,
         s.sample_seq_ids, s.num_lookahead)
        for s in schedule.seqs
    ]  # fmt: skip
    text = repr((parts, schedule.block_copies, schedule.preempted_seq_ids))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def check_same_schedule(schedule: Schedule, step: int) -> None:
    """Raises RuntimeError if any process scheduled differently (one all-gather of 8 bytes)."""
    mine = np.array([schedule_digest(schedule)], np.int64)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1)
    if np.any(every != every[0]):
        raise RuntimeError(
            f"step {step}: schedules differ across processes (digests {every.tolist()}); the "
            "request streams or the scheduler's inputs are not identical"
        )


def check_replicable(config: EngineConfig) -> None:
    """Refuses engine settings whose scheduling would differ between processes."""
    spec = config.speculative
    if spec is not None and spec.auto:
        raise ValueError(
            "EngineConfig.speculative with num_speculative_tokens='auto' cannot run on several "
            "processes: its γ controller chooses from measured step times, which differ between "
            "processes; expected a fixed num_speculative_tokens"
        )
