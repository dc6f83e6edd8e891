r"""Decode throughput of `ji.generate` against transformers `generate`, same checkpoint, same run.

    python experiments/bench_decode.py --workdir=/tmp/bench_decode
    python experiments/bench_decode.py --model=/path/to/hf_dir --batch_sizes=1,8

Without --model, a randomly initialised `bench-5m` preset (about 5 M parameters: 6 layers,
hidden 256) is saved as an HF directory and both libraries load it. Greedy decoding of
--new_tokens tokens from --prompt_len-token prompts; jaxinfer is timed on compiled calls (the
whole decode loop is one program), transformers in eager PyTorch on the CPU. Each figure is the
median of --repeats runs; the ratio is what to read, the machine is shared and noisy.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

import jaxinfer as ji

try:
    from experiments import flag_checks
except ImportError:  # run as `python experiments/X.py`: experiments/ itself is on sys.path
    import flag_checks

_MODEL = flags.DEFINE_string("model", None, "HF dir; default: a random bench-5m model.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where results.json is written.")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "8"], "Batch sizes.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 32, "Prompt tokens.", lower_bound=1)
_NEW_TOKENS = flags.DEFINE_integer(
    "new_tokens", 64, "Generated tokens per sequence.", lower_bound=1
)
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repeats (median reported).", lower_bound=1)
flag_checks.int_list(_BATCH_SIZES, min_value=1)


def _median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _bench_batch(cfg, params, hf, b: int) -> dict:
    """Times both libraries on the same b prompts; returns one result row."""
    import torch

    n_new = _NEW_TOKENS.value
    prompts = np.random.RandomState(b).randint(3, cfg.vocab_size, (b, _PROMPT_LEN.value))
    sp = ji.SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
    ji.generate(cfg, params, prompts.tolist(), sp)  # compile
    t_ji = _median_time(lambda: ji.generate(cfg, params, prompts.tolist(), sp), _REPEATS.value)
    ids = torch.tensor(prompts)

    def hf_run():
        with torch.no_grad():
            hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                min_new_tokens=n_new, do_sample=False, pad_token_id=0,
            )  # fmt: skip

    hf_run()  # warm-up
    t_hf = _median_time(hf_run, _REPEATS.value)
    row = {
        "batch": b,
        "jaxinfer_tok_s": b * n_new / t_ji,
        "transformers_tok_s": b * n_new / t_hf,
        "transformers_ms_per_step": 1000 * t_hf / n_new,
        "speedup": t_hf / t_ji,
    }
    print(json.dumps(row))
    return row


def main(argv):
    del argv
    import torch
    import transformers

    path = _MODEL.value
    if path is None:
        path = tempfile.mkdtemp(prefix="bench5m_")
        cfg = ji.preset("bench-5m")
        ji.save_checkpoint(path, cfg, ji.init_params(cfg, jax.random.key(0)))
    cfg, params = ji.load_checkpoint(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n_new = _NEW_TOKENS.value
    rows = [_bench_batch(cfg, params, hf, b) for b in map(int, _BATCH_SIZES.value)]
    result = {
        "model": _MODEL.value or "random bench-5m",
        "params": cfg.num_params(),
        "prompt_len": _PROMPT_LEN.value,
        "new_tokens": n_new,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__} "
        f"({jax.default_backend()}), torch {torch.__version__}",
        "rows": rows,
    }
    print("\n| batch | jaxinfer tok/s | transformers tok/s | speedup |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['jaxinfer_tok_s']:.0f} | {r['transformers_tok_s']:.0f} | "
            f"{r['speedup']:.1f}x |"
        )
    if _WORKDIR.value:
        os.makedirs(_WORKDIR.value, exist_ok=True)
        with open(os.path.join(_WORKDIR.value, "results.json"), "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    app.run(main)
