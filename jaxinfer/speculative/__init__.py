"""Speculative decoding: acceptance of drafted tokens and the speedup model.

See `acceptance` for the rejection / coupled / greedy modes and their trade-off, and `speedup`
for tokens per cycle, cycle time and the choice of γ.
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
# Generation loop (jaxinfer/speculative/loop.py: drafters, the lax.while_loop, cycle records).
# Reserved for the lead: re-export `generate` and friends here and add them to __all__.
# ---------------------------------------------------------------------------------------------

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
]
