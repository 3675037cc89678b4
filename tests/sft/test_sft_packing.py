"""Block-aligned packing and overlong splitting (sft.data.packing), on synthetic documents: the
invariants of docs/design.md 3.1 are checked on every row against the input documents themselves."""

import numpy as np
import pytest

from sft.data.config import block_align_for
from sft.data.packing import BlockPacker, Piece, align_responses, assemble_row, split_doc
from sft.data.render import Doc

PAD, IM_START = 7, 9


def make_doc(rng, n_blocks, block_len=(3, 12), header=0, source=0):
    """A fake rendered doc: blocks each opening with IM_START; the first block is a header of
    `header` tokens when given; the loss mask is on for the second half of odd blocks."""
    ids, mask, starts = [], [], []
    for b in range(n_blocks):
        n = header if (b == 0 and header) else int(rng.integers(*block_len))
        starts.append(len(ids))
        ids += [IM_START] + list(rng.integers(100, 1000, n - 1))
        mask += [False] * n if b % 2 == 0 else [False] * (n // 2) + [True] * (n - n // 2)
    return Doc(np.asarray(ids, np.int32), np.asarray(mask, bool), np.asarray(starts, np.int32),
               header_len=header, source=source)


def pack_all(pieces, seq_len, align, open_rows=4, pack=True):
    packer = BlockPacker(seq_len, align, open_rows, pack)
    rows = []
    for p in pieces:
        rows += packer.add(p)
    return rows + packer.flush()


def check_row(row, align, pad=PAD):
    """docs/design.md 3.1 invariants of one assembled row; returns its documents as (ids, mask)."""
    seg, pos, ids, mask = row["segment_ids"], row["positions"], row["input_ids"], row["loss_mask"]
    assert ids.dtype == np.int32 and seg.dtype == np.int32 and pos.dtype == np.int32
    assert mask.dtype == bool
    # pads: segment 0, pad token, no loss, position 0
    assert (ids[seg == 0] == pad).all() and not mask[seg == 0].any() and (pos[seg == 0] == 0).all()
    docs = []
    n_seg = int(seg.max())
    assert set(np.unique(seg)) - {0} == set(range(1, n_seg + 1))  # ids 1..n, no gaps
    prev_end = 0
    for s in range(1, n_seg + 1):
        where = np.flatnonzero(seg == s)
        start, end = int(where[0]), int(where[-1]) + 1
        assert len(where) == end - start, "a document must be contiguous"
        assert start % align == 0, f"document {s} starts at {start}, not a multiple of {align}"
        assert start >= prev_end  # in order
        assert (pos[start:end] == np.arange(end - start)).all(), "positions restart per document"
        docs.append((ids[start:end].copy(), mask[start:end].copy()))
        prev_end = end
    # no block of the grid holds two documents
    for b in range(0, len(seg), align):
        ids_in_block = set(seg[b:b + align]) - {0}
        assert len(ids_in_block) <= 1, f"block at {b} holds documents {ids_in_block}"
    return docs


@pytest.mark.parametrize("align,seq_len", [(4, 64), (32, 256)])
def test_packed_rows_are_block_aligned_and_lossless(align, seq_len):
    rng = np.random.default_rng(align)
    pieces = []
    for i in range(60):
        n = int(rng.integers(1, seq_len + 1))
        pieces.append(Piece(rng.integers(100, 1000, n).astype(np.int32), rng.random(n) < 0.5,
                            ref=(i, 0)))
    rows = pack_all(pieces, seq_len, align)
    seen = []
    for r in rows:
        row = assemble_row(r, seq_len, align, PAD)
        assert all(v.shape == (seq_len,) for v in row.values())
        seen += check_row(row, align)
    # every piece comes out exactly once, unchanged, and in input order within its row
    assert sorted(p.ref for r in rows for p in r) == [p.ref for p in pieces]
    by_ids = {tuple(p.ids.tolist()): p for p in pieces}
    assert len(seen) == len(pieces)
    for ids, mask in seen:
        assert (by_ids[tuple(ids.tolist())].mask == mask).all()
    # packing actually packs: fewer rows than documents
    assert len(rows) < len(pieces)
    # deterministic
    again = pack_all(pieces, seq_len, align)
    assert [[p.ref for p in r] for r in again] == [[p.ref for p in r] for r in rows]


def test_first_fit_fills_earlier_rows_and_respects_open_rows():
    mk = lambda n, i: Piece(np.ones(n, np.int32), np.ones(n, bool), ref=(i, 0))  # noqa: E731
    # seq 16, align 4: [10] -> row0 (used 12); [10] -> row1; [3] fits row0 (12+3 <= 16) -> row0 full
    rows = pack_all([mk(10, 0), mk(10, 1), mk(3, 2)], 16, 4, open_rows=4)
    assert [[p.ref[0] for p in r] for r in rows] == [[0, 2], [1]]
    # one open row only = sequential packing: the 3 cannot go back to row 0
    rows = pack_all([mk(10, 0), mk(10, 1), mk(3, 2)], 16, 4, open_rows=1)
    assert [[p.ref[0] for p in r] for r in rows] == [[0], [1, 2]]
    rows = pack_all([mk(3, 0), mk(3, 1)], 16, 4, pack=False)
    assert [[p.ref[0] for p in r] for r in rows] == [[0], [1]]
    with pytest.raises(ValueError, match="does not fit"):
        BlockPacker(16, 4).add(mk(17, 0))
    with pytest.raises(ValueError, match="multiple of block_align"):
        BlockPacker(18, 4)


def test_packer_state_restore():
    rng = np.random.default_rng(0)
    pieces = [Piece(np.full(int(n), i, np.int32), np.ones(int(n), bool), ref=(i, 0))
              for i, n in enumerate(rng.integers(1, 40, 30))]
    a = BlockPacker(64, 8, open_rows=3)
    out_a = []
    for p in pieces[:12]:
        out_a += a.add(p)
    state = a.state()
    b = BlockPacker(64, 8, open_rows=3)
    b.restore(state, lambda d, k: pieces[d])
    rest_a, rest_b = [], []
    for p in pieces[12:]:
        rest_a += a.add(p)
        rest_b += b.add(p)
    rest_a += a.flush()
    rest_b += b.flush()
    assert [[p.ref for p in r] for r in rest_a] == [[p.ref for p in r] for r in rest_b]


def test_split_overlong_at_block_starts_with_header():
    rng = np.random.default_rng(1)
    header, seq_len = 10, 64
    doc = make_doc(rng, n_blocks=30, header=header)
    assert len(doc) > 3 * seq_len
    res = split_doc(doc, seq_len, "split_turns", doc_index=5)
    assert res.overlong and res.hard_cuts == 0 and res.dropped_no_loss == 0
    bounds = sorted(set(doc.block_starts.tolist()) | {len(doc)})
    cursor = 0
    for k, p in enumerate(res.pieces):
        assert len(p) <= seq_len and p.ref == (5, k)
        prefix = header if k else 0
        if k:  # later pieces repeat the system block, never in the loss
            assert (p.ids[:header] == doc.input_ids[:header]).all() and not p.mask[:header].any()
        body_ids, body_mask = p.ids[prefix:], p.mask[prefix:]
        assert cursor in bounds, "a piece must begin at a message-block start"
        assert (body_ids == doc.input_ids[cursor:cursor + len(body_ids)]).all()
        assert (body_mask == doc.loss_mask[cursor:cursor + len(body_ids)]).all()
        start, cursor = cursor, cursor + len(body_ids)
        assert cursor in bounds
        if cursor < len(doc):  # greedy: the next block would not have fitted
            nxt = min(b for b in bounds if b > cursor)
            assert nxt - start > seq_len - prefix
    assert cursor == len(doc)  # the pieces cover the document exactly once


def test_split_hard_cut_drop_mode_and_no_loss_pieces():
    # one giant block: must be cut at the token limit
    n = 150
    doc = Doc(np.arange(n, dtype=np.int32), np.ones(n, bool), np.asarray([0], np.int32))
    res = split_doc(doc, 64, "split_turns")
    assert res.hard_cuts == 2 and [len(p) for p in res.pieces] == [64, 64, 22]  # last ends the doc
    assert np.concatenate([p.ids for p in res.pieces]).tolist() == list(range(n))
    # drop mode drops the whole document and says so
    res = split_doc(doc, 64, "drop")
    assert res.overlong and res.pieces == []
    # a piece without loss tokens is dropped and counted
    mask = np.zeros(n, bool)
    mask[100:] = True
    doc = Doc(np.arange(n, dtype=np.int32), mask, np.asarray([0, 50, 100], np.int32))
    res = split_doc(doc, 64, "split_turns")
    assert res.dropped_no_loss == 2 and len(res.pieces) == 1
    assert res.pieces[0].ids.tolist() == list(range(100, 150))
    # a fitting document without loss is dropped too; one with loss passes unchanged
    short = Doc(np.arange(10, dtype=np.int32), np.zeros(10, bool), np.asarray([0], np.int32))
    assert split_doc(short, 64, "split_turns").dropped_no_loss == 1
    ok = Doc(np.arange(10, dtype=np.int32), np.ones(10, bool), np.asarray([0], np.int32))
    res = split_doc(ok, 64, "split_turns")
    assert not res.overlong and res.pieces[0].ids is ok.input_ids


def test_block_align_is_lcm_of_block_sizes():
    assert block_align_for(32) == 32 and block_align_for((4, 8, 32)) == 32
    assert block_align_for((4, 6)) == 12


def _unpad(ids, mask, pad_at):
    keep = ~pad_at
    return ids[keep], mask[keep]


def _response_starts(mask):
    return np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]]))


@pytest.mark.parametrize("align", [1, 4, 32])
def test_align_responses_puts_every_response_on_the_grid(align):
    """Every run of loss tokens starts at a multiple of `align`; the inserted tokens are the pad,
    carry no loss and sit right before a response; removing them gives the input back."""
    rng = np.random.default_rng(align)
    for _ in range(20):
        doc = make_doc(rng, n_blocks=int(rng.integers(1, 9)))
        ids, mask = align_responses(doc.input_ids, doc.loss_mask, align, PAD)
        assert ids.dtype == doc.input_ids.dtype and mask.dtype == bool
        assert all(s % align == 0 for s in _response_starts(mask))
        # the pads: a lossless prefix-preserving insertion (random ids are >= 100, never PAD)
        pad_at = ids == PAD
        assert not mask[pad_at].any()
        back_ids, back_mask = _unpad(ids, mask, pad_at)
        assert (back_ids == doc.input_ids).all() and (back_mask == doc.loss_mask).all()
        # each gap is the smallest that aligns: fewer than `align` pads, and only before responses
        runs = np.split(np.flatnonzero(pad_at), np.flatnonzero(np.diff(np.flatnonzero(pad_at)) > 1) + 1)
        for r in (r for r in runs if r.size):
            assert r.size < align and mask[r[-1] + 1]
        if align == 1:
            assert ids is doc.input_ids


def test_split_with_alignment_fits_and_covers_the_document():
    """Overlong documents with alignment: every piece fits seq_len after padding, its responses are on
    the grid, and the pieces (pads and repeated headers removed) cover the document exactly once."""
    rng = np.random.default_rng(7)
    header, seq_len, align = 10, 64, 8
    for trial in range(10):
        doc = make_doc(rng, n_blocks=30, header=header)
        res = split_doc(doc, seq_len, "split_turns", align=align, pad_id=PAD)
        assert res.overlong and res.hard_cuts == 0
        body = []
        for k, p in enumerate(res.pieces):
            assert len(p) <= seq_len
            assert all(s % align == 0 for s in _response_starts(p.mask))
            ids, mask = _unpad(p.ids, p.mask, p.ids == PAD)
            if k:
                assert (ids[:header] == doc.input_ids[:header]).all()
                ids, mask = ids[header:], mask[header:]
            body.append((ids, mask))
        # pieces without loss are dropped; with this doc's mask every piece has loss
        assert res.dropped_no_loss == 0
        assert res.response_pads == sum(int((p.ids == PAD).sum()) for p in res.pieces) > 0
        assert (np.concatenate([b[0] for b in body]) == doc.input_ids).all()
        assert (np.concatenate([b[1] for b in body]) == doc.loss_mask).all()
    # a fitting document grows by its pads and may then need a split
    short = Doc(np.asarray([IM_START, 101, 102, 103, 104, 105], np.int32),
                np.asarray([0, 0, 0, 1, 1, 1], bool), np.asarray([0], np.int32))
    one = split_doc(short, 8, "split_turns", align=4, pad_id=PAD)
    assert not one.overlong and one.pieces[0].ids.tolist() == [IM_START, 101, 102, PAD, 103, 104, 105]
    assert one.response_pads == 1 and split_doc(short, 8, "split_turns").response_pads == 0
    cut = split_doc(short, 8, "split_turns", align=8, pad_id=PAD)  # 3 + 5 pads + 3 > 8
    assert cut.overlong and cut.hard_cuts >= 1
    assert all(len(p) <= 8 and all(s % 8 == 0 for s in _response_starts(p.mask)) for p in cut.pieces)
    assert np.concatenate([_unpad(p.ids, p.mask, p.ids == PAD)[0] for p in cut.pieces]).tolist()[-3:] == [103, 104, 105]
