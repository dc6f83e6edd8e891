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
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=child_env(devices), capture_output=True, text=True, timeout=timeout
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) == expected, tail
