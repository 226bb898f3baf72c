"""The decode kernel's block rules (pallas_kernels/tuning.py): which blocks a grid gets. The
kernels' correctness under those blocks is tests/test_paged_attention.py's."""
import pytest

from jaxinfer.errors import ConfigError
from pallas_kernels import tuning
from pallas_kernels.tuning import DecodeBlocks


def test_one_wave_rule():
    """Unsplit FP8 grids of 265-528 programs take the one-wave blocks; fewer programs, more,
    split grids and bf16 KV keep the table's."""
    one_wave = DecodeBlocks(64, 1, 2, 3, "f16pairs", True)
    assert tuning.decode_blocks(64, 8, 2048, 16, 1, 128) == one_wave
    assert tuning.decode_blocks(48, 8, 4096, 16, 1, 128) == one_wave
    for batch in (33, 67, 256):                      # 264 and 536, 2048 programs
        assert tuning.decode_blocks(batch, 8, 2048, 16, 1, 128).num_warps == 4
    assert tuning.decode_blocks(32, 8, 2048, 16, 1, 128).num_splits == 2   # split: table's
    assert tuning.decode_blocks(32, 8, 2048, 16, 1, 128).num_warps == 4
    assert tuning.decode_blocks(64, 8, 2048, 16, 2, 128).num_warps == 4    # bf16 KV


def test_longest_first_window_setting(monkeypatch):
    """tuning.env_window: the program-count windows' environment overrides."""
    name = "JAXINFER_LONGEST_FIRST"
    monkeypatch.delenv(name, raising=False)
    assert tuning.env_window(name, "1,2") == (1, 2)
    monkeypatch.setenv(name, "265,2048")
    assert tuning.env_window(name, "1,2") == (265, 2048)
    for bad in ("0", "1,2,3", "a,b"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ConfigError, match="JAXINFER_LONGEST_FIRST"):
            tuning.env_window(name, "1,2")
