"""Block-aligned packing (docs/design.md 3.1) and overlong-document splitting.

Row layout (``seq_len`` tokens): documents start at multiples of ``block_align``; between them,
and after the last one, pad tokens (``segment_ids`` 0, ``loss_mask`` False, ``positions`` 0).
Documents get ``segment_ids`` 1, 2, ... in row order and ``positions`` 0, 1, ... from their own
start, so the block grid is aligned to every document and no block holds two documents.

Packing is first-fit over at most ``open_rows`` open rows: a piece goes into the first open row
with room (``used_aligned + len <= seq_len``); when none has room and all rows are open, the oldest
open row is closed (emitted) and a new one opened. Rows are emitted in closing order. Everything
is a pure function of the input order, so it is deterministic; ``BlockPacker.state`` lists the
open rows as piece references, from which ``restore`` rebuilds them.

Overlong documents (``len > seq_len``): ``split_turns`` cuts at message-block starts
(``<|im_start|>`` positions) into pieces of at most ``seq_len`` tokens, each later piece prefixed
by the document's leading system block (tools included) when that block is at most ``seq_len // 2``
tokens, so a tool-use continuation still sees its tool schemas; a single block longer than the
room is cut at the token limit (``hard_cuts``). Pieces without any loss token are dropped (they
teach nothing). ``drop`` drops the document. Both are counted by the caller.

Response alignment (``align`` > 0, ``data.align_responses: block``): in every piece, pad tokens (no
loss, same document) go before each assistant response (each run of loss tokens), so that every
response starts at a multiple of ``align`` within the piece, hence on the block grid: no block mixes
a prompt's tail with response slots. The decoder pads a prompt the same way. Pieces are cut from the
unpadded document and their padded length is what must fit ``seq_len``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

import numpy as np

from sft.data.render import Doc

__all__ = ["BlockPacker", "Piece", "SplitResult", "align_responses", "assemble_row", "empty_row", "split_doc"]


@dataclass(frozen=True)
class Piece:
    """A packable unit: ``ids`` int32 [n], ``mask`` bool [n]; ``ref`` = (doc index, piece index)
    identifies it for iterator state; ``source`` = index of its source in the mix; ``loc`` = its
    record's location (``file:line``), for inspection and errors."""

    ids: np.ndarray
    mask: np.ndarray
    ref: tuple[int, int] = (0, 0)
    source: int = 0
    loc: str = ""

    def __len__(self) -> int:
        return int(self.ids.shape[0])


@dataclass
class SplitResult:
    pieces: list[Piece] = field(default_factory=list)
    overlong: bool = False
    hard_cuts: int = 0
    dropped_no_loss: int = 0
    response_pads: int = 0  # pad tokens the response alignment put into the kept pieces


def align_responses(ids: np.ndarray, mask: np.ndarray, align: int,
                    pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``ids`` int32 [n], ``mask`` bool [n] -> the same with ``pad_id`` tokens (mask False) inserted
    before every run of loss tokens, so each run starts at a multiple of ``align``. ``align`` <= 1
    returns the inputs. Invariant: removing the pads gives back ``ids`` and ``mask``."""
    starts = np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]])) if align > 1 else ()
    out_ids, out_mask, prev, shift = [], [], 0, 0
    for s in starts:
        gap = -(int(s) + shift) % align
        out_ids += [ids[prev:s], np.full(gap, pad_id, ids.dtype)]
        out_mask += [mask[prev:s], np.zeros(gap, bool)]
        prev, shift = int(s), shift + gap
    if not out_ids:
        return ids, mask
    return np.concatenate([*out_ids, ids[prev:]]), np.concatenate([*out_mask, mask[prev:]])


def split_doc(doc: Doc, seq_len: int, mode: Literal["split_turns", "drop"],
              doc_index: int = 0, align: int = 0, pad_id: int = 0) -> SplitResult:
    """Pieces of ``doc`` that fit in ``seq_len``; with ``align`` > 1 each piece's responses are
    aligned with ``pad_id`` (see the module docstring)."""

    def piece(start: int, end: int, prefix: int) -> tuple[np.ndarray, np.ndarray]:
        whole = start == 0 and end == len(doc)
        ids, mask = (doc.input_ids, doc.loss_mask) if whole else (doc.input_ids[start:end], doc.loss_mask[start:end])
        if prefix:
            ids = np.concatenate([doc.input_ids[:prefix], ids])
            mask = np.concatenate([np.zeros(prefix, bool), mask])
        return align_responses(ids, mask, align, pad_id)

    def fits(start: int, end: int, prefix: int) -> bool:
        return len(piece(start, end, prefix)[0]) <= seq_len

    n = len(doc)
    if n <= seq_len and fits(0, n, 0):
        ids, mask = piece(0, n, 0)
        keep = bool(mask.any())
        return SplitResult([Piece(ids, mask, (doc_index, 0), doc.source, doc.loc)] if keep else [],
                           dropped_no_loss=0 if keep else 1, response_pads=len(ids) - n if keep else 0)
    res = SplitResult(overlong=True)
    if mode == "drop":
        return res
    header = doc.header_len if 0 < doc.header_len <= seq_len // 2 else 0
    bounds = sorted({0, n, *(int(b) for b in doc.block_starts)})
    cursor, k = 0, 0
    while cursor < n:
        prefix = header if cursor > 0 else 0
        # the furthest block boundary that fits (the padded length grows with the end: bisect);
        # none -> cut the oversized block at the furthest token that fits
        cands = [b for b in bounds if cursor < b <= cursor + seq_len - prefix]
        lo, hi = 0, len(cands)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if fits(cursor, cands[mid], prefix) else (lo, mid)
        if lo:
            end = cands[lo - 1]
        else:
            res.hard_cuts += 1
            lo, hi = cursor + 1, cursor + seq_len - prefix
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(cursor, mid, prefix) else (lo, mid - 1)
            if not fits(cursor, lo, prefix):
                raise ValueError(f"{doc.loc}: seq_len {seq_len} has no room for one token after the "
                                 f"{prefix}-token header and the response alignment to {align}")
            end = lo
        ids, mask = piece(cursor, end, prefix)
        if mask.any():
            res.pieces.append(Piece(ids, mask, (doc_index, k), doc.source, doc.loc))
            res.response_pads += len(ids) - (end - cursor) - prefix
        else:
            res.dropped_no_loss += 1
        cursor, k = end, k + 1
    return res


def _aligned(n: int, align: int) -> int:
    return -(-n // align) * align


def empty_row(seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    return {"input_ids": np.full(seq_len, pad_id, np.int32),
            "segment_ids": np.zeros(seq_len, np.int32),
            "positions": np.zeros(seq_len, np.int32),
            "loss_mask": np.zeros(seq_len, bool)}


def assemble_row(pieces: Sequence[Piece], seq_len: int, block_align: int,
                 pad_id: int) -> dict[str, np.ndarray]:
    """One row from ``pieces`` placed back to back at ``block_align`` multiples.

    Returns ``input_ids`` int32, ``segment_ids`` int32, ``positions`` int32, ``loss_mask`` bool,
    each [seq_len]. Raises ValueError if they do not fit."""
    row = empty_row(seq_len, pad_id)
    start = 0
    for seg, p in enumerate(pieces, start=1):
        end = start + len(p)
        if end > seq_len:
            raise ValueError(f"pieces overflow the row: need {end} > seq_len {seq_len}")
        row["input_ids"][start:end] = p.ids
        row["segment_ids"][start:end] = seg
        row["positions"][start:end] = np.arange(len(p), dtype=np.int32)
        row["loss_mask"][start:end] = p.mask
        start = _aligned(end, block_align)
    return row


class BlockPacker:
    """First-fit packer of ``Piece``s into block-aligned rows (see the module docstring).

    ``add(piece)`` returns the rows (lists of pieces) closed by this addition; ``flush()`` closes
    all open rows. ``pack=False`` puts every piece in its own row."""

    def __init__(self, seq_len: int, block_align: int, open_rows: int = 8, pack: bool = True):
        if seq_len % block_align:
            raise ValueError(f"seq_len {seq_len} is not a multiple of block_align {block_align}")
        self.seq_len, self.block_align = seq_len, block_align
        self.open_rows = open_rows if pack else 1
        self.pack = pack
        self._rows: list[list[Piece]] = []
        self._used: list[int] = []  # aligned end of each open row

    def add(self, piece: Piece) -> list[list[Piece]]:
        n = len(piece)
        if not 0 < n <= self.seq_len:
            raise ValueError(f"piece of {n} tokens does not fit seq_len {self.seq_len}")
        closed: list[list[Piece]] = []
        slot = next((i for i, used in enumerate(self._used) if used + n <= self.seq_len), None) \
            if self.pack else None
        if slot is None:
            if len(self._rows) >= self.open_rows:
                closed.append(self._close(0))
            self._rows.append([])
            self._used.append(0)
            slot = len(self._rows) - 1
        self._rows[slot].append(piece)
        self._used[slot] += _aligned(n, self.block_align)
        if self._used[slot] >= self.seq_len or not self.pack:
            closed.append(self._close(slot))
        return closed

    def _close(self, i: int) -> list[Piece]:
        self._used.pop(i)
        return self._rows.pop(i)

    def flush(self) -> list[list[Piece]]:
        rows, self._rows, self._used = self._rows, [], []
        return rows

    def state(self) -> list[list[list[int]]]:
        """Open rows as ``[[doc_index, piece_index], ...]`` lists (JSON-serialisable)."""
        return [[list(p.ref) for p in row] for row in self._rows]

    def restore(self, state: Sequence[Sequence[Sequence[int]]],
                resolve: Callable[[int, int], Piece]) -> None:
        """Rebuild the open rows; ``resolve(doc_index, piece_index)`` must return that piece."""
        self._rows = [[resolve(int(d), int(k)) for d, k in row] for row in state]
        self._used = [sum(_aligned(len(p), self.block_align) for p in row) for row in self._rows]
