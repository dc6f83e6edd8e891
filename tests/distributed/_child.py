"""Runs a case file of tests/distributed in a fresh pytest process with N fake CPU devices.

jax fixes its device count when its backend starts, and the suite's process has started it with
one device, so cases that need a mesh run in a child with `--xla_force_host_platform_device_count`.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]


def child_env(devices: int | None = None) -> dict[str, str]:
    """The environment of a child process: the repo on its path, `devices` fake CPU devices."""
    env = dict(os.environ)
    if devices is not None:
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run_cases(path: str, expected: int, devices: int, timeout: float) -> None:
    """Runs `path` (relative to the repo root) under pytest; asserts exactly `expected` passed."""
    # -n0: the cases run in this one child (setup.cfg's `-n auto` would start xdist workers).
    cmd = [sys.executable, "-m", "pytest", "-q", "-n0", "-p", "no:cacheprovider", path]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=child_env(devices), capture_output=True, text=True, timeout=timeout
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) == expected, tail


# The worker spec's engine block shared by the multi-process tests: a pool small enough to preempt.
SMALL_ENGINE = dict(block_size=4, num_blocks=11, max_num_seqs=4, max_num_batched_tokens=16,
                    min_token_bucket=16, min_block_bucket=8, min_seq_bucket=4)  # fmt: skip


def mixed_requests(seed: int, sample_seed: int) -> tuple[list[dict], list[int]]:
    """Six worker requests, (requests, shared prefix): every other prompt starts with a shared
    9-token prefix (prefix-cache hits); the first three greedy, the rest sampled at T = 0.8 with
    seeds sample_seed + i."""
    rng = np.random.RandomState(seed)
    shared = rng.randint(2, 4096, 9).tolist()
    requests = []
    for i in range(6):
        prompt = (shared if i % 2 else []) + rng.randint(2, 4096, int(rng.randint(4, 12))).tolist()
        sampling = dict(max_tokens=6, ignore_eos=True, temperature=0.0)
        if i >= 3:
            sampling.update(temperature=0.8, seed=sample_seed + i)
        requests.append(dict(prompt=prompt, sampling=sampling))
    return requests, shared
