"""The op benches' device-side timing (bench/profile.py's device_seconds, used by
bench/kernels.py and bench/fp8_matmul.py): the arithmetic of its busy time (the profiled
timing itself needs a GPU; off it, rows carry the host clock only)."""
import jax
import pytest

from bench.profile import busy_seconds, device_seconds


def test_busy_seconds_sums_every_event_per_call():
    events = [{"name": "jaxinfer_paged_decode", "dur": 40.0},
              {"name": "jaxinfer_paged_decode_combine", "dur": 2.5},
              {"name": "MemcpyD2D", "dur": 1.5}, {"name": "jaxinfer_paged_decode", "dur": 44.0}]
    assert busy_seconds(events, 2) == pytest.approx(44e-6)


@pytest.mark.parametrize("events, calls", [([], 3), ([{"dur": 1.0}], 0)])
def test_busy_seconds_refuses_an_empty_trace(events, calls):
    with pytest.raises(ValueError):
        busy_seconds(events, calls)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU's answer")
def test_no_device_time_off_the_gpu():
    calls = []
    assert device_seconds(lambda: calls.append(1), 3) is None
    assert calls == [], "off the GPU nothing is run for a device time"


def test_attention_rows_keep_the_host_clock_off_the_gpu(monkeypatch):
    """bench.kernels' rows run end to end on the XLA reference: host-clock keys always,
    device keys only where a device time exists (never on the CPU)."""
    from bench import kernels

    monkeypatch.setattr(kernels, "TOUCH_BYTES", 1)   # two page-table sets, not 64: quick
    key = jax.random.PRNGKey(0)
    (bf16,) = kernels.bench_attention(1, 512, False, key, ["xla_reference"])
    (fp8,) = kernels.bench_attention(1, 512, True, key, ["xla_reference"], bf16)
    for row in (bf16, fp8):
        assert row["us"] > 0 and row["TBps"] >= 0 and "error" not in row
        if jax.default_backend() != "gpu":
            assert not any(k.endswith("_device") for k in row), row


@pytest.mark.parametrize("page", [16, 64, 128])
def test_attention_case_at_a_page_size(page, monkeypatch):
    """bench.kernels' case at another page size (bench/probes/page_size.py): pages of `page`
    tokens, page tables that cover the context with pages no two rows share, and blocks of
    at least one page."""
    import numpy as np
    from bench import kernels

    monkeypatch.setattr(kernels, "TOUCH_BYTES", 1)   # two page-table sets, not 64: quick
    _, k, v, _, tables, _ = kernels.make_case(2, 256, False, jax.random.PRNGKey(0), page=page)
    assert k.shape[3] == v.shape[3] == page and tables.shape[2] == 256 // page
    ids = np.asarray(tables).ravel()
    assert len(set(ids.tolist())) == ids.size and ids.min() >= 1 and ids.max() < k.shape[2]
    assert kernels.tuned_blocks(2, 256, False, page=page).block_tokens >= page


def test_ragged_prefill_probe_runs_and_checks_each_variant(tmp_path):
    """bench/probes/ragged_prefill.py on the CPU (small case, interpret mode): one row per
    variant, its output checked against the reference, the causal pair count that its
    TFLOP/s rests on, and the result's command and git."""
    import json

    from bench.probes import ragged_prefill as rp
    q, _, md, pairs = rp.make_case(((3, 5), (0, 4)), True, jax.random.PRNGKey(1))
    assert q.shape[0] == 9 and md.positions.tolist() == [3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert pairs == sum(p + 1 for p in md.positions.tolist())
    out = tmp_path / "r.json"
    rp.main(["--variants", "tuned;4,16,4,2,f16pairs,0,1", "--kv", "fp8", "--cases", "pair",
             "--rounds", "1", "--out", str(out)])
    res = json.loads(out.read_text())
    assert [r["variant"] for r in res["rows"]] == ["tuned", "4,16,4,2,f16pairs,0,1"]
    assert all(r["max_abs_err"] < 2e-2 for r in res["rows"])
    assert "heavy_first=True" in res["rows"][1]["blocks"]
    assert res["command"].startswith("python -m bench.probes.ragged_prefill") and res["git"]


def test_grid_barrier_probe_counts_every_arrival(tmp_path):
    """bench/probes/grid_barrier.py on the CPU: one program (interpret mode runs programs one
    after another, so more would only spin out) passes its barriers at once; the counter
    holds one arrival per barrier and none is missed, with either way of spinning."""
    import json

    from bench.probes import grid_barrier as gb
    cnt, missed = gb.barrier_run(1, 4, "volatile", interpret=True)
    assert int(cnt[0]) == 4 and int(missed.sum()) == 0
    out = tmp_path / "b.json"
    gb.main(["--programs", "1,2", "--barriers", "0,3", "--spin", "atomic,volatile",
             "--chain", "3", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    one = [r for r in rows if r["spin"] != "chain" and r["programs"] == 1]
    assert [(r["spin"], r["barriers"], r["counter"], r["missed"]) for r in one] == [
        ("atomic", 0, 0, 0), ("atomic", 3, 3, 0), ("volatile", 0, 0, 0), ("volatile", 3, 3, 0)]
    # two programs in turn: the first spins out its barrier (counted as missed)
    two = [r for r in rows if r["spin"] == "atomic" and r["programs"] == 2]
    assert two[1]["counter"] == 6 and two[1]["missed"] >= 1
    # the chain: 3 kernels of 1 and of 2 programs, every program's add counted
    assert [(r["programs"], r["counter"]) for r in rows if r["spin"] == "chain"] == [(1, 3), (2, 6)]


def test_cudnn_prefill_route_matches_the_reference():
    """bench/probes/cudnn_prefill.py's two-part route (chunk against its cached prefix, chunk
    against itself causally, merged by log-sum-exp) on the CPU with XLA's attention: a row
    with a prefix, one without, and rows padded past their chunks, FP8 and bf16 KV."""
    import jax.numpy as jnp

    from bench.probes import cudnn_prefill as cp
    from bench.probes.ragged_prefill import make_case
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
    for fp8 in (True, False):
        q, (k, v, ks, vs), md, _ = make_case(((21, 7), (0, 12), (5, 1)), fp8,
                                             jax.random.PRNGKey(2))
        out = cp.cudnn_route(q, k, v, ks, vs, md, rows=3, width=16,
                             prefix_width=md.page_table.shape[1] * cp.PAGE,
                             implementation="xla", sm_scale=cp.D ** -0.5)
        ref = ragged_paged_attention_reference(q, k, v, 0, md, ks, vs, sm_scale=cp.D ** -0.5)
        err = jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)))
        assert out.shape == q.shape and float(err) < 2e-2, (fp8, float(err))


def test_kv_scales_probe_drops_only_the_scales():
    """bench/probes/kv_scales.py: the kernel traced as it is matches the reference; traced
    with its scale refs dropped it computes without the scales (the reference over a cache
    whose scales are all 1), so the bound times the kernel minus the scale work only."""
    import jax.numpy as jnp

    from bench.kernels import make_case
    from bench.probes import kv_scales
    from pallas_kernels.paged_attention import paged_attention_reference
    q, k, v, (ks, vs), tables, lens = make_case(2, 64, True, jax.random.PRNGKey(3))
    case = (q, k, v, (ks, vs), tables, lens)
    got = {drop: kv_scales.compiled(2, 64, True, case, drop)(q, k, v, ks, vs, tables[0], lens)
           for drop in (False, True)}
    ones = jnp.ones_like(ks)
    for drop, scales in ((False, (ks, vs)), (True, (ones, ones))):
        ref = paged_attention_reference(q, k, v, 0, lens, tables[0], *scales,
                                         sm_scale=128 ** -0.5)
        rel = jnp.linalg.norm((got[drop] - ref).astype(jnp.float32)) / jnp.linalg.norm(
            ref.astype(jnp.float32))
        assert float(rel) < 1e-2, (drop, float(rel))


def test_write_probe_records_the_command_and_extra_keys(tmp_path, monkeypatch):
    """bench.probes.write_probe: the command from main's argv (or the process's), `--git`
    kept as given, extra keys before the rows."""
    import json
    import sys

    from bench.probes import write_probe
    out = tmp_path / "p.json"
    write_probe(str(out), "kv_scales", "abc123", ["--rounds", "2"], [{"x": 1}], note="n")
    res = json.loads(out.read_text())
    assert res["command"] == "python -m bench.probes.kv_scales --rounds 2"
    assert (res["git"], res["note"], res["rows"]) == ("abc123", "n", [{"x": 1}])
    assert list(res)[-1] == "rows" and res["date"] and res["jax"]
    monkeypatch.setattr(sys, "argv", ["kv_scales.py", "--shapes", "1x64"])
    write_probe(str(out), "kv_scales", None, None, [])
    res = json.loads(out.read_text())
    assert res["command"] == "python -m bench.probes.kv_scales --shapes 1x64" and res["git"]
