"""Start `python -m serve.cli` in a subprocess and find its ports (for tests and benches).

    with ServerProcess(["--model", "tiny", "--max-num-seqs", "4"]) as srv:
        srv.wait_serving(timeout=120)
        Client(srv.target) ...

The server binds port 0 (any free port) and logs the ports it got; output goes to a log file
(a pipe nobody reads would fill up and block the server). Teardown kills the process.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_LISTENING = re.compile(r"listening on (\S+): grpc port (\w+), http port (\w+), "
                        r"metrics port (\w+)")
ROOT = Path(__file__).resolve().parent.parent


class ServerProcess:
    def __init__(self, args: list[str], env: dict | None = None, log_path: Path | None = None,
                 module: str = "serve.cli"):
        """module: what `python -m` runs (one that ends in serve.cli.main)."""
        self.log_path = Path(log_path or tempfile.mkstemp(prefix="jaxinfer-serve-",
                                                          suffix=".log")[1])
        cmd = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", "0",
               "--metrics-port", "0", *args]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **(env or {})})
        self.port = self.http_port = self.metrics_port = None

    @property
    def target(self) -> str:
        """The gRPC target."""
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        """The HTTP API's base URL (with --http-port); the OpenAI client's is + '/v1'."""
        return f"http://127.0.0.1:{self.http_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_listening(self, timeout: float = 60.0) -> "ServerProcess":
        """Block until the gRPC port is open (health still NOT_SERVING while loading)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = _LISTENING.search(self.log())
            if m:
                self.port, self.http_port, self.metrics_port = (
                    None if g == "off" else int(g) for g in m.group(2, 3, 4))
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"server did not start (exit {self.proc.poll()}):\n{self.log()}")

    def wait_serving(self, timeout: float = 300.0, **client_kw) -> list[str]:
        """Poll health until SERVING; returns every status seen on the way. `client_kw`
        go to Client (tls_ca=... for a TLS server). Without gRPC: GET /health (200)."""
        from serve.client import Client

        if self.port is None and self.http_port is None:
            self.wait_listening()
        if self.port is None:
            return self._wait_http_ready(timeout)
        import grpc

        seen, deadline = [], time.monotonic() + timeout
        with Client(self.target, **client_kw) as c:
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    seen.append(c.health())
                except grpc.RpcError as e:
                    if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                        raise
                    # the server stopped listening, or cancelled the check as it stopped (a
                    # failed load drains, then exits): the loop sees it exit and the error
                    # below carries its log
                    time.sleep(0.1)
                    continue
                if seen[-1] == "SERVING":
                    return seen
                time.sleep(0.1)
        raise RuntimeError(self._not_ready("SERVING", timeout))

    def _wait_http_ready(self, timeout: float) -> list[str]:
        import urllib.error
        import urllib.request

        seen, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                urllib.request.urlopen(self.http_url + "/health", timeout=5)
                return [*seen, "SERVING"]
            except urllib.error.HTTPError as e:   # 503 while loading
                seen.append("NOT_SERVING" if e.code == 503 else str(e.code))
            time.sleep(0.1)
        raise RuntimeError(self._not_ready("ready", timeout))

    def _not_ready(self, what: str, timeout: float) -> str:
        status = self.proc.poll()
        why = (f"not {what} after {timeout} s" if status is None
               else f"exited with status {status} before it was {what}")
        return f"server {why}:\n{self.log()}"

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def shutdown(self, grace: float = 60.0) -> int | None:
        """SIGTERM (the server drains), then kill after `grace` seconds."""
        self.terminate()
        try:
            return self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            return self.stop()

    def stop(self, timeout: float = 10.0) -> int | None:
        """Kill the process if it is still alive; returns its exit status."""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
