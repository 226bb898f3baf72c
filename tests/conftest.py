import os
import shutil
import tempfile

ON_GPU = os.environ.get("JAXINFER_TEST_GPU") == "1"
# Tests run on the CPU unless a test is marked gpu and run on the device machine.
os.environ.setdefault("JAX_PLATFORMS", "" if ON_GPU else "cpu")

# CPU runs share JAX's persistent compilation cache, in a directory of their own: engines of
# the same configuration (a sync/async pair, each test's tiny engine) compile each executable
# once per run, not once per engine (tests/test_async_scheduling.py: 99 -> 47 s). Every
# executable is kept, however quick to compile. Set before jax is imported, so its config
# reads it; child processes (servers, the tensor-parallel run) inherit it. An executable
# loaded from the cache still counts as a compile for runner.CompileCounter (jax times the
# load as a backend compile), so "steady state compiles nothing" keeps its meaning. A cache
# directory the environment already names is used as it is and kept.
_OWN_CACHE = None
if not ON_GPU and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="jaxinfer-test-jit-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")


def pytest_sessionfinish(session, exitstatus):
    """The process that made the cache directory removes it (under pytest-xdist the
    controller makes it before its workers start, and they inherit it)."""
    if _OWN_CACHE:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
