"""The op suites' device-side timing (bench/profile.py's device_seconds, used by
bench/paged_attention.py and bench/fp8_matmul.py): the arithmetic of its busy time (the
profiled timing itself needs a GPU; off it, rows carry the host clock only)."""
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


def test_attention_rows_keep_the_host_clock_off_the_gpu():
    """bench.paged_attention's rows on the XLA reference: host-clock keys always, device keys
    only where a device time exists (never on the CPU)."""
    from bench import paged_attention

    key = jax.random.PRNGKey(0)
    (bf16,) = paged_attention.bench_attention(1, 512, False, key, ["xla_reference"])
    (fp8,) = paged_attention.bench_attention(1, 512, True, key, ["xla_reference"], bf16)
    for row in (bf16, fp8):
        assert row["us"] > 0 and row["TBps"] >= 0 and "error" not in row
        if jax.default_backend() != "gpu":
            assert not any(k.endswith("_device") for k in row), row
