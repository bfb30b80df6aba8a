"""Host-side logic of the decode CUDA graphs (nano/graphs.py), no GPU needed: buckets and
the padded static-buffer layout that one host-to-device copy moves per step."""
import numpy as np

from nano.graphs import FIELDS, DecodeGraphs, batch_buckets


def test_buckets():
    assert batch_buckets(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(1) == [1]


def test_layout_pads_rows_safely():
    graphs = DecodeGraphs.__new__(DecodeGraphs)  # layout needs no GPU state
    graphs.max_blocks = 5
    tables = np.array([[4, 9], [7, -1], [2, 3]], np.int32)
    host = graphs.layout(4, np.int32([11, 12, 13]), np.int32([20, 3, 17]), np.int32([73, 115, 49]),
                         np.int32([21, 4, 18]), tables)
    ids, positions, slots, context, rows = host[:FIELDS * 4].reshape(FIELDS, 4)
    np.testing.assert_array_equal(ids, [11, 12, 13, 0])
    np.testing.assert_array_equal(positions, [20, 3, 17, 0])
    np.testing.assert_array_equal(slots, [73, 115, 49, -1])   # padding writes no KV
    np.testing.assert_array_equal(context, [21, 4, 18, 1])    # padding attends to one token...
    np.testing.assert_array_equal(rows, [0, 1, 2, 3])
    assert host[FIELDS * 4] == 0
    padded = host[FIELDS * 4 + 1:].reshape(4, 5)
    np.testing.assert_array_equal(padded[:3, :2], tables)
    assert (padded[:3, 2:] == -1).all()
    np.testing.assert_array_equal(padded[3], [0, -1, -1, -1, -1])  # ...in block 0, a real block
