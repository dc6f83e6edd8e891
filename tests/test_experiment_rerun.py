"""Experiments rerun from their saved config.json, and a workdir never mixes two runs.

A run writes config.json ({"script", "flags", "given", "resolved"?}) before it starts and
results.json atomically when it ends; `--config=<workdir>/config.json` reruns it, explicit flags
on top. Each script runs in its own subprocess (absl's FLAGS is global). The cheap experiments
run on the shipped tiny target (or on presets only) in a few seconds each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import jaxinfer as ji
from experiments import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
needs_target = pytest.mark.skipif("target" not in ji.models.names(), reason="needs the tiny target")


def _run(script: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", f"experiments.{script}", *argv],
        capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=600,
    )  # fmt: skip


def _ok(script: str, *argv: str) -> subprocess.CompletedProcess:
    proc = _run(script, *argv)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def _read(workdir, name: str):
    with open(os.path.join(workdir, name)) as f:
        return json.load(f)


def shape(x):
    """The table shape of a results.json: keys of every dict, row count and row keys of lists."""
    if isinstance(x, dict):
        return {k: shape(v) for k, v in x.items()}
    if isinstance(x, list):
        return [len(x)] + ([shape(x[0])] if x and isinstance(x[0], (dict, list)) else [])
    return type(x).__name__ if x is not None else "null"


def _table_header(md: str) -> str:
    return next(ln for ln in md.splitlines() if ln.startswith("| "))


# script -> (first run's flags, markdown file whose table header must match, or None)
RERUNS = {
    "memory_report": (["--models=target,llama3-8b", "--weight_formats=bf16,w8", "--seq_len=1024"],
                      "memory.md"),
    "sim_h200": (["--tp=1,2", "--rates=2,8", "--num_requests=20", "--output_len=16"], None),
    "quantize": (["--model=target", "--method=rtn", "--bits=8", "--group_size=-1",
                  "--calib_samples=2", "--calib_len=32"], None),
    "generate": (["--model=target", "--max_tokens=6", "--prompt=def f(x):",
                  "--bad_words_ids=7;3,5"], None),
}  # fmt: skip


@pytest.mark.parametrize("script", sorted(RERUNS))
def test_rerun_from_saved_config_has_the_same_table_shape(script, tmp_path):
    if script in ("quantize", "generate") and "target" not in ji.models.names():
        pytest.skip("needs the tiny target")
    argv, md = RERUNS[script]
    first, again = tmp_path / "first", tmp_path / "again"
    _ok(script, *argv, f"--workdir={first}")
    _ok(script, f"--config={first}/config.json", f"--workdir={again}")
    saved, rerun = _read(first, "config.json"), _read(again, "config.json")
    assert saved["script"] == rerun["script"] == script
    # The same flags (the workdir aside) and the same flags counted as given.
    assert {**saved["flags"], "workdir": None} == {**rerun["flags"], "workdir": None}
    assert saved["given"] == rerun["given"]
    assert saved.get("resolved") == rerun.get("resolved")
    a, b = _read(first, "results.json"), _read(again, "results.json")
    assert shape(a) == shape(b)
    if md:
        assert _table_header((first / md).read_text()) == _table_header((again / md).read_text())


def test_an_explicit_flag_overrides_the_saved_one(tmp_path):
    argv = RERUNS["memory_report"][0]
    _ok("memory_report", *argv, f"--workdir={tmp_path / 'a'}")
    _ok("memory_report", f"--config={tmp_path}/a/config.json", "--seq_len=2048",
        "--gpu_gib=141", f"--workdir={tmp_path / 'b'}")  # fmt: skip
    a, b = _read(tmp_path / "a", "config.json"), _read(tmp_path / "b", "config.json")
    assert (a["flags"]["seq_len"], b["flags"]["seq_len"]) == (1024, 2048)
    assert b["flags"]["gpu_gib"] == 141.0 and b["flags"]["models"] == ["target", "llama3-8b"]
    rows = _read(tmp_path / "b", "results.json")["rows"]
    assert [list(r["fits"]) for r in rows] == [["141 GiB @ 2048"]] * len(rows) and len(rows) == 12


def test_a_bad_or_foreign_config_stops_before_any_write(tmp_path):
    _ok("sim_h200", "--num_requests=5", "--tp=1", "--rates=4", f"--workdir={tmp_path / 'sim'}")
    proc = _run("memory_report", f"--config={tmp_path}/sim/config.json", f"--workdir={tmp_path}/x")
    assert proc.returncode != 0 and "config.json of experiments.sim_h200" in proc.stderr
    _ok("memory_report", "--models=llama3-8b", f"--workdir={tmp_path / 'm'}")
    bad = _read(tmp_path / "m", "config.json")
    bad["flags"]["reserve_gib"] = 100.0  # >= gpu_gib: the multi-flag validator's refusal
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    proc = _run("memory_report", f"--config={tmp_path}/bad.json", f"--workdir={tmp_path}/y")
    assert proc.returncode != 0 and "smaller than --gpu_gib" in proc.stderr
    bad["flags"]["reserve_gib"], bad["flags"]["seq_len"] = 2.0, "long"
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    proc = _run("memory_report", f"--config={tmp_path}/bad.json", f"--workdir={tmp_path}/y")
    assert proc.returncode != 0 and "seq_len='long'" in proc.stderr
    proc = _run("memory_report", f"--config={tmp_path}/none.json", f"--workdir={tmp_path}/y")
    assert proc.returncode != 0 and "must name an existing config.json" in proc.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@needs_target
def test_a_failed_run_leaves_its_config_and_no_stale_results(tmp_path):
    work = tmp_path / "run"
    argv = ["--model=target", "--method=rtn", "--bits=8", "--group_size=-1", "--calib_len=32"]
    _ok("quantize", *argv, "--calib_samples=2", f"--workdir={work}")
    assert (work / "results.json").is_file()
    # Valid flags, a run that fails after it started: more sequences than the calib split holds.
    proc = _run("quantize", *argv, "--calib_samples=100000", f"--workdir={work}")
    assert proc.returncode != 0 and "100000" in proc.stderr
    assert _read(work, "config.json")["flags"]["calib_samples"] == 100000  # the failed run's
    assert not (work / "results.json").exists()  # not the earlier run's results beside it
    assert not [f for f in os.listdir(work) if f.endswith(".tmp")]


def test_write_json_is_atomic(tmp_path, monkeypatch):
    common.write_results(str(tmp_path), {"rows": [1, 2]})

    def broken(obj, f, **kw):
        f.write('{"rows": [')  # half a file, then the failure
        raise OSError("disk full")

    monkeypatch.setattr(common.json, "dump", broken)
    with pytest.raises(OSError, match="disk full"):
        common.write_results(str(tmp_path), {"rows": [3]})
    assert _read(tmp_path, "results.json") == {"rows": [1, 2]}  # the old file, whole
    assert os.listdir(tmp_path) == ["results.json"]  # no temp file left


def test_save_config_removes_stale_results(tmp_path):
    common.write_results(str(tmp_path), {"old": True})
    common.save_config(str(tmp_path), resolved={"n": 1}, script="unit")
    assert not (tmp_path / "results.json").exists()
    saved = common.read_config(str(tmp_path / "config.json"))
    assert saved["script"] == "unit" and saved["resolved"] == {"n": 1}
    assert isinstance(saved["flags"], dict) and isinstance(saved["given"], list)
    (tmp_path / "flat.json").write_text(json.dumps({"seq_len": 8}))  # the pre-"flags" layout
    assert common.read_config(str(tmp_path / "flat.json")) == {
        "script": None,
        "flags": {"seq_len": 8},
    }
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match="not a JSON object"):
        common.read_config(str(tmp_path / "list.json"))


def test_gb_per_s():
    assert common.gb_per_s(2 * 10**9, 10, 4.0) == 5.0  # 10 reads of 2 GB in 4 s


_RESOLVE = """
import dataclasses, json, sys
from absl import flags
from experiments import common
import importlib
mod = importlib.import_module("experiments." + sys.argv[1])
first, again, workdir = json.loads(sys.argv[2])
resolve = lambda: dataclasses.asdict(mod._resolve() if sys.argv[1] == "spec_bench"
                                     else mod.resolve_config("m"))
flags.FLAGS(["prog", *first])
before = resolve()
common.save_config(workdir, script=sys.argv[1])
flags.FLAGS.unparse_flags()
flags.FLAGS(["prog", *again])
common.apply_config(flags.FLAGS.config, script=sys.argv[1])
print("RESULT" + json.dumps([before, resolve()]))
"""


@pytest.mark.parametrize(
    "script, first",
    [
        ("spec_bench", ["--quick", "--drafters=ngram", "--gammas=3"]),
        ("serve_bench", ["--quick", "--rates=", "--max_len=96"]),
    ],
)
def test_quick_defaults_resolve_the_same_on_a_rerun(script, first, tmp_path):
    """--quick fills the flags not given: a rerun must not count the saved values as given."""
    again = [f"--config={tmp_path}/config.json", f"--workdir={tmp_path}/again"]
    argv = json.dumps([first + [f"--workdir={tmp_path}"], again, str(tmp_path)])
    proc = subprocess.run(
        [sys.executable, "-c", _RESOLVE, script, argv],
        capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    before, after = json.loads(lines[-1][len("RESULT") :])
    assert before == after
    quick = {"spec_bench": ("batch_sizes", [1]), "serve_bench": ("rate_fractions", [0.5, 2.0])}
    quick = quick[script]
    assert before[quick[0]] == quick[1]  # a --quick value of a flag not given


@needs_target
def test_serve_bench_takes_a_model_name():
    """--model of serve_bench (and bench_serve, which calls the same) is a name or a path. In a
    subprocess: importing serve_bench defines its absl flags, as other experiments' do here."""
    code = """
import json, sys
import jaxinfer as ji
from experiments import serve_bench as sb
cfg, _, path = sb.load_model("target")
same = cfg == ji.load_checkpoint(ji.models.path("target"))[0]
try:
    sb.load_model("no-such-model")
    err = None
except ValueError as e:
    err = str(e)
print("RESULT" + json.dumps([path, same, sb.load_model(path)[2], err]))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    path, same, again, err = json.loads(lines[-1][len("RESULT") :])
    assert path == ji.models.path("target") and same and again == path
    assert err is not None and "--model='no-such-model' is neither" in err
