"""experiments/bench_serve.py attached to the test server: a small soak and a small sweep."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments import pairing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(server, workdir, *flags):
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    cmd = [
        sys.executable, os.path.join(ROOT, "experiments", "bench_serve.py"),
        f"--base_url={server.url}", f"--workdir={workdir}", "--quick", "--num_requests=8",
        "--max_len=64", "--workloads=sharegpt", *flags,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    with open(os.path.join(workdir, "results.json")) as f:
        return json.load(f)


def test_soak_and_sweep_attached(server, tmp_path):
    out = _bench(server, tmp_path / "soak", "--soak", "--soak_requests=40")["soak"]
    assert out["ok"] and out["failed"] == 0 and out["kv_blocks_used_after"] == 0
    assert out["status_codes"].get("200", 0) + out["rejected_503"] == 40
    res = _bench(
        server, tmp_path / "sweep", "--rate_fractions=0.5", "--burstiness=0.5",
        "--slo_ttft_s=10", "--slo_tpot_s=1", "--max_concurrency=4", "--repeats=2", "--in_process",
    )  # fmt: skip
    w = res["workloads"]["sharegpt"]
    run = w["runs"]["http"][0]
    assert run["failed"] == 0 and run["summary"]["num_completed"] == 8
    assert run["summary"]["goodput"] > 0 and res["server_exit_code"] is None  # attached: not ours
    # two repeats per path, interleaved, compared pair by pair
    assert [len(w["runs"][p][0]["repeats"]) for p in ("http", "in_process")] == [2, 2]
    pair = w["paired"][0]
    assert pair["pairs"] == 2 and pair["goodput_ratio"]["min"] > 0
    http, local = (w["runs"][p][0]["repeats"] for p in ("http", "in_process"))
    ttft = [
        1e3 * (a["summary"]["ttft"]["p50"] - b["summary"]["ttft"]["p50"])
        for a, b in zip(http, local)
    ]
    assert (pair["ttft_p50_diff_ms"]["min"], pair["ttft_p50_diff_ms"]["max"]) == (
        min(ttft),
        max(ttft),
    )


def _side(ttft, n):
    """One path's result of a run of n requests whose completed TTFTs are `ttft` (seconds)."""
    return {"summary": {"num_requests": n, "goodput": 1.0, "ttft": {"p50": float(np.median(ttft))},
                        "tpot": {"p50": 0.05}}, "ttft": list(ttft)}  # fmt: skip


def test_paired_pools_and_pairs_the_ttfts():
    pairs = [
        {"http": _side([0.10, 0.20, 0.40], 3), "in_process": _side([0.10, 0.15, 0.30], 3)},
        {"http": _side([0.30, 0.50, 0.60], 3), "in_process": _side([0.20, 0.50, 0.70], 3)},
    ]
    out = pairing.paired(pairs)
    # pooled p50s: median(.1 .2 .4 .3 .5 .6) = .35, median(.1 .15 .3 .2 .5 .7) = .25
    assert out["ttft_p50_pooled_diff_ms"] == pytest.approx(100.0)
    per = [0, 50, 100, 100, 0, -100]  # ms, request by request
    assert out["ttft_per_request_diff_ms"] == pytest.approx(
        {"median": float(np.median(per)), "mean": float(np.mean(per))}
    )
    assert out["ttft_p50_diff_ms"]["median"] == pytest.approx(np.median([50.0, 0.0]))
    # a request that failed over HTTP: that pair's TTFTs no longer line up request by request
    pairs[1]["http"] = _side([0.30, 0.50], 3)
    per = pairing.paired(pairs)["ttft_per_request_diff_ms"]
    assert per == pytest.approx({"median": 50.0, "mean": 50.0})
    pairs[0]["http"] = _side([0.10, 0.20], 3)
    assert pairing.paired(pairs)["ttft_per_request_diff_ms"] is None
    # one request lost on each side: as many TTFTs on both, but not the same requests
    both_short = [{"http": _side([0.10, 0.20], 3), "in_process": _side([0.10, 0.30], 3)}]
    assert pairing.paired(both_short)["ttft_per_request_diff_ms"] is None
