"""Two-process disaggregation: process 0 prefills, process 1 decodes, a `SocketConnector` between.

    python -m jaxinfer.distributed.launch --num_processes 2 --out outdir -- \
        python -m jaxinfer.distributed.disagg_worker --requests requests.json --out outdir

The launcher's `--coordinator host:port` is the address the prefill process listens on (no
`jax.distributed` here: the processes exchange KV blocks, not collectives; each runs its own
engine on its own devices). The requests file is the worker's (`worker.py`) with optional
`prefill_engine` / `decode_engine` EngineConfig fields; each process reads it. Each process
writes `<out>/process_<i>.json`: the decode side every request's tokens (t0 first), its bytes
moved, blocks skipped and load seconds; both sides their pools' used blocks and the connector's
pending requests at exit (all 0 after a clean run, aborts included).

With `"warm_up": true` in the requests file, each process first serves the requests on a
throwaway engine of its own config (and gathers and writes each block-count bucket of a transfer
once), so the measured run compiles nothing. `--pin_cores` runs process i on core i alone
(`os.sched_setaffinity`, before jax starts its threads): the two sides own their cores.

Test hooks: `--abort RID` aborts that request on the decode side while its load is in flight;
`--preempt_prefill N` preempts N requests on the prefill side in the middle of their prefill.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

import jax

from jaxinfer.cache.metadata import bucket
from jaxinfer.distributed.connector import gather_blocks, scatter_blocks
from jaxinfer.distributed.disagg import DecodeSide, PrefillSide
from jaxinfer.distributed.socket_connector import SocketConnector
from jaxinfer.distributed.worker import load_model
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.sampling import SamplingParams


def _engine(spec: dict, side: str) -> Engine:
    cfg, params = load_model(spec["model"])
    config = EngineConfig(**spec.get(f"{side}_engine", spec.get("engine", {})))
    engine = Engine(cfg, params, config)
    if spec.get("warm_up"):
        warm_up(engine, spec["requests"])
    return engine


def warm_up(engine: Engine, requests: list[dict]) -> None:
    """Compiles what serving `requests` runs: their steps, on a throwaway engine of the same
    model and config (the jitted step is shared), and the block gather / write of a transfer
    for every block-count bucket up to the longest prompt's (blocks written onto themselves:
    the cache does not change)."""
    prompts = [r["prompt"] for r in requests]
    sps = [SamplingParams(**r.get("sampling", {})) for r in requests]
    Engine(engine.cfg, engine.params, engine.config).generate(prompts, sps)
    S, usable = engine.config.block_size, engine.config.num_blocks - 1
    most = min(max(len(p) // S for p in prompts), usable)
    for m in sorted({bucket(k) for k in range(1, most + 1)}):
        ids = list(range(1, min(m, usable) + 1))
        engine.cache = scatter_blocks(engine.cache, gather_blocks(engine.cache, ids), ids)
    jax.block_until_ready(engine.cache)


def run_prefill(spec: dict, address: str, preempt: int, timeout: float) -> dict:
    engine = _engine(spec, "prefill")
    conn = SocketConnector.listen(address, timeout)
    side = PrefillSide(engine, conn)
    for i, r in enumerate(spec["requests"]):
        side.add_request(r["prompt"], SamplingParams(**r.get("sampling", {})), i, engine.clock())
    forced = 0
    while side.has_unfinished():
        for e in side.step():  # finished at prefill (t0 a stop token, or max_tokens 1)
            conn.send_done(e.request_id, e.new_token_ids, e.finish_reason)
        mid = [s for s in engine.scheduler.running if s.in_prefill and s.num_computed > 0]
        if forced < preempt and mid:
            engine.scheduler.preempt(mid[0].seq_id)
            forced += 1
    conn.send_eos(len(spec["requests"]))
    conn.wait_for_bye(timeout)
    return dict(
        forced_preemptions=forced,
        preemptions=engine.num_preemptions,
        prefix_cache_hits=engine.allocator.prefix_cache_hits,
        used_blocks=engine.allocator.num_used_blocks,
        pending=conn.num_pending(),
    )


def _itls(engine: Engine, rid) -> list[float]:
    rec = engine.metrics_collector.requests.get(rid)
    return [] if rec is None else rec.itls


def run_decode(spec: dict, address: str, abort, timeout: float) -> dict:
    engine = _engine(spec, "decode")
    conn = SocketConnector.connect(address, jax.tree.map(lambda x: x.sharding, engine.cache))
    side = DecodeSide(engine, conn)
    tokens: dict = {}
    reasons: dict = {}
    finished: set = set()
    aborted_at_blocks = None
    deadline = time.monotonic() + timeout
    while conn.eos is None or len(finished) < conn.eos or side.has_unfinished():
        if time.monotonic() > deadline or conn.error is not None:
            raise RuntimeError(f"decode side stuck or disconnected: {conn.error!r}")
        side.start_loads()
        if abort is not None and abort in side.loading():
            used = engine.allocator.num_used_blocks
            side.abort(abort)  # while its load is in flight
            aborted_at_blocks = (used, engine.allocator.num_used_blocks)
            finished.add(abort)
            reasons[abort] = "abort"
        events = side.finish_loads(wait=False) + side.step()  # decodes never wait on a load
        while conn.done:
            d = conn.done.pop(0)
            events.append(d)
            tokens[d["rid"]] = d["tokens"]
            reasons[d["rid"]] = d["reason"]
            finished.add(d["rid"])
        for e in events:
            if isinstance(e, dict):
                continue
            tokens.setdefault(e.request_id, []).extend(e.new_token_ids)
            if e.finished:
                finished.add(e.request_id)
                reasons[e.request_id] = e.finish_reason
        if not events:
            time.sleep(0.002)
    conn.send_bye()
    n = conn.eos
    return dict(
        tokens=[tokens.get(i, []) for i in range(n)],
        finish_reasons=[reasons.get(i) for i in range(n)],
        bytes_moved=conn.bytes_moved,
        load_seconds=conn.load_seconds,
        num_loads=conn.num_loads,
        blocks_skipped=side.blocks_skipped,
        skipped={str(k): v for k, v in side.skipped.items()},
        preemptions=engine.num_preemptions,
        prefix_cache_hits=engine.allocator.prefix_cache_hits,
        used_blocks=engine.allocator.num_used_blocks,
        pending=conn.num_pending(),
        aborted_used_blocks=aborted_at_blocks,
        itls=[_itls(engine, i) for i in range(n)],  # decode-side seconds between events
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--coordinator", required=True, help="host:port the prefill side listens on")
    ap.add_argument("--num_processes", type=int, required=True)
    ap.add_argument("--process_id", type=int, required=True)
    ap.add_argument("--requests", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--abort", type=int, default=None, help="request to abort during its load")
    ap.add_argument("--preempt_prefill", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--pin_cores", action="store_true", help="process i runs on core i alone")
    args = ap.parse_args(argv)
    if args.num_processes != 2:
        raise SystemExit(f"--num_processes={args.num_processes}: expected 2 (prefill, decode)")
    if args.process_id not in (0, 1):
        raise SystemExit(f"--process_id={args.process_id}: expected 0 (prefill) or 1 (decode)")
    if args.pin_cores:
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < args.num_processes:
            raise SystemExit(
                f"--pin_cores: this process may run on {len(cores)} core(s) ({cores}), "
                f"fewer than --num_processes={args.num_processes}"
            )
        os.sched_setaffinity(0, {cores[args.process_id]})
    spec = json.loads(pathlib.Path(args.requests).read_text())
    if args.process_id == 0:
        result = run_prefill(spec, args.coordinator, args.preempt_prefill, args.timeout)
    else:
        result = run_decode(spec, args.coordinator, args.abort, args.timeout)
    result["pid"] = os.getpid()
    (pathlib.Path(args.out) / f"process_{args.process_id}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
