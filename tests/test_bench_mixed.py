"""bench/mixed_attention.py's mixed step: its metadata describes the step it claims (decode
rows with one new token at the last position, one prefill chunk from position 0), so the
mixed bench times what the engine runs. No timing here."""
import jax
import numpy as np

from bench.mixed_attention import PREFILL_VARIANTS, make_mixed
from bench.kernels import PAGE
from pallas_kernels import tuning


def test_mixed_step_metadata():
    q, (k, v, ks, vs), md = make_mixed(3, 20, True, jax.random.PRNGKey(0), context=(30, 60))
    lens = np.asarray(md.seq_lens)
    start, pos = np.asarray(md.query_start), np.asarray(md.positions)
    seq, table = np.asarray(md.token_seq), np.asarray(md.page_table)
    slots = np.asarray(md.slot_mapping)
    assert q.shape[0] == 23 and list(start) == [0, 1, 2, 3, 23] and lens[-1] == 20
    assert all(30 <= n < 60 for n in lens[:3])
    assert list(pos[:3]) == list(lens[:3] - 1) and list(pos[3:]) == list(range(20))
    assert list(seq) == [0, 1, 2] + [3] * 20
    np.testing.assert_array_equal(slots, table[seq, pos // PAGE] * PAGE + pos % PAGE)
    used = np.concatenate([table[b, :-(-n // PAGE)] for b, n in enumerate(lens)])
    assert len(set(used)) == len(used) and 0 not in used   # disjoint pages, page 0 reserved
    assert k.dtype == v.dtype and ks is not None and vs is not None


def test_prefill_variants_parse():
    for text in PREFILL_VARIANTS:
        tuning.RaggedBlocks(*tuning.parse_ragged(text))
