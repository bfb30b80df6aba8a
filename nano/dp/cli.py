"""run.py's data-parallel modes under mpirun -n DP x TP: --dp DP [--tp TP] with --prompt-file,
--bench or --serve, and --bench --dp-compare (every policy on the same requests and arrivals,
one table)."""
import gc
import sys

from nano import parallel
from nano.cli.output import describe, metrics_writer, write_summary
from nano.config import EngineConfig
from nano.disagg.cli import RankRun, sequences
from nano.dp import metrics as dp_metrics
from nano.dp import serving
from nano.dp.policy import POLICIES
from nano.errors import NanoError
from nano.sequence import SamplingParams
from nano.telemetry.summary import format_summary


def check_args(args, config: EngineConfig) -> None:
    """--dp's flags, before the model loads."""
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


def run_dp(args, config: EngineConfig, params: SamplingParams, requests) -> int:
    """--dp DP under mpirun: every replica an engine (serving.py); rank 0 routes and reports."""
    if args.dp_compare:
        return dp_compare(args, config, params)
    if args.serve:
        return serve_dp(args, config)
    run = RankRun(args, params, requests, serving.banner(args.dp, config.tp, args.dp_policy))
    try:
        ran = serving.launch(config, args.dp, args.dp_policy, run.make_requests, args.bench,
                             lambda seq, replica: run.on_result(seq, replica=replica),
                             lambda engine: metrics_writer(args, export=dp_metrics.ReplicaExport(
                                 engine.model_name)))
    finally:
        run.close()
    return run.report(ran, dp_metrics.summary, dp_metrics.format_replicas)


def serve_dp(args, config: EngineConfig) -> int:
    """--serve --dp N: the HTTP server on rank 0, in front of the router (front.py)."""
    from nano.dp.front import start_front
    from nano.server.cli import serve
    front = start_front(config, args.dp, args.dp_policy, lambda engine, export: metrics_writer(args, export=export))
    if front is None:
        return 0  # a replica, until the server ends
    print(f"{serving.banner(args.dp, config.tp, args.dp_policy)}; each {describe(front.local)}", file=sys.stderr)
    return serve(args, front, engine_metrics=False)


def dp_compare(args, config: EngineConfig, params: SamplingParams) -> int:
    """--bench --dp-compare: every policy in turn on the same requests and arrivals, fresh
    engines each time (no policy inherits another's prefix cache); with --dp 1, the one run."""
    results = {}
    for policy in POLICIES if args.dp > 1 else ("kv-aware",):
        gc.collect()  # the previous run's KV pools freed before this one sizes its own
        ran = serving.launch(config, args.dp, policy, lambda engine: sequences(args, engine, params, None)[0],
                             True)
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
