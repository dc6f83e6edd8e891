"""Speculative decoding: acceptance of drafted tokens and the speedup model.

See `acceptance` for the rejection / coupled / greedy modes and their trade-off, and `speedup`
for tokens per cycle, cycle time and the choice of γ; `loop` runs speculative generation and
`cycle_log` records its cycles; `autotune` reads them into the speedup model to choose γ.
"""

# ---------------------------------------------------------------------------------------------
# Acceptance (one cycle's decision, jitted).
# ---------------------------------------------------------------------------------------------
from jaxinfer.speculative.acceptance import (
    PAD_TOKEN,
    acceptance_probs,
    correction_probs,
    coupled_accept,
    expected_acceptance,
    greedy_accept,
    rejection_sample,
    rejection_sample_with_noise,
)

# ---------------------------------------------------------------------------------------------
# Speedup model (host-side numpy).
# ---------------------------------------------------------------------------------------------
from jaxinfer.speculative.speedup import (
    LinearCost,
    TableCost,
    best_gamma,
    cycle_time,
    emitted_distribution,
    estimate_alpha,
    expected_tokens_per_cycle,
    pooled_alpha,
    speedup,
)

# ---------------------------------------------------------------------------------------------
# Generation loop (loop.py: the lax.while_loop; drafters.py: model and n-gram drafters, and
# the hybrid of a head with the n-gram).
# ---------------------------------------------------------------------------------------------
from jaxinfer.speculative.drafters import ngram_lookup, ngram_propose, prefer_ngram
from jaxinfer.speculative.loop import ACCEPTANCE_MODES, SpeculativeOutput
from jaxinfer.speculative.config import SpeculativeConfig
from jaxinfer.speculative import heads  # learned drafters: Medusa, EAGLE-style (heads/)

# ---------------------------------------------------------------------------------------------
# Cycle logs (cycle_log.py: the host-driven loop, JSONL records) and γ tuning (autotune.py:
# logs into the speedup model, γ="auto", and `generate`, the package's entry point).
# ---------------------------------------------------------------------------------------------
from jaxinfer.speculative.autotune import (
    GammaChoice,
    choose_gamma,
    complete_alpha,
    fit_costs,
    generate,
    summarize_log,
)
from jaxinfer.speculative.cycle_log import (
    CycleRecord,
    accepted_counts,
    generate_with_log,
    read_cycle_log,
    write_cycle_log,
)

__all__ = [
    # acceptance
    "PAD_TOKEN",
    "acceptance_probs",
    "correction_probs",
    "coupled_accept",
    "expected_acceptance",
    "greedy_accept",
    "rejection_sample",
    "rejection_sample_with_noise",
    # speedup
    "LinearCost",
    "TableCost",
    "best_gamma",
    "cycle_time",
    "emitted_distribution",
    "estimate_alpha",
    "expected_tokens_per_cycle",
    "pooled_alpha",
    "speedup",
    # loop
    "ACCEPTANCE_MODES",
    "SpeculativeConfig",
    "SpeculativeOutput",
    "generate",
    "heads",
    "ngram_lookup",
    "ngram_propose",
    "prefer_ngram",
    # cycle logs
    "CycleRecord",
    "GammaChoice",
    "accepted_counts",
    "choose_gamma",
    "complete_alpha",
    "fit_costs",
    "generate_with_log",
    "read_cycle_log",
    "summarize_log",
    "write_cycle_log",
]
