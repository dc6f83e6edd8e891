"""One process of a multi-process engine: `python -m jaxinfer.distributed.worker --flags`.

    python -m jaxinfer.distributed.worker --coordinator 127.0.0.1:4321 --num_processes 2 \
        --process_id 0 --requests requests.json --out outdir

Normally started by `launch.py`, one per process. Each process joins `jax.distributed`, loads
the model, receives process 0's requests (`broadcast_requests`), builds the engine on a
tensor-parallel mesh over every process's devices and steps it to completion in lockstep with
the others (`multiprocess.py` says why the schedules agree). Each writes
`<out>/process_<i>.json`: the tokens of every request, its step count and schedule digests.

The requests file (read by process 0 only) is JSON: `{"model": name or path, "engine": {...
EngineConfig fields ...}, "requests": [{"prompt": [ids], "sampling": {... SamplingParams
fields ...}}, ...]}`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

import jax
import numpy as np

from jaxinfer import models
from jaxinfer.checkpoint import load_checkpoint
from jaxinfer.distributed import multiprocess
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.sampling import SamplingParams


def load_model(name: str):
    """(cfg, params) of a named model (`ji.models`) or a checkpoint path."""
    path = name if pathlib.Path(name).exists() else models.path(name)
    return load_checkpoint(path)


def serve(spec: dict, *, mesh: jax.sharding.Mesh | None, check_schedules: bool) -> dict:
    """Runs the requests of `spec` (the requests file's content) on an engine over `mesh`.

    Returns:
      {"tokens": [[ids] per request], "finish_reasons", "num_steps", "digests", "preemptions",
       "prefix_cache_hits"}.
    """
    cfg, params = load_model(spec["model"])
    config = EngineConfig(**spec.get("engine", {}), mesh=mesh)
    multiprocess.check_replicable(config)
    engine = Engine(cfg, params, config)
    rids = [
        engine.add_request(r["prompt"], SamplingParams(**r.get("sampling", {})), request_id=i)
        for i, r in enumerate(spec["requests"])
    ]
    outs: dict = {rid: [] for rid in rids}
    reasons: dict = {}
    digests = []
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        schedule = engine.last_schedule
        digests.append(multiprocess.schedule_digest(schedule))
        if check_schedules and jax.process_count() > 1:
            multiprocess.check_same_schedule(schedule, len(digests))
    return dict(
        tokens=[outs[r] for r in rids],
        finish_reasons=[reasons.get(r) for r in rids],
        num_steps=engine.num_steps,
        digests=digests,
        preemptions=engine.num_preemptions,
        prefix_cache_hits=engine.allocator.prefix_cache_hits,
        devices=len(jax.devices()),
        mesh=None if engine.mesh is None else dict(engine.mesh.shape),
        pid=os.getpid(),
        itls=[engine.metrics_collector.requests[r].itls for r in rids],  # seconds between events
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--coordinator", required=True, help="host:port of process 0")
    ap.add_argument("--num_processes", type=int, required=True)
    ap.add_argument("--process_id", type=int, required=True)
    ap.add_argument("--requests", required=True, help="the requests file (process 0 reads it)")
    ap.add_argument("--out", required=True, help="folder for process_<i>.json")
    ap.add_argument("--check_schedules", action="store_true", help="all-gather each digest")
    args = ap.parse_args(argv)
    multiprocess.initialize(args.coordinator, args.num_processes, args.process_id)
    spec = None
    if args.process_id == 0:
        spec = json.loads(pathlib.Path(args.requests).read_text())
    spec = multiprocess.broadcast_requests(spec)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("tp",))  # every process's devices
    result = serve(spec, mesh=mesh if mesh.size > 1 else None, check_schedules=args.check_schedules)
    out = pathlib.Path(args.out) / f"process_{args.process_id}.json"
    out.write_text(json.dumps(result))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
