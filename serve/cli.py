"""`jaxinfer serve` and `jaxinfer client`: argparse setup and the two commands.

Wired into jaxinfer/cli.py (`add_serve_arguments` + `run_serve`, `add_client_arguments` +
`run_client`); `python -m serve.cli ...` runs the same `serve` command without it.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from pathlib import Path

from jaxinfer.args import (add_distributed_args, add_engine_args, add_sampling_args,
                           engine_config_from_args, run_in_job, sampling_params_from_args)
from jaxinfer.engine import Engine
from jaxinfer.errors import ConfigError, JaxinferError
from serve.client import Client
from serve.server import ServeConfig, serve

TOKEN_ENV = "JAXINFER_AUTH_TOKEN"


def _token(args) -> str | None:
    """The bearer token: from --auth-token-file, else $JAXINFER_AUTH_TOKEN (never argv,
    where other users can read it). Fails closed: a file that cannot be read, or a file or
    variable holding no token, is a ConfigError, never "no authentication"."""
    if args.auth_token_file:
        try:
            token = Path(args.auth_token_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--auth-token-file {args.auth_token_file}: cannot read it "
                              f"({getattr(e, 'strerror', None) or e})") from None
        if not token:
            raise ConfigError(f"--auth-token-file {args.auth_token_file} holds no token "
                              f"(it is empty or only whitespace)")
        return token
    if TOKEN_ENV in os.environ:
        token = os.environ[TOKEN_ENV].strip()
        if not token:
            raise ConfigError(f"${TOKEN_ENV} is set but holds no token")
        return token
    return None


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    add_distributed_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: all)")
    g.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port)")
    g.add_argument("--no-grpc", action="store_true", help="serve no gRPC (HTTP only)")
    g.add_argument("--http-port", type=int, default=None,
                   help="serve the OpenAI-compatible HTTP API on this port (0: any free port; "
                        "default: off)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name the HTTP API answers to (default: --model)")
    g.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics over HTTP on this port (default: off)")
    g.add_argument("--metrics-host", default="127.0.0.1",
                   help="address the metrics port binds (0.0.0.0: all)")
    g.add_argument("--metrics-auth", action="store_true",
                   help="the metrics port requires the bearer token too")
    g.add_argument("--max-waiting", type=int, default=256,
                   help="requests waiting to be scheduled beyond this get RESOURCE_EXHAUSTED "
                        "(HTTP 429)")
    g.add_argument("--auth-token-file", default=None,
                   help=f"require 'authorization: Bearer <token>' with the token in this file "
                        f"(or in ${TOKEN_ENV})")
    g.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate chain (TLS)")
    g.add_argument("--tls-key", type=Path, default=None, help="PEM private key (TLS)")
    g.add_argument("--max-message-bytes", type=int, default=4 << 20,
                   help="largest gRPC message or HTTP request body")
    g.add_argument("--grace-period", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    g.add_argument("--log-prompts", action="store_true",
                   help="log prompts (off by default: prompts may hold private data)")
    g.add_argument("--allow-runtime-lora", action="store_true",
                   help="let clients load and unload LoRA adapters while serving (HTTP "
                        "/v1/load_lora_adapter, gRPC LoadLoRAAdapter; a load reads a path on "
                        "this machine, so keep the token on)")


def serve_config_from_args(args):
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    if args.max_waiting < 1:
        raise ConfigError(f"--max-waiting must be >= 1, got {args.max_waiting}")
    if args.no_grpc and args.http_port is None:
        raise ConfigError("--no-grpc leaves nothing to serve: add --http-port")
    token = _token(args)
    if args.metrics_auth and token is None:
        raise ConfigError("--metrics-auth needs a token: --auth-token-file or "
                          f"${TOKEN_ENV}")
    return ServeConfig(host=args.host, port=None if args.no_grpc else args.port,
                       http_port=args.http_port, served_model_name=args.served_model_name,
                       metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                       metrics_auth=args.metrics_auth,
                       max_waiting=args.max_waiting, auth_token=token,
                       tls_cert=args.tls_cert, tls_key=args.tls_key,
                       max_message_bytes=args.max_message_bytes,
                       grace_period_s=args.grace_period, log_prompts=args.log_prompts,
                       allow_runtime_lora=args.allow_runtime_lora)


def _engine_factory(args, on_engine=None):
    def make_engine():  # runs on the engine thread
        log = logging.getLogger("jaxinfer.serve")
        t0 = time.perf_counter()
        engine = Engine.from_model(args.model, engine_config_from_args(args), args.lora)
        if on_engine is not None:
            on_engine(engine)
        if args.warmup == "off":     # a server warms up unless told not to (auto: on)
            log.info("loaded %s in %.1f s; warm-up off (--warmup off): each step compiles "
                     "when it first runs; ready", args.model, time.perf_counter() - t0)
            return engine
        log.info("loaded %s in %.1f s; compiling %d buckets", args.model,
                 time.perf_counter() - t0, len(engine.buckets.all_buckets()))
        stats = engine.warmup(progress=False, on_done=lambda done, total: log.info(
            "compiled %d/%d step executables (%.1f s)", done, total, time.perf_counter() - t0))
        log.info("compiled %d buckets in %.1f s (%d compiled, %d from the compilation cache); "
                 "ready %.1f s after start", stats["buckets"], stats["seconds"],
                 stats["compiles"], stats["loaded_from_cache"], time.perf_counter() - t0)
        return engine

    return make_engine


def run_serve(args, on_engine=None) -> int:
    """Serve until SIGTERM; `on_engine(engine)` runs once the engine is built, before its
    warm-up (embedding: metrics, hooks)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(serve_config_from_args(args), _engine_factory(args, on_engine)))


def add_client_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="prompt text (or token ids with --token-ids: '1 15 27')")
    p.add_argument("--target", default="127.0.0.1:50051", help="server host:port")
    p.add_argument("--chat", action="store_true", help="send PROMPT as a user chat message")
    p.add_argument("--token-ids", action="store_true",
                   help="PROMPT is space-separated token ids (models without a tokenizer)")
    p.add_argument("--tls-ca", type=Path, default=None,
                   help="connect with TLS, trusting this PEM CA / self-signed certificate")
    p.add_argument("--auth-token-file", default=None,
                   help=f"bearer token file (or ${TOKEN_ENV})")
    p.add_argument("--timeout", type=float, default=None,
                   help="the request's deadline in seconds (one the server predicts it "
                        "cannot meet is refused at once)")
    p.add_argument("--priority", type=int, default=0,
                   help="the server's queue takes lower values first")
    p.add_argument("--ready-timeout", type=float, default=600.0,
                   help="seconds to wait for a server that is still starting (loading, "
                        "compiling) to report SERVING")
    add_sampling_args(p)


def run_client(args) -> int:
    """Stream the answer to stdout as it arrives; usage goes to stderr."""
    import grpc

    if args.token_ids:
        prompt = {"prompt_token_ids": [int(t) for t in args.prompt.split()]}
    else:
        prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    sampling = sampling_params_from_args(args)
    try:
        with Client(args.target, token=_token(args), tls_ca=args.tls_ca) as client:
            client.wait_until_ready(args.ready_timeout)   # a server still loading: wait
            for resp in client.generate(prompt, sampling, timeout=args.timeout,
                                        priority=args.priority):
                # Models without a tokenizer stream no text: show their token ids.
                sys.stdout.write("".join(f"{t} " for t in resp.token_ids) if args.token_ids
                                 else resp.text)
                sys.stdout.flush()
                if resp.finish_reason:
                    u = resp.usage
                    print(f"\n[{Client.finish_reason(resp)}: {u.prompt_tokens} prompt + "
                          f"{u.completion_tokens} completion tokens, TTFT {u.ttft_ms:.1f} ms, "
                          f"total {u.e2e_ms:.1f} ms]", file=sys.stderr)
    except grpc.RpcError as e:
        print(f"\njaxinfer client: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    return 0


def main(argv=None, on_engine=None) -> int:
    """`python -m serve.cli`: the server alone (= `jaxinfer serve`); on_engine: run_serve."""
    p = argparse.ArgumentParser(prog="python -m serve.cli",
                                description="Serve a model over gRPC and/or the OpenAI HTTP API "
                                            "(= `jaxinfer serve`).")
    add_serve_arguments(p)
    try:
        return run_in_job(p.parse_args(argv), lambda args: run_serve(args, on_engine))
    except JaxinferError as e:
        print(f"jaxinfer serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
