"""The context layouts (pallas_kernels/context/layout.py) by hand-computed tables and round trips."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.context.layout import (
    from_layout, from_piece_rows, layout_positions, piece_table, pieces, row_order, to_layout, to_piece_rows,
)


def test_zigzag_table_by_hand():
    assert pieces("contiguous") == 1 and pieces("zigzag") == 2
    np.testing.assert_array_equal(piece_table("zigzag", 4), [[0, 7], [1, 6], [2, 5], [3, 4]])
    np.testing.assert_array_equal(piece_table("contiguous", 3), [[0], [1], [2]])
    # row piece r sits at flat index shard * 2 + piece
    np.testing.assert_array_equal(row_order("zigzag", 4), [0, 2, 4, 6, 7, 5, 3, 1])
    # T 8 over 2 shards: pieces of 2 tokens; shard 0 holds rows 0-1 and 6-7, shard 1 rows 2-3 and 4-5
    np.testing.assert_array_equal(layout_positions(8, 2, "zigzag"), [0, 1, 6, 7, 2, 3, 4, 5])
    np.testing.assert_array_equal(layout_positions(8, 2, "contiguous"), np.arange(8))


def test_zigzag_balances_causal_work():
    """Visible (query, key) pairs of a causal row per shard: zigzag equal, contiguous 1 : 3 : 5 : 7."""
    t, n = 64, 4
    for layout, want_equal in (("zigzag", True), ("contiguous", False)):
        pos = layout_positions(t, n, layout).reshape(n, -1)
        work = [int(np.sum(p + 1)) for p in pos]  # query at row position p sees p + 1 keys
        assert (len(set(work)) == 1) == want_equal, (layout, work)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_round_trips(layout):
    x = jnp.arange(2 * 16 * 3).reshape(2, 16, 3)
    y = to_layout(x, 4 if layout == "contiguous" else 2, layout)
    np.testing.assert_array_equal(from_layout(y, 4 if layout == "contiguous" else 2, layout), x)
    np.testing.assert_array_equal(from_piece_rows(to_piece_rows(x, 2), 2), x)
    np.testing.assert_array_equal(to_piece_rows(x, 2)[1], x[0, 8:])


def test_bad_split_and_name():
    with pytest.raises(ValueError, match="does not split into 8 pieces"):
        layout_positions(12, 4, "zigzag")
    with pytest.raises(ValueError, match="unknown context layout 'ring'"):
        pieces("ring")
