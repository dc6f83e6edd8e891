r"""Simulated serving of a 7B/8B preset on H200s: TTFT, TPOT and goodput against request rate.

    python -m experiments.sim_h200 --workdir=runs/sim_h200
    python -m experiments.sim_h200 --preset=llama3-8b --tp=1,2,4,8 --rates=2,8,32

No device is used: `jaxinfer.engine.sim.Simulator` runs the engine's own scheduler and block
allocator on a virtual clock, each step priced by `RooflineStepTime` (989 dense bf16 TFLOP/s,
4.8 TB/s per H200, 0.5 ms per step of launch and host time; the TP collectives are not priced).
Colocated serving only (one engine does prefill and decode); disaggregation is not built yet.
Requests arrive as a Poisson process; prompts and outputs have fixed lengths (--prompt_len,
--output_len). The KV pool is what is left of --hbm_gib per device after the weight shard, times
--kv_fraction. Prints one row per (TP degree, rate) and writes results.json with the assumptions.
"""

from __future__ import annotations

from absl import app, flags

import jaxinfer as ji
from experiments import common, flag_checks
from jaxinfer.config import preset
from jaxinfer.engine.metrics import SLO
from jaxinfer.engine.sim import H200, RooflineStepTime, Simulator, poisson_workload

_WORKDIR = flags.DEFINE_string("workdir", None, "Where config.json and results.json go.")
_CONFIG = common.config_flag()
_PRESET = flags.DEFINE_string("preset", "llama2-7b", "Model preset (jaxinfer.config.PRESETS).")
_TP = flags.DEFINE_list("tp", ["1", "2", "4"], "Tensor-parallel degrees.")
_RATES = flags.DEFINE_list("rates", ["4", "16", "64"], "Request rates (requests / s).")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 200, "Requests per run.", lower_bound=1)
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 512, "Prompt tokens.", lower_bound=1)
_OUTPUT_LEN = flags.DEFINE_integer("output_len", 128, "Output tokens.", lower_bound=1)
_MAX_SEQS = flags.DEFINE_integer("max_num_seqs", 128, "Running sequences.", lower_bound=1)
_BUDGET = flags.DEFINE_integer("max_num_batched_tokens", 2048, "Tokens per step.", lower_bound=1)
_HBM_GIB = flags.DEFINE_float("hbm_gib", 141.0, "Device memory (GiB).")
_KV_FRACTION = flags.DEFINE_float("kv_fraction", 0.85, "Share of the rest given to the KV pool.")
_SLO_TTFT = flags.DEFINE_float("slo_ttft_s", 1.0, "Goodput SLO: TTFT (s).")
_SLO_TPOT = flags.DEFINE_float("slo_tpot_s", 0.05, "Goodput SLO: TPOT (s).")
flag_checks.int_list(_TP, min_value=1)
flag_checks.float_list(_RATES, above=0.0)
_BLOCK = 16


def _num_blocks(cfg, tp: int) -> int:
    item = 2  # bf16
    weights = cfg.num_params() * item / tp
    kv_token = 2 * cfg.num_layers * max(1, cfg.num_kv_heads // tp) * cfg.head_dim * item
    free = (_HBM_GIB.value * 2**30 - weights) * _KV_FRACTION.value
    return int(free // (kv_token * _BLOCK)) + 1


def main(argv):
    del argv
    common.apply_config(_CONFIG.value)
    cfg = preset(_PRESET.value)
    for tp in map(int, _TP.value):
        ji.distributed.tp_grid(cfg, tp)  # refuses a degree the heads cannot take: before writing
    if _WORKDIR.value:
        common.save_config(_WORKDIR.value)
    slo = SLO(ttft_s=_SLO_TTFT.value, tpot_s=_SLO_TPOT.value)
    rows = []
    header = f"{'tp':>3} {'rate':>6} {'ttft p50':>9} {'ttft p99':>9} {'tpot p50':>9} "
    header += f"{'tpot p99':>9} {'goodput':>8} {'tok/s':>8} {'blocks':>8}"
    print(header)
    for tp in map(int, _TP.value):
        nb = _num_blocks(cfg, tp)
        config = ji.EngineConfig(
            block_size=_BLOCK, num_blocks=nb, max_num_seqs=_MAX_SEQS.value,
            max_num_batched_tokens=_BUDGET.value,
            token_buckets="pow2",  # the roofline prices real tokens: T's padding costs nothing
        )  # fmt: skip
        sim = Simulator(config, RooflineStepTime(cfg, H200, tp=tp))
        for rate in map(float, _RATES.value):
            reqs = poisson_workload(
                rate, [_PROMPT_LEN.value] * _NUM_REQUESTS.value,
                [_OUTPUT_LEN.value] * _NUM_REQUESTS.value, vocab_size=cfg.vocab_size,
            )  # fmt: skip
            s = sim.run(reqs).summary(slo)
            row = dict(
                tp=tp, rate=rate, num_blocks=nb, ttft_p50=s.ttft.p50, ttft_p99=s.ttft.p99,
                tpot_p50=s.tpot.p50, tpot_p99=s.tpot.p99, goodput=s.goodput,
                output_throughput=s.output_throughput, num_preemptions=s.num_preemptions,
            )  # fmt: skip
            rows.append(row)
            print(
                f"{tp:>3} {rate:>6.1f} {s.ttft.p50:>9.4f} {s.ttft.p99:>9.4f} {s.tpot.p50:>9.4f} "
                f"{s.tpot.p99:>9.4f} {s.goodput:>8.2f} {s.output_throughput:>8.0f} {nb:>8}"
            )
    if _WORKDIR.value:
        assumptions = dict(
            hardware=H200.__dict__, preset=_PRESET.value, prompt_len=_PROMPT_LEN.value,
            output_len=_OUTPUT_LEN.value, num_requests=_NUM_REQUESTS.value,
            slo=dict(ttft_s=slo.ttft_s, tpot_s=slo.tpot_s), hbm_gib=_HBM_GIB.value,
            kv_fraction=_KV_FRACTION.value, collectives="not priced", deployment="colocated",
        )  # fmt: skip
        common.write_results(_WORKDIR.value, dict(assumptions=assumptions, rows=rows))


if __name__ == "__main__":
    app.run(main)
