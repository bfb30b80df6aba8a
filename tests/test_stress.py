"""Randomized stress: hundreds of requests with shared prefixes and random lengths through a
tiny KV pool, with the block manager's and scheduler's invariants checked after every step."""
from collections import Counter

import numpy as np
import pytest

from nano.config import EngineConfig
from nano.engine import LLMEngine
from nano.sequence import SamplingParams, Status
from nano.speculative import attach
from nano.telemetry.metrics import Metrics
from test_speculative import SPEC, Checked


def check_invariants(engine: LLMEngine) -> None:
    bm, sched = engine.block_manager, engine.scheduler
    owners = Counter()
    for seq in sched.running + sched.held:  # held: out of the batch with their blocks
        assert seq.status is (Status.RUNNING if seq in sched.running else Status.HELD)
        assert len(set(seq.block_table)) == len(seq.block_table), "a sequence holds a block twice"
        assert len(seq.block_table) >= bm.num_blocks_for(seq.num_computed_tokens)
        owners.update(seq.block_table)
    for block in bm.blocks:
        assert block.ref_count == owners[block.block_id], f"block {block.block_id} ref count != owners"
    free = set(bm.free_blocks)
    assert len(free) == len(bm.free_blocks)
    assert free == {b.block_id for b in bm.blocks if b.ref_count == 0}, "free list != unreferenced blocks"
    assert len(free) + len(owners) == bm.num_blocks, "free + used != total"
    for h, block_id in bm.hash_to_block.items():
        assert bm.blocks[block_id].hash == h
    assert sum(b.hash is not None for b in bm.blocks) == len(bm.hash_to_block)
    host = Counter()
    for seq in sched.swapped:
        assert seq.status is Status.SWAPPED
        host.update(seq.block_table)
    assert all(c == 1 for c in host.values()), "a host block owned twice"
    assert not set(host) & set(bm.free_host_blocks)
    assert len(host) + len(bm.free_host_blocks) == bm.num_swap_blocks
    for seq in sched.waiting:
        assert seq.status is Status.WAITING and not seq.block_table
    ids = [s.seq_id for s in sched.running + sched.held + list(sched.swapped) + list(sched.waiting)]
    assert len(ids) == len(set(ids)), "a sequence in two queues"


def make_requests(rng, n, vocab):
    prefixes = [rng.integers(3, vocab, int(rng.integers(8, 60))).tolist() for _ in range(8)]
    prompts, params = [], []
    for i in range(n):
        prefix = prefixes[int(rng.integers(len(prefixes)))] if rng.random() < 0.7 else []
        prompts.append(prefix + rng.integers(3, vocab, int(rng.integers(1, 40))).tolist())
        params.append(SamplingParams(temperature=float(rng.choice([0.0, 0.8])), seed=i,
                                     max_tokens=int(rng.integers(1, 40)), ignore_eos=bool(rng.random() < 0.5)))
    return prompts, params


@pytest.mark.parametrize("preemption,seed,speculative", [("auto", 0, False), ("swap", 1, False), ("recompute", 2, False),
                                                       ("auto", 3, True)])
def test_stress_invariants(tiny_model, tiny_dense, preemption, seed, speculative):
    rng = np.random.default_rng(seed)
    config = EngineConfig(model=str(tiny_model), device="cpu", num_blocks=40, block_size=8,
                          max_num_batched_tokens=int(rng.integers(16, 96)), max_num_seqs=12,
                          watermark=0.05, preemption=preemption,
                          # 24 host blocks of 8 tokens x (K, V x 2 layers x 2 KV heads x 16 dims x 4 bytes):
                          # small enough that swap space runs out too
                          swap_space=24 * 8 * (2 * 2 * 2 * 16 * 4))
    engine = LLMEngine(config)
    m = Metrics.attach(engine)
    if speculative:  # drafts too: each step's rollback checked as well
        attach(engine, SPEC)
        engine.observers.append(checked := Checked(engine))
    prompts, params = make_requests(rng, 300, 512)

    schedule = engine.scheduler.schedule

    def checked_schedule(now):
        out = schedule(now)
        assert sum(n for _, n in out.scheduled) <= config.token_budget
        assert len(out.scheduled) <= config.max_num_seqs
        assert all(n >= 1 for _, n in out.scheduled)
        if out.admitted:  # admissions come last in a step, each checked against the watermark
            assert engine.block_manager.num_free_blocks >= engine.scheduler.watermark_blocks
        return out

    engine.scheduler.schedule = checked_schedule
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        check_invariants(engine)
        steps += 1
        assert steps < 20000, "no progress"

    assert all(s.is_finished for s in seqs)
    reasons = Counter(s.finish_reason for s in seqs)
    assert reasons["rejected"] == 0
    for s in seqs:
        assert s.num_output_tokens == s.params.max_tokens or s.finish_reason == "stop"
    assert sum(m.preemptions.values()) > 0 and m.prefix_hits > 0
    if speculative:
        assert checked.accepted > 0 and checked.rejected > 0
    if preemption == "auto":
        assert "recompute:no_swap_space" in m.preemption_reasons or m.preemptions["swap"] > 0
    # Pool drained: every block back, all host blocks free.
    assert engine.block_manager.num_free_blocks == config.num_blocks
    assert len(engine.block_manager.free_host_blocks) == engine.block_manager.num_swap_blocks
    # And the answers are still right: greedy requests against the dense reference.
    greedy = [(p, s) for p, s in zip(prompts, seqs) if s.params.temperature == 0][:15]
    for prompt, seq in greedy:
        expected = tiny_dense.greedy(prompt, seq.num_output_tokens)
        assert seq.output_token_ids == expected[:seq.num_output_tokens]


def test_never_fits_is_rejected_without_blocking_others(tiny_model):
    engine = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu", num_blocks=8, block_size=8,
                                    watermark=0.0, max_model_len=200))
    metrics = Metrics.attach(engine)
    params = SamplingParams(temperature=0, max_tokens=4)
    prompts = [[5] * 10, [6] * 70, [7] * 300, [], [8] * 12]  # 70 > pool (64 slots), 300 > context
    seqs = engine.generate(prompts, params)
    assert [s.finish_reason for s in seqs] == ["length", "rejected", "rejected", "rejected", "length"]
    assert "KV blocks" in seqs[1].error and "context" in seqs[2].error and "empty" in seqs[3].error
    assert metrics.rejected == 3


def test_same_seed_same_output_whatever_the_batch(tiny_model):
    engine = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu"))
    target = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=20)
    alone = engine.generate([[1, 2, 3, 4]], target)[0].output_token_ids
    others = [SamplingParams(temperature=0.7, seed=i, max_tokens=30) for i in range(5)]
    batch = engine.generate([[9, 9, 9]] * 2 + [[1, 2, 3, 4]] + [[7, 8]] * 3, others[:2] + [target] + others[2:5])
    assert batch[2].output_token_ids == alone
    other_seed = engine.generate([[1, 2, 3, 4]], SamplingParams(temperature=1.0, top_p=0.9, top_k=50,
                                                                 seed=99, max_tokens=20))[0]
    assert other_seed.output_token_ids != alone
