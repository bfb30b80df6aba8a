"""Deadline-aware scheduling on a simulated clock (nano/bench/simulated.py), metrics snapshots,
and capacity planning."""
import json

import numpy as np
import pytest

from nano.bench import simulated, slo_matrix
from nano.bench.capacity import capacity_report
from nano.config import EngineConfig
from nano.deadline.cli import policy_factory
from nano.engine import LLMEngine
from nano.sequence import SamplingParams
from nano.telemetry.export import MetricsWriter
from nano.telemetry.metrics import met_slo, metrics_of, ttft_of
from nano.telemetry.prometheus import EngineExport

text_string_to_metric_families = pytest.importorskip("prometheus_client.parser").text_string_to_metric_families


def simulated_engine(model_dir, policy="fcfs", drop_late=False, **config_args) -> LLMEngine:
    return simulated.simulated_engine(EngineConfig(model=str(model_dir), device="cpu", **config_args),
                                      policy=policy_factory(policy, drop_late))


def mixed_workload():
    """One long prompt with a loose target queued first, then six short urgent ones."""
    rng = np.random.default_rng(0)
    long = (rng.integers(3, 500, 400).tolist(), SamplingParams(temperature=0, max_tokens=8, ttft_slo=2.0))
    short = [(rng.integers(3, 500, 20).tolist(), SamplingParams(temperature=0, max_tokens=4, ttft_slo=0.25))
             for _ in range(6)]
    return [long] + short


@pytest.mark.parametrize("policy,met", [("fcfs", 1), ("deadline", 7)])
def test_deadline_policy_meets_what_fcfs_misses(tiny_model, policy, met):
    engine = simulated_engine(tiny_model, policy=policy, max_num_batched_tokens=64)
    work = mixed_workload()
    seqs = engine.generate([p for p, _ in work], [sp for _, sp in work])
    assert sum(met_slo(s) for s in seqs) == met
    assert met_slo(seqs[0])  # the long request makes its loose target under both policies
    if policy == "fcfs":      # it held the whole budget for 7 steps: every short one was late
        assert all(ttft_of(s) > 0.25 for s in seqs[1:])


# The matrix's pool: 4,096 blocks of 16 tokens, more than its 40 requests of at most ~600
# tokens can fill, so KV never binds, as with the memory default's 262,144 blocks for the
# tiny model, whose Block objects would take half the matrix's time to build, engine by engine.
MATRIX_BLOCKS = 4096


@pytest.fixture(scope="module")
def policy_matrix(tiny_model):
    """nano/slo_matrix.py's matrix (run.py --bench --policy-compare) on the simulated clock:
    40 requests per run, 3 seeds, every workload and load."""
    return slo_matrix.run_matrix(lambda policy: simulated_engine(tiny_model, policy=policy, num_blocks=MATRIX_BLOCKS),
                                 512, 40, (0, 1, 2))


def goodputs(results, name, load, policy) -> list[float]:
    return [o.goodput for (w, l, _, p), o in sorted(results.items()) if (w, l, p) == (name, load, policy)]


@pytest.mark.parametrize("load", slo_matrix.LOADS)
def test_uniform_targets_deadline_never_loses_to_fcfs(policy_matrix, load):
    """Same targets for everyone: EDF is arrival order, so the deadline policy differs from
    FCFS only where it helps (admission control, step sizing); on every seed."""
    fcfs, deadline = (goodputs(policy_matrix, "uniform", load, p) for p in ("fcfs", "deadline"))
    assert all(d >= f for d, f in zip(deadline, fcfs)), (fcfs, deadline)


@pytest.mark.parametrize("load", slo_matrix.LOADS)
def test_loose_targets_deadline_meets_whatever_fcfs_meets(policy_matrix, load):
    """Where FCFS meets every target the deadline policy does too; elsewhere it misses fewer.
    On every seed."""
    for seed in (0, 1, 2):
        fcfs, deadline = (policy_matrix["loose", load, seed, p] for p in ("fcfs", "deadline"))
        assert deadline.met >= fcfs.met, (seed, fcfs.met, deadline.met)
        assert deadline.met == deadline.total or fcfs.met < fcfs.total, seed


def test_loose_targets_below_capacity_cost_no_ttft(policy_matrix):
    """Below capacity FCFS meets every loose target, and a step cap would buy nothing: the
    deadline policy takes none, so first tokens come as early as under FCFS (a cap on every
    long step, as by each decode's even pace or a third of every TTFT target, costs 2-6%)."""
    for seed in (0, 1, 2):
        fcfs, deadline = (policy_matrix["loose", "below", seed, p] for p in ("fcfs", "deadline"))
        assert fcfs.met == fcfs.total == deadline.met
        assert np.mean(deadline.ttft["loose"]) <= 1.02 * np.mean(fcfs.ttft["loose"]), seed


@pytest.mark.parametrize("load", ["near", "above"])
@pytest.mark.parametrize("name", ["mixed", "bursts"])
def test_deadline_goodput_is_1_3x_fcfs_where_urgency_differs(policy_matrix, name, load):
    fcfs, deadline = (np.mean(goodputs(policy_matrix, name, load, p)) for p in ("fcfs", "deadline"))
    assert deadline >= 1.3 * fcfs, (fcfs, deadline)


@pytest.fixture(scope="module")
def cpu_shaped_matrix(tiny_model):
    """The uniform- and loose-target rows with the CPU's step shape (simulated.CPU_STEP),
    24 requests, 3 seeds."""
    config = EngineConfig(model=str(tiny_model), device="cpu", num_blocks=MATRIX_BLOCKS)
    return slo_matrix.run_matrix(
        lambda policy: simulated.simulated_engine(config, simulated.CPU_STEP, policy=policy_factory(policy)),
        512, 24, (0, 1, 2), workloads=("uniform", "loose"))


def test_cpu_shaped_steps_deadline_keeps_what_fcfs_meets(cpu_shaped_matrix):
    """With steps shaped as on the CPU: loose targets below and near capacity, the deadline
    policy meets at least what FCFS meets, all of it where FCFS meets all, with first tokens as
    early below capacity (no cap there); over every row it meets more. (Above capacity it can
    meet fewer in a run: it protects decodes that are behind their pace, which FCFS lets fall
    further behind and catches up only when the arrivals end: tests/bench_deadline_noise.py.)"""
    for load in ("below", "near"):
        for seed in (0, 1, 2):
            fcfs, deadline = (cpu_shaped_matrix["loose", load, seed, p] for p in ("fcfs", "deadline"))
            assert deadline.met >= fcfs.met, (load, seed, fcfs.met, deadline.met)
            assert deadline.met == deadline.total or fcfs.met < fcfs.total, (load, seed)
            if load == "below":
                assert np.mean(deadline.ttft["loose"]) <= 1.02 * np.mean(fcfs.ttft["loose"]), seed
    met = {p: sum(o.met for k, o in cpu_shaped_matrix.items() if k[3] == p) for p in ("fcfs", "deadline")}
    assert met["deadline"] > met["fcfs"], met


def test_matrix_table_has_every_run(policy_matrix):
    table = slo_matrix.matrix_table(policy_matrix)
    assert len(table.splitlines()) == 2 + 2 * len(slo_matrix.WORKLOADS) * len(slo_matrix.LOADS)
    assert "| bursts | above | deadline |" in table and "interactive" in table
    kinds = slo_matrix.kind_table(policy_matrix).splitlines()
    assert len(kinds) == 2 + 2 * len(slo_matrix.LOADS) * (1 + 1 + 2 + 2)  # uniform, loose: 1 kind; mixed, bursts: 2
    assert "| mixed | near | interactive | deadline |" in "\n".join(kinds)


def test_drop_late_rejects_what_cannot_make_it(tiny_model):
    engine = simulated_engine(tiny_model, policy="deadline", drop_late=True, max_num_batched_tokens=64)
    hopeless = SamplingParams(temperature=0, max_tokens=4, ttft_slo=0.001)  # less than one step
    fine = SamplingParams(temperature=0, max_tokens=4, ttft_slo=1.0)
    seqs = engine.generate([[5] * 30, [6] * 30], [hopeless, fine])
    assert seqs[0].finish_reason == "rejected" and seqs[0].error.startswith("late: cannot meet its time-to-first-token")
    assert metrics_of(engine).rejected_late == 1 and metrics_of(engine).served_late == 0
    assert seqs[1].finish_reason == "length" and met_slo(seqs[1])


def test_snapshot_counts_add_up(tiny_model, tmp_path):
    jsonl, prom = tmp_path / "m.jsonl", tmp_path / "m.prom"
    engine = simulated_engine(tiny_model, policy="deadline", num_blocks=24, block_size=8, watermark=0.0,
                              max_num_batched_tokens=48)
    writer = MetricsWriter(str(jsonl), str(prom), EngineExport(engine))
    rng = np.random.default_rng(3)
    for i in range(40):
        # an empty prompt, and some longer than the whole pool (192 tokens): rejected on arrival
        prompt = rng.integers(3, 500, int(rng.integers(0, 220)) if i else 0).tolist()
        params = SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 30)), ttft_slo=0.5, tpot_slo=0.05)
        engine.add_request(prompt, params, arrival_time=float(rng.uniform(0, 2)))
    while engine.has_unfinished():
        engine.step()
        writer.after_step(engine)
    snaps = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(snaps) == metrics_of(engine).steps
    for s in snaps:
        assert s["arrived"] == s["finished"] + s["running"] + s["waiting"] + s["swapped"] + s["rejected"]
        assert s["ttft_histogram"][-1] + s["rejected"] <= s["arrived"]
    last = snaps[-1]
    assert last["arrived"] == 40 and last["running"] == last["waiting"] == last["swapped"] == 0
    assert last["rejected"] > 0 and sum(last["preemptions"].values()) > 0
    assert any(s["queue_depth_tokens"] > 0 for s in snaps)
    samples = {(s.name, s.labels.get("finished_reason") or s.labels.get("kind")): s.value
               for f in text_string_to_metric_families(prom.read_text()) for s in f.samples}
    m = metrics_of(engine)
    assert samples[("nano_requests_arrived_total", None)] == 40
    assert samples[("nano_requests_rejected_total", None)] == m.rejected == last["rejected"]
    served = samples[("vllm:request_success_total", "stop")] + samples[("vllm:request_success_total", "length")]
    assert served + m.rejected == 40 == served + samples[("nano_requests_rejected_total", None)]
    assert samples[("vllm:e2e_request_latency_seconds_count", None)] == served
    assert samples[("nano_requests_served_late_total", None)] == m.served_late > 0
    assert samples[("nano_preemptions_total", "swap")] == m.preemptions["swap"] == last["preemptions"]["swap"]
    assert samples[("vllm:num_preemptions_total", None)] == sum(last["preemptions"].values())
    assert samples[("vllm:generation_tokens_total", None)] == m.generated_tokens


def test_plan_matches_what_the_engine_allocates(tiny_model):
    config = EngineConfig(model=str(tiny_model), device="cpu", kv_cache_memory=300_000, block_size=8)
    plan = capacity_report(config)
    engine = LLMEngine(config)
    assert plan.num_blocks == engine.block_manager.num_blocks
    assert plan.kv_bytes_per_token == engine.kv_bytes_per_token
    assert plan.weight_bytes == engine.weight_bytes
    assert plan.ceiling(512) == engine.block_manager.num_blocks // (512 // 8)
