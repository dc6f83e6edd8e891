"""Helpers shared by the experiment scripts: models by name, test text for any tokenizer, JSON,
timing, achieved bandwidth and the run directory (config.json, results.json, reruns).

    from experiments import common
    _CONFIG = common.config_flag()  # --config=<workdir>/config.json: rerun a saved run
    ...
    def main(argv):
        common.apply_config(_CONFIG.value)  # first: the saved flags, validated, before any write
        common.save_config(workdir)  # removes a stale results.json, writes config.json
        cfg, params, path = common.load_model("smollm2-135m")  # a ji.models name or a path
        windows = common.test_windows(tok, cfg, max_tokens=8192)  # [N, 257] int32
        ...
        common.write_results(workdir, results)  # atomically: results.json of this config.json

A run directory holds the config.json and the results.json of one run, never of two: the
config is written (and the old results removed) before the run, the results atomically after
it, so a run that fails leaves its config.json and no results.json. config.json holds
{"script", "flags"} (the flags of the script's modules in experiments/), "given" (those given
on the command line: a --quick that fills the flags not given fills the same ones on a rerun)
and, where the script resolves them into a typed config, "resolved". A rerun,
`--config=<workdir>/config.json`, sets the saved flags; a flag also given on the command line
keeps the command line's value (so a rerun can change one setting, say a model path on another
machine), and the new config.json records what ran. --workdir and --config themselves are never
taken from a saved config.

The shipped splits are stored as text (`data.load_split`), so any tokenizer reads them. The tiny
models' tokenizer has `<|bos|>` / `<|eos|>`, which `data.tokenize_documents` looks up by
default; a pretrained tokenizer (SmolLM2) has neither, and its documents are separated the way
it was pretrained: one `<|endoftext|>` (or the config's eos) after each document.
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import jax
import numpy as np
from absl import flags

import jaxinfer as ji
from jaxinfer import data
from jaxinfer.config import PRESETS, from_hf_config
from jaxinfer.gguf.loader import config_from_gguf, find_gguf, open_gguf
from jaxinfer.model.decoder import forward

PRETRAINED_SEPARATOR = "<|endoftext|>"  # GPT-2 style document separator (SmolLM2: id 0)


def resolve_model(name_or_path: str) -> str:
    """A checkpoint path: a name of `ji.models` (shipped or packaged), or an existing path."""
    if name_or_path in ji.models.names() or name_or_path in ji.models.PACKAGED:
        return ji.models.path(name_or_path)  # a packaged model not installed: the install hint
    if os.path.exists(name_or_path):
        return name_or_path
    raise ValueError(
        f"--model={name_or_path!r} is neither a model name ({ji.models.names()}) nor a path"
    )


def load_model(name_or_path: str, **kwargs) -> tuple:
    """(cfg, params, path) of a model name or checkpoint path; kwargs go to load_checkpoint."""
    path = resolve_model(name_or_path)
    cfg, params = ji.load_checkpoint(path, **kwargs)
    return cfg, params, path


def split_stream(tokenizer, cfg, split: str = "test") -> np.ndarray:
    """A shipped or local split as one token stream, with this tokenizer's document marks. [N]"""
    if tokenizer.token_to_id(data.BOS_TOKEN) is not None:  # the tiny models' own tokenizer
        return data.token_stream(split, tokenizer)
    sep = tokenizer.token_to_id(PRETRAINED_SEPARATOR)
    sep = cfg.eos_token_id if sep is None else sep
    return data.tokenize_documents(tokenizer, data.load_split(split), add_bos=False, eos_id=sep)


def test_windows(tokenizer, cfg, max_tokens: int, seq_len: int = 256) -> np.ndarray:
    """The standard windows (`data.eval_windows`) over the test split. [N, seq_len + 1] int32"""
    return data.eval_windows(split_stream(tokenizer, cfg, "test"), seq_len, max_tokens)


# User turns for a model with a chat template (`chat_prompts` renders them).
CHAT_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "What is the capital of France?",
    "Explain in two sentences what a KV cache is in LLM inference.",
    "Write a Python class for a stack with push, pop and peek.",
    "How do I read a CSV file with Python's csv module? Show an example.",
    "Give three tips for writing readable Python code.",
    "Write a function that returns the n-th Fibonacci number iteratively.",
    "What does the `with` statement do in Python?",
]


def chat_prompts(tokenizer, questions) -> list[tuple[str, list[int]]]:
    """(rendered text, ids) of one-turn user conversations through the tokenizer's chat template,
    with the generation prompt (`ji.apply_chat_template`)."""
    out = []
    for q in questions:
        text = ji.apply_chat_template(
            tokenizer, [{"role": "user", "content": q}], add_generation_prompt=True
        )
        out.append((text, tokenizer.encode(text, add_special_tokens=False).ids))
    return out


def calib_batch(tokenizer, cfg, num_sequences: int, seq_len: int, seed: int = 0) -> np.ndarray:
    """`num_sequences` distinct chunks of the calib split. [num_sequences, seq_len] int32"""
    stream = split_stream(tokenizer, cfg, "calib")
    num_chunks = stream.shape[0] // seq_len
    if num_chunks < num_sequences:
        raise ValueError(
            f"calib split holds {num_chunks} chunks of {seq_len}, {num_sequences} asked"
        )
    pick = np.random.default_rng(seed).choice(num_chunks, size=num_sequences, replace=False)
    return np.stack([stream[i * seq_len : (i + 1) * seq_len] for i in np.sort(pick)])


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def times(fn: Callable[[], object], repeats: int) -> list[float]:
    """Wall seconds of `repeats` calls of fn."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def interleaved_step_ms(cfg, meta, systems: dict, reps: int) -> dict:
    """Median ms of one jitted paged `forward` step (cache donated) for each system, timed in turn.

    systems: name -> (params, backend, cache): each runs the same step metadata `meta` on its own
    params, attention backend and cache. Two calls each compile and warm up; then the systems
    alternate call by call for `reps` rounds, so all see the same background load.
    """
    steps, caches = {}, {}
    for name, (params, backend, cache) in systems.items():
        steps[name] = jax.jit(
            functools.partial(forward, cfg=cfg, backend=backend), donate_argnames=("cache",)
        )
        caches[name] = cache
        for _ in range(2):  # compile, warm up
            logits, caches[name] = steps[name](params, batch=meta, cache=caches[name])
        logits.block_until_ready()
    seconds = {name: [] for name in systems}
    for _ in range(reps):
        for name, (params, _, _) in systems.items():
            t0 = time.perf_counter()
            logits, caches[name] = steps[name](params, batch=meta, cache=caches[name])
            logits.block_until_ready()
            seconds[name].append(time.perf_counter() - t0)
    return {name: 1e3 * statistics.median(v) for name, v in seconds.items()}


def spread(seconds: list[float]) -> dict:
    """Median, min and max of a list of timings."""
    return {"median": statistics.median(seconds), "min": min(seconds), "max": max(seconds)}


def gb_per_s(nbytes: int, reads: int, seconds: float) -> float:
    """Achieved bandwidth: `reads` passes over `nbytes` (weights read once a decode step) in GB/s.

    Decode is bound by reading the weights: B sequences decoding n tokens read them n times (one
    step each, the batch shares it); a speculative run reads the target's once per cycle (plus
    the drafter's per drafted token). GB = 1e9 bytes.
    """
    return nbytes * reads / seconds / 1e9


def fmt(x, digits: int = 3) -> str:
    """A table cell: x with `digits` decimals; "—" for None or NaN."""
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


# The serving columns of a results table (serve_bench, bench_serve): `serving_cells` fills them.
SERVING_HEAD = "out tok/s | req/s | goodput | TTFT p50 / p90 / p99 (s) | TPOT p50 / p90 / p99 (ms)"


def serving_cells(m: dict) -> str:
    """The `SERVING_HEAD` cells of a `MetricsSummary.to_dict()`, joined by " | "."""
    t, p = m["ttft"], m["tpot"]
    return " | ".join([
        fmt(m["output_throughput"], 1), fmt(m["request_throughput"], 2), fmt(m["goodput"], 2),
        " / ".join(fmt(t[q]) for q in ("p50", "p90", "p99")),
        " / ".join(fmt(None if p[q] is None else 1e3 * p[q], 1) for q in ("p50", "p90", "p99")),
    ])  # fmt: skip


def write_json(workdir: str, name: str, obj) -> str:
    """Writes obj as workdir/name (indent 2) atomically (a temp file renamed); returns the path."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, name)
    fd, tmp = tempfile.mkstemp(dir=workdir, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, default=str)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def write_results(workdir: str, results: dict) -> str:
    """workdir/results.json, atomically: the results of the run whose config.json is there."""
    return write_json(workdir, RESULTS, results)


RESULTS = "results.json"
CONFIG = "config.json"
_NEVER_APPLIED = ("config", "workdir")
EXPERIMENTS_DIR = os.path.dirname(os.path.abspath(__file__))


def config_flag() -> flags.FlagHolder:
    """Defines --config (a saved <workdir>/config.json to rerun), once for all imported scripts."""
    if "config" in flags.FLAGS:  # a script importing another (bench_serve imports serve_bench)
        return flags.FlagHolder(flags.FLAGS, flags.FLAGS["config"])
    holder = flags.DEFINE_string(
        "config",
        None,
        "Rerun a saved <workdir>/config.json: its flags, with the flags given here on top.",
        module_name=__name__,
    )
    flags.register_validator(
        "config",
        lambda v: v is None or os.path.isfile(v),
        "--config must name an existing config.json (of a run's --workdir)",
    )
    return holder


def script_name() -> str:
    """The running experiment's name, "spec_bench" for `python -m experiments.spec_bench`."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = spec.name if spec is not None else os.path.basename(getattr(main, "__file__", ""))
    name = name.removesuffix(".py").removeprefix("experiments.")
    return name.removesuffix(".__main__")


def _is_experiment_module(module: str) -> bool:
    if module.startswith("experiments."):
        return True  # imported (or run with -m: absl keys __main__'s flags by its file)
    return module.endswith(".py") and os.path.dirname(os.path.abspath(module)) == EXPERIMENTS_DIR


def _own() -> list:
    out = []
    for module, fls in flags.FLAGS.flags_by_module_dict().items():
        if _is_experiment_module(module) and module != __name__:
            out += fls  # not common's --config: the rerun's pointer (train's names a setting)
    return sorted(out, key=lambda fl: fl.name)


def own_flags() -> dict:
    """name -> value of the flags the experiment modules define (absl's, jax's left out)."""
    return {fl.name: fl.value for fl in _own()}


def save_config(workdir: str, resolved: dict | None = None, script: str | None = None) -> str:
    """Starts a run in workdir: removes a stale results.json, then writes config.json.

    Call it after the flags are validated (absl's validators, `apply_config`) and before the
    run's first output. config.json: {"script", "flags": `own_flags()`, "given": names,
    "resolved"?}.
    """
    os.makedirs(workdir, exist_ok=True)
    stale = os.path.join(workdir, RESULTS)
    if os.path.exists(stale):
        os.remove(stale)  # of an earlier run: never beside this run's config.json
    config = {
        "script": script or script_name(),
        "flags": own_flags(),
        # Given on the command line (or by a --config): scripts whose --quick picks the values
        # of flags not given (spec_bench, serve_bench) must see the same ones given on a rerun.
        "given": [fl.name for fl in _own() if fl.present],
    }
    if resolved is not None:
        config["resolved"] = resolved
    return write_json(workdir, CONFIG, config)


def read_config(path: str) -> dict:
    """The {"script", "flags", ...} of a saved config.json (a flat dict of flags: legacy)."""
    try:
        with open(path) as fh:
            saved = json.load(fh)
    except FileNotFoundError:
        raise ValueError(f"--config={path!r}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--config={path!r} is not valid JSON: {e}") from None
    if not isinstance(saved, dict):
        raise ValueError(f"--config={path!r} holds a {type(saved).__name__}, not a JSON object")
    if not isinstance(saved.get("flags"), dict):
        saved = {"script": None, "flags": saved}  # written before "script"/"flags" existed
    return saved


def _parse_into(fl, value) -> None:
    """Sets a flag from its saved JSON value through the flag's own parser (type-checked)."""
    if value is None:
        fl.value = None
    elif isinstance(value, bool):
        fl.parse("true" if value else "false")
    elif isinstance(value, list):
        fl.parse(",".join(str(v) for v in value))
    else:
        fl.parse(str(value))


def apply_config(
    path: str | None,
    skip: tuple[str, ...] = _NEVER_APPLIED,
    take: tuple[str, ...] = (),
    script: str | None = None,
) -> dict:
    """Sets the flags saved in a config.json (by `save_config`); a no-op for path None.

    A flag given on the command line keeps its value (unless listed in `take`); flags in `skip`
    are never set. The saved values go through each flag's parser and then every validator runs
    (multi-flag ones included), so a bad or foreign config stops the script before it writes.

    Returns:
      The applied settings (name -> saved value).
    """
    if not path:
        return {}
    saved = read_config(path)
    script = script or script_name()
    if saved["script"] not in (None, script):
        raise ValueError(
            f"--config={path!r} is a config.json of experiments.{saved['script']}, "
            f"not of experiments.{script}"
        )
    unknown = sorted(k for k in saved["flags"] if k not in flags.FLAGS)
    if unknown:
        raise ValueError(f"--config={path!r}: flags {unknown} are not flags of {script}")
    given = saved.get("given")
    applied = {}
    for k, v in saved["flags"].items():
        fl = flags.FLAGS[k]
        if k in skip or (fl.present and k not in take):
            continue
        try:
            _parse_into(fl, v)
        except (flags.Error, ValueError) as e:
            raise ValueError(f"--config={path!r}: {k}={v!r}: {e}") from None
        if given is not None:
            fl.present = int(k in given)  # as in the saved run (parse counted it as given)
        applied[k] = v
    try:
        flags.FLAGS.validate_all_flags()
    except flags.Error as e:
        raise ValueError(f"--config={path!r}: {e}") from None
    return applied


def model_config(name: str):
    """The ModelConfig of a preset (`ji.preset`), a `ji.models` name or a checkpoint path, read
    from its config.json or GGUF metadata only: no weights are loaded."""
    if name in PRESETS:
        return ji.preset(name)
    path = resolve_model(name)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        with open(os.path.join(path, "config.json")) as f:
            return from_hf_config(json.load(f))
    return config_from_gguf(open_gguf(find_gguf(path) or path))
