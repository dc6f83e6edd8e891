"""Suite-wide fixtures, and the number of pytest-xdist workers."""

import atexit
import os
import shutil
import tempfile

import jax
import pytest

# Servers the tests start keep their compiled programs (experiments/serve.py's default
# --compilation_cache) in a folder of this run, not in the user's cache.
os.environ["JAXINFER_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxinfer-tests-")
atexit.register(shutil.rmtree, os.environ["JAXINFER_CACHE_DIR"], ignore_errors=True)

# `-n auto` (setup.cfg) gives one worker per core, at most this many. A worker's step is
# compilation (one thread) and XLA's run (all cores), so two workers on two cores keep both busy
# (the suite: 44 minutes in one process, 25-27 in two, on 2 cores); beyond a few, every worker holds
# its own copy of the loaded models.
MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: the cores this process may use, at most MAX_WORKERS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, MAX_WORKERS))


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
