r"""Decode throughput and achieved weight bandwidth: `ji.generate` against transformers `generate`
and llama.cpp on the same weights, in the same run, plus ms per decode step by weight format.

    python -m experiments.bench_decode --model=smollm2-135m --workdir=runs/bench_decode
    python -m experiments.bench_decode --workdir=/tmp/bench_decode       # random bench-5m, fast
    python -m experiments.bench_decode --config=runs/bench_decode/config.json --workdir=runs/again

--model is a name of `ji.models.names()` or a checkpoint path (HF dir or .gguf); without it a
randomly initialised `bench-5m` preset is saved as an HF directory and every library loads that.
transformers loads a GGUF with `from_pretrained(dir, gguf_file=name)` (it dequantizes to float32)
and runs eager PyTorch with torch threads = os.cpu_count() (XLA's CPU thread count); llama.cpp
(the optional `xllamacpp` wheel, benchmarks only) runs the GGUF file as stored, same threads.

Per batch size, every system is timed twice per repeat: a prefill-only call (1 new token) and a
full call (--new_tokens), so decode step time = (full − prefill) / (new_tokens − 1) excludes
prefill. Repeats are interleaved (the system order alternates), medians and min/max reported.
Achieved bandwidth = bytes of weights read per decode step (every parameter once; a tied
embedding counts once, as the LM head) ÷ step time, printed beside the machine's copy bandwidth
and a plain jitted float32 GEMV over a 256 MiB matrix measured here in the same run.
--formats adds ms per decode step at batch 1 for each weight format of the same model (from the
fastest runs: on a shared machine the paired differences are noisy).
Writes config.json and results.json into --workdir.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import jaxinfer as ji
from experiments import common, flag_checks
from jaxinfer import memory, quant

_MODEL = flags.DEFINE_string("model", None, "A ji.models name or path; default: random bench-5m.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where config.json and results.json go.")
_CONFIG = common.config_flag()
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "8"], "Batch sizes.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 200, "Prompt tokens.", lower_bound=1)
_NEW_TOKENS = flags.DEFINE_integer(
    "new_tokens", 64, "Generated tokens per sequence.", lower_bound=2
)
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repeats (median reported).", lower_bound=1)
_SYSTEMS = flags.DEFINE_list(
    "systems", ["jaxinfer", "transformers", "llamacpp"],
    "Systems to time (when installed); 'jaxinfer-penalties': ji.generate with a repetition and "
    "a frequency penalty (what penalties cost a step); 'jaxinfer-masks': with min_tokens, half "
    "the vocabulary allowed and three bad_words_ids (what the masks cost).",
)  # fmt: skip
_FORMATS = flags.DEFINE_list(
    "formats",
    ["float32", "bfloat16", "w8a16-rtn", "w4a16-rtn-g64", "w4a16-rtn-g32", "gguf-as-stored"],
    "Weight formats of the step-time table (batch 1); empty: none.",
)
_FORMAT_TOKENS = flags.DEFINE_integer(
    "format_tokens", 32, "New tokens per step-time run.", lower_bound=2
)
_GEMV_MIB = flags.DEFINE_integer("gemv_mib", 256, "float32 GEMV matrix size (MiB).", lower_bound=1)
flag_checks.int_list(_BATCH_SIZES, min_value=1)
flag_checks.choice_list(
    _SYSTEMS, ("jaxinfer", "jaxinfer-penalties", "jaxinfer-masks", "transformers", "llamacpp")
)
FORMATS = ("float32", "bfloat16", "w8a16-rtn", "w4a16-rtn-g64", "w4a16-rtn-g32", "gguf-as-stored")
flag_checks.choice_list(_FORMATS, FORMATS, allow_empty=True)


# ------------------------------------------------------------------------- machine references


def copy_bandwidth(mib: int, repeats: int = 7) -> dict:
    """GB/s of a jitted copy (`x + 0`: reads and writes each byte) and of numpy's copyto."""
    n = mib * 2**20 // 4
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(lambda a: a + 0.0)
    f(x).block_until_ready()
    t_xla = min(common.times(lambda: f(x).block_until_ready(), repeats))
    src, dst = np.ones(n, np.float32), np.empty(n, np.float32)
    t_np = min(common.times(lambda: np.copyto(dst, src), repeats))
    moved = 2 * n * 4  # bytes read + written
    return {"xla_copy_gb_s": moved / t_xla / 1e9, "numpy_copy_gb_s": moved / t_np / 1e9}


def gemv_bandwidth(mib: int, repeats: int = 9) -> dict:
    """GB/s of a jitted float32 GEMV `x[1, K] @ W[K, N]` over a `mib` MiB W (bytes of W / time)."""
    k = 4096
    n = mib * 2**20 // 4 // k
    w = jax.random.normal(jax.random.key(0), (k, n), jnp.float32)  # [K, N]
    x = jnp.ones((1, k), jnp.float32)  # [1, K]
    f = jax.jit(jnp.dot)
    f(x, w).block_until_ready()
    ts = common.times(lambda: f(x, w).block_until_ready(), repeats)
    return {"shape": [k, n], "ms": 1000 * statistics.median(ts),
            "gb_s": w.nbytes / statistics.median(ts) / 1e9}  # fmt: skip


# ------------------------------------------------------------------------------------ systems


def _sampling_extras(name: str, cfg) -> dict:
    """The SamplingParams fields of a jaxinfer system beside greedy decoding."""
    if name == "jaxinfer-penalties":
        return dict(repetition_penalty=1.2, frequency_penalty=0.5)
    if name == "jaxinfer-masks":  # every mask on, a large allowed set: the masks' worst case here
        v = cfg.vocab_size
        bans = [(8,), (260 % v, 260 % v), (28 % v, 30 % v, 32 % v)]
        return dict(min_tokens=1, allowed_token_ids=range(0, v, 2), bad_words_ids=bans)
    return {}


class JaxinferSystem:
    def __init__(self, cfg, params, name: str = "jaxinfer"):
        self.cfg, self.params = cfg, params
        self.name = name
        self.penalties = _sampling_extras(name, cfg)

    def run(self, prompts: np.ndarray, n_new: int) -> None:
        sp = ji.SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True, **self.penalties)
        ji.generate(self.cfg, self.params, prompts.tolist(), sp)


class TransformersSystem:
    name = "transformers"

    def __init__(self, path: str):
        import torch
        import transformers

        torch.set_num_threads(os.cpu_count())  # XLA's CPU client uses every core
        if path.endswith(".gguf"):
            kw = {"gguf_file": os.path.basename(path)}
            path = os.path.dirname(path)
        else:
            kw = {}
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            path, torch_dtype=torch.float32, **kw
        ).eval()

    def run(self, prompts: np.ndarray, n_new: int) -> None:
        ids = self.torch.tensor(prompts)
        with self.torch.no_grad():
            self.model.generate(
                ids, attention_mask=self.torch.ones_like(ids), max_new_tokens=n_new,
                min_new_tokens=n_new, do_sample=False, pad_token_id=0,
            )  # fmt: skip


class LlamaCppSystem:
    """llama.cpp through xllamacpp's in-process server: one completion request per batch, with
    one prompt per sequence, served in parallel slots (batched decode)."""

    name = "llamacpp"

    def __init__(self, path: str, max_batch: int, ctx_per_seq: int):
        import xllamacpp as xlc

        p = xlc.CommonParams()
        p.model.path = path
        p.n_parallel = max_batch
        p.n_ctx = max_batch * ctx_per_seq
        p.cpuparams.n_threads = os.cpu_count()
        p.cpuparams_batch.n_threads = os.cpu_count()
        self.server = xlc.Server(p)

    def run(self, prompts: np.ndarray, n_new: int) -> None:
        req = {"prompt": prompts.tolist(), "max_tokens": n_new, "temperature": 0,
               "ignore_eos": True, "cache_prompt": False}  # fmt: skip
        out = self.server.handle_completions(req)
        if not isinstance(out, dict) or "error" in out:
            raise RuntimeError(f"llama.cpp completion failed: {str(out)[:300]}")


def _llamacpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("xllamacpp") is not None


# ------------------------------------------------------------------------------------ benches


def bench_batch(systems: list, b: int, vocab: int, n_new: int, repeats: int, nbytes: dict):
    """Interleaved prefill-only and full runs of every system; one result row per system."""
    prompts = np.random.RandomState(b).randint(3, vocab, (b, _PROMPT_LEN.value))  # [B, P]
    for s in systems:  # warm-up: compiles jaxinfer's two programs, warms the others' caches
        s.run(prompts, 1)
        s.run(prompts, n_new)
    prefill = {s.name: [] for s in systems}
    full = {s.name: [] for s in systems}
    for r in range(repeats):
        for s in systems if r % 2 == 0 else systems[::-1]:  # alternate the order
            prefill[s.name] += common.times(lambda s=s: s.run(prompts, 1), 1)
            full[s.name] += common.times(lambda s=s: s.run(prompts, n_new), 1)
    rows = []
    for s in systems:
        steps = [(f - p) / (n_new - 1) for f, p in zip(full[s.name], prefill[s.name])]
        step = statistics.median(steps)
        row = {
            "system": s.name, "batch": b,
            "tok_s": b * n_new / statistics.median(full[s.name]),  # prefill included
            "decode_tok_s": b / step,
            "step_ms": 1000 * step,
            "step_ms_min_max": [1000 * min(steps), 1000 * max(steps)],
            "prefill_ms": 1000 * statistics.median(prefill[s.name]),
            "weight_bytes": nbytes[s.name],
            "weight_gb_s": nbytes[s.name] / step / 1e9,
            "full_s": common.spread(full[s.name]),
        }  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def format_params(fmt: str, path: str, cfg, params):
    """(cfg, params) of one weight format of the model: bfloat16 weights and activations, the
    quantized ones with float32 activations (the CPU's native float; "A16" names the format)."""
    if fmt == "float32":
        return cfg, params
    if fmt == "bfloat16":
        return cfg.replace(dtype="bfloat16"), jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    if fmt == "gguf-as-stored":
        return ji.load_checkpoint(path, keep_quantized=True)
    bits, group = {"w8a16-rtn": (8, None), "w4a16-rtn-g64": (4, 64), "w4a16-rtn-g32": (4, 32)}[fmt]
    calib = np.zeros((1, 16), np.int32)  # RTN reads no calibration data
    return cfg, quant.quantize(cfg, params, quant.QuantConfig("rtn", bits, group), calib)


def bench_formats(path: str, cfg, params, n_new: int, repeats: int) -> list[dict]:
    """ms per decode step at batch 1 for each of --formats: (fastest full run − fastest
    prefill-only run) / (tokens − 1); the min-max of the paired differences beside it."""
    rows = []
    prompts = np.random.RandomState(0).randint(3, cfg.vocab_size, (1, _PROMPT_LEN.value))
    for fmt in _FORMATS.value:
        if fmt == "gguf-as-stored" and not str(path).endswith(".gguf"):
            continue
        fcfg, fparams = format_params(fmt, path, cfg, params)
        s = JaxinferSystem(fcfg, fparams)
        s.run(prompts, 1)
        s.run(prompts, n_new)
        pre, full = [], []
        for _ in range(repeats):
            pre += common.times(lambda s=s: s.run(prompts, 1), 1)
            full += common.times(lambda s=s: s.run(prompts, n_new), 1)
        # Fastest of each: a load spike on a shared machine only ever adds time.
        step = (min(full) - min(pre)) / (n_new - 1)
        steps = [(f - p) / (n_new - 1) for f, p in zip(full, pre)]
        nb = memory.tree_bytes(fparams)
        row = {"format": fmt, "weight_bytes": nb, "step_ms": 1000 * step,
               "step_ms_min_max": [1000 * min(steps), 1000 * max(steps)],
               "weight_gb_s": nb / step / 1e9}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv):
    del argv
    if _CONFIG.value:
        common.apply_config(_CONFIG.value)
    if _WORKDIR.value:
        common.save_config(_WORKDIR.value)
    load0, t0 = common.load_average(), time.perf_counter()
    if _MODEL.value is None:
        path = tempfile.mkdtemp(prefix="bench5m_")
        cfg = ji.preset("bench-5m")
        ji.save_checkpoint(path, cfg, ji.init_params(cfg, jax.random.key(0)))
    else:
        path = common.resolve_model(_MODEL.value)
    cfg, params = ji.load_checkpoint(path)  # float32 for a GGUF
    refs = {"copy": copy_bandwidth(_GEMV_MIB.value), "gemv": gemv_bandwidth(_GEMV_MIB.value)}
    print(json.dumps(refs), flush=True)
    f32_bytes = memory.tree_bytes(params)  # every leaf: read once a decode step
    batches = [int(b) for b in _BATCH_SIZES.value]
    n_new = _NEW_TOKENS.value
    systems, notes = [], []
    if "jaxinfer" in _SYSTEMS.value:
        systems.append(JaxinferSystem(cfg, params))
    for name in ("jaxinfer-penalties", "jaxinfer-masks"):
        if name in _SYSTEMS.value:
            systems.append(JaxinferSystem(cfg, params, name))
    if "transformers" in _SYSTEMS.value:
        systems.append(TransformersSystem(path))
    nbytes = dict.fromkeys(
        ("jaxinfer", "jaxinfer-penalties", "jaxinfer-masks", "transformers"), f32_bytes
    )
    if "llamacpp" in _SYSTEMS.value:
        if not _llamacpp_available():
            notes.append("llama.cpp: xllamacpp is not installed (pip install xllamacpp)")
        elif not str(path).endswith(".gguf"):
            notes.append("llama.cpp: needs a .gguf checkpoint")
        else:
            systems.append(LlamaCppSystem(path, max(batches), _PROMPT_LEN.value + n_new + 16))
            nbytes["llamacpp"] = os.path.getsize(path)  # the file's tensors, as stored
    for n in notes:
        print(n)
    rows = []
    for b in batches:
        rows += bench_batch(systems, b, cfg.vocab_size, n_new, _REPEATS.value, nbytes)
    formats = bench_formats(path, cfg, params, _FORMAT_TOKENS.value, _REPEATS.value)
    result = {
        "model": _MODEL.value or "random bench-5m",
        "checkpoint": os.path.basename(str(path)),
        "params": cfg.num_params(),
        "prompt_len": _PROMPT_LEN.value,
        "new_tokens": n_new,
        "repeats": _REPEATS.value,
        "references": refs,
        "rows": rows,
        "formats": formats,
        "notes": notes,
        "seconds": time.perf_counter() - t0,
        "load_average": [load0, common.load_average()],
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__} "
        f"({jax.default_backend()})",
    }
    print(markdown(result))
    if _WORKDIR.value:
        common.write_json(_WORKDIR.value, "results.json", result)


def markdown(res: dict) -> str:
    g = res["references"]["gemv"]["gb_s"]
    c = res["references"]["copy"]
    lines = [
        f"Model {res['model']} ({res['params'] / 1e6:.1f} M parameters), {res['prompt_len']}-token "
        f"prompts, {res['new_tokens']} greedy tokens, median of {res['repeats']} interleaved "
        f"repeats; load average {res['load_average'][0]:.1f} -> {res['load_average'][1]:.1f}.",
        f"Machine: copy {c['xla_copy_gb_s']:.1f} GB/s (XLA), {c['numpy_copy_gb_s']:.1f} GB/s "
        f"(numpy); float32 GEMV {res['references']['gemv']['shape']}: {g:.1f} GB/s.",
        "",
        "| batch | system | tok/s (with prefill) | decode tok/s | step ms (min-max) | prefill ms "
        "| weight GB/s | % of GEMV |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lo, hi = r["step_ms_min_max"]
        lines.append(
            f"| {r['batch']} | {r['system']} | {r['tok_s']:.1f} | {r['decode_tok_s']:.1f} | "
            f"{r['step_ms']:.1f} ({lo:.1f}-{hi:.1f}) | {r['prefill_ms']:.0f} | "
            f"{r['weight_gb_s']:.1f} | {100 * r['weight_gb_s'] / g:.0f}% |"
        )
    if res["formats"]:
        lines += [
            "",
            "| weights (jaxinfer, batch 1) | MiB read a step | step ms (min-max) | GB/s |",
        ]
        lines += ["|---|---|---|---|"]
        for r in res["formats"]:
            lo, hi = r["step_ms_min_max"]
            lines.append(
                f"| {r['format']} | {r['weight_bytes'] / 2**20:.0f} | {r['step_ms']:.1f} "
                f"({lo:.1f}-{hi:.1f}) | {r['weight_gb_s']:.1f} |"
            )
    lines += [f"- {n}" for n in res["notes"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    app.run(main)
