"""Tensor parallelism on 8 fake CPU devices: `_tp_cases.py` and `_smollm2_cases.py`, each in its
own process (jax fixes its device count when its backend starts, and the suite's process has
started it with one device).
"""

from tests.distributed._child import run_cases


def test_tensor_parallel_cases_on_8_fake_devices():
    run_cases("tests/distributed/_tp_cases.py", 33, devices=8, timeout=1800)


def test_smollm2_cases_on_8_fake_devices():
    run_cases("tests/distributed/_smollm2_cases.py", 6, devices=8, timeout=1800)
