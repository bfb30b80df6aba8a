"""The lab's tensor-parallel, data-parallel, deadlines, disaggregation, kv-quant, autoscaling,
gqa and speculation experiments at their quick size (the tiny random model): each writes its PNG and
JSON, and where its claim's direction is robust on the tiny model, its check holds."""
import json

import pytest

from nano.lab.driver import list_experiments, run_experiment, verdict
from nano.lab.experiment import Size
from nano.lab.experiments import autoscaling, gqa
from test_tp import needs_mpi

QUICK = Size(quick=True, model=None, device="cpu", seed=0)


def run_quick(name: str, tmp_path) -> list[dict]:
    rows = run_experiment(name, QUICK, tmp_path)
    record = json.loads((tmp_path / f"{name}.json").read_text())
    assert record["rows"] == rows and record["size"]["quick"] and record["claim"]
    assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return rows


def holds(name: str, rows: list[dict]) -> None:
    failed = verdict(list_experiments()[name], rows)
    assert failed is None, failed


def test_kv_quant_int8_keeps_top1_and_gains_the_bytes_ratio_in_blocks(tmp_path):
    rows = run_quick("kv-quant", tmp_path)
    assert [r["keys"] for r in rows] == ["-", "token", "rotate"]
    assert rows[0]["kld"] == 0 and rows[0]["top1"] == 1  # the reference against itself
    assert all(r["kld"] > 0 for r in rows[1:])           # int8 does change the distributions
    holds("kv-quant", rows)


def test_deadline_policy_beats_fcfs_on_mixed_urgency(tmp_path):
    rows = run_quick("deadlines", tmp_path)
    assert len(rows) == 2 * 3 * 2  # workloads x loads x policies
    holds("deadlines", rows)


def test_queue_depth_leads_ttft_and_cpu_busy_reads_full_below_capacity(tmp_path):
    rows = run_quick("autoscaling", tmp_path)
    assert len(rows) == autoscaling.settings(QUICK)["windows"] and max(r["queue_tokens"] for r in rows) > 0
    holds("autoscaling", rows)


def test_alarms_are_when_a_signal_first_reaches_half_its_peak():
    rows = [{"t_s": t, "offered_x_capacity": x, "queue_tokens": q, "kv_occupancy": k, "cpu_busy": b,
             "ttft_p90_ms": f}
            for t, x, q, k, b, f in [(1, 0.5, 0, 0.1, 0.9, 10), (2, 0.9, 40, 0.6, 1, 10),
                                     (3, 1.2, 100, 1, 1, 30), (4, 1.5, 60, 1, 1, 100)]]
    assert autoscaling.alarms(rows) == {"queue_tokens": 3, "kv_occupancy": 2, "cpu_busy": 1, "ttft_p90_ms": 4,
                                        "overload": 3}
    assert autoscaling.check(rows) is None
    rows[1]["queue_tokens"] = 0  # the queue alarms with TTFT: the claim fails
    rows[2]["queue_tokens"] = 20
    assert "queue depth alarmed at 4.0 s, TTFT at 4.0 s" in autoscaling.check(rows)


def test_gqa_sharing_costs_and_one_kv_head_is_its_averaged_copy(tmp_path):
    """Averaging every KV head in K and V is exactly a model with one KV head; sharing both
    halves costs more than either alone."""
    rows = run_quick("gqa", tmp_path)
    merged = next(r for r in rows if r["model"] == "one KV head")
    averaged = next(r for r in rows if r["model"] == "heads averaged" and r["shared"] == "both")
    assert merged["kld"] == pytest.approx(averaged["kld"], rel=1e-3) and merged["top1"] == averaged["top1"]
    assert merged["kv_bytes_per_token"] == averaged["kv_bytes_per_token"]  # the bytes arithmetic, measured
    assert all(r["kld"] > 0 for r in rows)
    holds("gqa", rows)


def test_speculation_keeps_the_output_and_yields_what_its_drafts_allow(tmp_path):
    """The counts are exact (an oracle's drafts, a fixed mask), so they are asserted here; the
    speed-ups are timings of a tenth of a second on the tiny model, benchmark figures that the
    lab's check judges at full size, never assertions of a test."""
    rows = run_quick("speculation", tmp_path)
    assert all(r["same_output"] for r in rows)
    oracle = {(r["k"], r["accuracy"]): r for r in rows if r["proposer"] == "oracle"}
    assert all(oracle[k, 0.0]["acceptance"] == 0 and oracle[k, 0.0]["tokens_per_step"] == 1 for k in (1, 2, 4, 8))
    assert all(oracle[k, 1.0]["acceptance"] == 1 for k in (1, 2, 4, 8))
    assert oracle[8, 1.0]["tokens_per_step"] == 9  # 64 tokens: 7 steps of 9 after the prefill's one


def test_gqa_groups_are_contiguous():
    assert [g.tolist() for g in gqa.groups_of(3, 2)] == [[0, 1], [2]]
    assert [g.tolist() for g in gqa.groups_of(3, 1)] == [[0, 1, 2]]


@needs_mpi
def test_tensor_parallel_halves_what_each_rank_holds(tmp_path):
    rows = run_quick("tensor-parallel", tmp_path)
    assert [r["tp"] for r in rows] == [1, 2]
    assert rows[1]["q_heads_per_rank"] == [2, 2] and rows[1]["kv_heads_per_rank"] == [1, 1]
    holds("tensor-parallel", rows)


@needs_mpi
def test_data_parallel_kv_aware_computes_fewer_prompt_tokens(tmp_path):
    """Quick size checks the counts (prompt tokens computed, hit rate, requests per replica);
    its TTFTs are a few ms on the tiny model, mostly the loop's overhead, so not checked."""
    rows = run_quick("data-parallel", tmp_path)
    assert [r["run"] for r in rows] == ["dp=2 round-robin", "dp=2 least-loaded", "dp=2 kv-aware", "dp=1"]
    assert all(sum(r["requests_per_replica"]) == 24 and r["prompt_tokens"] == rows[0]["prompt_tokens"]
               for r in rows)  # every run served the same requests
    holds("data-parallel", rows)


@needs_mpi
def test_disaggregation_compares_both_setups_and_the_plan(tmp_path):
    """Quick size writes the figures only: on the tiny model a step is mostly fixed overhead,
    so the decode instance's isolation does not show (the full-size run shows it)."""
    rows = run_quick("disaggregation", tmp_path)
    assert [r["setup"] for r in rows] == ["colocated", "disaggregated 1:1"]
    apart = rows[1]
    assert apart["prefill_busy"] > 0 and apart["decode_busy"] > 0 and apart["planned_ratio"] > 0
