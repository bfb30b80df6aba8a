"""Disaggregated prefill and decode (nano/disagg.py): whole clusters of engines run in one
process over LocalLinks (tiny model, invariants checked after every round), then real runs
under mpirun with the default model."""
import dataclasses
import json
from collections import Counter

import numpy as np
import pytest

from nano.config import EngineConfig
from nano.disagg import kv_transfer
from nano.fleet.links import LocalLinks
from nano.disagg.metrics import summary
from nano.fleet.ranks import Node, run_local
from nano.disagg.serving import DecodeInstance, PrefillInstance, Router, parse_split
from nano.engine import LLMEngine
from nano.errors import NanoError
from nano.sequence import SamplingParams, Sequence, Status
from nano.speculative import attach
from nano.telemetry.metrics import Metrics, metrics_of
from test_speculative import Checked
from test_stress import check_invariants, make_requests
from test_tp import PROMPTS, assert_one_line_error, interrupt_one_rank, launch, needs_mpi


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    """Two 8-token blocks of the tiny model per payload message: handoffs arrive in pieces."""
    monkeypatch.setattr(kv_transfer, "PIECE_BYTES", 2 * 2 * 2 * 2 * 8 * 16 * 4)


SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def tiny_config(model, **overrides) -> EngineConfig:
    base = dict(model=str(model), device="cpu", num_blocks=64, block_size=8, max_num_batched_tokens=48,
                max_num_seqs=12, watermark=0.05, swap_space=32 * 8 * (2 * 2 * 2 * 16 * 4))
    return EngineConfig(**{**base, **overrides})


def cluster(prefill: list[EngineConfig], decode: list[EngineConfig], links=None, speculative=None) -> list[Node]:
    """One engine per config, prefill instances first (rank 0 routes), all in this process;
    the decode instances speculate with the `speculative` config, if given."""
    links = links or LocalLinks(len(prefill) + len(decode))
    nodes = []
    for rank, config in enumerate(prefill + decode):
        kind = PrefillInstance if rank < len(prefill) else DecodeInstance
        engine = LLMEngine(config)
        if kind is DecodeInstance and speculative:
            attach(engine, speculative)
            engine.observers.append(Checked(engine))  # its rollback checked after every step
        Metrics.attach(engine)
        nodes.append(Node(kind(engine, links.link(rank))))
    nodes[0].router = Router(links.link(0), len(prefill), len(decode), prefill[0].block_size,
                             nodes[0].instance.engine.clock)
    return nodes


def serve(nodes, prompts, params, on_tick=None) -> list[Sequence]:
    """Every request through the cluster; each one's result, in input order. The engines'
    invariants are checked after every round."""
    engine, router = nodes[0].instance.engine, nodes[0].router
    seqs = [engine.make_sequence(p, sp, 0.0) for p, sp in zip(prompts, params)]
    router.add(seqs)

    def checked(nodes):
        for node in nodes:
            check_invariants(node.instance.engine)
        if on_tick:
            on_tick(nodes)
    run_local(nodes, checked)
    assert sorted(router.results) == sorted(s.seq_id for s in seqs)  # one result each
    return [router.results[s.seq_id] for s in seqs]


def assert_no_leaks(nodes, links=None):
    for node in nodes:
        engine = node.instance.engine
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks, f"rank {node.instance.rank}: blocks leaked"
        assert len(bm.free_host_blocks) == bm.num_swap_blocks
        assert not engine.scheduler.has_work() and not engine.scheduler.held
        assert not getattr(node.instance, "offers", [])
    assert node.instance.stopped
    if links:
        assert not links.payloads, "a payload nobody received"
    report = nodes[0].router.reports
    assert all(r.used_blocks == 0 and r.used_swap_blocks == 0 for r in report.values())


def colocated(config, prompts, params) -> list[Sequence]:
    return LLMEngine(config).generate(prompts, params)


def workload(seed: int, n: int = 40):
    """Prompts sharing prefixes (prefix cache hits on the prefill side), greedy and seeded
    sampling, some finishing at their first token."""
    return make_requests(np.random.default_rng(seed), n, 512)


# ---- equivalence ------------------------------------------------------------------------
@pytest.mark.parametrize("split,kv,speculative", [((1, 1), "auto", None), ((2, 1), "auto", None), ((1, 2), "auto", None),
                                                  ((1, 1), "int8", None), ((1, 1), "auto", SPECULATIVE)])
def test_same_tokens_as_one_engine(tiny_model, split, kv, speculative):
    config = tiny_config(tiny_model, kv_cache_dtype=kv)
    prompts, params = workload(sum(split))
    links = LocalLinks(sum(split))
    nodes = cluster([config] * split[0], [config] * split[1], links, speculative)
    results = serve(nodes, prompts, params)
    expected = colocated(config, prompts, params)
    assert [r.output_token_ids for r in results] == [e.output_token_ids for e in expected]
    assert [r.finish_reason for r in results] == [e.finish_reason for e in expected]
    assert_no_leaks(nodes, links)
    s = summary(nodes[0].router, 1.0)
    assert s["prefix_cache_hit_rate"] > 0  # the prefill side's prefix cache at work
    assert s["handoffs"] == sum(e.num_output_tokens > 1 for e in expected)  # the rest end at their first token
    assert all(r.summary["steps"] > 0 for r in nodes[0].router.reports.values())  # routing spreads the work
    if speculative:  # the decode side checked drafts and accepted some
        checked = next(o for o in nodes[-1].instance.engine.observers if isinstance(o, Checked))
        assert checked.accepted > 0 and checked.rejected > 0


# ---- checksums ----------------------------------------------------------------------------
def filled_sequence(engine, num_tokens: int, seq_id: int = 7) -> Sequence:
    """A running sequence owning blocks of engine's pool, which is filled with random values."""
    rng = np.random.default_rng(seq_id)
    for a in engine.runner.kv_cache.block_arrays():
        a[...] = rng.standard_normal(a.shape).astype(a.dtype) if a.dtype.kind == "f" else \
            rng.integers(-127, 128, a.shape).astype(a.dtype)
    seq = Sequence(seq_id, "", list(range(num_tokens + 1)), SamplingParams(), 0.0, 0)
    seq.block_table = [5, 2, 9]
    seq.num_computed_tokens = num_tokens
    return running(engine, seq)


def running(engine, seq: Sequence) -> Sequence:
    """seq in engine's batch, as a prefilled one is when it is handed off."""
    seq.status = Status.RUNNING
    engine.scheduler.running.append(seq)
    return seq


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_blocks_arrive_exactly_and_each_is_checked(tiny_model, kv):
    config = tiny_config(tiny_model, kv_cache_dtype=kv)
    sender, receiver = LLMEngine(config), LLMEngine(config)
    seq = filled_sequence(sender, 20)  # 20 tokens of 8-token blocks: 3 blocks, the last part-filled
    offer, payload = kv_transfer.pack(sender, seq, 0, 2, lambda: 0.0)
    assert offer.num_blocks == 3 and payload.shape[0] == 3 and offer.seq.block_table == []
    kv_transfer.verify(offer, payload)
    receiver.runner.write_blocks([1, 3, 0], payload)
    for a, b in zip(sender.runner.kv_cache.block_arrays(), receiver.runner.kv_cache.block_arrays()):
        np.testing.assert_array_equal(a[:, :, [5, 2, 9]], b[:, :, [1, 3, 0]])

    corrupt = payload.copy()
    corrupt[1, 100] ^= 1
    with pytest.raises(kv_transfer.ChecksumError, match="block 1 of 3 failed its checksum"):
        kv_transfer.verify(offer, corrupt)
    with pytest.raises(kv_transfer.ChecksumError, match="block 0 of 3"):  # rows out of place: stale
        kv_transfer.verify(offer, payload[[2, 1, 0]])
    other = filled_sequence(sender, 20, seq_id=8)
    other.block_table = seq.block_table
    other_offer, other_payload = kv_transfer.pack(sender, other, 0, 2, lambda: 0.0)
    with pytest.raises(kv_transfer.ChecksumError, match="block 0"):  # another sequence's payload
        kv_transfer.verify(offer, other_payload)
    kv_transfer.verify(offer, payload[1:], first=1)  # a piece: blocks 1 and 2
    with pytest.raises(kv_transfer.ChecksumError, match="block 0 of 3"):
        kv_transfer.verify(offer, payload[1:])
    with pytest.raises(kv_transfer.ChecksumError, match="block 3 arrived, 3 were sent"):
        kv_transfer.verify(offer, payload, first=1)
    assert kv_transfer.pieces(dataclasses.replace(offer, blocks_per_piece=2)) == [(0, 2), (2, 1)]


def test_payload_buffers_are_reused_smallest_first():
    buffers = kv_transfer.PayloadBuffers()
    a, b = buffers.take(100), buffers.take(300)
    assert a.nbytes == 100 and b.nbytes == 300
    buffers.give(b)
    buffers.give(a)
    assert buffers.take(50) is a and buffers.take(200) is b and buffers.take(10) is not a


class CorruptingLinks(LocalLinks):
    """Flips one byte in the payload of the sequences named."""

    def __init__(self, n: int, victims: set[int]):
        super().__init__(n)
        self.victims = victims

    def link(self, rank):
        link = super().link(rank)
        send = link.send_payload

        def send_payload(dest, tag, array):
            array = array.copy()
            if any(tag == 2 + v for v in self.victims):
                array[-1, -1] ^= 0x10
            send(dest, tag, array)
        link.send_payload = send_payload
        return link


def test_a_corrupt_block_fails_its_request_alone(tiny_model):
    config = tiny_config(tiny_model)
    prompts = [list(range(3, 30)), list(range(40, 75)), list(range(80, 100))]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * 3
    links = CorruptingLinks(2, victims={1})
    nodes = cluster([config], [config], links)
    results = serve(nodes, prompts, params)
    expected = colocated(config, prompts, params)
    assert results[1].finish_reason == "rejected"
    assert results[1].error == "KV handoff of request 1: block 1 of 5 failed its checksum (corrupt or stale)"  # the last block of the first piece
    for i in (0, 2):
        assert results[i].output_token_ids == expected[i].output_token_ids
    assert_no_leaks(nodes, links)


# ---- back-pressure ------------------------------------------------------------------------
def test_back_pressure_holds_blocks_on_the_prefill_side(tiny_model):
    """A decode pool with room for ~3 sequences: offers wait for it (their payloads stay
    with the prefill side, whose held blocks then stop it admitting), and every admission
    respects the decode side's watermark. Outputs are still the colocated ones."""
    prefill, decode = tiny_config(tiny_model, num_blocks=24), tiny_config(tiny_model, num_blocks=20)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 512, int(rng.integers(20, 40))).tolist() for _ in range(16)]
    params = [SamplingParams(temperature=0, max_tokens=int(rng.integers(8, 20)), ignore_eos=True, seed=i)
              for i in range(16)]
    links = LocalLinks(2)
    nodes = cluster([prefill], [decode], links)
    seen = Counter()
    d = nodes[1].instance
    reserve = d.engine.scheduler.reserve

    def checked_reserve(seq):
        taken = reserve(seq)
        if taken is True:
            seen["adopted"] += 1
            assert d.engine.block_manager.num_free_blocks >= d.engine.scheduler.watermark_blocks
        return taken
    d.engine.scheduler.reserve = checked_reserve

    def watch(nodes):
        p = nodes[0].instance
        if d.offers:
            seen["offers waiting"] += 1
            assert len(links.payloads) >= len(d.offers)  # not received: still the prefill side's
        if p.engine.scheduler.held and p.engine.scheduler.waiting:
            seen["prefill blocked"] += 1
    results = serve(nodes, prompts, params, watch)
    assert seen["offers waiting"] > 0 and seen["prefill blocked"] > 0 and seen["adopted"] == 16, seen
    expected = colocated(decode, prompts, params)
    assert [r.output_token_ids for r in results] == [e.output_token_ids for e in expected]
    assert_no_leaks(nodes, links)


@pytest.mark.parametrize("decode_blocks", [[8], [14, 12]])
def test_a_request_no_decode_pool_can_hold_is_rejected_before_its_prefill(tiny_model, decode_blocks):
    """Decode pools smaller than the prefill pool's 64 blocks of 8: a request that fits the
    prefill pool but no decode pool is rejected by the router, as one engine of the largest
    decode pool's size rejects it (the same words), before the prefill instance sees it; one
    that fits only the larger decode pool is served there; the others in the run finish."""
    prefill = tiny_config(tiny_model)
    decode = [tiny_config(tiny_model, num_blocks=n) for n in decode_blocks]
    # 6, 13 and 19 blocks. With pools of 14 and 12, the first leaves the larger one fewer free
    # blocks than the smaller has: the second still goes to the larger, the one that can hold it.
    prompts = [list(range(400, 440)), list(range(3, 103)), list(range(200, 350))]
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)] * 3
    expected = colocated(decode[0], prompts, params)
    assert [e.finish_reason for e in expected] == ["rejected" if n > decode_blocks[0] else "length"
                                                   for n in (6, 13, 19)]
    links = LocalLinks(1 + len(decode))
    nodes = cluster([prefill], decode, links)
    results = serve(nodes, prompts, params)
    for r, e in zip(results, expected):
        assert (r.finish_reason, r.error, r.output_token_ids) == (e.finish_reason, e.error, e.output_token_ids)
    p = nodes[0].instance
    served = [len(q) for q, e in zip(prompts, expected) if e.finish_reason != "rejected"]
    assert p.received == len(served)  # the rejected ones never reached it
    assert sum(prompt for _, _, prompt, _ in metrics_of(p.engine).step_log) == sum(served)  # no prefill spent on them
    assert_no_leaks(nodes, links)


def test_a_request_that_just_fits_ends_as_it_does_in_one_engine(tiny_model):
    """8 blocks of 8: a 63-token prompt and its first token fill them. One engine generates a
    second token and ends it ("length"); the decode instance, counting the handed-over
    sequence as one engine counts a prompt, must not reject it after its prefill."""
    config = tiny_config(tiny_model, num_blocks=8, watermark=0.0)
    prompts, params = [list(range(3, 66))], [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    expected = colocated(config, prompts, params)[0]
    assert (expected.finish_reason, expected.num_output_tokens) == ("length", 2)
    links = LocalLinks(2)
    nodes = cluster([config], [config], links)
    (result,) = serve(nodes, prompts, params)
    assert (result.finish_reason, result.output_token_ids) == ("length", expected.output_token_ids), result.error
    assert_no_leaks(nodes, links)


# ---- aborts, preemptions, leaks ---------------------------------------------------------------
@pytest.mark.parametrize("preemption,seed", [("swap", 0), ("recompute", 1), ("auto", 2)])
def test_aborts_and_preemptions_leak_nothing(tiny_model, preemption, seed):
    """Random aborts wherever a request is (routed, prefilling, parked, offered, decoding),
    decode pools small enough to preempt: invariants after every round, one result per
    request, every block and payload back at the end, and the requests left alone get
    their colocated tokens."""
    prefill = tiny_config(tiny_model, num_blocks=40, preemption=preemption)
    decode = tiny_config(tiny_model, num_blocks=24, preemption=preemption,
                         swap_space=12 * 8 * (2 * 2 * 2 * 16 * 4))
    prompts, params = workload(seed, 60)
    params = [SamplingParams(**{**sp.__dict__, "max_tokens": sp.max_tokens + 10}) for sp in params]
    links = LocalLinks(3)
    nodes = cluster([prefill, prefill], [decode], links)
    rng = np.random.default_rng(seed)
    aborted = set()

    def abort_some(nodes):
        router = nodes[0].router
        live = [i for i in router.where if i not in aborted]
        if live and rng.random() < 0.08:
            victim = int(rng.choice(live))
            aborted.add(victim)
            router.abort(victim)
    results = serve(nodes, prompts, params, abort_some)
    reasons = Counter(r.finish_reason for r in results)
    assert reasons["aborted"] > 0, reasons
    assert all(r.finish_reason != "aborted" or r.seq_id in aborted for r in results)
    preempted = sum(r.summary["preemptions_swap"] + r.summary["preemptions_recompute"]
                    for r in nodes[0].router.reports.values())
    assert preempted > 0
    assert_no_leaks(nodes, links)
    expected = colocated(prefill, prompts, params)
    for r, e in zip(results, expected):
        if r.finish_reason != "aborted":
            assert r.output_token_ids == e.output_token_ids


@pytest.mark.parametrize("where", ["routed", "prefilling", "offered", "arriving", "decoding"])
def test_an_abort_ends_the_request_wherever_it_is(tiny_model, where):
    """Abort one request once it is in a given place (a small decode pool makes offers wait):
    it ends "aborted", reported once, its blocks and payload freed on both sides; the
    others get their colocated tokens."""
    prefill, decode = tiny_config(tiny_model, num_blocks=32), tiny_config(tiny_model, num_blocks=12)
    prompts = [list(range(3 + 40 * i, 33 + 40 * i)) for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 6
    links = LocalLinks(2)
    nodes = cluster([prefill], [decode], links)
    router, p, d = nodes[0].router, nodes[0].instance, nodes[1].instance
    victim = []

    def place(seq_id):
        if seq_id in p.seqs:
            return "prefilling" if p.seqs[seq_id].num_computed_tokens else "routed"
        if any(o.seq.seq_id == seq_id for o in d.offers):
            return "offered"
        if d.arriving and d.arriving.offer.seq.seq_id == seq_id:
            return "arriving"
        return "decoding" if seq_id in d.seqs and d.seqs[seq_id].num_output_tokens > 1 else None

    def abort_one(nodes):
        if victim:
            return
        for seq_id in router.where:
            if place(seq_id) == where:
                victim.append(seq_id)
                router.abort(seq_id)
                return
    results = serve(nodes, prompts, params, abort_one)
    assert len(victim) == 1
    expected = colocated(decode, prompts, params)
    for r, e in zip(results, expected):
        if r.seq_id == victim[0]:
            assert r.finish_reason == "aborted" and len(r.output_token_ids) < 12
        else:
            assert r.output_token_ids == e.output_token_ids
    assert_no_leaks(nodes, links)


# ---- routing and reports ------------------------------------------------------------------
def test_routing_prefers_short_prefill_queues_and_free_decode_blocks(tiny_model):
    config = tiny_config(tiny_model)
    nodes = cluster([config] * 2, [config] * 2)
    router = nodes[0].router
    engine = nodes[0].instance.engine
    long, short = engine.make_sequence(list(range(3, 200)), SamplingParams()), \
        engine.make_sequence(list(range(3, 10)), SamplingParams())
    router.add([long, short])
    for source, message in router.link.poll():  # each instance's capacity
        router.receive(source, message)
    router.route()
    assert router.where[long.seq_id][0] != router.where[short.seq_id][0]  # the second avoids the busy one
    assert router.where[long.seq_id][1] != router.where[short.seq_id][1]  # promised blocks count as used
    assert router.queued_tokens(router.where[long.seq_id][0]) == long.num_prompt_tokens


def test_parse_split():
    assert parse_split("3:2") == (3, 2)
    for bad in ("1", "0:1", "1:0", "a:b", "1:2:3"):
        with pytest.raises(NanoError, match="--disagg"):
            parse_split(bad)


# ---- under mpirun ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("disagg") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def tokens_of(tmp_path, name, args, ranks=None):
    out = tmp_path / name
    proc = launch(["run.py", *args, "--output", str(out), "--temperature", "0", "--max-tokens", "20"], ranks)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line)["token_ids"] for line in out.read_text().splitlines()], proc.stdout


@needs_mpi
@pytest.mark.parametrize("split,ranks", [("1:1", 2), ("1:2", 3)])
def test_mpirun_disagg_gives_the_colocated_tokens(prompt_file, tmp_path, split, ranks):
    one, _ = tokens_of(tmp_path, "one.jsonl", ["--prompt-file", str(prompt_file)])
    # A 16-token step budget chunks the prompts and lets later ones hit the cached system prompt.
    tokens, stdout = tokens_of(tmp_path, "dis.jsonl", ["--prompt-file", str(prompt_file), "--disagg", split,
                                                      "--max-num-batched-tokens", "16"], ranks)
    assert tokens == one
    assert f"KV handoffs         {len(PROMPTS)}," in stdout
    assert "blocks in use at end none (no leaks)" in stdout
    assert "prefix cache hits   0.0%" not in stdout


@needs_mpi
@pytest.mark.parametrize("flags", [["--disagg", "1:1"], ["--dp", "2"]])
def test_mpirun_the_scheduling_policy_reaches_every_engine(tiny_model, prompt_file, flags):
    """--policy deadline --drop-late with a TTFT target no prompt can make: the engines of a
    run over ranks (ranks.start) schedule with the deadline policy, and reject every request."""
    proc = launch(["run.py", "--model", str(tiny_model), "--prompt-file", str(prompt_file), "--no-chat",
                   "--policy", "deadline", "--drop-late", "--ttft-slo", "0.01", "--max-tokens", "4", *flags], 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"0 served late, {len(PROMPTS)} rejected as late" in proc.stdout


@needs_mpi
def test_mpirun_with_the_wrong_number_of_ranks_is_one_error(prompt_file):
    proc = launch(["run.py", "--disagg", "2:1", "--prompt-file", str(prompt_file)], 2)
    assert_one_line_error(proc, "--disagg 2:1 needs 3 MPI ranks, got 2: run mpirun -n 3 python run.py "
                                "--disagg 2:1 ...")


def test_disagg_without_mpirun_is_one_error(prompt_file):
    proc = launch(["run.py", "--disagg", "1:1", "--prompt-file", str(prompt_file)])
    assert_one_line_error(proc, "--disagg 1:1 needs 2 MPI ranks, got 1: run mpirun -n 2 python run.py "
                                "--disagg 1:1 ...")


@needs_mpi
@pytest.mark.parametrize("rank", [1, 0])
def test_ctrl_c_on_either_instance_ends_both(tmp_path, tiny_model, rank):
    interrupt_one_rank(tmp_path, tiny_model, rank, ["--disagg", "1:1"])


# ---- figures: the pools' signals, interference, the P:D estimate --------------------------------
def test_pool_snapshots_carry_each_pools_queue_and_occupancy(tiny_model, tmp_path):
    from prometheus_client.parser import text_string_to_metric_families
    from nano.disagg.metrics import PoolExport
    from nano.telemetry.export import MetricsWriter
    config = tiny_config(tiny_model)
    nodes = cluster([config], [config])
    writer = MetricsWriter(str(tmp_path / "m.jsonl"), str(tmp_path / "m.prom"), PoolExport("tiny"))
    nodes[0].router.on_snapshot = writer.write
    prompts, params = workload(5, 30)
    serve(nodes, prompts, params)
    snaps = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert snaps and snaps[-1]["finished"] == 30
    assert max(s["pools"]["prefill"]["queue_depth_tokens"] for s in snaps) > 0
    assert max(s["pools"]["decode"]["queue_depth_tokens"] for s in snaps) > 0
    assert max(s["pools"]["decode"]["kv_occupancy"] for s in snaps) > 0
    for pool in snaps[-1]["pools"].values():  # quiet at the end: no stale busy figures
        assert pool["queue_depth_tokens"] == 0 and pool["kv_occupancy"] == 0
    samples = {(s.name, s.labels.get("pool")): s.value
               for f in text_string_to_metric_families((tmp_path / "m.prom").read_text()) for s in f.samples
               if s.labels["model_name"] == "tiny"}
    assert samples[("nano_pool_instances", "prefill")] == samples[("nano_pool_instances", "decode")] == 1
    assert ("nano_pool_kv_cache_usage_perc", "decode") in samples
    assert ("nano_pool_queue_depth_tokens", "prefill") in samples
    assert samples[("nano_requests_finished_total", None)] == samples[("nano_requests_arrived_total", None)] == 30
    s = summary(nodes[0].router, 1.0)
    assert s["prefill_queue_tokens_peak"] > 0 and s["decode_kv_occupancy_peak"] > 0


def test_decode_interference_compares_steps_of_as_many_decodes():
    from nano.disagg.metrics import decode_interference
    # (start, end, prompt tokens, decodes): quiet steps of 1 and 2 decodes take 10 and 20 ms
    steps = [(0.00, 0.01, 0, 1), (0.02, 0.03, 0, 1), (0.04, 0.06, 0, 2), (0.07, 0.09, 0, 2),
             (0.10, 0.13, 0, 2),    # overlaps another engine's prefill: 30 ms = 1.5x
             (0.15, 0.16, 0, 1),    # after a 5 ms stall: 15 ms = 1.5x
             (0.20, 0.60, 100, 1),  # carries prompt tokens itself: 40x
             (0.70, 0.71, 50, 0)]   # prefill only: not a decoding step
    out = decode_interference([(steps, [(0.135, 0.14)])], [(0.11, 0.12)])
    assert out["decode_steps_quiet"] == 4 and out["decode_steps_during_prefill"] == 3
    assert out["decode_slowdown_quiet_p50"] == pytest.approx(1.0)
    assert out["decode_slowdown_prefill_p50"] == pytest.approx(1.5)
    assert out["decode_slowdown_prefill_p99"] == pytest.approx(40, rel=0.05)


def test_disagg_plan_balances_the_pools():
    from nano.disagg.estimate import estimate
    # c0 10 ms, 1 ms per prompt token, 2 ms per decode, 10 us per context token
    coef = (0.01, 0.001, 0.002, 1e-5)
    p = estimate(coef, prompt_len=1000, output_len=101, chunk=512, num_blocks=640, block_size=16,
                 max_num_seqs=256)
    assert p.prefill_seconds == pytest.approx(2 * 0.01 + 1.0)      # two chunks
    per_seq_blocks = -(-1101 // 16)                                 # 69 -> 640 // 69 = 9 sequences
    assert p.decode_batch == 640 // per_seq_blocks and p.batch_limit == "KV pool"
    step = 0.01 + 9 * (0.002 + 1e-5 * 1050.5)
    assert p.decode_step == pytest.approx(step)
    assert p.decode_capacity == pytest.approx(9 / (100 * step))
    assert p.ratio == pytest.approx(p.decode_capacity * 1.02)
    assert p.split_for(0.5) == (1, 1) and p.split_for(2.0) == (3, 3)  # C_P 0.98, C_D 0.73 req/s
    slo = estimate(coef, 1000, 101, 512, 640, 16, 256, tpot_slo=0.04)  # T(b) <= 40 ms: b <= 2
    assert slo.decode_batch == 2 and slo.batch_limit == "--tpot-slo"


def test_plan_disagg_prints_the_estimate(tiny_model):
    proc = launch(["run.py", "--capacity", "--disagg", "1:1", "--model", str(tiny_model), "--input-len", "40:60",
                   "--output-len", "8", "--request-rate", "2", "--num-blocks", "64"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    for text in ("prefill instance", "decode instance", "balanced P:D", "at 2.0 req/s", "--disagg 1:1"):
        assert text in proc.stdout, proc.stdout


@pytest.mark.parametrize("args,message", [
    (["--disagg"], "--disagg needs P:D, e.g. --disagg 1:1 (only --capacity --disagg estimates it)"),
    (["--disagg-compare", "1:1"], "--policy-compare, --request-rate, --tenants, --dp-compare and "
                                  "--disagg-compare are --bench modes: add --bench"),
    (["--bench", "--disagg-compare", "1:1", "--output", "x.jsonl"],
     "--disagg-compare writes a table (and --summary-json), no completions or metrics files: drop --output, "
     "--metrics-file and --metrics-prom"),
    (["--disagg", "1:1", "--tp", "2"], "--disagg runs each instance on one rank: drop --tp"),
])
def test_bad_disagg_flags_are_one_line(prompt_file, args, message):
    proc = launch(["run.py", "--prompt-file", str(prompt_file), *args])
    assert_one_line_error(proc, message)


@needs_mpi
def test_disagg_compare_runs_both_and_prints_the_table(tiny_model, tmp_path):
    out = tmp_path / "s.json"
    proc = launch(["run.py", "--bench", "--disagg-compare", "1:1", "--model", str(tiny_model), "--num-blocks", "128",
                   "--num-seqs", "8", "--input-len", "20:60", "--output-len", "4:12", "--request-rate", "20",
                   "--summary-json", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| colocated |" in proc.stdout and "| disaggregated 1:1 |" in proc.stdout
    both = json.loads(out.read_text())
    assert both["colocated"]["requests"] == both["disaggregated"]["requests"] == 8
    assert both["disaggregated"]["handoffs"] == 8
    assert both["colocated"]["generated_tokens"] == both["disaggregated"]["generated_tokens"]


# ---- on the GPU (tests/device_check.sh) ---------------------------------------------------------
def check_gpu_handoff(model, kv):
    """Blocks gathered from one GPU pool arrive bit for bit in another's; a cluster of GPU
    engines gives a GPU engine's own greedy tokens. Run on a GPU (below) and on the CPU
    emulator (tests/test_engine_emulated.py)."""
    config = tiny_config(model, device="gpu", kv_cache_dtype=kv, enforce_eager=True)
    sender, receiver = LLMEngine(config), LLMEngine(config)
    xp, rng = sender.device.xp, np.random.default_rng(0)
    for a in sender.runner.kv_cache.block_arrays():
        values = rng.standard_normal(a.shape) if a.dtype.kind == "f" else rng.integers(-127, 128, a.shape)
        a[...] = xp.asarray(values.astype(a.dtype))
    seq = Sequence(3, "", list(range(21)), SamplingParams(), 0.0, 0)
    seq.block_table, seq.num_computed_tokens = [5, 2, 9], 20
    running(sender, seq)
    offer, payload = kv_transfer.pack(sender, seq, 0, 2, lambda: 0.0)
    kv_transfer.verify(offer, payload)
    receiver.runner.write_blocks([1, 3, 0], payload)
    for a, b in zip(sender.runner.kv_cache.block_arrays(), receiver.runner.kv_cache.block_arrays()):
        np.testing.assert_array_equal(sender.device.to_host(a)[:, :, [5, 2, 9]],
                                      receiver.device.to_host(b)[:, :, [1, 3, 0]])
    prompts = [list(range(3 + 7 * i, 40 + 7 * i)) for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)] * 6
    links = LocalLinks(2)
    nodes = cluster([config], [config], links)
    results = serve(nodes, prompts, params)
    assert [r.output_token_ids for r in results] == [e.output_token_ids for e in colocated(config, prompts, params)]
    assert_no_leaks(nodes, links)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_gpu_handoff_is_exact_and_keeps_the_tokens(tmp_path, kv):
    from reference import make_random_model
    # head dim 64: a shape the attention kernels take
    check_gpu_handoff(make_random_model(tmp_path, hidden=256, heads=4, kv_heads=2, intermediate=256,
                                        dtype="float16", seed=7), kv)
