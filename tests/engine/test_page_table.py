"""PageAllocator: reserved page 0, ref counts, prefix-cache sharing and LRU eviction; PageList."""
import random

import numpy as np
import pytest

from jaxinfer.page_table import PageAllocator, PageList, extend_page_keys, page_key


def keys_of(tokens, page_size):
    keys = []
    extend_page_keys(keys, tokens, page_size)
    return keys


def test_page_zero_is_never_handed_out_and_pool_is_bounded():
    a = PageAllocator(num_pages=9, page_size=4)
    pages = a.allocate(8)
    assert sorted(pages) == list(range(1, 9))
    assert a.num_free == 0 and a.num_used == 8
    with pytest.raises(RuntimeError, match="only 0 are free"):
        a.allocate(1)
    a.free(pages)
    assert a.num_free == 8
    a.check()


def test_double_free_and_page_zero_free_raise():
    a = PageAllocator(num_pages=5, page_size=4)
    p = a.allocate(2)
    a.free(p)
    with pytest.raises(RuntimeError, match="double free"):
        a.free(p[:1])
    with pytest.raises(RuntimeError, match="not an allocatable page"):
        a.free([0])
    a.check()


def test_page_keys_name_the_whole_prefix():
    rng = random.Random(0)
    tokens = [rng.randrange(1000) for _ in range(20)]
    keys = keys_of(tokens, 8)
    assert len(keys) == 2   # the 4 trailing tokens are not a full page
    other = keys_of([tokens[0] + 1] + tokens[1:], 8)
    assert other[0] != keys[0] and other[1] != keys[1]   # same 2nd page, different prefix
    assert keys[1] == page_key(keys[0], tokens[8:16])
    keys_more = keys[:1]
    extend_page_keys(keys_more, tokens + [5] * 4, 8)
    assert keys_more[:2] == keys and len(keys_more) == 3


def test_shared_prefix_pages_are_reused_copy_free():
    a = PageAllocator(num_pages=16, page_size=4)
    rng = random.Random(1)
    tokens = [rng.randrange(1000) for _ in range(12)]
    keys = keys_of(tokens, 4)
    owner = a.allocate(3)
    for p, k in zip(owner, keys):
        a.cache_page(p, k)
    sharer = a.match_prefix(keys[:2] + keys_of(tokens[:8] + [9, 9, 9, 9], 4)[2:])
    assert sharer == owner[:2]
    assert [a.ref_count(p) for p in owner] == [2, 2, 1]
    a.free(reversed(owner))
    assert a.num_free == 16 - 1 - 2   # owner's 3rd page is evictable, counted as free
    a.free(reversed(sharer))
    assert a.num_free == 15 and a.num_cached == 3
    assert a.match_prefix(keys) == owner   # evictable pages come back with their content
    a.free(owner)
    a.check()


def test_eviction_is_lru_and_only_when_free_pages_run_out():
    a = PageAllocator(num_pages=7, page_size=2)   # 6 usable
    rng = random.Random(2)
    seq_a, seq_b = ([rng.randrange(1000) for _ in range(4)] for _ in range(2))
    ka, kb = keys_of(seq_a, 2), keys_of(seq_b, 2)
    pa, pb = a.allocate(2), a.allocate(2)
    for p, k in zip(pa + pb, ka + kb):
        a.cache_page(p, k)
    a.free(reversed(pa))   # A freed first: older in the LRU
    a.free(reversed(pb))
    fresh = a.allocate(2)  # the 2 never-used pages: no eviction yet
    assert not set(fresh) & set(pa + pb) and a.num_cached == 4
    got = a.allocate(1)    # evicts A's tail page (freed first)
    assert got == [pa[1]] and a.num_cached == 3
    assert a.match_prefix(ka) == [pa[0]]   # A's head survives; its tail is gone
    assert a.match_prefix(kb) == pb
    a.free(fresh + got + [pa[0]] + pb)
    a.check()
    assert a.num_free == a.num_usable


def test_duplicate_content_stays_private():
    a = PageAllocator(num_pages=5, page_size=2)
    k = keys_of([3, 4], 2)[0]
    p1, p2 = a.allocate(2)
    a.cache_page(p1, k)
    a.cache_page(p2, k)   # same prefix already cached: p2 is not registered
    a.free([p1, p2])
    assert a.num_cached == 1 and a.num_free == 4
    a.check()


def test_prefix_caching_off_never_matches():
    a = PageAllocator(num_pages=5, page_size=2, enable_prefix_caching=False)
    k = keys_of([3, 4], 2)
    p = a.allocate(1)
    a.cache_page(p[0], k[0])
    assert a.match_prefix(k) == [] and a.num_cached == 0
    a.free(p)
    a.check()


def test_random_ops_never_leak_or_double_free():
    rng = random.Random(3)
    a = PageAllocator(num_pages=20, page_size=2)
    vocab = [rng.randrange(5) for _ in range(6)]   # tiny vocab: many shared prefixes
    held = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.5:
            tokens = [rng.choice(vocab) for _ in range(rng.randrange(1, 9))]
            keys = keys_of(tokens, 2)
            pages = a.match_prefix(keys)
            need = -(-len(tokens) // 2) - len(pages)
            if need > a.num_free:
                a.free(reversed(pages))
            else:
                pages += a.allocate(need)
                for p, k in zip(pages, keys):
                    a.cache_page(p, k)
                held.append(pages)
        elif held:
            a.free(reversed(held.pop(rng.randrange(len(held)))))
        a.check()
    for pages in held:
        a.free(pages)
    a.check()
    assert a.num_free == a.num_usable


def test_page_list_acts_like_a_list_and_its_snapshots_stay_put():
    rng = random.Random(3)
    pages, mirror, snapshots = PageList([5, 9]), [5, 9], []
    for _ in range(40):                     # grows past its first buffers several times
        snapshots.append((pages.array(), list(mirror)))
        new = [rng.randrange(1, 1000) for _ in range(rng.randrange(0, 4))]
        pages.extend(new)
        mirror.extend(new)
        assert len(pages) == len(mirror) and pages == mirror and list(pages) == mirror
        assert pages.array().tolist() == mirror
        assert pages[-1] == mirror[-1] and type(pages[0]) is int
        assert pages[1:3] == mirror[1:3] and list(reversed(pages)) == mirror[::-1]
    for view, then in snapshots:            # what a scheduled row saw is what it keeps
        assert view.tolist() == then and view.dtype == np.int32
        with pytest.raises(ValueError):
            view[0] = 0
    assert PageList() == [] and len(PageList()) == 0 and PageList().array().shape == (0,)
