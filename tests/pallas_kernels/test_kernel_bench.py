"""experiments/kernel_bench.py end to end on CPU: its correctness part, and that one failing
section of a (faked) GPU run is recorded without losing the others."""

import json

import jax
import pytest
from absl import flags

from experiments import kernel_bench as kb

SMALL = ["--int4_m=1", "--contexts=512", "--batches=1", "--reps=1", "--inner=1",
         "--copy_mib=1", "--rotate_mib=1"]  # fmt: skip


def _run(tmp_path, extra=()):
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["kernel_bench", f"--workdir={tmp_path}", *SMALL, *extra])
    try:
        kb.main([])
        code = 0
    except SystemExit as e:
        code = e.code
    with open(tmp_path / "results.json") as f:
        return code, json.load(f)


def test_cpu_runs_the_correctness_part(tmp_path):
    code, results = _run(tmp_path)
    assert code == 0
    assert results["errors"] == {}
    assert len(results["correctness"]) == 9
    for row in results["correctness"]:
        assert row["ok"] and row["interpret_vs_ref"] <= row["tolerance"], row
    assert "copy" not in results and results["timing"].startswith("skipped")


def test_a_failing_section_is_recorded_and_the_rest_still_runs(tmp_path, monkeypatch):
    """On a CPU posing as a GPU every compiled Pallas call fails; the XLA copy still runs."""

    class FakeGpu:
        platform, device_kind = "gpu", "fake"

    monkeypatch.setattr(jax, "devices", lambda *a: [FakeGpu()])
    code, results = _run(tmp_path)
    assert code == 1
    assert results["copy"]["gb_s"] > 0
    assert set(results["errors"]) == {"int4", "attention"}
    rows = results["correctness"]
    assert rows and all(not r["ok"] and "error" in r for r in rows)
    assert all(r["interpret_vs_ref"] <= r["tolerance"] for r in rows)  # interpret still ran


@pytest.fixture(autouse=True)
def _restore_flags():
    yield
    flags.FLAGS.unparse_flags()
