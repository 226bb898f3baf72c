"""The decode kernel's block rules (pallas_kernels/tuning.py): which blocks a grid gets. The
kernels' correctness under those blocks is tests/kernels/test_paged_attention.py's."""

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
