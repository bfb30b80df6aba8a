"""The scheduler's rules on their own, without a model: a BlockManager, a CostModel with fixed
coefficients, and a stand-in for the engine that computes what each step scheduled."""
import itertools

import numpy as np
import pytest

from nano.block_manager import BlockManager
from nano.config import STEP_TARGET, EngineConfig
from nano.cost_model import CostModel
from nano.deadline.cli import policy_factory
from nano.plan import StepPlan
from nano.scheduler import Scheduler
from nano.sequence import SamplingParams, Sequence, Status

BLOCK = 4
KV_BYTES_PER_TOKEN = 1000
# seconds: step base, per prefill token, per decode sequence, per context token
COEF = (0.010, 0.001, 0.002, 0.0)
seq_ids = itertools.count()


def make_scheduler(num_blocks, num_swap_blocks=0, swap_bandwidth=1e9, max_model_len=4096, policy="fcfs",
                   drop_late=False, **config_args) -> Scheduler:
    config = EngineConfig(block_size=BLOCK, enable_prefix_caching=False, **config_args)
    bm = BlockManager(num_blocks, BLOCK, num_swap_blocks, enable_prefix_caching=False)
    return Scheduler(config, bm, max_model_len=max_model_len, kv_bytes_per_token=KV_BYTES_PER_TOKEN,
                     cost_model=CostModel(COEF, swap_bandwidth), policy=policy_factory(policy, drop_late))


def request(sched, prompt_len, arrival=0.0, **params) -> Sequence:
    seq = Sequence(next(seq_ids), "", [7] * prompt_len,
                   SamplingParams(temperature=0, max_tokens=params.pop("max_tokens", 100), **params),
                   arrival, seed=0)
    sched.waiting.append(seq)
    return seq


class FakeKV:
    """Stands in for the runner's pools: each slot holds (seq_id, position) of the token
    whose KV was written there; swaps copy whole blocks as the runner does, out first."""

    def __init__(self):
        self.device, self.host = {}, {}

    def run(self, out):
        for dev, host in out.blocks_to_swap_out:
            self.host[host] = list(self.device[dev])
        for host, dev in out.blocks_to_swap_in:
            self.device[dev] = list(self.host[host])
        for seq, n in out.scheduled:
            for t in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                self.device.setdefault(seq.block_table[t // BLOCK], [None] * BLOCK)[t % BLOCK] = (seq.seq_id, t)

    def check(self, seqs):
        """Every computed token of each running sequence is where its block table says."""
        for seq in seqs:
            for t in range(seq.num_computed_tokens):
                assert self.device[seq.block_table[t // BLOCK]][t % BLOCK] == (seq.seq_id, t), (seq, t)


def step(sched, now=0.0, kv=None):
    """Schedule one step and do what the engine would: compute the scheduled tokens and
    sample one more token for every sequence whose prompt is now all computed."""
    out = sched.schedule(now)
    assert sum(n for _, n in out.scheduled) <= sched.config.token_budget
    assert len(out.scheduled) <= sched.config.max_num_seqs
    if kv is not None:
        kv.run(out)
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
            if seq.first_token_time is None:
                seq.first_token_time = now
    return out


def test_fcfs_victims_are_the_most_recently_admitted_first():
    # Four one-block prompts fill the pool; at their first decode each needs a second block.
    sched = make_scheduler(num_blocks=4, preemption="recompute", watermark=0.0)
    a, b, c, d = (request(sched, BLOCK) for _ in range(4))
    assert [s for s, _ in step(sched).scheduled] == [a, b, c, d]
    out = step(sched)
    # a's decode finds no block: d, admitted last, gives way (not a, which needs the block);
    # then b's: c gives way. a and b grow into what d and c freed.
    assert [p.seq for p in out.preempted] == [d, c]
    assert [s for s, _ in out.scheduled] == [a, b]
    assert list(sched.waiting) == [c, d]  # back at the front, in their old order


def test_admission_keeps_the_free_blocks_at_or_above_the_watermark():
    # 10 blocks, watermark 2: a and b (4 blocks each) leave exactly 2 free, which is allowed;
    # c (1 block) would leave 1, so it waits, in the queue, until a's blocks come back.
    sched = make_scheduler(num_blocks=10, watermark=0.2)
    a, b, c = request(sched, 4 * BLOCK), request(sched, 4 * BLOCK), request(sched, BLOCK)
    out = step(sched)
    assert out.admitted == [a, b] and list(sched.waiting) == [c]
    assert sched.block_manager.num_free_blocks == 2
    sched.finish(a, "stop")
    assert step(sched).admitted == [c]


def test_never_fits_the_pool_is_rejected_at_once_and_does_not_block_the_queue():
    # 10 blocks, watermark 2: one request can ever hold 8 blocks, 32 tokens. A prompt needs
    # room for itself and one generated token: 31 fits exactly, 32 never does.
    sched = make_scheduler(num_blocks=10, watermark=0.2)
    too_long, fits = request(sched, 8 * BLOCK), request(sched, 8 * BLOCK - 1)
    out = step(sched)
    assert out.finished == [too_long] and too_long.finish_reason == "rejected"
    assert "needs 9 KV blocks" in too_long.error and "can ever give one request 8" in too_long.error
    assert out.admitted == [fits] and sched.block_manager.num_free_blocks == 2


def test_never_fits_the_context_is_rejected_at_once_and_does_not_block_the_queue():
    sched = make_scheduler(num_blocks=1000, watermark=0.0, max_model_len=20)
    too_long, fits = request(sched, 20), request(sched, 19)   # 19 + 1 generated = the context
    out = step(sched)
    assert out.finished == [too_long] and "model context of 20" in too_long.error
    assert out.admitted == [fits]


def test_swapped_sequence_waits_for_the_watermark_while_others_run():
    # 10 blocks, watermark 2: c, b (1 block each) and a (6) fill all but 2; at the first
    # decode a, admitted last, needs a 7th block and is swapped out.
    sched = make_scheduler(num_blocks=10, num_swap_blocks=10, preemption="swap", watermark=0.2)
    c, b, a = request(sched, BLOCK), request(sched, BLOCK), request(sched, 6 * BLOCK)
    step(sched)
    assert [(p.seq, p.mode) for p in step(sched).preempted] == [(a, "swap")]
    for _ in range(6):
        step(sched)                          # c and b decode, into 3 blocks each
    sched.finish(b, "stop")
    assert sched.block_manager.num_free_blocks == 7     # a needs 7 back: 0 would be left, below 2
    d = request(sched, BLOCK)                # fits beside the watermark, but a was first
    out = step(sched)
    assert not out.blocks_to_swap_in and [s for s, _ in out.scheduled] == [c]
    assert a.status is Status.SWAPPED and d.status is Status.WAITING  # none admitted past a swapped one
    sched.finish(c, "stop")                  # nothing runs: the watermark is waived
    assert step(sched).blocks_to_swap_in and a.status is Status.RUNNING


def test_swapped_sequence_comes_back_only_within_the_step_budget():
    # As above with no watermark: once b ends, a has room to come back, but c's decode takes
    # the whole budget of one token; a returns at the next step with a budget.
    sched = make_scheduler(num_blocks=10, num_swap_blocks=10, preemption="swap", watermark=0.0)
    c, b, a = request(sched, BLOCK), request(sched, BLOCK), request(sched, 6 * BLOCK)
    step(sched)
    assert [(p.seq, p.mode) for p in step(sched).preempted] == [(a, "swap")]
    sched.finish(b, "stop")
    sched.config.max_num_batched_tokens = 1
    out = step(sched)
    assert [s for s, _ in out.scheduled] == [c] and not out.blocks_to_swap_in and a.status is Status.SWAPPED
    sched.config.max_num_batched_tokens = None
    assert step(sched).blocks_to_swap_in and a.status is Status.RUNNING


def test_next_arrival_is_the_earliest_request_still_to_arrive():
    sched = make_scheduler(num_blocks=10)
    request(sched, BLOCK, arrival=0.0), request(sched, BLOCK, arrival=5.0), request(sched, BLOCK, arrival=3.0)
    step(sched, now=1.0)
    assert sched.next_arrival() == 3.0
    step(sched, now=6.0)
    assert not sched.waiting and sched.next_arrival() is None


def test_reserve_holds_blocks_within_the_watermark_and_refuses_what_never_fits():
    # Blocks for sequences whose KV is written from outside (a KV handoff): 4 blocks, a
    # watermark of 1. Held sequences' blocks are counted as used and freed when they end.
    sched = make_scheduler(num_blocks=4, watermark=0.25, max_model_len=64)

    def handed(tokens):
        seq = Sequence(next(seq_ids), "", [7] * tokens, SamplingParams(temperature=0), 0.0, seed=0)
        seq.num_computed_tokens = tokens  # its KV arrives from the engine that computed it
        return seq
    first, second = handed(2 * BLOCK), handed(2 * BLOCK)
    assert sched.reserve(first) is True
    assert first.status is Status.HELD and len(first.block_table) == 2 and first.num_computed_tokens == 2 * BLOCK
    assert sched.reserve(second) is False and second.status is Status.WAITING  # 0 left, under 1
    assert "model context of 64 tokens" in sched.reserve(handed(100))
    sched.finish(first, "aborted")
    assert sched.block_manager.num_free_blocks == 4 and not sched.held


def test_swap_out_and_in_brings_every_token_back_to_its_slot():
    sched = make_scheduler(num_blocks=10, num_swap_blocks=10, preemption="swap", watermark=0.0)
    kv = FakeKV()
    c, b, a = request(sched, BLOCK), request(sched, 2 * BLOCK + 1), request(sched, 5 * BLOCK + 2)
    swapped_out = swapped_in = 0
    for i in range(12):                        # a, admitted last, is swapped out at once
        if i == 6:
            sched.finish(b, "stop")            # room for a to come back while c runs
        out = step(sched, kv=kv)
        swapped_out += len(out.blocks_to_swap_out)
        swapped_in += len(out.blocks_to_swap_in)
        kv.check(sched.running)
        if out.blocks_to_swap_out:
            (p,) = out.preempted
            assert p.mode == "swap" and [h for _, h in out.blocks_to_swap_out] == p.seq.block_table
    assert swapped_in and swapped_out > swapped_in  # a out, back in, out again (still there)
    assert a.status is Status.SWAPPED and len(sched.block_manager.free_host_blocks) == 10 - len(a.block_table)
    for seq in (a, c):
        sched.finish(seq, "aborted")
    assert len(sched.block_manager.free_host_blocks) == 10 and sched.block_manager.num_free_blocks == 10


def test_recompute_victim_gives_its_blocks_up_and_goes_back_ahead_of_the_queue():
    # 3 blocks: a and b (one block each) run, c (two blocks) waits; at the first decode a
    # needs a second block and b, admitted last, is preempted by recompute.
    sched = make_scheduler(num_blocks=3, preemption="recompute", watermark=0.0)
    kv = FakeKV()
    a, b, c = request(sched, BLOCK), request(sched, BLOCK), request(sched, 2 * BLOCK)
    step(sched, kv=kv)
    assert list(sched.waiting) == [c]
    out = step(sched, kv=kv)
    assert [(p.seq, p.mode) for p in out.preempted] == [(b, "recompute")]
    assert b.status is Status.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert list(sched.waiting) == [b, c]       # it was admitted before c: first in line
    assert len(a.block_table) == 2 and sched.block_manager.num_free_blocks == 1  # a grew into b's freed block
    sched.finish(a, "stop")
    out = step(sched, kv=kv)
    assert out.admitted == [b] and out.scheduled == [(b, BLOCK + 1)]  # its prompt and its token, again
    kv.check(sched.running)


def test_a_step_that_preempts_admits_no_one():
    # 3 blocks, prefix caching on: a (1 block) and b (2 blocks, its first a copy of a's) fill
    # the pool. At the next step a needs a second block and b, admitted last, is preempted by
    # recompute: a's cached block and the one block left would take it straight back, in the
    # step that had no room for it. It comes back the step after.
    config = EngineConfig(block_size=BLOCK, watermark=0.0, preemption="recompute")
    bm = BlockManager(3, BLOCK, 0, enable_prefix_caching=True)
    sched = Scheduler(config, bm, max_model_len=4096, kv_bytes_per_token=KV_BYTES_PER_TOKEN,
                      cost_model=CostModel(COEF, 1e9))
    a, b = (Sequence(next(seq_ids), "", tokens, SamplingParams(temperature=0), 0.0, seed=0)
            for tokens in ([1] * BLOCK, [1] * BLOCK + [2]))
    sched.waiting.extend([a, b])
    step(sched)
    for seq in (a, b):
        bm.register_full_blocks(seq)
    out = step(sched)
    assert [(p.seq, p.mode) for p in out.preempted] == [(b, "recompute")] and not out.admitted
    assert step(sched).admitted == [b]


def test_a_requests_prefix_hit_is_its_first_admissions_not_its_own_blocks_after_recompute():
    """num_cached_prompt_tokens (the server's usage.prompt_tokens_details.cached_tokens): b is
    preempted by recompute once its first block is computed and cached; re-admitted, it finds
    that block (num_cached_tokens), which is its own work, not a hit of its prompt."""
    config = EngineConfig(block_size=BLOCK, preemption="recompute", watermark=0.0)
    bm = BlockManager(3, BLOCK, 0, enable_prefix_caching=True)
    sched = Scheduler(config, bm, max_model_len=4096, kv_bytes_per_token=KV_BYTES_PER_TOKEN,
                      cost_model=CostModel(COEF, 1e9))
    a = Sequence(next(seq_ids), "", [1] * BLOCK, SamplingParams(temperature=0), 0.0, seed=0)
    b = Sequence(next(seq_ids), "", [2] * (BLOCK + 1), SamplingParams(temperature=0), 0.0, seed=0)
    for seq in (a, b):
        sched.waiting.append(seq)

    def run_step():
        out = step(sched)
        for seq, _ in out.scheduled:
            bm.register_full_blocks(seq)
        return out
    run_step()
    assert (a.num_cached_prompt_tokens, b.num_cached_prompt_tokens) == (0, 0)
    assert [p.seq for p in run_step().preempted] == [b]
    sched.finish(a, "stop")
    assert run_step().admitted == [b]
    assert b.num_cached_tokens == BLOCK and b.num_cached_prompt_tokens == 0
    c = Sequence(next(seq_ids), "", [2] * (BLOCK + 3), SamplingParams(temperature=0), 0.0, seed=0)
    sched.waiting.append(c)  # a new request with b's first block as its prefix: a hit of its prompt
    run_step()
    assert c.num_cached_prompt_tokens == BLOCK


def test_chunked_prefill_fills_the_token_budget_and_never_exceeds_it():
    sched = make_scheduler(num_blocks=100, watermark=0.0, max_num_batched_tokens=10)
    kv = FakeKV()
    seqs = [request(sched, n) for n in (3, 37, 15)]
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in seqs):
        work = sum(s.num_uncomputed_tokens for s in seqs)
        out = step(sched, kv=kv)               # (and step() checks the budget)
        assert sum(n for _, n in out.scheduled) == min(10, work)  # no budget left unused while there is work
        kv.check(sched.running)                # each chunk starts where the last one ended
    assert all(s.num_output_tokens >= 1 for s in seqs)


def test_a_step_holds_at_most_max_num_seqs_sequences():
    sched = make_scheduler(num_blocks=100, watermark=0.0, max_num_seqs=2)
    a, b, c = (request(sched, BLOCK) for _ in range(3))
    assert [s for s, _ in step(sched).scheduled] == [a, b] and list(sched.waiting) == [c]


def test_swapped_in_tokens_count_against_the_budget_of_admissions():
    sched = make_scheduler(num_blocks=100, num_swap_blocks=10, preemption="swap", watermark=0.0,
                           max_num_batched_tokens=8)
    s = request(sched, 8)
    step(sched)
    sched._preempt(s, StepPlan())
    assert s.status is Status.SWAPPED
    w = request(sched, 20)
    out = step(sched)                          # s's decode comes back, w gets what is left
    assert out.scheduled == [(s, 1), (w, 7)]


def test_swapped_sequence_comes_back_below_the_watermark_when_nothing_runs():
    # 10 blocks, watermark 2. b (1 block) was admitted first, a (7 blocks) second.
    sched = make_scheduler(num_blocks=10, num_swap_blocks=10, preemption="swap", watermark=0.2)
    b, a = request(sched, 4), request(sched, 28)
    step(sched)                              # both prefilled; 2 blocks left
    for _ in range(4):
        step(sched)                          # decodes: a grows to 8 blocks, b to 2
    out = step(sched)                        # b needs a 3rd block: a, the latest, is swapped out
    assert [(p.seq, p.mode) for p in out.preempted] == [(a, "swap")]
    sched.finish(b, "stop")                  # nothing runs; a needs 9 of the 10 free blocks,
    out = step(sched)                        # which leaves 1, below the watermark of 2
    assert out.blocks_to_swap_in and [s for s, _ in out.scheduled] == [a]
    assert a.status is Status.RUNNING and len(a.block_table) == 9


def test_alone_and_out_of_blocks_finishes_with_length():
    sched = make_scheduler(num_blocks=2, preemption="swap", num_swap_blocks=4, watermark=0.0)
    seq = request(sched, 2 * BLOCK - 1)
    step(sched)                              # prompt computed, one token sampled: 8 tokens
    step(sched)                              # the 8th token's KV fills the second block
    out = step(sched)                        # the 9th needs a third block: there is none, ever
    assert out.finished == [seq] and not out.preempted and not out.scheduled
    assert seq.finish_reason == "length" and not sched.has_work()
    assert sched.block_manager.num_free_blocks == 2


@pytest.mark.parametrize("policy,chunk", [("fcfs", 1000), ("deadline", 28)])
def test_deadline_caps_prefill_where_a_decode_would_miss_its_tpot(policy, chunk):
    sched = make_scheduler(num_blocks=1000, policy=policy, watermark=0.0, max_num_batched_tokens=2048)
    request(sched, BLOCK, max_tokens=10, tpot_slo=0.1)  # "decoding" below
    step(sched, now=0.0)                     # first token at t=0
    request(sched, 1000, arrival=0.5)        # a long prompt arrives while it decodes
    out = step(sched, now=0.5)
    # decoding's last token is due at 0.1 * 9 = 0.9 s; at t=0.5 it has 9 tokens left. The
    # whole prompt in this step would take 0.010 + 0.002 + 1.0 s: too long. The rest of a
    # cut prompt runs in the next steps, which it decodes in too: its 9 steps may take
    # 0.4 s, planned at 90% (MARGIN): 0.04 s each, less the decode's 0.012 s: 28 prefill
    # tokens at 0.001 s a step.
    assert [n for _, n in out.scheduled] == [1, pytest.approx(chunk, abs=1)]


def test_deadline_takes_no_tpot_cap_for_a_decode_that_pays_for_the_prefill_anyway():
    """199 tokens to go, due in 3.38 s: the whole prompt now and 198 decode steps take
    3.388 s, a miss; cut to a block (4 tokens) a step, the decode pays for it in each of
    its 199 steps (3.18 s, over 90% of 3.38 s): no cut saves it, so none is made."""
    sched = make_scheduler(num_blocks=1000, policy="deadline", watermark=0.0, max_num_batched_tokens=2048)
    request(sched, BLOCK, max_tokens=200, tpot_slo=0.0195)
    step(sched, now=0.0)
    request(sched, 1000, arrival=0.5)
    assert [n for _, n in step(sched, now=0.5).scheduled] == [1, 1000]


@pytest.mark.parametrize("ttft_slo,chunk", [(2.0, 28), (1.03, 1000)])
def test_deadline_takes_no_tpot_cap_that_costs_a_first_token(ttft_slo, chunk):
    """The first case, the long prompt with a TTFT target: whole, its first token comes at
    0.5 + 1.012 s; cut to 28 tokens a step, at 0.5 + 36 x 0.012 + 1.0 = 1.932 s. A 2 s target
    affords the cap; a 1.03 s one does not, and one request's TTFT for another's TPOT buys
    nothing: no cap."""
    sched = make_scheduler(num_blocks=1000, policy="deadline", watermark=0.0, max_num_batched_tokens=2048)
    request(sched, BLOCK, max_tokens=10, tpot_slo=0.1)
    step(sched, now=0.0)
    request(sched, 1000, arrival=0.5, ttft_slo=ttft_slo)
    assert [n for _, n in step(sched, now=0.5).scheduled] == [1, pytest.approx(chunk, abs=1)]


@pytest.mark.parametrize("policy", ["fcfs", "deadline"])
def test_deadline_takes_no_tpot_cap_that_buys_nothing(policy):
    """The decode's slack absorbs one long step (its TPOT target is an average): the prompt
    runs whole, as under FCFS, instead of being cut to the decode's per-token pace."""
    sched = make_scheduler(num_blocks=1000, policy=policy, watermark=0.0, max_num_batched_tokens=2048)
    request(sched, BLOCK, max_tokens=10, tpot_slo=0.2)  # last token due at 1.8 s
    step(sched, now=0.0)
    request(sched, 1000, arrival=0.5)
    # At t=0.5: 1.3 s left for 9 tokens; after a 1.012 s step the other 8 at 0.012 s fit.
    assert [n for _, n in step(sched, now=0.5).scheduled] == [1, 1000]


@pytest.mark.parametrize("urgent,chunk", [(False, 1000), (True, 37)])
def test_deadline_ttft_cap_only_for_arrivals_served_first(urgent, chunk):
    """A recent request with a tight TTFT target: a step carrying a prompt with a later
    deadline is cut to a third of that target (0.15 s / 3 = 0.05 s, less the 0.010 s base:
    40 prefill tokens, 3 for the short prompt and 37 of the long one); with the same target
    for both, an arrival would wait for the long prompt however its prefill is cut: no cap."""
    sched = make_scheduler(num_blocks=1000, policy="deadline", watermark=0.0, max_num_batched_tokens=2048)
    request(sched, 1000, ttft_slo=0.15 if not urgent else 100.0)  # its deadline
    request(sched, 3, ttft_slo=0.15)                              # a recent tight target
    out = step(sched, now=0.0)
    short, long = sorted(n for _, n in out.scheduled)
    assert short == 3 and long == pytest.approx(chunk, abs=1)


@pytest.mark.parametrize("later_target,order", [(1.0, "AB"), (0.1, "BA")])
def test_deadline_moves_a_late_request_back_only_to_save_another(later_target, order):
    """A's first token cannot make its 0.05 s target (0.010 s step + 100 x 0.001 s). B behind
    it makes a 1 s target even after A's prefill (0.12 s): A keeps its place, in case the
    prediction is wrong. B's 0.1 s target it makes only if it goes first (0.02 s): A moves.
    (--drop-late, so that the policy names the late ones.)"""
    sched = make_scheduler(num_blocks=1000, policy="deadline", drop_late=True, watermark=0.0,
                           max_num_batched_tokens=2048)
    a = request(sched, 100, ttft_slo=0.05)
    b = request(sched, 10, ttft_slo=later_target)
    sched.now = 0.0
    admitted, late = sched.policy.admission_order([a, b])
    assert late == [a] and admitted == ([a, b] if order == "AB" else [b, a])


def test_deadline_prefill_cap_ignores_decodes_already_late():
    sched = make_scheduler(num_blocks=1000, policy="deadline", watermark=0.0, max_num_batched_tokens=2048)
    request(sched, BLOCK, max_tokens=10, tpot_slo=0.01)   # due at 0.09 s: late by t=0.5
    step(sched, now=0.0)
    request(sched, 1000, arrival=0.5)
    assert [n for _, n in step(sched, now=0.5).scheduled] == [1, 1000]


def preempted_mode(sched) -> str:
    """Fill a 2-block pool with two one-block prompts; at the first decode the second gives
    way. Returns why it went the way it did."""
    for _ in range(2):
        request(sched, BLOCK)
    step(sched)
    (preemption,) = step(sched).preempted
    return preemption.reason


def test_learned_swap_bandwidth_turns_swap_into_recompute():
    # The victim has 4 computed tokens: recompute costs 4 x 0.001 s; swapping 4,000 bytes
    # out and back at the prior 1 GB/s costs 8 us.
    args = dict(num_blocks=2, num_swap_blocks=2, preemption="auto", watermark=0.0)
    assert preempted_mode(make_scheduler(**args)) == "swap_cheaper"
    learned = make_scheduler(**args)
    for _ in range(50):  # swaps measured at 1 MB/s: 8 ms, now dearer than recomputing
        learned.policy.cost.observe_swap(1_000_000, 1.0)
    assert preempted_mode(learned) == "recompute_cheaper"


def test_learned_prefill_cost_turns_recompute_into_swap():
    # At 1 MB/s a swap of the victim costs 8 ms, more than the prior 4 ms of recompute.
    args = dict(num_blocks=2, num_swap_blocks=2, preemption="auto", watermark=0.0, swap_bandwidth=1e6)
    assert preempted_mode(make_scheduler(**args)) == "recompute_cheaper"
    learned = make_scheduler(**args)
    for i in range(32):  # steps measured at 10 ms per prefill token: recompute now costs 40 ms
        prefill = 16 * (i % 8 + 1)
        learned.policy.cost.observe_step(prefill, 0, 0, COEF[0] + 0.010 * prefill)
    assert preempted_mode(learned) == "swap_cheaper"


def test_step_time_fit_keeps_every_term_non_negative_without_mispricing_small_steps():
    """Steps whose best free fit has a negative term (decodes' context cost drowned by their
    count: collinear, as in a real saturated run): the fit has no negative term and still
    prices decode steps close to what they took. Clipping the free fit's negative term to 0
    instead leaves the others fitted around it: decode steps priced ~30% off (median)."""
    rng = np.random.default_rng(0)
    steps = [(int(rng.integers(256, 2048)), 0, 0) if i % 8 == 0 else (0, d, d * int(rng.integers(100, 500)))
             for i, d in enumerate(rng.integers(1, 25, 64))]
    took = {s: 0.05 + 0.0028 * s[0] + 0.009 * s[1] - 1.2e-5 * s[2] for s in steps}
    cost = CostModel((0.05, 0.003, 0.005, 1e-6), 1e9)
    for s in steps:
        cost.observe_step(*s, took[s])
    assert (cost.coef >= 0).all()
    errors = [abs(cost.step_time(*s) - took[s]) / took[s] for s in steps if s[1]]
    assert np.median(errors) < 0.15, np.median(errors)


def test_the_window_ring_fits_what_a_fit_of_the_last_steps_in_order_gives():
    """The cost model keeps its window of steps as a ring of columns: after every step of a long
    random run (past the window three times, prefills and decodes mixed, so the newest steps
    move the fit) its coefficients are a from-scratch fit of the last `window` steps, in the
    order observed, within float64 rounding (the sums run in another order)."""
    rng, window = np.random.default_rng(1), 64
    cost = CostModel((0.05, 0.003, 0.005, 1e-6), 1e9, window=window)
    steps = []
    for i in range(3 * window + 17):
        prefill, decodes = int(rng.integers(0, 2048)) * (i % 5 == 0), int(rng.integers(0, 40))
        steps.append((prefill, decodes, decodes * int(rng.integers(10, 900)),
                      0.02 + 3e-4 * prefill + 2e-3 * decodes + rng.normal(0, 4e-3)))
        cost.observe_step(*steps[-1])
        last = np.array(steps[-window:])
        fresh = cost._fit(np.r_[[np.ones(len(last))], last[:, :3].T], last[:, 3]) if i >= 7 else cost.prior
        np.testing.assert_allclose(cost.coef, fresh, rtol=1e-9, atol=1e-15, err_msg=f"step {i}")


def test_decode_only_steps_ask_for_no_fit_and_the_next_question_gets_a_fresh_one():
    """The cost model fits its window when a decision asks for a cost, not on every step: under
    FCFS a step with no prompt to budget for asks nothing, so a run of decode-only steps costs
    no fit; the first question after them is answered from a fit of every step observed."""
    sched = make_scheduler(num_blocks=64)
    cost = sched.policy.cost
    request(sched, BLOCK, max_tokens=50)
    step(sched)  # the prompt: its budget asks the model (the prior, under 8 steps)
    for i in range(20):
        out = step(sched)
        assert out.num_decodes == 1 and not out.prefill_tokens
        cost.observe_step(out.prefill_tokens, out.num_decodes, out.decode_kv_tokens, 0.01 + 1e-4 * i)
    assert cost.fitted[0] == 0  # 20 steps observed, none fitted
    request(sched, BLOCK)
    step(sched)  # a prompt to budget for: the model answers from all 20
    assert cost.fitted[0] == 20 and (cost.fitted[1] != cost.prior).any()


def test_drop_late_never_rejects_a_sequence_that_has_output_already():
    """Preempted by recompute after its first token: back in the queue, long past its TTFT
    deadline, but its target was met; --drop-late must not throw its output away."""
    sched = make_scheduler(num_blocks=2, policy="deadline", drop_late=True, watermark=0.0,
                           preemption="recompute")
    for _ in range(2):
        request(sched, BLOCK, ttft_slo=0.05)
    step(sched, now=0.0)                     # both prompts, one block each: first tokens
    out = step(sched, now=1.0)               # both need a second block: one is recomputed
    assert [p.seq for p in out.preempted] and out.preempted[0].mode == "recompute"
    victim = out.preempted[0].seq
    assert victim.first_token_time == 0.0 and victim.status is Status.WAITING
    for t in (2.0, 3.0, 4.0):
        step(sched, now=t)
        assert victim.finish_reason != "rejected", victim.error


@pytest.mark.parametrize("policy", ["fcfs", "deadline"])
def test_the_default_budget_keeps_a_step_near_the_step_target(policy):
    """Without --max-num-batched-tokens a step carries what the step-time model says fits
    STEP_TARGET (1 s): 0.010 + 4 decodes x 0.002 + n x 0.001 s -> 982 prompt tokens, the rest
    in later steps, so no running stream waits much longer than that for its next token. Given
    a budget, the step takes all of it, as vLLM does."""
    for budget, chunk in ((None, 982), (2048, 2000)):
        sched = make_scheduler(num_blocks=1000, policy=policy, watermark=0.0, max_num_batched_tokens=budget)
        for _ in range(4):
            request(sched, BLOCK, max_tokens=50)
        step(sched)                           # the four decode from now on
        request(sched, 2000)
        out = step(sched)
        assert [n for _, n in out.scheduled] == [1, 1, 1, 1, chunk]
        assert (sched.policy.cost.step_time(chunk, 4, 0) <= STEP_TARGET) == (budget is None)
