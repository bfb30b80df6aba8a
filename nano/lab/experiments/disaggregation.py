"""disaggregation: what running prefill and decode on separate instances isolates, and what
it costs. The same seeded random requests at the same Poisson arrival times (those of
`run.py --bench --request-rate`) are served colocated, by one engine in this process, and
disaggregated, by `run.py --bench --disagg 1:1` under mpirun (one prefill and one decode
instance, one rank each): nano/disagg/compare.py's comparison. Long prompts arriving among
decodes are the prefill bursts: colocated, a step that carries a prompt slows every decode
in it; disaggregated, decodes run on an instance that never prefills. The planner
(nano/disagg/estimate.py, fitted on this engine's real steps of the workload's shape)
predicts each pool's load at this rate; the disaggregated run measures them (each pool's
time in steps)."""
import numpy as np

from nano.bench.workload import poisson_arrivals, random_requests
from nano.disagg import estimate
from nano.disagg.compare import colocated_summary, run_disaggregated
from nano.lab.experiment import Experiment, Size, engine, model_of, serve

SPLIT = "1:1"


def settings(size: Size) -> dict:
    if size.quick:
        return dict(num=12, input_len=(32, 160), output_len=(8, 24), rate=20.0, memory=64 * 2**20)
    return dict(num=8, input_len=(64, 256), output_len=(8, 24), rate=0.5, memory=256 * 2**20)


def bench_argv(size: Size, s: dict) -> list[str]:
    """run.py's flags for this workload: the disaggregated run makes the same requests and arrivals."""
    model = model_of(size)
    return ["--bench", *(["--model", model] if model else []), "--device", size.device,
            "--num-seqs", str(s["num"]), "--input-len", "{}:{}".format(*s["input_len"]),
            "--output-len", "{}:{}".format(*s["output_len"]), "--request-rate", str(s["rate"]),
            "--kv-cache-memory", str(s["memory"])]


def figures(name: str, summary: dict) -> dict:
    return {"setup": name, **{k: summary[k] for k in (
        "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "decode_slowdown_prefill_p50",
        "decode_slowdown_prefill_p99", "decode_steps_during_prefill", "output_tokens_per_s", "wall_s")}}


def run(size: Size) -> list[dict]:
    s = settings(size)
    eng = engine(size, kv_cache_memory=s["memory"])
    # random_requests and poisson_arrivals with run.py --bench's seeds: the requests and times it makes
    prompts, params = random_requests(s["num"], s["input_len"], s["output_len"], eng.model_config.vocab_size)
    arrivals = poisson_arrivals(s["num"], s["rate"])
    start = eng.clock.now()
    seqs = serve(eng, list(zip(prompts, params, arrivals)))
    colocated = colocated_summary(eng, seqs, eng.clock.now() - start)

    prompt_len, output_len = np.mean(s["input_len"]), np.mean(s["output_len"])
    coef = estimate.calibrate(eng, int(prompt_len), int(output_len))
    plan = estimate.estimate(coef, prompt_len, output_len, eng.config.token_budget,
                             eng.capacity.num_blocks, eng.config.block_size, eng.config.max_num_seqs)
    del eng
    apart = run_disaggregated(bench_argv(size, s), SPLIT)
    return [figures("colocated", colocated),
            {**figures(f"disaggregated {SPLIT}", apart),
             "prefill_load_planned": s["rate"] / plan.prefill_capacity, "prefill_busy": apart["prefill_busy"],
             "decode_load_planned": s["rate"] / plan.decode_capacity, "decode_busy": apart["decode_busy"],
             "planned_ratio": plan.ratio, "measured_ratio": apart["prefill_busy"] / apart["decode_busy"],
             "kv_transfer_fraction_of_ttft": apart["kv_transfer_fraction_of_ttft"]}]


def plot(rows: list[dict], fig) -> None:
    ax_tpot, ax_ttft, ax_plan = fig.subplots(1, 3)
    names = [r["setup"] for r in rows]
    x = np.arange(len(rows))
    for ax, key, title in ((ax_tpot, "tpot", "time per output token (ms)"), (ax_ttft, "ttft", "TTFT (ms)")):
        ax.bar(x - 0.2, [r[f"{key}_p50_ms"] for r in rows], 0.4, label="p50")
        ax.bar(x + 0.2, [r[f"{key}_p99_ms"] for r in rows], 0.4, label="p99")
        ax.set_xticks(x, names)
        ax.set_title(title)
        ax.legend(fontsize=8)
    apart = rows[1]
    pools = np.arange(2)
    ax_plan.bar(pools - 0.2, [100 * apart["prefill_load_planned"], 100 * apart["decode_load_planned"]], 0.4,
                label="planned load")
    ax_plan.bar(pools + 0.2, [100 * apart["prefill_busy"], 100 * apart["decode_busy"]], 0.4, label="measured busy")
    ax_plan.set_xticks(pools, ["prefill pool", "decode pool"])
    ax_plan.set_title(f"pools (%): planned P:D {apart['planned_ratio']:.2f}, measured {apart['measured_ratio']:.2f}",
                      fontsize=9)
    ax_plan.legend(fontsize=8)


def check(rows: list[dict]) -> str | None:
    colocated, apart = rows
    if not apart["tpot_p99_ms"] < colocated["tpot_p99_ms"]:
        return (f"TPOT p99 {apart['tpot_p99_ms']:.1f} ms disaggregated, not below colocated's "
                f"{colocated['tpot_p99_ms']:.1f} ms")
    return None


EXPERIMENT = Experiment(
    name="disaggregation",
    claim="Separating prefill from decode keeps long prompts from slowing decodes (lower TPOT p99) at the "
          "cost of TTFT (the KV handoff, half the cores each); the planner predicts which pool is loaded.",
    varies="colocated (one engine) vs disaggregated 1:1 (a prefill and a decode instance under mpirun)",
    fixed="the cores, seeded random requests with long prompts, their Poisson arrival times, KV pool memory",
    measures="TTFT and TPOT p50/p99, decode-step slowdown during prefill, each pool's planned load "
             "(estimate.py) against its measured busy time",
    run=run, plot=plot, check=check)
