r"""Simulated serving of a 7B/8B preset on H200s: TTFT, TPOT and goodput against request rate.

    python -m experiments.sim_h200 --workdir=runs/sim_h200
    python -m experiments.sim_h200 --preset=llama3-8b --tp=1,2,4,8 --rates=2,8,32

No device is used: `jaxinfer.engine.sim.Simulator` runs the engine's own scheduler and block
allocator on a virtual clock, each step priced by `RooflineStepTime` (989 dense bf16 TFLOP/s,
4.8 TB/s per H200, 0.5 ms per step of launch and host time; the TP collectives are not priced).
Requests arrive as a Poisson process; prompts and outputs have fixed lengths (--prompt_len,
--output_len). The KV pool is what is left of --hbm_gib per device after the weight shard, times
--kv_fraction. Prints one row per (TP degree, rate) of colocated serving (one engine does prefill
and decode), then, with --disagg, colocated against disaggregated serving on the same two GPUs:
  colocated      two TP-1 replicas, requests routed round-robin (the same requests as the
                 disaggregated run; the replicas' metrics merged into one client view);
  disaggregated  one TP-1 prefill GPU and one TP-1 decode GPU (`jaxinfer.engine.sim_disagg`),
                 KV over a link of each --link_gbs (GB/s; 50: one 400 Gb/s NIC between nodes,
                 450: NVLink 4 one way) with --link_latency_us per transfer, one FIFO link,
                 2 · L · K · D · 2 bytes (bf16) per moved prompt token.
Writes results.json with the assumptions.
"""

from __future__ import annotations

import numpy as np
from absl import app, flags

import jaxinfer as ji
from experiments import common, flag_checks
from jaxinfer.config import preset
from jaxinfer.engine.metrics import SLO
from jaxinfer.engine.sim import H200, RooflineStepTime, Simulator, poisson_workload
from jaxinfer.engine.sim_disagg import DisaggSimulator, KVLink, kv_bytes_per_token, merged

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
_DISAGG = flags.DEFINE_boolean("disagg", True, "Also colocated vs disaggregated on 2 GPUs.")
_LINK_GBS = flags.DEFINE_list("link_gbs", ["50", "450"], "KV link bandwidths (GB/s).")
_LINK_LATENCY_US = flags.DEFINE_float(
    "link_latency_us", 20.0, "KV link latency per transfer (us).", lower_bound=0.0
)
flag_checks.int_list(_TP, min_value=1)
flag_checks.float_list(_LINK_GBS, above=0.0)
flag_checks.float_list(_RATES, above=0.0)
_BLOCK = 16


def _num_blocks(cfg, tp: int) -> int:
    item = 2  # bf16
    weights = cfg.num_params() * item / tp
    kv_token = 2 * cfg.num_layers * max(1, cfg.num_kv_heads // tp) * cfg.head_dim * item
    free = (_HBM_GIB.value * 2**30 - weights) * _KV_FRACTION.value
    return int(free // (kv_token * _BLOCK)) + 1


def _engine_config(cfg, tp: int) -> ji.EngineConfig:
    return ji.EngineConfig(
        block_size=_BLOCK, num_blocks=_num_blocks(cfg, tp), max_num_seqs=_MAX_SEQS.value,
        max_num_batched_tokens=_BUDGET.value,
        token_buckets="pow2",  # the roofline prices real tokens: T's padding costs nothing
    )  # fmt: skip


def compare_disaggregated(cfg, slo: SLO) -> list[dict]:
    """Colocated (2 TP-1 replicas) against disaggregated (1P + 1D) rows, per rate (docstring)."""
    config = _engine_config(cfg, 1)
    roof = RooflineStepTime(cfg, H200, tp=1)
    n, p, o = _NUM_REQUESTS.value, _PROMPT_LEN.value, _OUTPUT_LEN.value
    rows = []
    print(f"\ncolocated (2 x TP1, round-robin) vs disaggregated (1P + 1D), SLO {slo}")
    print(f"{'deployment':>22} {'rate':>6} {'ttft p50':>9} {'ttft p99':>9} {'tpot p50':>9} "
          f"{'tpot p99':>9} {'goodput':>8} {'transfer':>9}")  # fmt: skip
    for rate in map(float, _RATES.value):
        reqs = poisson_workload(rate, [p] * n, [o] * n, vocab_size=cfg.vocab_size)
        replicas = [Simulator(config, roof).run(reqs[k::2]).metrics for k in range(2)]
        s = merged(*replicas).summary(slo)
        cells = [("colocated 2x", s, s.goodput, None)]
        for gbs in map(float, _LINK_GBS.value):
            link = KVLink(gbs * 1e9, _LINK_LATENCY_US.value * 1e-6)
            res = DisaggSimulator(
                config, config, roof, roof, link, kv_bytes_per_token(cfg, 2)
            ).run(reqs)  # fmt: skip
            d = res.summary(slo)
            transfer = [tm.parts["transfer"] for tm in res.timings.values()]
            cells.append((f"disagg 1P1D {gbs:g} GB/s", d, d.goodput, float(np.median(transfer))))
        for name, m, goodput, transfer in cells:
            rows.append(dict(
                deployment=name, rate=rate, ttft_p50=m.ttft.p50, ttft_p99=m.ttft.p99,
                tpot_p50=m.tpot.p50, tpot_p99=m.tpot.p99, goodput=goodput,
                transfer_p50=transfer,
            ))  # fmt: skip
            t = "—" if transfer is None else f"{transfer * 1e3:.2f}ms"
            print(
                f"{name:>22} {rate:>6.1f} {m.ttft.p50:>9.4f} {m.ttft.p99:>9.4f} "
                f"{m.tpot.p50:>9.4f} {m.tpot.p99:>9.4f} {goodput:>8.2f} {t:>9}"
            )
    return rows


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
        config = _engine_config(cfg, tp)
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
    disagg_rows = compare_disaggregated(cfg, slo) if _DISAGG.value else []
    if _WORKDIR.value:
        assumptions = dict(
            hardware=H200.__dict__, preset=_PRESET.value, prompt_len=_PROMPT_LEN.value,
            output_len=_OUTPUT_LEN.value, num_requests=_NUM_REQUESTS.value,
            slo=dict(ttft_s=slo.ttft_s, tpot_s=slo.tpot_s), hbm_gib=_HBM_GIB.value,
            kv_fraction=_KV_FRACTION.value, collectives="not priced", deployment="colocated",
            disaggregated=dict(
                gpus="1 prefill + 1 decode (TP 1 each) against 2 TP-1 replicas, round-robin",
                link_gbs=[float(x) for x in _LINK_GBS.value],
                link_latency_us=_LINK_LATENCY_US.value, link="one FIFO pipe",
                kv_bytes_per_token=kv_bytes_per_token(cfg, 2),
                decode_host="acts at its step boundaries (transfers start and land there)",
            ),
        )  # fmt: skip
        common.write_results(
            _WORKDIR.value, dict(assumptions=assumptions, rows=rows, disaggregated=disagg_rows)
        )


if __name__ == "__main__":
    app.run(main)
