"""Several processes, one model (jaxinfer/multihost.py): 2 processes x 2 CPU devices over
loopback (gloo collectives), tensor parallel 4 across both; the leader's engine gives the
tokens of one process on one device, greedy and seeded sampling, n > 1 and prompt logprobs
included, with async scheduling (its steps take pending tokens from the step before)."""
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import multihost_worker as worker
from engine_util import free_port
from jaxinfer import multihost
from jaxinfer.config import EngineConfig
from jaxinfer.kv_cache import AttentionMetadata
from jaxinfer.sampling import SamplingArrays
from jaxinfer.step_input import StepInput, dummy_input

WORKER = Path(worker.__file__)


def _run_pair(out: Path, *follower_args: str, timeout: float = 400, env=None):
    """The worker as 2 processes; returns (return codes, outputs, seconds each took),
    leader first. env: variables added to the workers' environment."""
    port = free_port()
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(pid), "2", str(port), str(out),
                               *(follower_args if pid else ())],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, **(env or {})})
             for pid in (0, 1)]
    try:
        logs, took = [], []
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
            took.append(time.monotonic() - t0)
    finally:
        for p in procs:
            p.kill()
    return [p.returncode for p in procs], logs, took


def test_two_processes_tp4_equal_one_device(tmp_path):
    out = tmp_path / "tokens.json"
    codes, logs, _ = _run_pair(out)
    assert codes == [0, 0], "\n".join(logs)[-3000:]
    got = json.loads(out.read_text())
    assert got["devices"] == 4
    model_cfg, cfg, graphdef, params, Engine = worker.engine(1)
    want = worker.run(Engine(model_cfg, cfg, graphdef, params), warm=False)
    assert got["tokens"] == want


def test_a_lost_follower_ends_the_leader_loudly_and_soon(tmp_path):
    """The follower exits mid-run: the leader ends non-zero instead of hanging, JAX's
    coordination service naming the process whose heartbeats (10 s here) stopped. (Whether
    the leader's next step fails first, EngineDeadError, depends on the machine's speed.)"""
    out = tmp_path / "tokens.json"
    codes, logs, took = _run_pair(out, "12", timeout=300)
    assert "follower exits" in logs[1] and codes[1] == 9
    assert codes[0] != 0 and not out.exists()
    # JAX's words: "Task 1 heartbeat timeout" or "unhealthy (stopped sending heartbeats):\n1"
    assert re.search(r"Task 1 heartbeat timeout|stopped sending heartbeats\):\s*1", logs[0]), \
        logs[0][-3000:]
    assert took[0] < 200, f"the leader took {took[0]:.0f} s to end"


class _NoFollowers:
    """A RunnerMirror that sends nothing."""

    def step(self, *_):
        pass

    def call(self, *_, **__):
        pass


def test_a_failed_step_across_processes_is_not_recovered():
    """On one process a failed step fails its requests and the rest go on; across processes
    the engine is dead at once (EngineDeadError), since a peer is most likely gone."""
    from jaxinfer.errors import EngineDeadError
    from jaxinfer.request import SamplingParams
    model_cfg, cfg, graphdef, params, Engine = worker.engine(1)
    engine = Engine(model_cfg, cfg, graphdef, params)
    engine.runner.mirror = _NoFollowers()
    engine.add_request({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4))

    def fail(phase, runner):
        if phase == "dispatched":
            raise RuntimeError("a peer is gone")
    engine.runner.fault_hook = fail
    with pytest.raises(EngineDeadError, match="job of .* processes"):
        engine.step()
    engine.runner.mirror = None                        # one process: recovered
    assert [o.finish_reason for o in engine.step()] == ["error"]


def test_step_message_round_trip():
    """A step's host input survives the store's bytes: every array, static flag and None."""
    bucket = type("B", (), dict(num_tokens=8, num_seqs=2, pages_per_seq=3, num_samples=2,
                                decode_only=False))()
    inp = dummy_input(bucket, full=True, max_num_seqs=4, vocab_size=40, lora=True, prompt=True)
    inp = StepInput(np.arange(8, dtype=np.int32), inp.md, inp.logits_index, inp.sampling,
                    inp.prev_tokens, inp.prev_index,
                    np.arange(4, dtype=np.int32).reshape(2, 2), inp.lora_index,
                    inp.prompt_targets)
    kind, header, arrays = multihost.decode(multihost.step_message(inp, prev_step=7))
    assert kind == "step" and header["prev_step"] == 7
    back = multihost.step_input(header, arrays, prev_tokens=None)
    assert isinstance(back.md, AttentionMetadata) and isinstance(back.sampling, SamplingArrays)
    assert back.md.decode_only is False and back.prev_tokens is None
    for a, b in zip(*(multihost.jax.tree_util.tree_leaves(x) for x in (
            StepInput(**{**vars(inp), "prev_tokens": None}),
            StepInput(**{**vars(back), "prev_tokens": None})))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    plain = dummy_input(bucket, max_num_seqs=4)
    header = multihost.decode(multihost.step_message(plain, None))[1]
    assert header["prev_step"] is None and header["token_bitmask"] is None
    assert header["prompt_targets"] is None and header["lora_index"] is None


def test_engine_refuses_to_run_on_a_follower(monkeypatch):
    from jaxinfer.errors import ConfigError
    monkeypatch.setattr(multihost.jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost.jax, "process_index", lambda: 1)
    model_cfg, cfg, graphdef, params, Engine = worker.engine(1)
    with pytest.raises(ConfigError, match="process 0 only"):
        Engine(model_cfg, EngineConfig(**worker.ENGINE), graphdef, params)


def test_each_process_reads_only_its_shards_of_a_safetensors_model(tmp_path):
    """An HF model dir (safetensors) served by 2 processes x 2 devices, tensor parallel 4
    (attention, MLP and vocabulary all split): each process reads at most 60% of the weight
    bytes (its half of the split weights and the replicated norms), and the leader's tokens
    are those of one process on one device reading the whole model."""
    import ml_dtypes
    from checkpoints import lazy
    from checkpoints.hf_loader import load_hf_dir
    from checkpoints_util import write_hf_dir, tiny_hf_config
    model = tmp_path / "model"
    write_hf_dir(model, tiny_hf_config(num_attention_heads=4, num_key_value_heads=4),
                 np.random.default_rng(5), ml_dtypes.bfloat16, shards=2, std=0.08)
    total = sum(x.nbytes for x in load_hf_dir(model, ml_dtypes.bfloat16, lazy=True)[1].values())
    out = tmp_path / "tokens.json"
    codes, logs, _ = _run_pair(out, env={"JAXINFER_TEST_HF_DIR": str(model)})
    assert codes == [0, 0], "\n".join(logs)[-3000:]
    read = [json.loads(Path(f"{out}.bytes{pid}").read_text()) for pid in (0, 1)]
    assert all(0.4 * total < r <= 0.6 * total for r in read), (read, total)
    before = lazy.bytes_read()
    model_cfg, cfg, graphdef, params, Engine = worker.engine(1, str(model))
    assert lazy.bytes_read() == before      # one device: read whole, not lazily
    want = worker.run(Engine(model_cfg, cfg, graphdef, params), warm=False)
    assert json.loads(out.read_text())["tokens"] == want


def _run_job(cwd: Path, argv) -> list[str]:
    """Python with argv(port, process id) in 2 processes x 2 CPU devices, a job over
    loopback; both must exit 0. Returns their output, process 0's first. The processes keep
    this process's XLA flags (its optimization level, tests/conftest.py)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    port, env = free_port(), {**os.environ, "XLA_FLAGS": " ".join(
        [*flags, "--xla_force_host_platform_device_count=2"])}
    procs = [subprocess.Popen([sys.executable, *argv(port, pid)], cwd=cwd, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for pid in (0, 1)]
    try:
        logs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)[-3000:]
    return logs


# The SmolLM2 jobs' engine: both jobs (LLM.generate and `jaxinfer generate`) share its greedy
# steps' programs through the compilation cache (the second job's seeded, sampled line also
# compiles the split step's forward and sampling halves, ~19 more executables), and one
# in-process LLM of it (smollm2_one_device) is both references.
SMOL_ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256)


@pytest.fixture(scope="module")
def smollm2_one_device():
    from jaxinfer import LLM
    return LLM("smollm2", **SMOL_ENGINE)


# Every process of the job runs this script (argv: port, process id), as a user's would.
_LLM_SCRIPT = """
import json, sys
from jaxinfer import LLM, DistributedConfig, SamplingParams
port, pid = sys.argv[1], int(sys.argv[2])
llm = LLM("smollm2", tensor_parallel=4, max_num_seqs=4, max_num_batched_tokens=32,
          max_model_len=256, distributed=DistributedConfig(f"127.0.0.1:{port}", 2, pid))
outs = llm.generate(["The capital of France is", "def fibonacci(n):"],
                    SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
print("TOKENS", json.dumps([o.token_ids for o in outs]), flush=True)
"""


def test_llm_in_every_process_of_a_job_answers_on_process_0_as_one_process_does(
        tmp_path, smollm2_one_device):
    """The same script in 2 processes x 2 CPU devices, LLM(..., distributed=...) with tensor
    parallel 4: process 0's LLM.generate gives SmolLM2's greedy tokens of one process on one
    device; on process 1 LLM(...) follows and then ends the process (status 0) before the
    script's next line."""
    from jaxinfer import SamplingParams
    logs = _run_job(tmp_path, lambda port, pid: ["-c", _LLM_SCRIPT, str(port), str(pid)])
    assert "TOKENS" not in logs[1]
    got = json.loads(logs[0].split("TOKENS ", 1)[1].splitlines()[0])
    llm = smollm2_one_device
    want = llm.generate(["The capital of France is", "def fibonacci(n):"],
                        SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert got == [w.token_ids for w in want]
    assert llm.tokenizer.decode(got[0]).startswith(" Paris")


def test_llm_refuses_a_distributed_setting_of_the_wrong_type():
    from jaxinfer import LLM
    from jaxinfer.errors import InvalidTypeError
    with pytest.raises(InvalidTypeError) as e:
        LLM("smollm2", distributed="127.0.0.1:1234")
    assert e.value.field == "distributed"


def test_jaxinfer_generate_as_a_two_process_job_equals_one_process(tmp_path,
                                                                    smollm2_one_device):
    """`jaxinfer generate` run as a job (the same command in 2 processes x 2 CPU devices,
    --tensor-parallel 4): process 0 writes SmolLM2's answers, token for token those of
    LLM.generate in one process on one device; process 1 follows and exits 0."""
    from jaxinfer import SamplingParams
    lines = [{"id": "a", "prompt": "The capital of France is", "max_tokens": 8,
              "temperature": 0},
             {"id": "b", "prompt": "def fibonacci(n):", "max_tokens": 12, "temperature": 0},
             {"id": "c", "messages": [{"role": "user", "content": "Name three colors."}],
              "max_tokens": 10, "temperature": 0.7, "seed": 3}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SMOL_ENGINE.items()]
    _run_job(tmp_path, lambda port, pid: [
        "-m", "jaxinfer.cli", "generate", "--input", "in.jsonl", "--output",
        f"out{pid}.jsonl", "--tensor-parallel", "4", *flags, "--coordinator-address",
        f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(pid)])
    assert not (tmp_path / "out1.jsonl").exists()
    results = (tmp_path / "out0.jsonl").read_text().splitlines()
    got = {r["id"]: r["token_ids"] for r in map(json.loads, results)}
    llm = smollm2_one_device
    want = llm.generate([x.get("prompt") or x["messages"] for x in lines],
                        [SamplingParams(**{k: v for k, v in x.items()
                                           if k not in ("id", "prompt", "messages")})
                         for x in lines], use_tqdm=False)
    assert got == {x["id"]: w.token_ids for x, w in zip(lines, want)}
    assert llm.tokenizer.decode(got["a"]).startswith(" Paris")


class _Store:
    """The coordination service's key-value store, in memory."""

    def __init__(self):
        self.values, self.lock = {}, threading.Lock()

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.lock:
            assert allow_overwrite or key not in self.values
            self.values[key] = value

    def key_value_try_get(self, key):
        with self.lock:
            if key not in self.values:
                raise RuntimeError(f"NOT_FOUND: {key}")
            return self.values[key]


def test_the_watchdog_names_the_follower_that_stopped_beating_not_one_that_ended(monkeypatch):
    """Followers 1 and 2 beat; 3 ends its loop on purpose (done); 2 stops: the leader's
    watchdog declares 2 lost within its timeout, and never 1 or 3."""
    store, lost = _Store(), []
    monkeypatch.setattr(multihost.jax, "process_count", lambda: 4)
    monkeypatch.setattr(multihost, "BEAT_S", 0.05)
    monkeypatch.setattr(multihost, "_lost", lambda p, silent: lost.append((p, silent)))
    multihost.Liveness._stop.clear()
    watch = threading.Thread(target=multihost.Liveness._watch, args=(store, 0, 0.6),
                             daemon=True)
    watch.start()
    store.key_value_set(f"{multihost.ALIVE}/3", "done", True)
    t0 = time.monotonic()
    for beat in range(40):                   # 2 s of beats from 1; 2 beats for 0.5 s only
        store.key_value_set(f"{multihost.ALIVE}/1", str(beat), True)
        if beat < 10:
            store.key_value_set(f"{multihost.ALIVE}/2", str(beat), True)
        time.sleep(0.05)
        if lost:
            break
    multihost.Liveness._stop.set()
    watch.join(timeout=5)
    assert [p for p, _ in lost] == [2], lost
    assert 0.6 < lost[0][1] < 1.5 and time.monotonic() - t0 < 2.0
