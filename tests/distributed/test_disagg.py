"""Disaggregated serving: `_disagg_cases.py` (one process, two sub-meshes of 4 fake devices)."""

from tests.distributed._child import run_cases

EXPECTED = 7  # cases in _disagg_cases.py


def test_disaggregated_cases_on_4_fake_devices():
    run_cases("tests/distributed/_disagg_cases.py", EXPECTED, devices=4, timeout=900)
