"""Experiment flags are validated at parse time, before any work or write (issue 15, cause 13).

Each script defines its flags on absl's global FLAGS, and several share names, so every script
is parsed in its own subprocess: one per script, trying many command lines in turn.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PARSER = """
import json, sys
from absl import flags
import importlib
mod = importlib.import_module(sys.argv[1])
if hasattr(mod, "define_flags"):  # a script that defines its flags only when run (train_drafter)
    mod.define_flags()
out = []
for argv in json.loads(sys.argv[2]):
    try:
        flags.FLAGS(["prog", *argv])
        out.append(None)
    except flags.Error as e:
        out.append(str(e))
    flags.FLAGS.unparse_flags()
print("RESULT" + json.dumps(out))
"""

# script -> [(extra argv, regex the error must match, or None: accepted)]
CASES = {
    "spec_bench": [
        ([], None),
        (["--quick", "--drafters=ngram", "--gammas=2,4"], None),
        (["--drafters=foo"], r"'foo' is not one of model, ngram"),
        (["--drafters=model,model"], "repeated"),
        (["--gammas=0"], r"0 is not an integer >= 1"),
        (["--gammas=2.5"], r"'2.5' is not an integer"),
        (["--batch_sizes="], "at least one"),
        (["--temperatures=-0.5"], r"-0.5 is not a finite number >= 0"),
        (["--temperatures=nan"], "nan is not a finite number"),
        (["--acceptance=greedy"], r"'greedy' is not one of rejection, coupled"),
        (["--prompt_len=64"], "exactly 2 values"),
        (["--prompt_len=128,64"], "LO <= HI"),
    ],
    "serve_bench": [
        ([], None),
        (["--rates=0.5,2"], None),
        (["--rates=-1"], r"-1.0 is not a finite number > 0"),
        (["--rates=0"], r"0.0 is not a finite number > 0"),
        (["--rate_fractions=x"], "'x' is not a finite number"),
        (["--workloads=chat"], r"'chat' is not one of sharegpt, shared_prefix, long_prompt"),
        (["--backend=cuda"], "pallas-interpret"),  # DEFINE_enum lists the backends
        (["--slo_ttft_s=0"], r"0.0 is not a finite number > 0"),
    ],
    "quantize": [
        ([], None),
        (["--method=rtn", "--bits=8", "--group_size=-1"], None),
        (["--method=gptq", "--bits=8"], "bits=8 is not supported by gptq"),
        (["--group_size=12"], "group_size=12"),
        (["--damp=-1"], "damp=-1"),
        (["--method=smoothquant", "--bits=8", "--alpha=3"], "alpha=3"),
        (["--method=foo"], "method"),
    ],
    "memory_report": [
        ([], None),
        (["--models=gpt-5"], r"'gpt-5' is not one of"),
        (["--models=target,llama3-8b"], None),
        (["--weight_formats=w9"], "weight format 'w9'"),
        (["--kv_formats=int4"], r"'int4' is not one of"),
        (["--gpu_gib=0"], r"> 0"),
        (["--gpu_gib=80", "--reserve_gib=100"], "smaller than --gpu_gib"),
    ],
    "attention_bench": [
        ([], None),
        (["--backends=xla,cuda"], r"'cuda' is not one of"),
        (["--kv_formats=float,int4"], r"'int4' is not one of float, int8, fp8"),
        (["--cache_blocks=0"], "0 is not an integer >= 1"),
    ],
    "bucket_tables": [([], None), (["--processes=0"], "not a positive integer")],
    "compile_cache": [
        ([], None),
        (["--speculative=none", "--max_num_seqs=4", "--min_compile_secs=0"], None),
        (["--speculative=eagle"], r"value should be one of <hybrid\|none>"),
        (["--rounds=0"], "0 is not a positive integer"),
        (["--baseline=no/such/checkout"], "--baseline must be a jaxinfer checkout"),
    ],
    "map_count": [
        ([], None),
        (["--formats=float32", "--warm_up=1,2"], None),
        (["--formats=int3"], r"'int3' is not one of gguf-as-stored, float32"),
        (["--warm_up=0"], "0 is not an integer >= 1"),
    ],
    "step_ab": [
        ([], None),
        (["--compare=row_forms", "--contexts=100,1000"], None),
        (["--compare=heads"], "should be one of"),
        (["--contexts=256,0"], "0 is not an integer >= 1"),
        (["--compare=attention", "--verify=1,5", "--prompts=8", "--products=1,2"], None),
        (["--products=0"], "0 is not an integer >= 1"),
        (["--verify=1,0"], "0 is not an integer >= 1"),
        (["--prompts=0"], "not a positive integer"),
    ],
    "linear_bench": [
        ([], None),
        (["--rows=1,0"], "0 is not an integer >= 1"),
        (["--prompt=-1"], "not a non-negative integer"),
        (["--reps=0"], "not a positive integer"),
    ],
    "int4_forms": [
        ([], None),
        (["--rows=1,16", "--forms=blocked,int8_dot"], None),
        (["--forms=blocked,int3"], "'int3' is not one of float32, blocked"),
        (["--rows=0"], "0 is not an integer >= 1"),
        (["--reps=0"], "not a positive integer"),
    ],
    "pipeline": [
        ([], None),
        (["--model=target", "--full"], None),
        (["--eval_tokens=1"], "1 is not"),
        (["--stages=quality,foo"], r"'foo' is not one of quality, quantization"),
    ],
    "generate": [
        ([], None),
        (["--top_p=0"], r"0.0 is not a finite number > 0.0 and <= 1.0"),
        (["--min_p=2"], "<= 1.0"),
        (["--temperature=-1"], ">= 0"),
        (["--backend=gpu"], "pallas-interpret"),
        (["--repetition_penalty=1.3", "--presence_penalty=-2"], None),
        (["--repetition_penalty=0"], ">= 0.01"),
        (["--frequency_penalty=2.5"], "<= 2.0"),
        (["--min_tokens=8"], None),
        (["--min_tokens=65"], "min_tokens must be <= --max_tokens"),
        (["--min_tokens=-1"], "not a non-negative integer"),
        (["--bad_words_ids=7;3,5"], None),
        (["--bad_words_ids=3,x"], r"'3,x' is not a ','-separated list of token ids"),
        (["--bad_words_ids=7;-2"], r"bad_words_ids=\[\(7,\), \(-2,\)\] is invalid: token id -2"),
    ],
    "bench_decode": [([], None), (["--batch_sizes=1,x"], "'x' is not an integer")],
    "quant_sweep": [([], None), (["--quick"], None), (["--group_sizes=64,4"], ">= 8")],
    "spec_ngram": [([], None), (["--quick"], None), (["--gammas=0"], ">= 1")],
    "kernel_bench": [([], None), (["--contexts=512,-4"], "-4 is not an integer >= 1")],
    "kernel_compile_check": [([], None), (["--arch=sm_90"], "MAJOR.MINOR")],
    "train": [([], None), (["--kd_weight=1.5"], "<= 1.0"), (["--peak_lr=0"], "> 0")],
    "build_corpus": [([], None), (["--min_frequency=0"], "min_frequency")],
    "eval_ppl": [([], None), (["--seq_len=1"], ">= 2")],
    "sim_h200": [
        ([], None),
        (["--tp=0"], ">= 1"),
        (["--rates=0"], "> 0"),
        (["--link_gbs=0"], "> 0"),
        (["--link_latency_us=-1"], "not a non-negative number"),
    ],
    "sim_check": [
        ([], None),
        (["--quick", "--model=smollm2-135m", "--repeats=1"], None),
        (["--repeats=0"], "positive integer"),
        (["--calib_seed=0"], "must differ from --seed"),
        (["--rate_fractions=0"], "> 0"),
        (["--workloads=chat"], r"'chat' is not one of"),
    ],
    "quality_report": [([], None), (["--calib_sequences=0"], "not a positive integer")],
    "bench_serve": [([], None), (["--rates=-1"], "> 0")],
    "cost_model_check": [([], None), (["--rounds=0"], "not a positive integer")],
    "engine_step_profile": [([], None), (["--prompt_len=0"], "not a positive integer")],
    "drafter_bench": [
        ([], None),
        (["--gamma=0"], "not a positive integer"),
        (["--ngram_first=1,3"], None),
        (["--ngram_first=0"], r"0 is not an integer >= 1"),
    ],
    "spec_lowload": [
        ([], None),
        (["--formats=gguf-as-stored", "--drafters=ngram", "--in_flight=1"], None),
        (["--formats=bf16"], r"'bf16' is not one of float32, gguf-as-stored"),
        (["--drafters=model"], r"'model' is not one of ngram, head, hybrid"),
        (["--drafters=hybrid", "--ngram_first=3"], None),
        (["--ngram_first=0"], "not a positive integer"),
        (["--in_flight=0"], r"0 is not an integer >= 1"),
        (["--rounds=0"], "not a positive integer"),
    ],
    "train_drafter": [
        ([], None),
        (["--kind=foo"], "should be one of"),
        (["--steps=0"], "not a positive integer"),
        (["--chain_attention"], None),
        (["--chain_attention=maybe"], "Non-boolean argument"),
        (["--feature_layers=2,15,29"], None),
    ],
    "disagg_bench": [
        ([], None),
        (["--parts=transfer,foo"], "'foo' is not one of"),
        (["--blocks=0"], ">= 1"),
    ],
}
# Every script reruns a saved run: --config names an existing file, checked at parse time
# (train's --config also takes a setting name).
_MISSING = "must name an existing config.json"
for _script, _cases in CASES.items():
    _cases.append((["--config=no/such/config.json"], None if _script == "train" else _MISSING))
# Not experiments with a workdir: the server, and a summary of an engine's cycle log.
NOT_RERUN = {"serve", "engine_cycles"}


def test_every_script_is_covered():
    scripts = {
        name[: -len(".py")]
        for name in os.listdir(os.path.join(ROOT, "experiments"))
        if name.endswith(".py")
        and "app.run(main)" in open(os.path.join(ROOT, "experiments", name)).read()
    }
    assert scripts - NOT_RERUN == set(CASES), scripts ^ set(CASES)


def _parse(module: str, argvs: list[list[str]]) -> list[str | None]:
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", _PARSER, module, json.dumps(argvs)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT") :])


@pytest.mark.parametrize("script", sorted(CASES))
def test_flags_are_validated_at_parse_time(script, tmp_path):
    cases = CASES[script]
    workdir = [] if script == "generate" else ["--workdir", str(tmp_path / "never")]
    got = _parse(f"experiments.{script}", [argv + workdir for argv, _ in cases])
    for (argv, match), error in zip(cases, got):
        if match is None:
            assert error is None, f"{script} {argv}: refused a valid command line: {error}"
        else:
            assert error is not None, f"{script} {argv}: accepted"
            assert re.search(match, error), f"{script} {argv}: {error}"
    assert not (tmp_path / "never").exists()


def test_spec_bench_refuses_an_unknown_drafter_before_any_work(tmp_path):
    """The run of the issue: `--drafters=foo` ran 136 s and labelled n-gram results "foo"."""
    workdir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "experiments/spec_bench.py", "--drafters=foo", f"--workdir={workdir}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"),
        timeout=120,
    )
    assert proc.returncode != 0
    assert "'foo' is not one of model, ngram" in proc.stderr
    assert not workdir.exists()  # refused before the workdir, the models or any timing
