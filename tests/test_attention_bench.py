"""experiments/attention_bench.py end to end on a tiny grid (in a subprocess: its absl flags would
clash with other experiments' in this process): every system of a row is timed, and each ratio
is that system's time over the first's, under a header that names the pair it divides."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_kv_formats_rows_and_ratios(tmp_path):
    args = ["--backends=xla", "--kv_formats=float,int8", "--cache_blocks=64", "--num_seqs=2",
            "--max_blocks=4", "--context=20", "--chunk=16", "--prompt=16", "--reps=1"]  # fmt: skip
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "experiments", "attention_bench.py"),
         f"--workdir={tmp_path}", *args],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
        env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    with open(tmp_path / "results.json") as f:
        result = json.load(f)
    assert result["flags"]["kv_formats"] == ["float", "int8"]
    rows = result["rows"]
    assert [r["batch"] for r in rows] == ["decode", "decode_low", "mixed", "prefill"]
    for r in rows:
        assert set(r["ms"]) == {"xla/float", "xla/int8"} and min(r["ms"].values()) > 0
        want = r["ms"]["xla/int8"] / r["ms"]["xla/float"]
        assert r["ratio"] == {"xla/int8": pytest.approx(want)}
    header = "| batch | T | cache blocks | xla/float ms | xla/int8 ms | xla/int8 / xla/float |"
    assert header in run.stdout
