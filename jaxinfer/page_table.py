"""The page allocator: a fixed pool of KV-cache pages, reference counts and the prefix cache.

The cache holds `num_pages` pages of `page_size` tokens each. Page 0 is reserved and never
handed out: padded page-table entries point at it (see kv_cache.py), so usable pages are
1 .. num_pages - 1.

Every page is in exactly one of three states:
  free       on the free list, content meaningless;
  in use     ref count >= 1 (several requests share a page when their prefixes match);
  evictable  ref count 0 but its content is a known, full page of tokens that a later request
             may reuse; kept in LRU order and only reclaimed when the free list runs dry.
`num_free` counts free + evictable, because an evictable page is one `allocate` away.

Prefix caching: a FULL page is keyed by a hash of (key of the previous page, its tokens), so
a key names the whole prefix up to the end of that page, not just the page's own tokens.
A new request's leading full pages whose keys are cached are shared copy-free (ref count + 1).
Only full pages are shared: a partly filled page is still being written by its owner. Keys are
128-bit BLAKE2b digests, so a crafted prompt cannot collide with another user's prefix.

Misuse (double free, freeing page 0, allocating more than is free) raises RuntimeError: those
are scheduler bugs, not user errors, and must never pass silently.
"""
from __future__ import annotations

import array
import collections
import hashlib
from typing import Iterable, Sequence

import numpy as np

RESERVED_PAGE = 0


def page_key(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The prefix-cache key of one full page given the key of the page before it."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array.array("q", token_ids).tobytes())
    return h.digest()


def extend_page_keys(keys: list[bytes], token_ids: Sequence[int], page_size: int,
                     num_tokens: int | None = None, root: bytes | None = None) -> None:
    """Append to `keys` the keys of the full pages of `token_ids` (of its first `num_tokens`)
    not yet covered by it. root: what the first page's key chains from (a LoRA adapter's
    key: the same tokens under two adapters never share pages), None for the base model."""
    n = len(token_ids) if num_tokens is None else num_tokens
    for i in range(len(keys), n // page_size):
        keys.append(page_key(keys[-1] if keys else root,
                             token_ids[i * page_size:(i + 1) * page_size]))


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_pages
        # A stack popped from the end: page 1 is handed out first (readable tests and traces).
        self._free = list(range(num_pages - 1, RESERVED_PAGE, -1))
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._page_by_key: dict[bytes, int] = {}
        self._key_by_page: dict[int, bytes] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0

    # --- capacity -----------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages whose content is registered in the prefix cache (in use or evictable)."""
        return len(self._key_by_page)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def ref_count(self, page_id: int) -> int:
        return self._ref[page_id]

    # --- allocate / free ----------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} pages but only {self.num_free} are free")
        pages = [self._take_one() for _ in range(n)]
        for p in pages:
            self._ref[p] = 1
        return pages

    def share(self, page_ids: Iterable[int]) -> None:
        """Take one more reference to each page in use (another sequence reads it: the n
        completions of one prompt)."""
        for p in page_ids:
            if not 0 < p < self.num_pages or self._ref[p] <= 0:
                raise RuntimeError(f"cannot share page {p}: it is not in use")
            self._ref[p] += 1

    def _take_one(self) -> int:
        if self._free:
            return self._free.pop()
        page, _ = self._evictable.popitem(last=False)  # least recently freed first
        del self._page_by_key[self._key_by_page.pop(page)]
        return page

    def free(self, page_ids: Iterable[int]) -> None:
        """Drop one reference to each page. Pass a request's pages tail first: the tail then
        enters the LRU first and is evicted first, keeping the more shareable head cached."""
        for p in page_ids:
            if p == RESERVED_PAGE or not 0 < p < self.num_pages:
                raise RuntimeError(f"cannot free page {p}: not an allocatable page")
            if self._ref[p] <= 0:
                raise RuntimeError(f"double free of page {p}")
            self._ref[p] -= 1
            if self._ref[p] == 0:
                if p in self._key_by_page:
                    self._evictable[p] = None
                else:
                    self._free.append(p)

    # --- prefix cache -------------------------------------------------------------------
    def match_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """Take a reference to the cached pages of the longest cached prefix of `keys`."""
        if not self.enable_prefix_caching:
            return []
        pages = []
        for key in keys:
            page = self._page_by_key.get(key)
            if page is None:
                break
            if self._ref[page] == 0:
                del self._evictable[page]
            self._ref[page] += 1
            pages.append(page)
        return pages

    def cache_page(self, page_id: int, key: bytes) -> None:
        """Register a full, written, in-use page under its prefix key. If another page already
        holds that prefix (two equal prompts admitted together), this one stays private."""
        if not self.enable_prefix_caching or key in self._page_by_key:
            return
        if self._ref[page_id] <= 0:
            raise RuntimeError(f"cannot cache page {page_id}: it is not in use")
        if page_id in self._key_by_page:
            raise RuntimeError(f"page {page_id} is already cached under another key")
        self._page_by_key[key] = page_id
        self._key_by_page[page_id] = key

    def forget_cache(self) -> None:
        """Drop every prefix-cache entry (the KV cache's contents were lost): evictable pages
        become free; pages in use stay with their holders, no longer shareable."""
        self._free.extend(reversed(self._evictable))
        self._evictable.clear()
        self._page_by_key.clear()
        self._key_by_page.clear()

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission (its tokens, those served from the cache) for the hit rate."""
        self.queried_tokens += num_tokens
        self.hit_tokens += num_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def check(self) -> None:
        """Assert the three-state invariant (tests call this after every operation)."""
        free, evictable = set(self._free), set(self._evictable)
        in_use = {p for p in range(1, self.num_pages) if self._ref[p] > 0}
        if len(free) != len(self._free):
            raise RuntimeError("a page is on the free list twice")
        if (free & evictable) or (free & in_use) or (evictable & in_use):
            raise RuntimeError("a page is in two states at once")
        if free | evictable | in_use != set(range(1, self.num_pages)) or self._ref[0]:
            raise RuntimeError("a page is lost or page 0 was handed out")
        if any(p in self._key_by_page for p in free) or not evictable <= set(self._key_by_page):
            raise RuntimeError("free/evictable pages disagree with the prefix cache")
        if {self._page_by_key[k]: k for k in self._page_by_key} != self._key_by_page:
            raise RuntimeError("prefix cache maps are inconsistent")


class PageList:
    """A request's page ids: a list's interface over an int32 buffer that grows by doubling.

    Each step copies every running row's pages into the page table; from Python ints that
    cost ~3 us per row of ~100 pages (0.6-0.8 ms at 256 rows), from this buffer a numpy copy.
    `view` (and `array()`) is a read-only view of the pages so far, safe to keep as a
    snapshot: pages below the length are never rewritten (a request that gives its pages
    back gets a new PageList) and growth copies into a new buffer. It is an attribute, remade
    as the pages grow (every S tokens of a decode row), so the scheduler's per-row loop reads
    it and its length without a call."""

    __slots__ = ("_buf", "_len", "view")

    def __init__(self, pages: Iterable[int] = ()):
        pages = np.fromiter(pages, np.int32)
        self._buf = np.empty(max(8, len(pages)), np.int32)
        self._buf[:len(pages)] = pages
        self._len = len(pages)
        self._remake_view()

    def _remake_view(self) -> None:
        self.view = self._buf[:self._len]
        self.view.flags.writeable = False

    def extend(self, pages: Iterable[int]) -> None:
        pages = np.fromiter(pages, np.int32)
        n = self._len + len(pages)
        if n > len(self._buf):
            grown = np.empty(max(n, 2 * len(self._buf)), np.int32)
            grown[:self._len] = self._buf[:self._len]
            self._buf = grown
        self._buf[self._len:n] = pages
        self._len = n
        self._remake_view()

    def array(self) -> np.ndarray:
        return self.view

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i):
        return self.array()[i].tolist()   # Python ints, like the list it stands in for

    def __iter__(self):
        return iter(self.array().tolist())

    def __reversed__(self):
        return reversed(self.array().tolist())

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    def __repr__(self) -> str:
        return f"PageList({list(self)})"
