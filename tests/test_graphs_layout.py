"""Host-side logic of the packed step (nano/plan.py) and of the decode CUDA graphs
(nano/graphs.py), no GPU needed: a plan's packing, buckets, and the padded
static-buffer layout that one host-to-device copy moves per step."""
import numpy as np

from nano.graphs import DecodeGraphs, batch_buckets
from nano.plan import PackedShape, StepPlan, packed_shape, unpack_step
from nano.sequence import SamplingParams, Sequence


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
                         np.int32([21, 4, 18]), tables, np.int32([2, -1, 0]))
    fields = unpack_step(host, packed_shape(host))
    ids, positions, slots, context, rows = (fields[k] for k in (
        "input_ids", "positions", "slot_mapping", "context_lens", "logits_indices"))
    np.testing.assert_array_equal(ids, [11, 12, 13, 0])
    np.testing.assert_array_equal(positions, [20, 3, 17, 0])
    np.testing.assert_array_equal(slots, [73, 115, 49, -1])   # padding writes no KV
    np.testing.assert_array_equal(context, [21, 4, 18, 1])    # padding attends to one token...
    np.testing.assert_array_equal(rows, [0, 1, 2, 3])
    assert fields["cu_seqlens_q"].tolist() == [0]
    padded = fields["block_tables"]
    np.testing.assert_array_equal(padded[:3, :2], tables)
    assert (padded[:3, 2:] == -1).all()
    np.testing.assert_array_equal(padded[3], [0, -1, -1, -1, -1])  # ...in block 0, a real block
    assert fields["lora_slots"].tolist() == [2, -1, 0, -1]  # padding rows have no adapter


def sequence(seq_id, tokens, computed, blocks):
    seq = Sequence(seq_id, "", tokens, SamplingParams(), 0.0, 0)
    seq.num_computed_tokens, seq.block_table = computed, blocks
    return seq


def test_a_mixed_step_packs_in_the_plan_layout():
    """Rows decodes first; a prefill chunk short of its prompt's end samples nothing; the
    swaps travel in the same array (what rank 0 broadcasts under TP)."""
    chunk = sequence(0, list(range(100, 110)), 0, [5, 6])       # 6 of 10 prompt tokens this step
    decode = sequence(1, [7, 8, 9, 10, 11], 4, [2, 3])          # its 5th token
    prefill = sequence(2, [20, 21, 22], 0, [9])                 # the whole prompt: samples
    plan = StepPlan(scheduled=[(chunk, 6), (decode, 1), (prefill, 3)],
                           blocks_to_swap_out=[(4, 0)], blocks_to_swap_in=[(1, 8), (2, 9)]).freeze(block_size=4)
    assert [sample.seq for sample in plan.samples] == [decode, prefill]
    packed = plan.packed
    sizes = packed_shape(packed)
    assert sizes == PackedShape(swap_out=1, swap_in=2, tokens=10, seqs=3, decodes=1, max_blocks=2, logits=2)
    f = unpack_step(packed, sizes)
    assert f["blocks_to_swap_out"].tolist() == [[4, 0]] and f["blocks_to_swap_in"].tolist() == [[1, 8], [2, 9]]
    assert f["input_ids"].tolist() == [11] + list(range(100, 106)) + [20, 21, 22]
    assert f["positions"].tolist() == [4, 0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert f["slot_mapping"].tolist() == [12, 20, 21, 22, 23, 24, 25, 36, 37, 38]
    assert f["context_lens"].tolist() == [5, 6, 3]
    assert f["block_tables"].tolist() == [[2, 3], [5, 6], [9, -1]]
    assert f["cu_seqlens_q"].tolist() == [0, 6, 9]
    assert f["logits_indices"].tolist() == [0, 9]


def test_a_decode_step_packs_as_its_graph_bucket_lays_it_out():
    seqs = [sequence(i, list(range(3 + i)), 2 + i, [i, 10 + i]) for i in range(2)]
    packed = StepPlan(scheduled=[(s, 1) for s in seqs]).freeze(block_size=4).packed
    f = unpack_step(packed, packed_shape(packed))
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs.max_blocks = 2
    host = graphs.layout(2, f["input_ids"], f["positions"], f["slot_mapping"], f["context_lens"],
                         f["block_tables"], f["lora_slots"])
    np.testing.assert_array_equal(host, packed)


def test_the_plan_is_fixed_when_planned():
    """What a step computes and what each logits row is for are taken when the step is
    planned: advancing its sequences afterwards, as postprocessing does, changes nothing."""
    scorer = Sequence(3, "", [30, 31, 32, 33], SamplingParams(prompt_logprobs=2), 0.0, 0)
    scorer.block_table = [7]
    decode = sequence(1, [7, 8, 9, 10], 4, [2, 3])
    decode.token_ids.append(11)  # its first output token, now fed back
    plan = StepPlan(scheduled=[(scorer, 4), (decode, 1)]).freeze(block_size=4)
    fixed = (plan.packed.copy(), [(s.seq.seq_id, list(s.rows), s.drafts, s.output_count) for s in plan.samples],
             [(s.seq.seq_id, s.row, s.target) for s in plan.scores], plan.prefill_tokens, plan.num_decodes,
             plan.decode_kv_tokens)
    assert fixed[1:] == ([(1, [0], [], 1), (3, [4], [], 0)], [(3, 1, 31), (3, 2, 32), (3, 3, 33)], 4, 1, 5)
    for seq, n in plan.scheduled:  # the engine's postprocessing
        seq.num_computed_tokens += n
        seq.token_ids.append(99)
    scorer.prompt_logprobs += [(0.0, 1, [])] * 3
    np.testing.assert_array_equal(plan.packed, fixed[0])
    assert [(s.seq, list(s.rows), s.drafts, s.output_count) for s in plan.samples] == [(decode, [0], [], 1), (scorer, [4], [], 0)]
    assert [(s.seq, s.row, s.target) for s in plan.scores] == [(scorer, 1, 31), (scorer, 2, 32), (scorer, 3, 33)]
    assert (plan.prefill_tokens, plan.num_decodes, plan.decode_kv_tokens) == (4, 1, 5)
