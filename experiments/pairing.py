"""HTTP against in-process, pair by pair: `bench_serve`'s comparison of its interleaved repeats.

A module of its own, without absl flags, so that the tests import it beside other experiments
(whose flags share absl's registry).
"""

from __future__ import annotations

import math
import statistics


def paired(pairs: list[dict]) -> dict | None:
    """HTTP against in-process over repeated runs, each pair adjacent in time: the medians (and
    min / max) of the goodput ratio and of the TTFT p50 and TPOT p50 differences (HTTP minus
    in-process, ms). Pairs where either side completed nothing are left out.

    The p50 of one run moves by the gaps between its sorted TTFTs (tens of ms at a few dozen
    requests), so two steadier estimates of the same difference come with it: the p50 of every
    pair's TTFTs pooled, HTTP minus in-process; and, over the pairs where both sides completed
    every request (the same arrival schedule, request by request), the median and mean of the
    per-request differences."""
    both = [
        p for p in pairs if all((p.get(k) or {}).get("summary") for k in ("http", "in_process"))
    ]
    if not both:
        return None

    def stat(xs):
        xs = [x for x in xs if x is not None and math.isfinite(x)]
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else None

    h = [p["http"]["summary"] for p in both]
    i = [p["in_process"]["summary"] for p in both]
    ratio = [
        a["goodput"] / b["goodput"] if a["goodput"] and b["goodput"] else None for a, b in zip(h, i)
    ]
    return {
        "pairs": len(both),
        "goodput_ratio": stat(ratio),
        "ttft_p50_diff_ms": stat(
            [1e3 * (a["ttft"]["p50"] - b["ttft"]["p50"]) for a, b in zip(h, i)]
        ),
        "tpot_p50_diff_ms": stat(
            [
                1e3 * (a["tpot"]["p50"] - b["tpot"]["p50"])
                for a, b in zip(h, i)
                if a["tpot"]["p50"] is not None and b["tpot"]["p50"] is not None
            ]
        ),  # fmt: skip
        "ttft_p50_pooled_diff_ms": _pooled_p50_ms(both, "http")
        - _pooled_p50_ms(both, "in_process"),
        "ttft_per_request_diff_ms": _per_request(both),
    }


def _pooled_p50_ms(pairs: list[dict], path: str) -> float:
    return 1e3 * statistics.median(t for p in pairs for t in p[path]["ttft"])


def _per_request(pairs: list[dict]) -> dict | None:
    """Median and mean (ms) of HTTP minus in-process TTFT, request by request, over the pairs in
    which both sides completed every request; None if no pair did."""

    def complete(p):  # the in-process engine counts every request it was given
        n = p["in_process"]["summary"]["num_requests"]
        return len(p["http"]["ttft"]) == len(p["in_process"]["ttft"]) == n

    diffs = [
        1e3 * (a - b)
        for p in pairs
        if complete(p)
        for a, b in zip(p["http"]["ttft"], p["in_process"]["ttft"])
    ]
    return {"median": statistics.median(diffs), "mean": statistics.fmean(diffs)} if diffs else None
