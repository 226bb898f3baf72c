"""The gRPC server process: Inference + grpc.health.v1 Health + reflection on one port,
Prometheus metrics on another, the engine on its own thread.

Lifecycle: the port opens at once with health NOT_SERVING (Generate answers UNAVAILABLE) while
the engine thread loads the weights and compiles every bucket; then SERVING. On SIGTERM or
SIGINT: health NOT_SERVING, new requests UNAVAILABLE, in-flight requests get `grace_period_s`
to finish (the rest are cancelled and told so), then the process exits 0.

    python -m serve.cli --model tiny --port 50051     # same flags as `jaxinfer serve`
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from serve import jaxinfer_pb2 as pb
from serve import jaxinfer_pb2_grpc as pb_grpc
from serve.auth import BearerTokenInterceptor
from serve.engine_thread import EngineThread
from serve.metrics import Metrics, StepObserver
from serve.service import InferenceService

log = logging.getLogger("jaxinfer.serve")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 50051                  # 0: any free port (logged)
    metrics_port: int | None = None    # None: no metrics endpoint; 0: any free port
    max_waiting: int = 256             # waiting requests beyond this get RESOURCE_EXHAUSTED
    auth_token: str | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    max_message_bytes: int = 4 << 20
    grace_period_s: float = 30.0
    log_prompts: bool = False


def _build(cfg: ServeConfig, service, health_servicer) -> tuple[grpc.aio.Server, int]:
    interceptors = [BearerTokenInterceptor(cfg.auth_token)] if cfg.auth_token else []
    server = grpc.aio.server(interceptors=interceptors, options=[
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.max_send_message_length", cfg.max_message_bytes)])
    pb_grpc.add_InferenceServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{cfg.host}:{cfg.port}"
    if cfg.tls_cert:
        creds = grpc.ssl_server_credentials([(cfg.tls_key.read_bytes(),
                                              cfg.tls_cert.read_bytes())])
        return server, server.add_secure_port(address, creds)
    return server, server.add_insecure_port(address)


def _start_metrics(cfg: ServeConfig, metrics: Metrics) -> int | None:
    if cfg.metrics_port is None:
        return None
    from prometheus_client import start_http_server

    started = start_http_server(cfg.metrics_port, addr=cfg.host, registry=metrics.registry)
    return started[0].server_port if isinstance(started, tuple) else cfg.metrics_port


async def _set_health(servicer, status) -> None:
    for name in ("", SERVICE_NAME):
        await servicer.set(name, status)


async def _until_ready(engine: EngineThread, stop: asyncio.Event) -> bool:
    """Wait for the engine to load (polling: a thread blocked on it would hold up exit)."""
    while not engine.ready.is_set() and not stop.is_set():
        await asyncio.sleep(0.05)
    return engine.ready.is_set()


async def _drain(cfg: ServeConfig, server, service: InferenceService, health_servicer) -> None:
    service.draining = True
    await health_servicer.enter_graceful_shutdown()
    log.info("draining: %d requests in flight, %.1f s grace", service.num_active,
             cfg.grace_period_s)
    try:
        await asyncio.wait_for(service.idle.wait(), cfg.grace_period_s)
    except asyncio.TimeoutError:
        log.warning("grace period over: cancelling %d requests", service.num_active)
        service.abort_all()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(service.idle.wait(), 5.0)
    await server.stop(grace=1.0)


async def serve(cfg: ServeConfig, make_engine: Callable[[], object]) -> int:
    """Run until SIGTERM/SIGINT; returns the exit status (0 after a clean drain)."""
    metrics = Metrics()
    engine = EngineThread(make_engine, cfg.max_waiting,
                          on_ready=lambda e: StepObserver(metrics, e))
    service = InferenceService(engine, metrics, cfg.log_prompts)
    health_servicer = health.aio.HealthServicer()
    server, port = _build(cfg, service, health_servicer)
    await _set_health(health_servicer, _NOT_SERVING)
    await server.start()
    metrics_port = _start_metrics(cfg, metrics)
    log.info("listening on %s:%d (%s); metrics on port %s", cfg.host, port,
             "tls" if cfg.tls_cert else "insecure", metrics_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    engine.start()
    if await _until_ready(engine, stop):
        if engine.error is not None:
            log.error("could not load the model: %s", engine.error)
            await server.stop(grace=None)
            return 1
        await _set_health(health_servicer, _SERVING)
        log.info("serving %s", engine.engine.model_name)
    await stop.wait()
    await _drain(cfg, server, service, health_servicer)
    engine.stop(timeout=10.0 if engine.ready.is_set() else 0.0)
    log.info("stopped")
    if engine.alive:
        # Stopped while loading: interpreter teardown under a thread that is inside an XLA
        # compilation aborts the process (SIGABRT), so leave without waiting for it.
        logging.shutdown()
        os._exit(0)
    return 0

