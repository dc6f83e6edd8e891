r"""Profile of an engine step at one request in flight against `ji.generate`'s per-token time.

    python -m experiments.engine_step_profile                       # SmolLM2-135M, ~3 min on 2 CPUs
    python -m experiments.engine_step_profile --model=tiny --new_tokens=64

For each engine variant (padding T to `min_token_bucket` rows or to the measured-cost bucket;
params stacked or in `inference_layout`), one greedy request decodes `--new_tokens` tokens and
every decode step is split into
  schedule   `Scheduler.schedule()` (host);
  build      the padded batch on the host (`Engine._build`);
  dispatch   the jitted call returning (async dispatch: the host is free from here);
  device     waiting for the sampled ids (`block_until_ready`);
  update     transfer of the ids, `Scheduler.update`, outputs and metrics (host).
`ji.generate`'s per-token time is the difference of two compiled calls (2N and N new tokens) over
N, so its prefill and compilation cancel. Rounds are interleaved (every variant once per round)
and medians reported with the 1-minute load average.
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import numpy as np
from absl import app, flags

import jaxinfer as ji
from experiments import common
from jaxinfer.engine import engine as engine_mod

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "'tiny', a packaged model name or a path.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "Prompt tokens.", lower_bound=1)
_NEW = flags.DEFINE_integer("new_tokens", 32, "Decode steps timed per run.", lower_bound=2)
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds.", lower_bound=1)
_WORKDIR = flags.DEFINE_string("workdir", "runs/engine_step_profile", "Where results.json goes.")
_CONFIG = common.config_flag()
_VARIANTS = flags.DEFINE_list(
    "variants",
    ["stacked-T16", "stacked-T1", "layout-T16", "layout-T1", "default"],
    "Engine variants: <stacked|layout>-T<min_token_bucket> (pow2 buckets), or 'default' "
    "(EngineConfig(): layout on a CPU, measured buckets). stacked-T16 is the engine before #16.",
)

PHASES = ("schedule", "build", "dispatch", "device", "update")


def load(name: str):
    if name == "tiny":
        cfg = ji.ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=16, intermediate_size=128,
                             max_position_embeddings=512)  # fmt: skip
        return cfg, ji.init_params(cfg, jax.random.key(0))
    path = ji.models.path(name) if name in ji.models.names() else name
    return ji.load_checkpoint(path)


def generate_per_token(cfg, params, prompt, n: int) -> float:
    """Seconds per decoded token of compiled `ji.generate` at batch 1."""

    def run(k):
        sp = ji.SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True)
        t0 = time.perf_counter()
        ji.generate(cfg, params, [prompt], sp)
        return time.perf_counter() - t0

    run(n), run(2 * n)  # compile both
    return (run(2 * n) - run(n)) / n


class Timed:
    """Splits each `Engine.step` of one engine into PHASES (seconds per step, decode steps only)."""

    def __init__(self, engine):
        self.engine = engine
        self.times = {p: [] for p in PHASES}
        self._cur = {}
        sched = engine.scheduler
        orig_schedule, orig_build = sched.schedule, engine._build

        def schedule(*a, **k):
            t0 = time.perf_counter()
            out = orig_schedule(*a, **k)
            self._cur["schedule"] = time.perf_counter() - t0
            return out

        def build(s):
            t0 = time.perf_counter()
            out = orig_build(s)
            self._cur["build"] = time.perf_counter() - t0
            return out

        def run(batch):
            t0 = time.perf_counter()
            tokens, engine.cache = engine_mod._step(
                engine.params, engine.cache, batch.meta, batch.src, batch.sb, batch.pos,
                batch.index, cfg=engine.cfg, backend=engine.config.backend,
            )  # fmt: skip
            t1 = time.perf_counter()
            tokens.block_until_ready()
            t2 = time.perf_counter()
            self._cur["dispatch"], self._cur["device"] = t1 - t0, t2 - t1
            engine.step_shapes[batch.shape] += 1
            tokens = np.asarray(tokens).tolist()
            return {sid: (t, p) for sid, t, p in zip(batch.ids, tokens, batch.pos.tolist())}

        sched.schedule, engine._build, engine._run = schedule, build, run

    def step(self):
        self._cur = {}
        t0 = time.perf_counter()
        self.engine.step()
        total = time.perf_counter() - t0
        if len(self._cur) == 4:  # a step that reached the device
            self._cur["update"] = total - sum(self._cur.values())
            for p in PHASES:
                self.times[p].append(self._cur[p])
        return total


def engine_variant(cfg, params, name: str):
    if name == "default":  # inference layout on a CPU, measured token buckets
        return ji.Engine(cfg, params, ji.EngineConfig())
    layout, t = name.split("-T")
    config = ji.EngineConfig(
        min_token_bucket=int(t),
        token_buckets="pow2",
        layout="auto" if layout == "layout" else "stacked",
    )
    return ji.Engine(cfg, params, config)


def engine_steps(engine, prompt, n: int) -> dict:
    """Per-phase medians (ms) and the mean decode-step time of one request of n new tokens."""
    timed = Timed(engine)
    engine.add_request(prompt, ji.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    totals = []
    first = True
    while engine.has_unfinished():
        t = timed.step()
        if not first:  # the first step is the prefill
            totals.append(t)
        first = False
    out = {p: 1e3 * statistics.median(v) for p, v in timed.times.items()}
    out["step"] = 1e3 * statistics.mean(totals)
    return out


def main(argv):
    del argv
    common.apply_config(_CONFIG.value)
    common.save_config(_WORKDIR.value)
    cfg, params = load(_MODEL.value)
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, cfg.vocab_size, _PROMPT_LEN.value).tolist()
    n = _NEW.value
    engines = {v: engine_variant(cfg, params, v) for v in _VARIANTS.value}
    for e in engines.values():  # compile prefill and decode shapes
        engine_steps(e, prompt, 4)
    gen, res = [], {v: [] for v in engines}
    loads = []
    for _ in range(_ROUNDS.value):
        gen.append(1e3 * generate_per_token(cfg, params, prompt, n))
        for v, e in engines.items():
            res[v].append(engine_steps(e, prompt, n))
        loads.append(os.getloadavg()[0])
    g = statistics.median(gen)
    print(f"model={_MODEL.value} prompt={_PROMPT_LEN.value} new={n} rounds={_ROUNDS.value} "
          f"load1={min(loads):.2f}-{max(loads):.2f} jax={jax.__version__}")  # fmt: skip
    print(f"ji.generate per token: {g:.2f} ms (rounds: {', '.join(f'{x:.2f}' for x in gen)})")
    head = "| variant | step ms | vs generate | " + " | ".join(PHASES) + " | shapes (T,B,M) |"
    print(head)
    print("|" + "---|" * (len(PHASES) + 4))
    for v, rows in res.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        spread = [r["step"] for r in rows]
        shapes = sorted(engines[v].step_shapes)
        print(f"| {v} | {med['step']:.2f} ({min(spread):.2f}-{max(spread):.2f}) | "
              f"{med['step'] / g:.2f}x | " + " | ".join(f"{med[p]:.2f}" for p in PHASES)
              + f" | {shapes} |")  # fmt: skip
    for v, e in engines.items():
        print(f"{v}: token buckets {e.token_buckets}")
    common.write_results(
        _WORKDIR.value,
        {"model": _MODEL.value, "prompt_len": _PROMPT_LEN.value, "new_tokens": n,
         "load1": loads, "generate_per_token_ms": gen, "variants": res,
         "token_buckets": {v: list(e.token_buckets) for v, e in engines.items()}},
    )  # fmt: skip


if __name__ == "__main__":
    app.run(main)
