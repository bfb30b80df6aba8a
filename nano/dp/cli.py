"""run.py's data-parallel modes under mpirun -n DP x TP: --dp DP [--tp TP] with --prompt-file,
--bench or --serve, and --bench --dp-compare (every policy on the same requests and arrivals,
one table); their flags and the checks between them."""
import gc
import sys

from nano import parallel
from nano.cli.output import describe, metrics_writer, write_summary
from nano.config import EngineConfig
from nano.dp import serving
from nano.dp.policy import POLICIES
from nano.errors import NanoError
from nano.fleet.cli import RankRun, sequences
from nano.telemetry.summary import format_summary

DEFAULT_POLICY = "kv-aware"


def add_arguments(p) -> None:
    d = p.add_argument_group("data parallel (nano/dp)")
    d.add_argument("--dp", type=int, default=None,
                   help="data parallel: DP replicas, each of --tp ranks, behind a router on rank 0: run "
                        "under mpirun -n DP x TP (nano/dp)")
    d.add_argument("--dp-policy", default=DEFAULT_POLICY,
                   help="--dp routing: round-robin | least-loaded (queued tokens, then KV occupancy) | "
                        "kv-aware (prompt tokens left after the replica's cached prefix + queued tokens)")
    d.add_argument("--dp-compare", action="store_true",
                   help="with --dp: the same requests and arrivals under each --dp-policy, one table "
                        "(nano/dp/cli.py)")


def check_args(args, config: EngineConfig) -> None:
    """--dp's flags, before the model loads."""
    if args.dp is None:
        if args.dp_compare or args.dp_policy != DEFAULT_POLICY:
            raise NanoError("--dp-policy and --dp-compare route between replicas: add --dp N (under mpirun -n N)")
        return
    serving.check_replicas(args.dp)
    if args.dp_policy not in POLICIES:
        raise NanoError(f"--dp-policy must be one of {', '.join(POLICIES)}, got {args.dp_policy!r}")
    clash = [flag for flag, on in (("--disagg", args.disagg is not None),
                                   ("--capacity", args.capacity), ("--policy-compare", args.policy_compare),
                                   ("--disagg-compare", args.disagg_compare)) if on]
    if clash:
        raise NanoError(f"--dp runs replicas of one engine: drop {', '.join(clash)}")
    if args.dp_compare and (args.output or args.metrics_file or args.metrics_prom):
        raise NanoError("--dp-compare writes a table (and --summary-json), no completions or metrics files: "
                        "drop --output, --metrics-file and --metrics-prom")
    if not parallel.launched_by_mpirun():
        raise NanoError(f"{serving.flags(args.dp, config.tp)} runs under mpirun: "
                        + serving.how_to_run(args.dp, config.tp))


def run_dp(args, config: EngineConfig, workload, engine_policy) -> int:
    """--dp DP under mpirun: every replica an engine (serving.py); rank 0 routes and reports.
    workload: engine -> the run's requests (nano/cli/prompts.py's Workload); engine_policy:
    every replica's scheduling policy (LLMEngine's policy)."""
    from nano.dp import metrics as dp_metrics  # prometheus_client: loaded for these modes only
    if args.dp_compare:
        return dp_compare(args, config, workload, engine_policy)
    run = RankRun(args, workload, serving.banner(args.dp, config.tp, args.dp_policy))
    try:
        ran = serving.launch(config, args.dp, args.dp_policy, run.make_requests, args.bench,
                             lambda seq, replica: run.on_result(seq, replica=replica),
                             lambda engine: metrics_writer(args, export=dp_metrics.ReplicaExport(
                                 engine.model_name)), engine_policy, args.speculative)
    finally:
        run.close()
    return run.report(ran, dp_metrics.summary, dp_metrics.format_replicas)


def make_front(args, config: EngineConfig, engine_policy):
    """--serve --dp N: rank 0 gets the router's Front (front.py), which run.py hands to the
    HTTP server in place of an engine; the other ranks run their replicas until the server
    ends, and get None."""
    from nano.dp.front import start_front
    front = start_front(config, args.dp, args.dp_policy, lambda engine, export: metrics_writer(args, export=export),
                        engine_policy, args.speculative, (args.served_model_name or [None])[0])
    if front is not None:
        print(f"{serving.banner(args.dp, config.tp, args.dp_policy)}; each {describe(front.local)}", file=sys.stderr)
    return front


def dp_compare(args, config: EngineConfig, workload, engine_policy) -> int:
    """--bench --dp-compare: every policy in turn on the same requests and arrivals, fresh
    engines each time (no policy inherits another's prefix cache); with --dp 1, the one run."""
    from nano.dp import metrics as dp_metrics
    results = {}
    for policy in POLICIES if args.dp > 1 else ("kv-aware",):
        gc.collect()  # the previous run's KV pools freed before this one sizes its own
        ran = serving.launch(config, args.dp, policy, lambda engine: sequences(engine, workload)[0],
                             True, engine_policy=engine_policy, speculative=args.speculative)
        if ran:
            router, _, wall = ran
            name = f"dp={args.dp} {policy}" if args.dp > 1 else "dp=1"
            results[name] = dp_metrics.summary(router, wall)
            print(f"--- {name}\n{format_summary(results[name])}\n{dp_metrics.format_replicas(results[name])}",
                  flush=True)
        del ran
    if not results:
        return 0
    print(f"\n{args.num_seqs} requests, {args.tenants} tenants x {args.prefix_len}-token system prompts + "
          f"--input-len {args.input_len}, --output-len {args.output_len}, {args.request_rate or 'all at once'} "
          f"req/s (Poisson, seeded), --num-blocks {config.num_blocks} per replica, TTFT target {args.ttft_slo} ms, "
          f"TPOT target {args.tpot_slo} ms")
    print(dp_metrics.compare_table(results))
    write_summary(args.summary_json, results)
    return 0
