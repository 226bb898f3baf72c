"""Several processes, one model: JAX's multi-controller runtime (`jax.distributed`).

Every process loads the model with the same EngineConfig; the tensor-parallel mesh spans every
process's devices (sharding.make_layout over jax.devices()), and each step is one SPMD program
that every process must run, in the same order, with the same inputs. Process 0, the leader,
runs the scheduler and the front ends; each other process, a follower, runs `follow`: its
ModelRunner repeats the leader's runner calls (`RunnerMirror`) as the leader sends them.

The messages travel through the coordination service's key-value store (the one
jax.distributed already runs for its own bookkeeping: no other channel or port), one key per
message in order: a step's host input (its packed StepInput as named numpy arrays, never
pickled; the tokens a step takes from the previous step's device output are named by that
step's number, each follower holding the same outputs), page copies, warm-ups and KV-cache
rebuilds. Keys older than WINDOW messages are deleted: followers run every step with the
leader (its collectives wait for them), so none lags that far.

A lost process ends the job loudly (`Liveness`): every follower bumps a counter in the same
store every BEAT_S, and the leader's watchdog declares a follower lost when its counter has
not moved for half the heartbeat timeout, before JAX's own failure handling aborts the leader.
It logs which process was lost, runs the `on_lost` hooks (the server turns NOT_SERVING) and,
LOST_GRACE_S later, exits the process with status 1: a job missing a process cannot run
another step. A step that fails first (a collective sees the dead peer) takes the server's
own failure path, which asks `name_lost` which follower went silent and leaves through
`exit_now`.
"""
from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import threading
import time
from typing import Callable

import jax
import numpy as np

from jaxinfer import sampling
from jaxinfer.kv_cache import AttentionMetadata
from jaxinfer.step_input import StepInput

log = logging.getLogger("jaxinfer.multihost")

PREFIX = "jaxinfer/runner"
WINDOW = 256               # messages kept in the store
RECV_TIMEOUT_MS = 60_000   # a follower's wait per try (it waits again while the leader idles)
_CLASSES = {c.__name__: c for c in (AttentionMetadata, sampling.SamplingArrays)}


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """jax.distributed.initialize's settings; all None: its own cluster detection (SLURM,
    Open MPI, ...)."""

    coordinator_address: str | None = None   # host:port of process 0's coordination service
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_timeout_s: int = 30            # a process silent this long is declared dead


def initialize(cfg: DistributedConfig) -> None:
    """Join the processes of one job (once per process, before any other JAX call). On CPUs
    the collectives run over gloo."""
    if jax.distributed.is_initialized():
        return
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except AttributeError:      # a jax without the option
        pass
    jax.distributed.initialize(cfg.coordinator_address, cfg.num_processes, cfg.process_id,
                               heartbeat_timeout_seconds=cfg.heartbeat_timeout_s)
    log.info("process %d of %d: %d local of %d devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())


def join(cfg: DistributedConfig) -> bool:
    """initialize, then whether this process leads (process 0); in a job of several
    processes the liveness checks start (Liveness)."""
    initialize(cfg)
    if jax.process_count() > 1:
        Liveness.start(max(2.0, cfg.heartbeat_timeout_s / 2))
    return jax.process_index() == 0


ALIVE = "jaxinfer/alive"
BEAT_S = 0.5          # how often a follower proves it is alive
LOST_GRACE_S = 2.0    # from reporting a lost process to exiting: health probes see it
_on_lost: list[Callable[[int], None]] = []


def on_lost(hook: Callable[[int], None]) -> None:
    """Run hook(process) on the leader when a follower is lost (from the watchdog's thread),
    before the process exits."""
    _on_lost.append(hook)


class Liveness:
    """The liveness checks of one process (module doc). Followers beat until `done`
    (their loop ended: a stopped job, not a lost process); the leader watches every
    follower until `done`."""

    _stop = threading.Event()

    @classmethod
    def start(cls, timeout_s: float) -> None:
        cls._stop.clear()
        me = jax.process_index()
        target = cls._watch if me == 0 else cls._beat
        threading.Thread(target=target, args=(_client(), me, timeout_s), daemon=True,
                         name="jaxinfer-liveness").start()

    @classmethod
    def done(cls) -> None:
        """Stop this process's checks; a follower tells the leader it ended on purpose."""
        cls._stop.set()
        if jax.process_count() > 1 and jax.process_index() > 0:
            _client().key_value_set(f"{ALIVE}/{jax.process_index()}", "done", True)

    @classmethod
    def _beat(cls, client, me: int, _timeout_s: float) -> None:
        count = 0
        while not cls._stop.wait(BEAT_S):
            count += 1
            try:
                client.key_value_set(f"{ALIVE}/{me}", str(count), True)
            except Exception:        # the leader is gone: JAX's own checks end this process
                return

    @classmethod
    def _watch(cls, client, _me: int, timeout_s: float) -> None:
        start = time.monotonic()
        last = {p: (None, start) for p in range(1, jax.process_count())}
        while last and not cls._stop.wait(BEAT_S):
            now = time.monotonic()
            for p, (value, since) in list(last.items()):
                try:
                    got = client.key_value_try_get(f"{ALIVE}/{p}")
                except Exception:    # not there yet
                    got = None
                if got == "done":
                    del last[p]
                elif got != value:
                    last[p] = (got, now)
                elif now - since > timeout_s:
                    del last[p]
                    _lost(p, now - since)


def _lost(process: int, silent_s: float) -> None:
    log.critical("process %d of %d is lost (no sign of life for %.0f s): the job cannot run "
                 "another step; exiting", process, jax.process_count(), silent_s)
    for hook in _on_lost:
        try:
            hook(process)
        except Exception:
            log.exception("an on_lost hook failed")
    time.sleep(LOST_GRACE_S)
    exit_now(1)


def in_job() -> bool:
    """Whether this process is one of a job of several."""
    return jax.distributed.is_initialized() and jax.process_count() > 1


def name_lost(wait_s: float = LOST_GRACE_S) -> list[int]:
    """On the leader after a failed step: the followers whose liveness counter does not move
    over wait_s (logged as lost), those that ended on purpose left out."""
    client = _client()

    def read(p):
        try:
            return client.key_value_try_get(f"{ALIVE}/{p}")
        except Exception:
            return None
    before = {p: read(p) for p in range(1, jax.process_count())}
    time.sleep(wait_s)
    lost = [p for p, v in before.items() if v != "done" and read(p) == v]
    for p in lost:
        log.critical("process %d of %d is lost (no sign of life for %.0f s since the step "
                     "failed)", p, jax.process_count(), wait_s)
    return lost


def exit_now(status: int) -> None:
    """End a process of a job at once: the interpreter's own exit would first wait in JAX's
    shutdown barrier for every process, lost ones included, until the heartbeat timeout."""
    logging.shutdown()
    os._exit(status)


def _client():
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return client


COMPILE_BARRIER_S = 3600    # how long a process waits for the others to finish compiling


def barrier(name: str, timeout_s: float = COMPILE_BARRIER_S) -> None:
    """Wait until every process of the job reaches `name` (a no-op on one process). Before
    its first run a newly compiled program waits here: processes compile at their own speed,
    and a collective's peers wait only seconds for each other."""
    if jax.process_count() > 1:
        _client().wait_at_barrier(name, int(timeout_s * 1000))


def encode(kind: str, header: dict, arrays: dict[str, np.ndarray]) -> bytes:
    """One message: a JSON header and named numpy arrays (np.savez, no pickles)."""
    buf = io.BytesIO()
    text = json.dumps({"kind": kind, **header}, default=lambda o: o.item())  # numpy scalars
    np.savez(buf, __header__=np.frombuffer(text.encode(), np.uint8), **arrays)
    return buf.getvalue()


def decode(data: bytes) -> tuple[str, dict, dict[str, np.ndarray]]:
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    header = json.loads(arrays.pop("__header__").tobytes())
    return header.pop("kind"), header, arrays


def _flatten(obj, prefix: str, header: dict, arrays: dict) -> None:
    for f in dataclasses.fields(obj):
        v, key = getattr(obj, f.name), prefix + f.name
        if dataclasses.is_dataclass(v):
            header[key] = {"class": type(v).__name__}
            _flatten(v, key + ".", header, arrays)
        elif v is None or isinstance(v, (bool, int, float, str)):
            header[key] = v
        else:
            arrays[key] = np.asarray(v)


def _build(cls, prefix: str, header: dict, arrays: dict):
    kw = {}
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if key in arrays:
            kw[f.name] = arrays[key]
        elif isinstance(header.get(key), dict):
            kw[f.name] = _build(_CLASSES[header[key]["class"]], key + ".", header, arrays)
        else:
            kw[f.name] = header.get(key)
    return cls(**kw)


def step_message(inp: StepInput, prev_step: int | None) -> bytes:
    """A step's host input; `prev_step`: the step whose output holds its pending tokens
    (None: none, the runner's zeros)."""
    mask = inp.token_bitmask
    header = {"prev_step": prev_step,
              "all_allowed": None if mask is None or isinstance(mask, np.ndarray)
              else list(mask.shape)}
    arrays: dict = {}
    _flatten(dataclasses.replace(inp, prev_tokens=None,
                                 token_bitmask=mask if isinstance(mask, np.ndarray) else None),
             "", header, arrays)
    return encode("step", header, arrays)


def step_input(header: dict, arrays: dict, prev_tokens) -> StepInput:
    """The StepInput of a step message, `prev_tokens` on the device."""
    from jaxinfer.step_input import all_allowed
    inp = _build(StepInput, "", header, arrays)
    mask = inp.token_bitmask
    if header["all_allowed"] is not None:
        rows, words = header["all_allowed"]
        mask = all_allowed(rows, words * 32)
    return dataclasses.replace(inp, prev_tokens=prev_tokens, token_bitmask=mask)


class Channel:
    """Ordered messages from the leader to every follower (module doc)."""

    def __init__(self, prefix: str = PREFIX):
        self._client, self._prefix, self._next = _client(), prefix, 0

    def send(self, data: bytes) -> None:
        self._client.key_value_set_bytes(f"{self._prefix}/{self._next}", data)
        old = self._next - WINDOW
        if old >= 0:
            self._client.key_value_delete(f"{self._prefix}/{old}")
        self._next += 1

    def recv(self) -> bytes:
        """The next message (waits for it as long as it takes)."""
        key = f"{self._prefix}/{self._next}"
        while True:
            try:
                data = self._client.blocking_key_value_get_bytes(key, RECV_TIMEOUT_MS)
                break
            except Exception as e:      # a timeout: the leader is idle; anything else: raise
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
        self._next += 1
        return data


class RunnerMirror:
    """The leader's side: ModelRunner sends each call the followers must repeat."""

    def __init__(self, channel: Channel | None = None):
        self.channel = channel or Channel()

    def step(self, inp: StepInput, prev_step: int | None) -> None:
        self.channel.send(step_message(inp, prev_step))

    def call(self, kind: str, header: dict | None = None, **arrays) -> None:
        self.channel.send(encode(kind, header or {}, arrays))

    def stop(self) -> None:
        """Release the followers (`follow` returns); the leader stops watching them."""
        self.call("stop")
        Liveness.done()

    def pause(self) -> None:
        """Let the followers return from `follow(..., until_pause=True)`."""
        self.call("pause")


def follow(runner, buckets, channel: Channel | None = None, until_pause: bool = False
           ) -> str:
    """A follower's loop: repeat the leader's runner calls until it says stop (or pause,
    with until_pause). Returns the message that ended it."""
    channel = channel or Channel()
    outputs: dict[int, object] = {}     # step number -> its next_tokens, recent ones
    while True:
        kind, header, arrays = decode(channel.recv())
        if kind == "step":
            prev = header["prev_step"]
            inp = step_input(header, arrays,
                             runner.no_prev if prev is None else outputs[prev])
            _, next_tokens = runner.submit(inp)
            outputs[runner.num_steps] = next_tokens
            outputs.pop(runner.num_steps - 8, None)
        elif kind == "copy":
            runner.copy_pages([tuple(p) for p in arrays["pairs"].tolist()])
        elif kind == "warmup":
            runner.warmup(buckets, variants=tuple(header["variants"]))
        elif kind == "rebuild":
            runner.rebuild_kv()
        elif kind in ("stop", "pause"):
            if kind == "stop" or until_pause:
                return kind
        else:
            raise RuntimeError(f"unknown message {kind!r} from the leader")
