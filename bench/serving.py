"""`jaxinfer bench serving`: online serving over gRPC and/or the OpenAI HTTP API (--protocol),
Poisson arrivals at a sweep of request rates, two workloads (token-id prompts, so any model
works; greedy, ignore_eos):
  short  prompts uniform in --prompt-len, answers in --answer-len (default 64-512, 4-40)
  chat   one shared system prompt (--chat-system-len, a prefix-cache hit after the first
         request) + a user turn (--chat-user-len), longer answers (--chat-answer-len)
Arrivals: exponential gaps at `rate` requests/s for --duration seconds. Per (workload, rate):
throughput (completed requests / span from first send to last token), goodput (requests with
e2e <= the budget / same span), output tokens/s, TTFT / inter-token latency / e2e p50 and
p99 as the client sees them, errors by status code, and from the server's metrics (when the
bench started it, or --metrics-target) its steps' mean wall time and host part, the host's
share of a step, and the decode-bandwidth and prefill-FLOP/s gauges. Top level:
`max_rate_p99_e2e_under_500ms`, the highest short-workload rate whose e2e p99 met the budget
with no errors (per protocol in `max_rate_by_protocol`), and `max_chat_rate_by_protocol`, the
chat workload's under its own budget (TTFT p99 <= 500 ms, inter-token p99 <= 50 ms). A workload's
sweep stops once the server is saturated (`saturated`): higher rates only queue more.

Over HTTP each request is a streamed POST /v1/completions with `return_token_ids` (token
ids: synthetic-weight models have no tokenizer, so no text), read with aiohttp. With
`--protocol both` the two sweeps run one after the other against the same server.

The server is started as a subprocess with the engine flags given (all buckets compiled
before any timing), or --target / --http-target name a running one.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.request

import grpc
import numpy as np

from bench.common import engine_argv, new_result, print_table, save
from serve import jaxinfer_pb2 as pb
from serve import jaxinfer_pb2_grpc as pb_grpc
from serve.client import auth_metadata, build_request, channel_credentials

E2E_BUDGET_MS = 500.0
CHAT_BUDGET_MS = {"ttft_p99_ms": 500.0, "itl_p99_ms": 50.0}   # the chat workload's own
KEYS = ["protocol", "workload", "rate", "num_requests", "throughput_rps", "goodput_rps",
        "output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
        "e2e_p50_ms", "e2e_p99_ms", "step_ms", "host_share", "padding", "errors"]


def make_requests(workload: str, args, n: int, vocab: int, rng) -> list[tuple[list[int], int]]:
    """[(prompt token ids, answer length)] for one (workload, rate) run."""
    def ids(k):
        return rng.integers(3, vocab, k).tolist()

    if workload == "short":
        return [(ids(rng.integers(args.prompt_len[0], args.prompt_len[1] + 1)),
                 int(rng.integers(args.answer_len[0], args.answer_len[1] + 1)))
                for _ in range(n)]
    system = np.random.default_rng(args.seed).integers(3, vocab, args.chat_system_len).tolist()
    return [(system + ids(rng.integers(args.chat_user_len[0], args.chat_user_len[1] + 1)),
             int(rng.integers(args.chat_answer_len[0], args.chat_answer_len[1] + 1)))
            for _ in range(n)]


async def one_request(stub, metadata, prompt, answer_len, timeout) -> dict:
    """Send one request; returns its send time, token arrival times and status."""
    req = build_request(prompt, {"max_tokens": answer_len, "temperature": 0.0,
                                 "ignore_eos": True})
    sent, times = time.perf_counter(), []
    try:
        async for resp in stub.Generate(req, timeout=timeout, metadata=metadata):
            now = time.perf_counter()
            times.extend([now] * len(resp.token_ids))
        return {"sent": sent, "times": times, "code": "OK"}
    except grpc.aio.AioRpcError as e:
        return {"sent": sent, "times": times, "code": e.code().name}


class HttpSender:
    """One streamed POST /v1/completions per request, over one aiohttp session."""

    def __init__(self, session, base_url: str, token: str | None):
        self.session, self.url = session, base_url + "/v1/completions"
        self.headers = {"authorization": f"Bearer {token}"} if token else {}

    async def __call__(self, prompt, answer_len, timeout) -> dict:
        import aiohttp

        body = {"prompt": prompt, "max_tokens": answer_len, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}
        sent, times = time.perf_counter(), []
        try:
            async with self.session.post(self.url, json=body, headers=self.headers,
                                         timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status != 200:
                    return {"sent": sent, "times": times, "code": f"HTTP_{resp.status}"}
                async for line in resp.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    now = time.perf_counter()
                    for choice in json.loads(line[6:])["choices"]:
                        times.extend([now] * len(choice.get("token_ids", ())))
            return {"sent": sent, "times": times, "code": "OK"}
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return {"sent": sent, "times": times, "code": type(e).__name__}


async def run_rate(send, requests, rate: float, rng, timeout: float) -> list[dict]:
    """Fire `requests` at Poisson arrival times of `rate` per second through `send(prompt,
    answer_len, timeout)`; wait for all."""
    gaps = rng.exponential(1.0 / rate, len(requests))
    start, tasks = time.perf_counter(), []
    for at, (prompt, n) in zip(np.cumsum(gaps) - gaps[0], requests):
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        tasks.append(asyncio.create_task(send(prompt, n, timeout)))
    return await asyncio.gather(*tasks)


def _pct(values, q) -> float | None:
    return round(float(np.percentile(values, q)) * 1e3, 2) if len(values) else None


def summarize(workload: str, rate: float, results: list[dict]) -> dict:
    ok = [r for r in results if r["code"] == "OK" and r["times"]]
    errors: dict[str, int] = {}
    for r in results:
        if r not in ok:
            errors[r["code"]] = errors.get(r["code"], 0) + 1
    ttft = [r["times"][0] - r["sent"] for r in ok]
    e2e = [r["times"][-1] - r["sent"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    span = (max(r["times"][-1] for r in ok) - min(r["sent"] for r in results)) if ok else 0.0
    per_s = (lambda k: round(k / span, 3)) if span > 0 else (lambda k: 0.0)
    sends = [r["sent"] for r in results]
    # The span the server needed beyond the arrivals, for a request of median length: what
    # "keeping up" allows. Saturation shows as completions falling behind it.
    keep_up = (max(sends) - min(sends)) + (float(np.median(e2e)) if e2e else 0.0)
    return {"workload": workload, "rate": rate, "num_requests": len(results),
            "keep_up_rps": round(len(ok) / keep_up, 3) if keep_up > 0 else 0.0,
            "throughput_rps": per_s(len(ok)),
            "goodput_rps": per_s(sum(e * 1e3 <= E2E_BUDGET_MS for e in e2e)),
            "output_tokens_per_s": per_s(sum(len(r["times"]) for r in ok)),
            "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
            "itl_p50_ms": _pct(itl, 50), "itl_p99_ms": _pct(itl, 99),
            "e2e_p50_ms": _pct(e2e, 50), "e2e_p99_ms": _pct(e2e, 99), "errors": errors}


def saturated(row: dict) -> bool:
    """The server fell behind the offered rate: completions per (arrival window + median e2e)
    under 80% of the rate (long answers alone do not count: their e2e is in the window);
    for the short workload, also with its p99 over the budget."""
    behind = row["keep_up_rps"] < 0.8 * row["rate"]
    if row["workload"] != "short":
        return behind
    p99 = row["e2e_p99_ms"]
    return behind and (p99 is None or p99 > E2E_BUDGET_MS)


def within_budget(row: dict) -> bool:
    """No errors, and the workload's budget met: short, e2e p99 <= E2E_BUDGET_MS; chat, TTFT
    p99 and inter-token p99 within CHAT_BUDGET_MS."""
    budget = {"e2e_p99_ms": E2E_BUDGET_MS} if row["workload"] == "short" else CHAT_BUDGET_MS
    return not row["errors"] and all(row[k] is not None and row[k] <= v
                                     for k, v in budget.items())


def max_rate_under_budget(rows: list[dict], protocol: str | None = None,
                          workload: str = "short") -> float | None:
    good = [r["rate"] for r in rows if r["workload"] == workload
            and protocol in (None, r.get("protocol")) and within_budget(r)]
    return max(good) if good else None


def server_metrics(address: str | None) -> dict | None:
    """The server's Prometheus samples by name (labelled ones as `name{label=value,...}`),
    or None without an address."""
    if address is None:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return {s.name + ("{%s}" % ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                      if s.labels else ""): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def step_fields(before: dict | None, after: dict | None) -> dict:
    """What the server's metrics say of the steps between two readings: their mean wall time
    and host part (jaxinfer_step_seconds / jaxinfer_step_host_seconds), the host's share, the
    share of the compiled shapes' tokens that were padding, the roofline gauges at the
    end, and the engine thread's time per step by part (`thread_ms`:
    jaxinfer_engine_thread_seconds; Engine.step is its `step`)."""
    if before is None or after is None:
        return {}

    def mean_ms(name):
        n = after[f"{name}_count"] - before[f"{name}_count"]
        return (after[f"{name}_sum"] - before[f"{name}_sum"]) / n * 1e3 if n else None

    step, host = mean_ms("jaxinfer_step_seconds"), mean_ms("jaxinfer_step_host_seconds")
    real, shaped = (after[k] - before[k] for k in ("jaxinfer_step_tokens_total",
                                                     "jaxinfer_step_bucket_tokens_total"))
    steps = int(after["jaxinfer_step_seconds_count"] - before["jaxinfer_step_seconds_count"])
    thread = {}
    for key, total in after.items():
        if key.startswith("jaxinfer_engine_thread_seconds_total{part=") and steps:
            part = key[len("jaxinfer_engine_thread_seconds_total{part="):-1]
            thread[part] = round((total - before.get(key, 0.0)) / steps * 1e3, 3)
    return {"steps": steps,
            "step_ms": None if step is None else round(step, 3),
            "host_ms": None if host is None else round(host, 3),
            "host_share": round(host / step, 3) if step and host is not None else None,
            "padding": round(1 - real / shaped, 3) if shaped else None,
            "decode_hbm_TBps": round(
                after["jaxinfer_decode_hbm_bandwidth_bytes_per_second"] / 1e12, 4),
            "prefill_TFLOPs": round(after["jaxinfer_prefill_flops_per_second"] / 1e12, 2),
            "thread_ms": thread}


async def _sweep_protocol(args, protocol: str, send, vocab: int, metrics: str | None,
                          result) -> None:
    rng = np.random.default_rng(args.seed)
    for workload, rates in (("short", args.rates), ("chat", args.chat_rates or args.rates)):
        # Warm the path (and, for chat, the shared prefix) outside the timing.
        await run_rate(send, make_requests(workload, args, 4, vocab, rng), 1e3, rng,
                       args.timeout)
        for rate in rates:
            n = max(1, int(rng.poisson(rate * args.duration)))
            reqs = make_requests(workload, args, n, vocab, rng)
            before = server_metrics(metrics)
            row = {"protocol": protocol, **summarize(workload, rate, await run_rate(
                send, reqs, rate, rng, args.timeout))}
            row.update(step_fields(before, server_metrics(metrics)))
            rows = result["rows"] + [row]
            result["max_rate_by_protocol"][protocol] = max_rate_under_budget(rows, protocol)
            result["max_rate_p99_e2e_under_500ms"] = result["max_rate_by_protocol"].get(
                "grpc", result["max_rate_by_protocol"][protocol])
            result["max_chat_rate_by_protocol"][protocol] = max_rate_under_budget(
                rows, protocol, "chat")
            save(result, args.out, [row])
            if saturated(row) and not args.no_early_stop:
                break


async def sweep(args, token, target: str | None, http_url: str | None,
                metrics: str | None, result: dict) -> None:
    protocols = ("grpc", "http") if args.protocol == "both" else (args.protocol,)
    creds = channel_credentials(args.tls_ca)
    options = [("grpc.max_receive_message_length", 64 << 20)]
    async with (grpc.aio.secure_channel(target, creds, options) if creds
                else grpc.aio.insecure_channel(target, options)) as channel:
        stub, metadata = pb_grpc.InferenceStub(channel), auth_metadata(token)
        info = await stub.ModelInfo(pb.ModelInfoRequest(), metadata=metadata, timeout=60)
        result.update(device=info.device, jax=info.jax_version, model=info.model,
                      engine={"max_num_seqs": info.max_num_seqs, "dtype": info.dtype,
                              "max_num_batched_tokens": info.max_num_batched_tokens,
                              "weights": info.weights_dtype, "kv_dtype": info.kv_dtype,
                              "max_model_len": info.context_length})
        if "grpc" in protocols:
            async def send(prompt, n, timeout):
                return await one_request(stub, metadata, prompt, n, timeout)

            await _sweep_protocol(args, "grpc", send, info.vocab_size, metrics, result)
    if "http" in protocols:
        import aiohttp

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await _sweep_protocol(args, "http", HttpSender(session, http_url, token),
                                  info.vocab_size, metrics, result)


def run(args) -> int:
    from serve.launcher import ServerProcess

    token = open(args.auth_token_file).read().strip() if args.auth_token_file else None
    result = new_result(args, e2e_budget_ms=E2E_BUDGET_MS, chat_budget_ms=CHAT_BUDGET_MS,
                        max_rate_p99_e2e_under_500ms=None, max_rate_by_protocol={},
                        max_chat_rate_by_protocol={})
    server = None
    if args.target is None:
        server = ServerProcess([*engine_argv(args), "--max-waiting", "100000",
                                *(["--http-port", "0"] if args.protocol != "grpc" else [])])
        print(f"starting the server (log: {server.log_path})", file=sys.stderr)
        server.wait_serving(timeout=1800)
    elif args.protocol != "grpc" and args.http_target is None:
        print("jaxinfer bench serving: --protocol http/both with --target needs --http-target",
              file=sys.stderr)
        return 2
    http_url = (server.http_url if server else
                args.http_target if "://" in (args.http_target or "://") else
                f"http://{args.http_target}")
    try:
        asyncio.run(sweep(args, token, args.target or server.target, http_url,
                          f"127.0.0.1:{server.metrics_port}" if server
                          else args.metrics_target, result))
    finally:
        if server is not None:
            server.shutdown()
    print_table(result["rows"], KEYS)
    print(f"max_rate_p99_e2e_under_500ms: {result['max_rate_by_protocol']}; chat under TTFT "
          f"p99 500 ms / ITL p99 50 ms: {result['max_chat_rate_by_protocol']}")
    return 0


def main(argv=None) -> int:
    """`python -m bench.serving ...`, the same as `jaxinfer bench serving ...`."""
    from bench import cli

    return cli.main(["serving", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
