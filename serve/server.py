"""The server process: the gRPC service (Inference + grpc.health.v1 Health + reflection) on one
port, the OpenAI-compatible HTTP API (serve/openai_http.py) on another, Prometheus metrics on
a third, the engine on its own thread shared by both front ends. Either front end can be off.

Lifecycle: the ports open at once with health NOT_SERVING (gRPC Generate answers UNAVAILABLE,
HTTP 503) while the engine thread loads the weights and compiles every bucket; then SERVING.
On SIGTERM or SIGINT: health NOT_SERVING, new requests UNAVAILABLE / 503, in-flight requests
get `grace_period_s` to finish (the rest are cancelled and told so), then the process exits 0.
In a job of several processes, a lost follower (multihost.Liveness, or a step that fails)
turns health NOT_SERVING, is named in the log, and the process exits 1 moments later.

    python -m serve.cli --model tiny --port 50051 --http-port 8000   # = `jaxinfer serve`
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
from pathlib import Path
from typing import Callable

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from serve import jaxinfer_pb2 as pb
from serve.admission import Admission
from serve.auth import BearerTokenInterceptor
from jaxinfer import multihost
from jaxinfer.engine_thread import EngineThread
from serve.metrics import Metrics, StepObserver
from serve.openai_http import HttpSettings, build_app, metrics_app
from serve.service import InferenceService, add_to_server

log = logging.getLogger("jaxinfer.serve")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int | None = 50051           # gRPC; 0: any free port (logged); None: no gRPC
    http_port: int | None = None       # the OpenAI HTTP API; 0: any free port; None: off
    metrics_port: int | None = None    # None: no metrics endpoint; 0: any free port
    metrics_host: str = "127.0.0.1"
    metrics_auth: bool = False         # the metrics port requires auth_token too
    served_model_name: str | None = None  # the HTTP API's model name (default: --model)
    max_waiting: int = 256             # waiting requests beyond this get RESOURCE_EXHAUSTED
    auth_token: str | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    max_message_bytes: int = 4 << 20
    grace_period_s: float = 30.0
    log_prompts: bool = False
    # LoRA adapters loaded and unloaded while serving (HTTP /v1/load_lora_adapter, gRPC
    # LoadLoRAAdapter): off unless asked for, since a load reads a path on this machine.
    allow_runtime_lora: bool = False


def _build(cfg: ServeConfig, service, health_servicer) -> tuple[grpc.aio.Server, int]:
    interceptors = [BearerTokenInterceptor(cfg.auth_token)] if cfg.auth_token else []
    server = grpc.aio.server(interceptors=interceptors, options=[
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.max_send_message_length", cfg.max_message_bytes)])
    add_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{cfg.host}:{cfg.port}"
    if cfg.tls_cert:
        creds = grpc.ssl_server_credentials([(cfg.tls_key.read_bytes(),
                                              cfg.tls_cert.read_bytes())])
        return server, server.add_secure_port(address, creds)
    return server, server.add_insecure_port(address)


class _Uvicorn(uvicorn.Server):
    """uvicorn inside our event loop: the process's signal handlers stay ours (the drain)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def _start_http(app, host: str, port: int, cert=None, key=None):
    """Serve an ASGI app on host:port (0: any free port); returns (server, task, port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False,
                            lifespan="off", timeout_graceful_shutdown=5,
                            ssl_certfile=str(cert) if cert else None,
                            ssl_keyfile=str(key) if key else None)
    server = _Uvicorn(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()   # raises what stopped it
            raise RuntimeError(f"the HTTP server on {host}:{port} did not start")
        await asyncio.sleep(0.01)
    return server, task, sock.getsockname()[1]


async def _stop_http(started) -> None:
    if started is not None:
        server, task, _ = started
        server.should_exit = True
        await task


async def _set_health(servicer, status) -> None:
    for name in ("", SERVICE_NAME):
        await servicer.set(name, status)


async def _until_ready(engine: EngineThread, stop: asyncio.Event) -> bool:
    """Wait for the engine to load (polling: a thread blocked on it would hold up exit)."""
    while not engine.ready.is_set() and not stop.is_set():
        await asyncio.sleep(0.05)
    return engine.ready.is_set()


async def _drain(cfg: ServeConfig, admission: Admission, health_servicer) -> None:
    admission.draining = True
    if health_servicer is not None:
        await health_servicer.enter_graceful_shutdown()
    log.info("draining: %d requests in flight, %.1f s grace", admission.num_active,
             cfg.grace_period_s)
    try:
        await asyncio.wait_for(admission.idle.wait(), cfg.grace_period_s)
    except asyncio.TimeoutError:
        log.warning("grace period over: cancelling %d requests", admission.num_active)
        admission.abort_all()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(admission.idle.wait(), 5.0)


def _port(started) -> str:
    return "off" if started is None else str(started if isinstance(started, int) else started[2])


async def serve(cfg: ServeConfig, make_engine: Callable[[], object]) -> int:
    """Run until SIGTERM/SIGINT; returns the exit status (0 after a clean drain)."""
    metrics = Metrics()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    engine = EngineThread(make_engine, cfg.max_waiting,
                          on_ready=lambda e: StepObserver(metrics, e),
                          on_exit=lambda: loop.call_soon_threadsafe(stop.set))
    admission = Admission(engine, metrics)
    grpc_server = health_servicer = grpc_port = None
    if cfg.port is not None:
        health_servicer = health.aio.HealthServicer()
        grpc_server, grpc_port = _build(cfg, InferenceService(admission, cfg.log_prompts,
                                                                 cfg.allow_runtime_lora),
                                        health_servicer)
        await _set_health(health_servicer, _NOT_SERVING)
        await grpc_server.start()
    http = metrics_http = None
    if cfg.http_port is not None:
        http = await _start_http(
            build_app(admission, HttpSettings(cfg.served_model_name, cfg.auth_token,
                                              cfg.max_message_bytes, cfg.log_prompts,
                                              cfg.allow_runtime_lora)),
            cfg.host, cfg.http_port, cfg.tls_cert, cfg.tls_key)
    if cfg.metrics_port is not None:
        metrics_http = await _start_http(
            metrics_app(metrics.registry, cfg.auth_token if cfg.metrics_auth else None),
            cfg.metrics_host, cfg.metrics_port)
    log.info("listening on %s: grpc port %s, http port %s, metrics port %s (%s)", cfg.host,
             _port(grpc_port), _port(http), _port(metrics_http),
             "tls" if cfg.tls_cert else "insecure")
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def lost() -> None:     # a job's follower is lost: the process exits soon
        admission.draining = True
        if health_servicer is not None:
            asyncio.ensure_future(_set_health(health_servicer, _NOT_SERVING))
    if multihost.in_job():
        multihost.on_lost(lambda process: loop.call_soon_threadsafe(lost))
    engine.start()
    status = 0
    if await _until_ready(engine, stop):
        if engine.error is not None:
            log.error("could not load the model: %s", engine.error)
            stop.set()
            status = 1
        else:
            if health_servicer is not None:
                await _set_health(health_servicer, _SERVING)
            log.info("serving %s", cfg.served_model_name or engine.engine.model_name)
    await stop.wait()
    if engine.ready.is_set() and engine.error is not None and status == 0:
        # The engine failed beyond recovery: not serving; exit non-zero for a supervisor.
        log.critical("the engine failed: %s; exiting", engine.error)
        if health_servicer is not None:
            await _set_health(health_servicer, _NOT_SERVING)
        status = 1
        if multihost.in_job():   # most likely a process was lost: name it, NOT_SERVING
            await loop.run_in_executor(None, multihost.name_lost)
    await _drain(cfg, admission, health_servicer)
    if grpc_server is not None:
        await grpc_server.stop(grace=1.0)
    await _stop_http(http)
    await _stop_http(metrics_http)
    engine.stop(timeout=10.0 if engine.ready.is_set() else 0.0)
    log.info("stopped")
    if status != 0 and multihost.in_job():
        multihost.exit_now(status)
    if engine.alive:
        # Stopped while loading: interpreter teardown under a thread that is inside an XLA
        # compilation aborts the process (SIGABRT), so leave without waiting for it.
        logging.shutdown()
        os._exit(status)
    return status
