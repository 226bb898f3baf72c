"""batch.prepare: numpy step arrays padded to a bucket, checked by hand."""
import subprocess
import sys

import numpy as np
import pytest

from jaxinfer.batch import PageTables, prepare
from jaxinfer.buckets import Bucket
from jaxinfer.page_table import PageList
from jaxinfer.scheduler_output import ScheduledRow, SchedulerOutput

S = 4   # page size


def mixed_output():
    return SchedulerOutput((
        ScheduledRow("a", (11,), 9, (3, 7, 2), True),                    # decode, pos 9
        ScheduledRow("b", (20, 21, 22, 23, 24), 4, (5, 6, 8), False),    # chunk, pos 4..8
        ScheduledRow("c", (30,), 0, (1,), True),                         # 1-token prompt
    ))


def test_mixed_decode_and_prefill_step():
    arr = prepare(mixed_output(), Bucket(16, 8, 4, False), S)
    pad = [0] * 9
    np.testing.assert_array_equal(arr.tokens, [11, 20, 21, 22, 23, 24, 30] + pad)
    np.testing.assert_array_equal(arr.positions, [9, 4, 5, 6, 7, 8, 0] + pad)
    # a: pos 9 -> page index 2 = page 2, slot 1 -> 2*4+1.  b: pos 4..7 -> page 6 slots 0..3,
    # pos 8 -> page 8 slot 0.  c: pos 0 -> page 1 slot 0.
    np.testing.assert_array_equal(arr.slot_mapping,
                                  [9, 24, 25, 26, 27, 32, 4] + [-1] * 9)
    np.testing.assert_array_equal(arr.token_seq, [0, 1, 1, 1, 1, 1, 2] + pad)
    np.testing.assert_array_equal(arr.page_table, [[3, 7, 2, 0], [5, 6, 8, 0], [1, 0, 0, 0]]
                                  + [[0] * 4] * 5)
    np.testing.assert_array_equal(arr.seq_lens, [10, 9, 1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(arr.query_start, [0, 1, 6, 7, 7, 7, 7, 7, 7])
    np.testing.assert_array_equal(arr.logits_index, [0, 5, 6, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(arr.samples, [True, False, True] + [False] * 5)
    assert arr.request_ids == ("a", "b", "c") and arr.num_rows == 3
    assert not arr.decode_only
    for name in ("tokens", "positions", "slot_mapping", "token_seq", "page_table", "seq_lens",
                 "query_start", "logits_index"):
        assert getattr(arr, name).dtype == np.int32, name


def test_decode_only_step_with_padded_rows():
    rng = np.random.default_rng(0)
    rows = tuple(ScheduledRow(f"r{i}", (int(rng.integers(1000)),), int(p), (i + 1, i + 5), True)
                 for i, p in enumerate(rng.integers(0, 8, size=3)))
    arr = prepare(SchedulerOutput(rows), Bucket(4, 4, 2, True), S)
    assert arr.decode_only
    np.testing.assert_array_equal(arr.query_start, [0, 1, 2, 3, 3])
    np.testing.assert_array_equal(arr.logits_index, [0, 1, 2, 0])
    np.testing.assert_array_equal(arr.token_seq, [0, 1, 2, 0])
    for b, r in enumerate(rows):
        page = r.page_ids[r.start_pos // S]
        assert arr.slot_mapping[b] == page * S + r.start_pos % S
        assert arr.seq_lens[b] == r.start_pos + 1
    assert arr.slot_mapping[3] == -1 and arr.seq_lens[3] == 0


def test_page_tables_from_the_last_step_equal_tables_built_afresh():
    """Rows that grow pages, finish, join, move up the batch and share one step's shape or
    alternate between two: each step's table (and every other array) equals the one built
    from the rows' pages alone."""
    rng = np.random.default_rng(7)
    tables, pages, next_id = PageTables(), {}, 0
    for step in range(60):
        for rid in list(pages):
            if rng.random() < 0.03:
                del pages[rid]                      # finished
            elif rng.random() < 0.1:
                pages[rid].extend(rng.integers(1, 500, int(rng.integers(1, 3))).tolist())
        while len(pages) < 6 or (len(pages) < 8 and rng.random() < 0.3):
            pages[f"r{next_id}"] = PageList(rng.integers(1, 500, int(rng.integers(1, 5))))
            next_id += 1
        for rid in [r for r in pages if len(pages[r]) > 12]:
            pages[rid] = PageList(pages[rid].view[:3])   # preempted and admitted again
        order = list(pages)
        if rng.random() < 0.2:
            rng.shuffle(order)
        out = SchedulerOutput(tuple(
            ScheduledRow(rid, (1,), S * len(pages[rid]) - 1, pages[rid].view, True)
            for rid in order))
        bucket = Bucket(8, 8, 16 if step % 3 else 12, True)
        got, want = prepare(out, bucket, S, tables), prepare(out, bucket, S)
        for field in ("page_table", "slot_mapping", "seq_lens", "positions", "tokens"):
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field),
                                          err_msg=f"step {step}: {field}")


def test_step_that_does_not_fit_raises():
    out = mixed_output()
    with pytest.raises(ValueError, match="does not fit"):
        prepare(out, Bucket(4, 4, 4, False), S)        # 7 tokens > 4
    with pytest.raises(ValueError, match="does not fit"):
        prepare(out, Bucket(16, 8, 2, False), S)       # 3 pages > 2
    with pytest.raises(ValueError, match="one token per row"):
        prepare(out, Bucket(8, 8, 4, True), S)
    short = SchedulerOutput((ScheduledRow("x", (1, 2), 3, (4,), True),))   # pos 4 has no page
    with pytest.raises(ValueError, match="outside its request's pages"):
        prepare(short, Bucket(16, 8, 4, False), S)
    beyond = SchedulerOutput((ScheduledRow("x", (1, 2), 3, (4,), True),))
    with pytest.raises(ValueError, match="outside its request's pages"):
        prepare(beyond, Bucket(16, 8, 1, False), S)   # pos 4 is past the table's width


def test_host_side_modules_do_not_import_jax():
    code = ("import sys, jaxinfer.request, jaxinfer.page_table, jaxinfer.scheduler, "
            "jaxinfer.buckets, jaxinfer.batch; assert 'jax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
