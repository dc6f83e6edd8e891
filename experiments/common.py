"""Helpers shared by the experiment scripts: models by name, test text for any tokenizer, JSON,
timing and rerunning a saved configuration.

    from experiments import common
    cfg, params, path = common.load_model("smollm2-135m")  # a ji.models name or a path
    windows = common.test_windows(tok, cfg, max_tokens=8192)  # [N, 257] int32
    common.save_config(workdir)  # workdir/config.json: this script's flags
    common.apply_config(saved)  # --config=<workdir>/config.json: rerun a saved run

The shipped splits are stored as text (`data.load_split`), so any tokenizer reads them. The tiny
models' tokenizer has `<|bos|>` / `<|eos|>`, which `data.tokenize_documents` looks up by
default; a pretrained tokenizer (SmolLM2) has neither, and its documents are separated the way
it was pretrained: one `<|endoftext|>` (or the config's eos) after each document.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
from absl import flags

import jaxinfer as ji
from jaxinfer import data

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


def spread(seconds: list[float]) -> dict:
    """Median, min and max of a list of timings."""
    return {"median": statistics.median(seconds), "min": min(seconds), "max": max(seconds)}


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
    """Writes obj as workdir/name (indent 2); returns the path."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, name)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=str)
    return path


def save_config(workdir: str) -> str:
    """The parsed flags of this script (absl's FLAGS of its own module) as workdir/config.json."""
    f = flags.FLAGS
    own = {
        fl.name: fl.value for fl in f.get_flags_for_module(f.find_module_defining_flag("workdir"))
    }
    return write_json(workdir, "config.json", own)


def apply_config(path: str, keep: tuple[str, ...] = ("config", "workdir")) -> dict:
    """Sets the flags saved in a config.json (by `save_config`), except those in `keep`.

    Flags given on the command line beside --config are overridden unless listed in `keep`.
    Returns the applied settings.
    """
    with open(path) as fh:
        saved = json.load(fh)
    unknown = sorted(k for k in saved if k not in flags.FLAGS)
    if unknown:
        raise ValueError(f"{path}: flags {unknown} are not flags of this script")
    applied = {k: v for k, v in saved.items() if k not in keep}
    for k, v in applied.items():
        flags.FLAGS[k].value = v
    return applied


def model_config(name: str):
    """The ModelConfig of a preset (`ji.preset`), a `ji.models` name or a checkpoint path, read
    from its config.json or GGUF metadata only: no weights are loaded."""
    from jaxinfer.config import PRESETS, from_hf_config

    if name in PRESETS:
        return ji.preset(name)
    path = resolve_model(name)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        with open(os.path.join(path, "config.json")) as f:
            return from_hf_config(json.load(f))
    from jaxinfer.gguf.loader import config_from_gguf, find_gguf, open_gguf

    return config_from_gguf(open_gguf(find_gguf(path) or path))
