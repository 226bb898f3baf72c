"""`jaxinfer bench ray_affinity`: engine replicas under Ray Serve (serve/ray_app.py), the
prefix cache's hit rate with jaxinfer's prefix-affinity router against Ray's default
(power-of-two-choices) router.

A chat workload: --systems system prompts of --system-chars characters, each followed by
--questions different user questions (--max-tokens greedy tokens each), interleaved and
sent --concurrency at a time through Ray's HTTP proxy with the official `openai` client, to
--replicas replicas of --model on a local Ray. Each router serves the workload on a fresh
application (empty caches). Per router: the hit rate over all replicas (prompt tokens found
in the prefix cache / prompt tokens admitted, each replica's totals read from its last
response's x-jaxinfer-prefix-cache-* headers), the requests each replica answered, how many
replicas each system prompt's requests reached, and requests/s.
"""
from __future__ import annotations

import concurrent.futures
import os
import socket
import time

import numpy as np

from bench.common import engine_config, new_result, print_table, save

KEYS = ["router", "replicas", "requests", "prefix_cache_hit_rate", "replicas_per_system",
        "requests_per_replica", "requests_per_s"]
_WORDS = ("model tokens cache answer question system prompt replica engine page batch step "
          "device memory kernel latency budget route prefix serve request user assistant").split()


def workload(systems: int, questions: int, chars: int, seed: int) -> list[tuple[int, list]]:
    """(system prompt index, chat messages) of every request, interleaved."""
    rng = np.random.default_rng(seed)
    prompts = []
    for s in range(systems):
        words = [f"You are assistant number {s}."]
        while sum(len(w) + 1 for w in words) < chars:
            words.append(str(rng.choice(_WORDS)))
        prompts.append(" ".join(words)[:chars])
    return [(s, [{"role": "system", "content": prompts[s]},
                 {"role": "user", "content": f"Question {q}: what is {q} plus {s}?"}])
            for q in range(questions) for s in range(systems)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_router(router: str, base_url: str, requests, args, engine_kwargs) -> dict:
    import openai
    from ray import serve

    from serve.ray_app import app
    serve.run(app({"model": args.model, "num_replicas": args.replicas, "router": router,
                   "num_cpus": args.num_cpus, **engine_kwargs}), name="jaxinfer",
              route_prefix="/")
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=600,
                           max_retries=0)

    def ask(item):
        system, messages = item
        raw = client.chat.completions.with_raw_response.create(
            model=args.model, messages=messages, max_tokens=args.max_tokens, temperature=0)
        raw.parse()
        h = raw.headers
        return (system, h["x-jaxinfer-replica"], int(h["x-jaxinfer-prefix-cache-hit-tokens"]),
                int(h["x-jaxinfer-prefix-cache-queried-tokens"]))

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        answers = list(pool.map(ask, requests))
    wall = time.perf_counter() - t0
    serve.delete("jaxinfer")
    totals: dict[str, tuple[int, int]] = {}
    for _, replica, hit, queried in answers:     # each replica's totals only grow
        old = totals.get(replica, (0, 0))
        totals[replica] = (max(old[0], hit), max(old[1], queried))
    per_system: dict[int, set] = {}
    for system, replica, _, _ in answers:
        per_system.setdefault(system, set()).add(replica)
    hit = sum(t[0] for t in totals.values())
    queried = sum(t[1] for t in totals.values())
    return {"router": router, "replicas": args.replicas, "requests": len(answers),
            "prefix_cache_hit_rate": round(hit / queried, 4) if queried else 0.0,
            "hit_tokens": hit, "queried_tokens": queried,
            "replicas_per_system": round(float(np.mean([len(r) for r in per_system.values()])),
                                         2),
            "requests_per_replica": sorted((sum(1 for a in answers if a[1] == r)
                                            for r in totals), reverse=True),
            "wall_s": round(wall, 3), "requests_per_s": round(len(answers) / wall, 3)}


def run(args) -> int:
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "120")
    import ray
    from ray import serve

    cfg = engine_config(args)
    engine_kwargs = {"max_num_seqs": cfg.max_num_seqs, "max_model_len": cfg.max_model_len,
                     "max_num_batched_tokens": cfg.max_num_batched_tokens,
                     "page_size": cfg.page_size, "dtype": cfg.dtype,
                     "enable_prefix_caching": cfg.enable_prefix_caching}
    requests = workload(args.systems, args.questions, args.system_chars, args.seed)
    result = new_result(args, model=args.model, ray=ray.__version__,
                        concurrency=args.concurrency, systems=args.systems,
                        questions=args.questions, system_chars=args.system_chars,
                        max_tokens=args.max_tokens, engine=engine_kwargs)
    ray.init(num_cpus=max(2, int(args.replicas * args.num_cpus) + 1),
             include_dashboard=False, log_to_driver=False)
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for router in ("prefix", "default"):
            save(result, args.out, [run_router(router, f"http://127.0.0.1:{port}", requests,
                                               args, engine_kwargs)])
    finally:
        serve.shutdown()
        ray.shutdown()
    rows = {r["router"]: r for r in result["rows"]}
    result["hit_rate_prefix_over_default"] = round(
        rows["prefix"]["prefix_cache_hit_rate"]
        / max(rows["default"]["prefix_cache_hit_rate"], 1e-9), 3)
    save(result, args.out)
    print_table(result["rows"], KEYS)
    return 0
