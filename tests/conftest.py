import collections
import os
import secrets
import shutil
import tempfile

import pytest

ON_GPU = os.environ.get("JAXINFER_TEST_GPU") == "1"
# Tests run on the CPU unless a test is marked gpu and run on the device machine.
os.environ.setdefault("JAX_PLATFORMS", "" if ON_GPU else "cpu")

# CPU runs share JAX's persistent compilation cache, in a directory of their own: engines of
# the same configuration compile each executable once per run, not once per engine. Set
# before jax is imported; child processes (servers, the tensor-parallel run) inherit it. A
# load from the cache still counts as a compile for runner.CompileCounter, so "steady state
# compiles nothing" keeps its meaning. A cache directory the environment names is kept.
_OWN_CACHE = None
if not ON_GPU and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="jaxinfer-test-jit-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

# XLA's CPU backend compiles with LLVM at -O0 on all but one worker: most of the suite's
# time is compiling small executables it runs a few times, and -O0 takes ~25-35% off those
# files. The files that run the real model long enough to lose by it (OPTIMIZED_FILES) go
# to worker OPTIMIZED_WORKER, which compiles as XLA does by default
# (pytest_xdist_make_scheduler). The level is LLVM's, after XLA's own passes: the same HLO,
# fusions and kernels. Runs outside xdist, and XLA_FLAGS naming a level, keep theirs.
# test_openai_http_errors.py and test_ray_app.py go there too: their SmolLM2 engines are
# test_openai_http's and test_serve_lifecycle's (max_num_seqs 4, 64 batched tokens, length
# 256, float32), whose step programs they then load from the compilation cache (compiled
# with other flags they would be compiled again).
OPTIMIZED_WORKER = "gw0"
OPTIMIZED_FILES = frozenset((
    "test_fp8_quality.py", "test_hf_parity.py", "test_serve_lifecycle.py", "test_convert.py",
    "test_serve.py", "test_batch_generate_cli.py", "test_engine_text.py",
    "test_structured_output.py", "test_openai_http.py", "test_lora_hf.py",
    "test_speculative_text.py", "test_speculative_serve.py", "test_openai_batch.py",
    "test_openai_http_errors.py", "test_ray_app.py",
))
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if (not ON_GPU and _WORKER not in (None, OPTIMIZED_WORKER)
        and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0").strip()

# Torch (the HF transformers oracle) runs its CPU ops on OpenMP threads that spin while they
# wait; with three xdist workers on two cores the spinning starves the other workers. Idle
# threads sleep instead (same threads, same results). Set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# A Ray cluster a test starts (`ray start`, tests/serve/test_ray_app.py) authenticates with a
# token of this run's own, whatever ~/.ray holds; Ray reads the mode when it is first
# imported, so it is set before any test module imports it.
os.environ["RAY_AUTH_MODE"] = "token"
os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


def pytest_sessionfinish(session, exitstatus):
    """The process that made the cache directory removes it (under pytest-xdist the
    controller makes it before its workers start, and they inherit it)."""
    if _OWN_CACHE:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def skipped_in_gpu_runs(path, markexpr: str) -> bool:
    """Whether a GPU run (`-m gpu`, the README's command) leaves this file uncollected: a test
    file with no gpu-marked test in its text. Such files may import packages the GPU machine
    lacks (gguf, grpc_health, grpc_reflection) and would stop the run at collection with
    nothing of theirs selected. Any other mark expression collects everything as before, and
    so does a file named on the command line (pytest collects those whatever this says)."""
    name = os.path.basename(str(path))
    if markexpr.strip() != "gpu" or not (name.startswith("test_") and name.endswith(".py")):
        return False
    with open(path, encoding="utf-8") as f:
        return "mark.gpu" not in f.read()


def pytest_ignore_collect(collection_path, config):
    return True if skipped_in_gpu_runs(collection_path, config.option.markexpr) else None


# Longest files first. Under `-n 3 --dist loadfile` each file is one unit of work, handed out
# in queue order; xdist's own order (most tests first) would leave a long file with few tests
# to run alone at the end. Listed: the files of ~30 s and more alone on 2 cores, longest
# first; every other file follows in xdist's order. Each file's tests keep their order.
LONGEST_FIRST = (
    "test_fp8_quality.py",              # ~165 s
    "test_structured_output.py",        # ~95 s
    "test_tensor_parallel.py",          # ~70 s (one child process)
    "test_engine.py",                   # ~65 s
    "test_paged_attention.py",          # ~65 s
    "test_hf_parity.py",                # ~60 s
    "test_lora_hf.py",                  # ~45 s
    "test_model_glue.py",               # ~50 s
    "test_ragged_paged_attention.py",   # ~50 s
    "test_serve_lifecycle.py",          # ~50 s
    "test_async_scheduling.py",         # ~45 s
    "test_decode_qkv.py",               # ~45 s
    "test_bench.py",                    # ~40 s
    "test_checkpoints.py",              # ~35 s
    "test_kv_write.py",                 # ~33 s
    "test_fp8_matmul.py",               # ~31 s
    "test_convert.py",                  # ~31 s
)


def pytest_configure(config):
    """The xdist controller keeps the workers' collection order (see
    pytest_collection_modifyitems) instead of re-sorting the files by number of tests: xdist's
    --no-loadscope-reorder. Processes that run tests share the embedded GGUF's parse."""
    if getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput"):
        if config.option.dist in ("loadfile", "loadscope") and hasattr(
                config.option, "loadscopereorder"):
            config.option.loadscopereorder = False
        return
    from gguf_share import share_the_embedded_gguf_parse
    share_the_embedded_gguf_parse()


def pytest_collection_modifyitems(session, config, items):
    """Under xdist, each worker orders the collected files: LONGEST_FIRST, then the rest by
    number of tests (xdist's own rule), ties in collection order. A stable sort by file:
    the order of the tests within a file is unchanged. Single-process runs are left alone."""
    if not hasattr(config, "workerinput"):
        return
    counts = collections.Counter(item.path for item in items)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -counts[item.path]))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's loadfile scheduling, but OPTIMIZED_WORKER takes the OPTIMIZED_FILES first
    and the other workers the rest first (each in queue order); a worker whose kind of file
    is used up takes the next file of the other kind."""
    if config.getvalue("dist") != "loadfile":
        return None                      # xdist's own scheduler for other modes
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _assign_work_unit(self, node):
            optimized = node.workerinput["workerid"] == OPTIMIZED_WORKER
            scopes = list(self.workqueue)
            preferred = [sc for sc in scopes
                         if (os.path.basename(sc.split("::")[0]) in OPTIMIZED_FILES)
                         == optimized]
            self.workqueue.move_to_end((preferred or scopes)[0], last=False)
            super()._assign_work_unit(node)

    return Scheduling(config, log)
