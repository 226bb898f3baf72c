"""The op benches' device-side timing (bench/profile.py's device_seconds, used by
bench/kernels.py and bench/fp8_matmul.py): the arithmetic of its busy time (the profiled
timing itself needs a GPU; off it, rows carry the host clock only)."""
import jax
import pytest

from bench.kernels import device_time_impl
from bench.profile import busy_seconds


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
    assert device_time_impl(lambda *a: a[0], None) is None
