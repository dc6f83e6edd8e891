"""The experiment scripts: thin absl mains over the library, run as modules from the checkout.

    python -m experiments.pipeline --workdir=runs/pipeline
    python -m experiments.spec_bench --config=runs/spec_bench/config.json --workdir=runs/again

Shared loading, JSON, timing and run-directory helpers are in `experiments.common`; parse-time
flag checks in `experiments.flag_checks`; training settings in `experiments.configs`.
"""
