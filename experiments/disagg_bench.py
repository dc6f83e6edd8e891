r"""Disaggregation benchmarks: KV transfer GB/s, and decode interference colocated vs disaggregated.

    python -m experiments.disagg_bench --workdir=runs/disagg_bench

Transfer: a SmolLM2-135M-shaped block payload (L=30, K=3, D=64, S=16, float32: 46 KiB per
token) moved by each connector, median of --repeats: `MeshConnector` (gather on device 0,
`jax.device_put` to device 1 of two fake CPU devices, i.e. a host memcpy here) and
`SocketConnector` over loopback TCP in one process (device -> host, socket, host -> device).

Interference: --decoders short requests decode --decode_tokens tokens while --long_prompts long
prompts (--long_len tokens) arrive behind them, all queued at t = 0 (the long prompts are
admitted as the decoders start, and with chunked prefill their chunks share the decoders'
steps). Colocated: one engine in this process, on every core. Disaggregated: `disagg_worker.py`,
two processes (prefill, decode), with --pin_cores each on one core of its own (the same cores in
all, split between the sides, as DistServe compares deployments on the same GPUs). Each process
first serves the requests once on a throwaway engine, and the colocated engine serves them in a
discarded round 0, so no measured step compiles. The figure is the decoders' inter-token latency
(ITL) p50 / p99, measured by the engine's metrics clock (on the decode side: from its first
decode output on, so the handoff is not an ITL), and the run's wall time (processes' start,
model load and warm-up included).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import json  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from experiments import common, flag_checks  # noqa: E402
from jaxinfer.cache.paged import PagedKVCache  # noqa: E402
from jaxinfer.distributed import worker  # noqa: E402
from jaxinfer.distributed.connector import MeshConnector, Prefilled, gather_blocks  # noqa: E402
from jaxinfer.distributed.launch import free_port, launch  # noqa: E402
from jaxinfer.distributed.socket_connector import SocketConnector  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", None, "Where config.json and results.json go.")
_CONFIG = common.config_flag()
_BLOCKS = flags.DEFINE_list("blocks", ["8", "32", "128"], "Payload sizes in blocks of 16.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Transfers per size (median).")
_DECODERS = flags.DEFINE_integer("decoders", 4, "Short requests that decode.")
_DECODE_TOKENS = flags.DEFINE_integer("decode_tokens", 48, "Their output tokens.")
_LONG = flags.DEFINE_integer("long_prompts", 4, "Long prompts arriving behind them.")
_LONG_LEN = flags.DEFINE_integer("long_len", 256, "Their prompt tokens.")
_PARTS = flags.DEFINE_list("parts", ["transfer", "interference"], "Which benchmarks to run.")
flag_checks.int_list(_BLOCKS, min_value=1)
flag_checks.choice_list(_PARTS, ("transfer", "interference"))
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Measured rounds (after one warm-up), interleaved.")
_MODEL = flags.DEFINE_string("model", "target", "Interference model: a `ji.models` name or path.")
_PIN = flags.DEFINE_bool("pin_cores", True, "Disaggregated: each process on a core of its own.")

L, K, D, S = 30, 3, 64, 16  # SmolLM2-135M's cache shape


def _pool(n: int, device) -> PagedKVCache:
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((L, n + 1, K, S, D), np.float32) for _ in range(2))
    return jax.device_put(PagedKVCache(k, v, None, None), device)


def _transfer(conn_for, n: int, repeats: int) -> dict:
    """Median seconds and GB/s of moving n blocks, save -> start_load -> wait_for_load."""
    pool = _pool(n, jax.devices()[0])
    secs = []
    for r in range(repeats):
        save, load = conn_for()
        blocks = gather_blocks(pool, list(range(1, n + 1)))
        info = Prefilled(r, tuple(range(n * S)), 0, n, {}, 0.0)
        save.save(info, jax.block_until_ready(blocks))
        t0 = time.perf_counter()
        load.start_load(r, 0)
        moved = load.wait_for_load(r)
        secs.append(time.perf_counter() - t0)
        assert moved.k.shape[1] == n
        load.request_finished(r)
        save.request_finished(r)
    nbytes = 2 * L * K * D * 4 * n * S
    med = statistics.median(secs)
    return dict(blocks=n, bytes=nbytes, seconds=med, gb_per_s=nbytes / med / 1e9)


def _mesh_pair():
    target = jax.tree.map(lambda x: x.sharding, _pool(1, jax.devices()[1]))
    conn = MeshConnector(target)
    return conn, conn


def _socket_pair(target, address):
    box = {}
    server = threading.Thread(target=lambda: box.setdefault("p", SocketConnector.listen(address)))
    server.start()
    dec = SocketConnector.connect(address, target)
    server.join()
    pre = box["p"]
    # the prefill side's `ready` announcements reach the decode side's reader before a load
    return pre, dec


def _interference_spec() -> dict:
    rng = np.random.default_rng(3)
    requests = [
        dict(prompt=rng.integers(2, 4096, 8).tolist(),
             sampling=dict(temperature=0.0, max_tokens=_DECODE_TOKENS.value, ignore_eos=True))
        for _ in range(_DECODERS.value)
    ] + [
        dict(prompt=rng.integers(2, 4096, _LONG_LEN.value).tolist(),
             sampling=dict(temperature=0.0, max_tokens=2, ignore_eos=True))
        for _ in range(_LONG.value)
    ]  # fmt: skip
    engine = dict(block_size=16, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64,
                  min_token_bucket=16, min_seq_bucket=8)  # fmt: skip
    return dict(model=_MODEL.value, engine=engine, requests=requests, warm_up=True)


def _itl_stats(itls: list[list[float]]) -> dict:
    flat = np.asarray([x for r in itls[: _DECODERS.value] for x in r]) * 1e3
    return dict(
        itl_p50_ms=float(np.percentile(flat, 50)), itl_p99_ms=float(np.percentile(flat, 99))
    )


def _interference(workdir: pathlib.Path) -> dict:
    spec = _interference_spec()
    path = workdir / "interference.json"
    path.write_text(json.dumps(spec))
    rows = {"colocated": [], "disaggregated": []}
    # Every process compiles through one persistent cache, and round 0 (which fills it) is
    # discarded, so no ITL holds a compilation.
    cache_env = {"JAX_COMPILATION_CACHE_DIR": str(workdir / "jax_cache"),
                 "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}  # fmt: skip
    for r in range(_ROUNDS.value + 1):
        t0 = time.perf_counter()
        co = worker.serve(spec, mesh=None, check_schedules=False)
        co_row = {**_itl_stats(co["itls"]), "wall_s": time.perf_counter() - t0}
        out = pathlib.Path(tempfile.mkdtemp(dir=workdir))
        cmd = [sys.executable, "-m", "jaxinfer.distributed.disagg_worker",
               "--requests", str(path), "--out", str(out)]  # fmt: skip
        cmd += ["--pin_cores"] if _PIN.value else []
        root = str(pathlib.Path(__file__).resolve().parents[1])
        env = {**os.environ, **cache_env, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu",
               "PYTHONPATH": root}  # fmt: skip
        t0 = time.perf_counter()
        launch(cmd, 2, out, timeout=600, env=env)
        dec = json.loads((out / "process_1.json").read_text())
        assert dec["tokens"] == co["tokens"], "disaggregated tokens differ from colocated"
        dis_row = {**_itl_stats(dec["itls"]), "wall_s": time.perf_counter() - t0,
                   "transfer_gb_per_s": dec["bytes_moved"] / max(dec["load_seconds"], 1e-9) / 1e9,
                   "loadavg": os.getloadavg()[0]}  # fmt: skip
        if r > 0:  # round 0 compiles
            rows["colocated"].append(co_row)
            rows["disaggregated"].append(dis_row)
    return rows


def main(argv):
    del argv
    common.apply_config(_CONFIG.value)
    workdir = pathlib.Path(_WORKDIR.value or tempfile.mkdtemp())
    common.save_config(str(workdir))
    load0 = os.getloadavg()[0]
    target1 = jax.tree.map(lambda x: x.sharding, _pool(1, jax.devices()[1]))
    transfer = {"mesh": [], "socket": []}
    for n in (int(b) for b in _BLOCKS.value if "transfer" in _PARTS.value):
        transfer["mesh"].append(_transfer(_mesh_pair, n, _REPEATS.value))
        transfer["socket"].append(
            _transfer(lambda: _socket_pair(target1, f"127.0.0.1:{free_port()}"), n, _REPEATS.value)
        )
    for kind, rows in transfer.items():
        for r in rows:
            print(f"transfer {kind:6s} {r['blocks']:4d} blocks {r['bytes'] / 2**20:7.1f} MiB "
                  f"{r['seconds'] * 1e3:8.2f} ms  {r['gb_per_s']:6.2f} GB/s")  # fmt: skip
    inter = _interference(workdir) if "interference" in _PARTS.value else {}
    for kind, rows in inter.items():
        for r in rows:
            print(f"{kind:14s} ITL p50 {r['itl_p50_ms']:6.2f} ms  p99 {r['itl_p99_ms']:6.2f} ms  "
                  f"wall {r['wall_s']:6.1f} s")  # fmt: skip
    result = dict(transfer=transfer, interference=inter, loadavg=[load0, os.getloadavg()[0]])
    common.write_results(str(workdir), result)
    print(f"load average {load0:.2f} -> {os.getloadavg()[0]:.2f}; results in {workdir}")


if __name__ == "__main__":
    app.run(main)
