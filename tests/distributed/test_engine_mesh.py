"""`EngineConfig(mesh=...)` on 4 fake CPU devices: `_engine_cases.py` in its own process."""

from tests.distributed._child import run_cases

EXPECTED = 9  # cases in _engine_cases.py: a collection change must show up here


def test_engine_mesh_cases_on_4_fake_devices():
    run_cases("tests/distributed/_engine_cases.py", EXPECTED, devices=4, timeout=900)
