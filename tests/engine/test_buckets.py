"""Buckets: a small set of shapes, the smallest fitting one chosen, padding accounted."""
import random

import pytest

from jaxinfer.buckets import Bucket, Buckets, fitted_tokens, geometric
from jaxinfer.config import EngineConfig


def test_default_config_has_few_buckets():
    b = Buckets.from_config(EngineConfig())
    pps = EngineConfig().pages_per_seq
    assert b.decode_sizes == [1, 2, 4, 8, 16, 32]
    assert b.mixed_sizes == [16, 32, 64, 128, 256]
    buckets = b.all_buckets()
    assert len(buckets) == 11 and len(set(buckets)) == 11
    assert Bucket(8, 8, pps, True) in buckets and Bucket(256, 32, pps, False) in buckets


def test_geometric_includes_limits():
    assert geometric(1, 1) == [1]
    assert geometric(16, 100) == [16, 32, 64, 100]
    assert geometric(1, 10, growth=1.5) == [1, 2, 3, 5, 8, 10]
    with pytest.raises(ValueError):
        geometric(0, 4)


def test_choose_decode_and_mixed():
    b = Buckets(max_num_seqs=32, max_num_batched_tokens=256, max_pages_per_seq=128)
    assert b.choose(5, 5, 3) == Bucket(8, 8, 128, True)
    assert b.choose(32, 32, 1) == Bucket(32, 32, 128, True)
    assert b.choose(17, 3, 2) == Bucket(32, 32, 128, False)
    assert b.choose(3, 2, 1) == Bucket(16, 16, 128, False)
    assert b.choose(200, 32, 128) == Bucket(256, 32, 128, False)


def test_choose_is_smallest_fitting_bucket():
    rng = random.Random(0)
    b = Buckets(max_num_seqs=24, max_num_batched_tokens=200, max_pages_per_seq=64,
                pages_per_seq_levels=(8, 64))
    all_b = b.all_buckets()
    for _ in range(500):
        n_tok = rng.randrange(1, 201)
        n_seq = rng.randrange(1, min(n_tok, 24) + 1)
        pages = rng.randrange(0, 65)
        got = b.choose(n_tok, n_seq, pages)
        assert got in all_b
        fits = [x for x in all_b if x.decode_only == (n_tok == n_seq) and x.num_tokens >= n_tok
                and x.num_seqs >= n_seq and x.pages_per_seq >= pages]
        assert got == min(fits, key=lambda x: (x.num_tokens, x.pages_per_seq))


def test_budget_smaller_than_seq_cap():
    b = Buckets(max_num_seqs=32, max_num_batched_tokens=7, max_pages_per_seq=4)
    assert b.decode_sizes == [1, 2, 4, 7] and b.mixed_sizes == [7]
    assert b.choose(7, 7, 1) == Bucket(7, 7, 4, True)
    assert b.choose(7, 2, 1) == Bucket(7, 7, 4, False)


def test_choose_rejects_impossible_steps():
    b = Buckets(max_num_seqs=4, max_num_batched_tokens=64, max_pages_per_seq=8)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        b.choose(65, 4, 1)
    with pytest.raises(ValueError, match="num_seqs"):
        b.choose(3, 5, 1)
    with pytest.raises(ValueError, match="num_seqs"):
        b.choose(10, 0, 1)
    with pytest.raises(ValueError, match="pages_per_seq"):
        b.choose(10, 2, 9)
    with pytest.raises(ValueError, match="include it"):
        Buckets(4, 64, 8, pages_per_seq_levels=(2, 4))


def test_padding_fraction():
    b = Buckets(max_num_seqs=32, max_num_batched_tokens=256, max_pages_per_seq=16)
    assert b.padding_fraction == 0.0
    b.choose(5, 5, 1)     # bucket 8
    b.choose(17, 3, 1)    # bucket 32
    assert (b.real_tokens, b.padded_tokens) == (22, 40)
    assert b.padding_fraction == pytest.approx(18 / 40)


def test_fitted_tokens_cuts_a_step_just_over_a_size_and_pads_one_well_over():
    sizes = geometric(16, 2048)
    assert fitted_tokens(300, 1, 300, sizes) == 256        # 300 of 512 < 256 of 256 per cost
    assert fitted_tokens(300, 41, 260, sizes) == 216       # decode rows stay, the chunk gives
    assert fitted_tokens(450, 1, 450, sizes) == 450        # 450 of 512 beats 256 of 256
    assert fitted_tokens(256, 1, 256, sizes) == 256        # fills its size
    assert fitted_tokens(64, 64, 1, sizes) == 1            # a decode step
    assert fitted_tokens(300, 2, 40, sizes) == 40          # the cut would empty the row
    assert fitted_tokens(10, 1, 10, sizes) == 10           # under the smallest size
    for total in range(17, 2049):   # a cut step lands exactly on a size
        keep = fitted_tokens(total, 1, total, sizes)
        assert keep == total or keep in sizes
