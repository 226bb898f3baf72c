"""bench/serving.py's rules without a server: when a sweep counts as saturated, and each
workload's latency budget (the smoke test against a real server is in
tests/serve/test_serve.py)."""


def test_serving_bench_saturation_rule():
    """Long answers that keep up are not 'saturated' (their end-to-end latency is long at
    any rate, so counting it would stop a chat sweep at its first rate); completions falling
    behind the arrivals are."""
    from bench.serving import saturated, summarize

    def run(done_at):  # 19 requests sent 0.53 s apart at 2/s, 170 tokens each
        return [{"code": "OK", "sent": i * 0.53,
                 "times": [done_at(i) - 0.01 * (169 - k) for k in range(170)]}
                for i in range(19)]
    keeping_up = summarize("chat", 2.0, run(lambda i: i * 0.53 + 1.72))
    assert keeping_up["e2e_p99_ms"] > 500 and not saturated(keeping_up)
    behind = summarize("chat", 2.0, run(lambda i: 2.0 * (i + 1)))  # serial, 2 s each
    assert saturated(behind)
    short_ok = summarize("short", 8.0, [{"code": "OK", "sent": i / 8, "times": [i / 8 + 0.3]}
                                        for i in range(80)])
    assert not saturated(short_ok)


def test_serving_bench_budgets_per_workload():
    """Short: e2e p99 within 500 ms; chat: TTFT p99 within 500 ms and inter-token p99 within
    50 ms, however long the answers; any error disqualifies a rate."""
    from bench.serving import max_rate_under_budget, summarize

    def run(ttft, gap, n_tokens=100):   # 40 requests at 4/s
        return [{"code": "OK", "sent": i / 4,
                 "times": [i / 4 + ttft + gap * k for k in range(n_tokens)]} for i in range(40)]
    rows = [summarize("chat", 4.0, run(0.1, 0.03)),      # 3.1 s answers, within chat's budget
            summarize("chat", 8.0, run(0.1, 0.06)),      # inter-token 60 ms: over
            summarize("chat", 6.0, run(0.6, 0.01)),      # TTFT 600 ms: over
            summarize("short", 8.0, run(0.1, 0.003)),    # 0.4 s: within
            summarize("short", 16.0, run(0.1, 0.005))]   # 0.6 s: over
    assert max_rate_under_budget(rows, workload="chat") == 4.0
    assert max_rate_under_budget(rows) == 8.0
    failed = summarize("short", 4.0, run(0.1, 0.003)[:-1] + [{"code": "DEADLINE_EXCEEDED",
                                                              "sent": 9.0, "times": []}])
    assert max_rate_under_budget([failed]) is None
