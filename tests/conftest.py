"""Suite-wide fixtures."""

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops jax's compiled programs after each test module.

    The whole suite compiles thousands of XLA programs in one process. Each one keeps its
    JIT-compiled code mapped, and near the end of a full run the process reached the kernel's
    limit on memory mappings (vm.max_map_count, 65530 here): XLA then crashed inside a compile
    (SIGSEGV / SIGABRT in tests/test_train.py). Modules do not share compiled programs that
    matter for speed, so clearing between modules costs little.
    """
    yield
    jax.clear_caches()
