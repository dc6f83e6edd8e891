"""The main job's defaults: SmolLM2 and --quick unless told otherwise; the tiny pair still runs.

Flags are parsed in a subprocess (absl's FLAGS is global and other scripts share flag names);
the end-to-end check runs the tiny pair's quality stage on a small budget (~30 s on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import jaxinfer as ji

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")

_RESOLVE = """
import json, sys
from absl import flags
from experiments import pipeline as pl
out = []
for argv in json.loads(sys.argv[1]):
    flags.FLAGS(["prog", *argv])
    paths = {"target": "T", "draft": "D"}
    out.append({
        "model": pl._MODEL.value, "quick": pl._quick(),
        "tiny_budget": pl.eval_budget(True), "pretrained_budget": pl.eval_budget(False),
        "commands": {tiny: {s: pl.stage_command(s, "W", paths, bool(tiny), False)[1:]
                            for s in pl.TITLES} for tiny in ("1", "")},
    })
    flags.FLAGS.unparse_flags()
print("RESULT" + json.dumps(out))
"""


def _resolve(argvs):
    proc = subprocess.run(
        [sys.executable, "-c", _RESOLVE, json.dumps(argvs)],
        capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT") :])


def test_defaults_are_smollm2_and_quick():
    default, full, target = _resolve([[], ["--full"], ["--model=target"]])
    assert default["model"] == "smollm2-135m" and default["quick"]
    assert not full["quick"] and full["pretrained_budget"] == ji.eval.EVAL_TOKENS
    assert target["model"] == "target" and target["quick"]
    assert default["pretrained_budget"] < default["tiny_budget"] < ji.eval.EVAL_TOKENS
    pre, tiny = default["commands"][""], default["commands"]["1"]
    # SmolLM2 stages: the sweep with group sizes it can take, the n-gram drafter; all --quick.
    assert pre["quantization"][:2] == ["-m", "experiments.quant_sweep"]
    assert pre["speculative"][1] == "experiments.spec_ngram" and "--model=T" in pre["speculative"]
    if "smollm2-135m" in ji.models.names():
        assert "--models=smollm2-135m,llama3-8b,qwen2.5-7b" in pre["memory"]
    assert tiny["quantization"][:2] == ["-m", "experiments.quality_report"]
    assert tiny["speculative"][1] == "experiments.spec_bench" and "--draft=D" in tiny["speculative"]
    for cmds in (pre, tiny):
        for stage, cmd in cmds.items():
            assert ("--quick" in cmd) == (stage != "memory"), (stage, cmd)
    assert all("--quick" not in c for c in full["commands"][""].values())


@pytest.mark.skipif("target" not in ji.models.names(), reason="needs the shipped tiny pair")
def test_tiny_pair_quality_stage_runs(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.pipeline", "--model=target", "--stages=quality",
         "--eval_tokens=1025", "--max_tokens=8", f"--workdir={tmp_path}"],
        capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["quality"]["eval_tokens"] == 1024
    assert {"target", "draft", "unigram"} <= set(res["quality"])
    assert len(res["samples"]) == 5 and all(s["kind"] == "raw" for s in res["samples"])
    assert "## 1. Quality" in (tmp_path / "report.md").read_text()
