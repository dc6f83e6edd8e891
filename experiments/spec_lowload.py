r"""TPOT of the engine at low load, speculation off against `num_speculative_tokens="auto"`, by
weight format: issue 16's low-load goal measured directly (one or two requests in flight).

    python -m experiments.spec_lowload --formats=float32 --workdir=runs/spec_lowload_f32
    python -m experiments.spec_lowload --formats=gguf-as-stored --workdir=runs/spec_lowload_gguf

For each weight format (`float32`: SmolLM2 dequantized; `gguf-as-stored`: its Q4_1 / Q8_0
tensors as stored, `keep_quantized=True`) and drafter (`ngram`, `head` = the shipped EAGLE head,
`hybrid` = that head with `ngram_first=--ngram_first`),
engines with speculation off and with γ = auto serve the same greedy requests: `EngineConfig()`
as a server builds it but for a --num_blocks pool, and the auto engine's controller calibrated
by `warm_up` first, as a server's is. The requests are --prompts windows of the test split
(Python source, --prompt_len tokens each), --max_tokens tokens each, in groups of --in_flight
requests added together. Per request, TPOT = (time of its last token − time of its first) /
(tokens − 1), timed around `Engine.step`. Every (format, drafter, system) serves every group
once per round, rounds interleaved (a run that compiled a new shape, which a γ choice can meet,
is served again); the table gives the median TPOT over requests and rounds,
its min–max over rounds' medians, and off / auto. One format per process keeps memory small.
Greedy outputs of off and auto are compared (they must be token-identical).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import time

import jax
from absl import app, flags

import jaxinfer as ji
from experiments import common, flag_checks
from jaxinfer.engine.cycles import warm_up
from jaxinfer.engine.workload import engine_compiles

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "A packaged GGUF model name or path.")
_FORMATS = flags.DEFINE_list("formats", ["float32", "gguf-as-stored"], "Weight formats.")
_DRAFTERS = flags.DEFINE_list("drafters", ["ngram", "head"], "Drafters of the auto engine.")
_HEAD = flags.DEFINE_string(
    "head", "smollm2-135m-eagle", "--drafters=head or hybrid: the head's name."
)
_NGRAM_FIRST = flags.DEFINE_integer(
    "ngram_first",
    2,
    "--drafters=hybrid: the head with `Head.ngram_first` set to this.",
    lower_bound=1,
)
_IN_FLIGHT = flags.DEFINE_list("in_flight", ["1", "2"], "Requests served together.")
_PROMPTS = flags.DEFINE_integer("prompts", 4, "Requests per group size.", lower_bound=1)
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "Prompt tokens.", lower_bound=1)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "Tokens per request.", lower_bound=2)
_MAX_GAMMA = flags.DEFINE_integer("max_gamma", 4, "γ cap of the auto engine.", lower_bound=1)
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Interleaved rounds.", lower_bound=1)
_NUM_BLOCKS = flags.DEFINE_integer(
    "num_blocks", 64, "KV blocks of each engine (16 tokens each; warm_up builds one scratch "
    "engine per γ, so the default pool of 512 blocks would hold GBs).", lower_bound=2,
)  # fmt: skip
_WORKDIR = flags.DEFINE_string("workdir", "runs/spec_lowload", "Where results.json goes.")
_CONFIG = common.config_flag()
_ATTEMPTS = 4  # runs of one group until one compiles nothing (a γ choice can meet a new shape)
flag_checks.choice_list(_FORMATS, ("float32", "gguf-as-stored"))
flag_checks.choice_list(_DRAFTERS, ("ngram", "head", "hybrid"))
flag_checks.int_list(_IN_FLIGHT, min_value=1)


def serve(engine, group: list[list[int]], n: int) -> tuple[list[float], list[list[int]]]:
    """Serves one group of greedy requests together; (TPOT s of each, its tokens)."""
    sp = ji.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    rids = [engine.add_request(p, sp) for p in group]
    first, last = {}, {}
    tokens = {r: [] for r in rids}
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
                tokens[o.request_id] += o.new_token_ids
    tpot = [(last[r] - first[r]) / (len(tokens[r]) - 1) for r in rids]
    return tpot, [tokens[r] for r in rids]


def main(argv):
    del argv
    common.apply_config(_CONFIG.value)
    common.save_config(_WORKDIR.value)
    path = common.resolve_model(_MODEL.value)
    tok = ji.load_tokenizer(path)
    n, k = _MAX_TOKENS.value, _PROMPTS.value
    sizes = [int(x) for x in _IN_FLIGHT.value]
    engines, labels = {}, []
    for fmt in _FORMATS.value:
        cfg, params = ji.load_checkpoint(path, keep_quantized=fmt == "gguf-as-stored")
        windows = common.test_windows(tok, cfg, max_tokens=10**7, seq_len=_PROMPT_LEN.value)
        step = max(len(windows) // k, 1)
        prompts = [windows[i * step, : _PROMPT_LEN.value].tolist() for i in range(k)]
        ecfg = ji.EngineConfig(num_blocks=_NUM_BLOCKS.value)
        engines[fmt, "off"] = ji.Engine(cfg, params, ecfg)
        for d in _DRAFTERS.value:
            drafter = "ngram"
            if d in ("head", "hybrid"):
                drafter = ji.speculative.heads.load_head(common.resolve_model(_HEAD.value), cfg)
            if d == "hybrid":
                drafter = dataclasses.replace(drafter, ngram_first=_NGRAM_FIRST.value)
            spec = ji.SpeculativeConfig(
                drafter=drafter, num_speculative_tokens="auto", max_gamma=_MAX_GAMMA.value
            )
            eng = ji.Engine(cfg, params, dataclasses.replace(ecfg, speculative=spec))
            warm_up(eng, batch_sizes=tuple(sizes))  # the controller's step-time table
            gc.collect()  # warm_up's scratch engines and their pools
            engines[fmt, d] = eng
        for key in [kk for kk in engines if kk[0] == fmt]:  # compile every shape once
            for b in sizes:
                serve(engines[key], prompts[:b], n)
        labels.append((fmt, prompts))
    tpot = {key: {b: [] for b in sizes} for key in engines}  # per round: median over requests
    exact = {key: True for key in engines}
    recompiled = {key: 0 for key in engines}  # timed runs served again after compiling
    loads = []
    for _ in range(_ROUNDS.value):
        for fmt, prompts in labels:
            for b in sizes:
                groups = [prompts[i : i + b] for i in range(0, k - b + 1, b)]
                ref = {}
                for key in [kk for kk in engines if kk[0] == fmt]:
                    times, outs = [], []
                    for g in groups:
                        for _ in range(_ATTEMPTS):  # a run that compiled a shape is served again
                            before = engine_compiles()
                            t, o = serve(engines[key], g, n)
                            if engine_compiles() == before:
                                break
                            recompiled[key] += 1
                        times += t
                        outs += o
                    tpot[key][b].append(1e3 * statistics.median(times))
                    if key[1] == "off":
                        ref[b] = outs
                    elif outs != ref[b]:
                        exact[key] = False
        loads.append(os.getloadavg()[0])
    print(
        f"model={_MODEL.value} prompt_len={_PROMPT_LEN.value} max_tokens={n} prompts={k} "
        f"rounds={_ROUNDS.value} load1={min(loads):.2f}-{max(loads):.2f} jax={jax.__version__}"
    )
    print("| weights | in flight | system | TPOT p50 ms (min–max of rounds) | off / this | "
          "greedy output = off |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    rows = []
    for fmt, _ in labels:
        for b in sizes:
            base = statistics.median(tpot[fmt, "off"][b])
            for key in [kk for kk in engines if kk[0] == fmt]:
                v = tpot[key][b]
                med = statistics.median(v)
                name = "off" if key[1] == "off" else f"auto, {key[1]}"
                print(f"| {fmt} | {b} | {name} | {med:.1f} ({min(v):.1f}–{max(v):.1f}) | "
                      f"{base / med:.2f}× | {'yes' if exact[key] else 'NO'} |")  # fmt: skip
                rows.append({"format": fmt, "in_flight": b, "system": key[1], "tpot_ms_rounds": v,
                             "speedup": base / med, "exact": exact[key]})  # fmt: skip
    counters = {  # over the engine's life: compile passes and rounds
        f"{f}/{d}": {"cycles": c.cycles, "proposed": c.proposed, "accepted": c.accepted}
        for (f, d), e in engines.items()
        if d != "off" and (c := e.spec_counters) is not None
    }
    print("acceptance counters (compile passes included):", counters)
    print(
        "timed runs served again after compiling:",
        {f"{f}/{d}": c for (f, d), c in recompiled.items()},
    )
    results = {"model": _MODEL.value, "prompt_len": _PROMPT_LEN.value, "max_tokens": n,
               "load1": loads, "rows": rows, "spec_counters": counters,
               "recompiled": {f"{f}/{d}": c for (f, d), c in recompiled.items()}}  # fmt: skip
    common.write_results(_WORKDIR.value, results)


if __name__ == "__main__":
    app.run(main)
