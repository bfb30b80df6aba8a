"""run.py's disaggregated modes: --disagg P:D under mpirun, --bench --disagg-compare P:D (one
command: colocated here, then disaggregated under mpirun) and --capacity --disagg [P:D]; their
flags and the checks between them."""
import gc
import os
import sys

from nano.cli.flags import parse_range
from nano.cli.offline import run_all, warm_up
from nano.cli.output import describe, metrics_writer, write_summary
from nano.config import EngineConfig
from nano.disagg import serving
from nano.errors import NanoError
from nano.fleet.cli import RankRun
from nano.sequence import SamplingParams
from nano.speculative import attach
from nano.telemetry.metrics import Metrics
from nano.telemetry.summary import format_summary


def add_arguments(p) -> None:
    d = p.add_argument_group("disaggregated prefill and decode (nano/disagg)")
    d.add_argument("--disagg", metavar="P:D", nargs="?", const="",
                   help="disaggregated serving: P prefill and D decode instances, one rank each: run "
                        "under mpirun -n P+D (nano/disagg); with --capacity, P:D is optional")
    d.add_argument("--disagg-compare", metavar="P:D",
                   help="the same requests and arrivals served colocated (one engine, all cores), then "
                        "disaggregated (mpirun -n P+D, a core each) (nano/disagg/compare.py)")


def check_args(args, config: EngineConfig, rank: int) -> None:
    """--disagg's and --disagg-compare's flags, before the model loads."""
    if args.disagg == "" and not args.capacity:
        raise NanoError("--disagg needs P:D, e.g. --disagg 1:1 (only --capacity --disagg estimates it)")
    if args.disagg:
        serving.parse_split(args.disagg)
        if config.tp > 1:
            raise NanoError("--disagg runs each instance on one rank: drop --tp")
        if args.policy_compare or args.disagg_compare:
            raise NanoError("--policy-compare and --disagg-compare run in one process: drop --disagg")
    if args.disagg_compare:
        serving.parse_split(args.disagg_compare)
        if rank > 0 or args.policy_compare or config.tp > 1:
            raise NanoError("--disagg-compare runs alone (it starts mpirun itself): no mpirun, --tp "
                            "or --policy-compare")
        if args.output or args.metrics_file or args.metrics_prom:
            raise NanoError("--disagg-compare writes a table (and --summary-json), no completions or "
                            "metrics files: drop --output, --metrics-file and --metrics-prom")


def run_disagg(args, config: EngineConfig, workload, engine_policy) -> int:
    """--disagg P:D under mpirun: every rank an instance (serving.py); rank 0 routes and
    reports. workload: engine -> the run's requests (nano/cli/prompts.py's Workload)."""
    from nano.disagg import metrics as disagg_metrics  # prometheus_client: loaded for these modes only
    num_prefill, num_decode = serving.parse_split(args.disagg)
    run = RankRun(args, workload, f"disaggregated: {num_prefill} prefill + {num_decode} decode instances, "
                                  "one rank each")
    try:
        ran = serving.launch(config, num_prefill, num_decode, run.make_requests, args.bench, run.on_result,
                             lambda engine: metrics_writer(args, export=disagg_metrics.PoolExport(
                                 engine.model_name)), engine_policy, args.speculative)
    finally:
        run.close()
    return run.report(ran, disagg_metrics.summary, disagg_metrics.format_disagg)


def disagg_compare(args, argv: list[str], config: EngineConfig, workload, engine_policy) -> int:
    """--bench --disagg-compare P:D: colocated here, then disaggregated under mpirun (workload:
    engine -> --bench's Workload; engine_policy: LLMEngine's policy)."""
    from nano.disagg import compare
    from nano.engine import LLMEngine
    engine = LLMEngine(config, policy=engine_policy)
    Metrics.attach(engine)
    attach(engine, args.speculative)
    print(describe(engine), file=sys.stderr)
    w = workload(engine)
    warm_up(engine)
    seqs, wall = run_all(engine, w.inputs, w.per_request, w.arrivals)
    colocated = compare.colocated_summary(engine, seqs, wall)
    print(f"--- colocated\n{format_summary(colocated)}\n--- disaggregated {args.disagg_compare}", flush=True)
    del engine, seqs
    gc.collect()  # its KV pool freed before the ranks allocate theirs
    disaggregated = compare.run_disaggregated(argv, args.disagg_compare)
    print(f"\n{args.num_seqs} requests, --input-len {args.input_len} --output-len {args.output_len}, "
          f"{args.request_rate or 'all at once'} req/s (Poisson, seeded), TTFT target {args.ttft_slo} ms, "
          f"TPOT target {args.tpot_slo} ms; {os.cpu_count()} cores either way")
    results = {"colocated": colocated, f"disaggregated {args.disagg_compare}": disaggregated}
    print(compare.table(results))
    for name, s in results.items():
        print(compare.targets(name, s))
    write_summary(args.summary_json, {"colocated": colocated, "disaggregated": disaggregated})
    return 0


def show_estimate(args, config: EngineConfig, params: SamplingParams) -> None:
    """--capacity --disagg: P:D for the workload of --input-len, --output-len (their means) and
    --request-rate, from the step-time model fitted on this machine (estimate.py)."""
    from nano.disagg import estimate
    from nano.engine import LLMEngine
    prompt_len, output_len = (sum(parse_range(r, name)) / 2 for r, name in
                              ((args.input_len, "--input-len"), (args.output_len, "--output-len")))
    engine = LLMEngine(config)
    Metrics.attach(engine)
    warm_up(engine)
    print(f"\nfitting the step-time model on this machine ({engine.device.kind}, prompts of "
          f"{prompt_len:.0f} tokens) ...", file=sys.stderr)
    coef = estimate.calibrate(engine, int(prompt_len), int(output_len))
    split = estimate.estimate(coef, prompt_len, output_len, config.token_budget,
                              engine.capacity.num_blocks, config.block_size, config.max_num_seqs,
                              params.tpot_slo)
    print("\ndisaggregated serving, one engine per instance on this machine's share of it:")
    print(estimate.format_estimate(split, args.request_rate,
                                   serving.parse_split(args.disagg) if args.disagg else None))
