"""data-parallel: what the router's knowledge of each replica's prefix cache buys. Real runs
of `run.py --bench --dp-compare` (nano/dp/cli.py: every policy on the same seeded tenants,
prompts and arrivals, fresh replicas each time) under mpirun with two ranks, and once with
one rank (the same requests on one replica), one BLAS thread per rank, each writing its
summaries. Each replica's pool holds about two tenants' prefixes and its running requests,
not all of them: where a request is sent decides whether its prefix is computed again."""
import os

from nano.disagg.compare import mpirun_command, run_summary
from nano.lab.experiment import Experiment, Size, model_of

REPLICAS = (2, 1)
COLORS = {"round-robin": "tab:gray", "least-loaded": "tab:blue", "kv-aware": "tab:green", "dp=1": "tab:purple"}


def workload(size: Size) -> dict:
    """The fixed workload: tenants x prefix blocks exceed a replica's pool (blocks), which holds
    about two tenants' prefixes; arrivals well below either setup's capacity, so throughput is
    the arrival rate's unless the routing piles the load onto one replica."""
    if size.quick:
        return {"num_seqs": 24, "tenants": 4, "prefix_len": 48, "input_len": "4:12", "output_len": 4,
                "request_rate": 20.0, "block_size": 8, "num_blocks": 20, "ttft_slo": 500, "tpot_slo": 200}
    return {"num_seqs": 16, "tenants": 4, "prefix_len": 96, "input_len": "8:16", "output_len": 4,
            "request_rate": 0.5, "block_size": 16, "num_blocks": 20, "ttft_slo": 5000, "tpot_slo": 2000}


def bench_args(size: Size) -> list[str]:
    w = workload(size)
    model = model_of(size)
    return ["--bench", "--dp-compare", *(["--model", model] if model else []), "--device", size.device,
            "--seed", str(size.seed), "--stall-timeout", "600",
            *[arg for key, value in w.items() for arg in (f"--{key.replace('_', '-')}", str(value))]]


def row(name: str, dp: int, s: dict) -> dict:
    replicas = s["replicas"].values()
    return {"run": name, "dp": dp, "policy": s["policy"] if dp > 1 else "-",
            "prefix_hit_rate": s["prefix_cache_hit_rate"], "prefill_tokens": s["prefill_tokens"],
            "prompt_tokens": s["prompt_tokens"], "ttft_p50_ms": s["ttft_p50_ms"], "ttft_p99_ms": s["ttft_p99_ms"],
            "goodput_rps": s["goodput_rps"], "output_tokens_per_s": s["output_tokens_per_s"],
            "requests_per_replica": [x["requests"] for x in replicas],
            "busy_per_replica": [round(x["busy"], 3) for x in replicas]}


def run(size: Size) -> list[dict]:
    # One BLAS thread per rank; ranks that share cores yield while they wait for messages.
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", OMPI_MCA_mpi_yield_when_idle="1")
    rows = []
    for dp in REPLICAS:
        summaries = run_summary([*bench_args(size), "--dp", str(dp)], f"the {dp}-replica --dp-compare",
                                mpirun_command(dp, "--lab data-parallel"), env)
        rows += [row(name, dp, s) for name, s in summaries.items()]
    return rows


def plot(rows: list[dict], fig) -> None:
    ax_p, ax_t, ax_r = fig.subplots(1, 3)
    names = [r["run"].replace(" ", "\n", 1) for r in rows]
    colors = [COLORS[r["policy"] if r["dp"] > 1 else "dp=1"] for r in rows]
    ax_p.bar(names, [r["prefill_tokens"] for r in rows], color=colors)
    for i, r in enumerate(rows):
        ax_p.annotate(f"{100 * r['prefix_hit_rate']:.0f}% hits", (i, r["prefill_tokens"]), ha="center",
                      va="bottom", fontsize=8)
    ax_p.set_title(f"prompt tokens computed (of {rows[0]['prompt_tokens']})")
    x = range(len(rows))
    ax_t.bar([i - 0.2 for i in x], [r["ttft_p50_ms"] for r in rows], 0.4, color=colors, label="p50")
    ax_t.bar([i + 0.2 for i in x], [r["ttft_p99_ms"] for r in rows], 0.4, color=colors, alpha=0.45,
             label="p99")
    ax_t.set_xticks(list(x), names)
    ax_t.set_title("TTFT p50 (solid) / p99 (light), ms")
    bottom = [0] * len(rows)
    for k in range(max(len(r["requests_per_replica"]) for r in rows)):
        counts = [r["requests_per_replica"][k] if k < len(r["requests_per_replica"]) else 0 for r in rows]
        ax_r.bar(names, counts, bottom=bottom, color=colors, alpha=1 - 0.45 * k, edgecolor="white",
                 label=f"replica {k}")
        bottom = [b + c for b, c in zip(bottom, counts)]
    for i, r in enumerate(rows):
        ax_r.annotate(f"{r['output_tokens_per_s']:.3g} tok/s\ngood {r['goodput_rps']:.3g}/s",
                      (i, bottom[i]), ha="center", va="bottom", fontsize=7)
    ax_r.set_ylim(0, 1.3 * max(bottom))
    ax_r.set_title("requests per replica (0 solid, 1 light)")
    for ax in (ax_p, ax_t, ax_r):
        ax.tick_params(axis="x", labelsize=7)


def check(rows: list[dict]) -> str | None:
    """The counts only (prefill tokens, hits, requests per replica): they follow from the
    routing. TTFT and throughput are times on whatever the ranks share, so they are reported
    and drawn, not checked."""
    by = {r["policy"]: r for r in rows if r["dp"] == 2}
    kv, rr = by["kv-aware"], by["round-robin"]
    if not kv["prefill_tokens"] < rr["prefill_tokens"]:
        return f"kv-aware computed {kv['prefill_tokens']} prompt tokens, round-robin {rr['prefill_tokens']}"
    if not kv["prefix_hit_rate"] > rr["prefix_hit_rate"]:
        return f"kv-aware's prefix hit rate {kv['prefix_hit_rate']:.3f} is not above round-robin's " \
               f"{rr['prefix_hit_rate']:.3f}"
    if max(kv["requests_per_replica"]) > 0.75 * sum(kv["requests_per_replica"]):
        return f"kv-aware piled the load onto one replica: {kv['requests_per_replica']} requests"
    return None


EXPERIMENT = Experiment(
    name="data-parallel",
    claim="On a multi-tenant workload whose shared prefixes do not all fit in one replica's pool, a KV-aware "
          "router keeps each tenant where its prefix is cached: fewer prompt tokens computed and lower TTFT "
          "than round-robin, with the load still even enough to cost no throughput.",
    varies="router policy (round-robin, least-loaded, kv-aware) at dp=2 (mpirun), and dp=1",
    fixed="model, seeded tenants, system-prompt length, prompts and Poisson arrivals, KV pool blocks per replica, "
          "one BLAS thread per rank",
    measures="prefix hit rate, prompt tokens computed, TTFT p50/p99, goodput, output tok/s, requests per replica "
             "(and each replica's busy fraction)",
    run=run, plot=plot, check=check)
