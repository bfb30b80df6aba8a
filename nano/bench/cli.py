"""The benchmark and planning modes of run.py: --bench, --bench --request-rate (FCFS vs
deadline on one arrival trace), --bench --policy-compare (slo_matrix.py) and --capacity; their
flags and the checks between them."""
import gc
import sys

from nano import checks
from nano.bench import workload
from nano.cli.flags import given, parse_range
from nano.cli.offline import generate, run_all, warm_up
from nano.cli.output import describe, metrics_writer, write_summary
from nano.cli.prompts import Workload
from nano.config import EngineConfig
from nano.errors import NanoError
from nano.sequence import SamplingParams
from nano.speculative import attach
from nano.telemetry.metrics import Metrics, metrics_of
from nano.telemetry.summary import format_summary, summarize


def add_arguments(p) -> None:
    b = p.add_argument_group("benchmark and planning (nano/bench)")
    b.add_argument("--capacity", action="store_true",
                   help="print the KV pool, the batch ceiling and the decode-step floor, then exit")
    b.add_argument("--bench", action="store_true", help="random-token prompts, EOS ignored, fixed seed")
    b.add_argument("--num-seqs", type=int, default=256)
    b.add_argument("--input-len", default="100:1024", help="LEN or MIN:MAX")
    b.add_argument("--output-len", default="100:1024", help="LEN or MIN:MAX")
    b.add_argument("--request-rate", type=float, default=None,
                   help="requests/s arriving by a seeded Poisson process; runs FCFS and deadline side by side")
    b.add_argument("--policy-compare", action="store_true",
                   help="FCFS vs deadline over three workloads x three loads x --seeds seeds, "
                        "--num-seqs requests each (nano/bench/slo_matrix.py)")
    b.add_argument("--seeds", type=int, default=3, help="--policy-compare: seeds per workload and load")
    b.add_argument("--tenants", type=int, default=None,
                   help="prompts of N tenants: each starts with its tenant's system prompt (--prefix-len "
                        "tokens), then --input-len tokens of its own")
    b.add_argument("--prefix-len", type=int, default=None, help="--tenants: tokens of each tenant's system prompt")


def check_args(args, config: EngineConfig) -> None:
    """The benchmark's flags; --capacity --disagg sizes the pools for their workload, so it
    takes them too. The comparisons of nano/dp and nano/disagg run on --bench's workload."""
    estimate_disagg = args.capacity and args.disagg is not None
    if args.bench or estimate_disagg:
        check_bench_args(args, config)
    if not args.bench and (args.policy_compare or args.disagg_compare or args.dp_compare or
                           args.tenants is not None or args.prefix_len is not None or
                           (args.request_rate is not None and not estimate_disagg)):
        raise NanoError("--policy-compare, --request-rate, --tenants, --dp-compare and --disagg-compare are "
                        "--bench modes: add --bench")
    workload = ("input_len", "output_len", "request_rate") if estimate_disagg else ()
    if not args.bench and (flags := given(args, add_arguments, ("bench", "capacity") + workload)):
        raise NanoError(f"{', '.join(flags)}: --bench's workload, which needs --bench")
    if args.summary_json and args.policy_compare:
        raise NanoError("--policy-compare prints its matrix: drop --summary-json")


def check_bench_args(args, config: EngineConfig) -> None:
    checks.integer("--num-seqs", args.num_seqs, low=1)
    parse_range(args.input_len, "--input-len")
    parse_range(args.output_len, "--output-len")
    checks.number("--request-rate", args.request_rate, low=0, open_low=True, optional=True)
    checks.integer("--seeds", args.seeds, low=1)
    checks.integer("--tenants", args.tenants, low=1, optional=True)
    checks.integer("--prefix-len", args.prefix_len, low=1, optional=True)
    if (args.tenants is None) != (args.prefix_len is None):
        raise NanoError("--tenants and --prefix-len go together: N tenants, each with a system prompt of LEN tokens")
    if args.tenants and args.policy_compare:
        raise NanoError("--policy-compare runs its own workloads: drop --tenants and --prefix-len")
    if (args.request_rate is not None or args.policy_compare) and config.tp > 1:
        raise NanoError("--request-rate and --policy-compare compare two policies in one process: "
                        "run them without --tp")


def bench_seed(args) -> int:
    """What --bench's workload (prompts, per-request sampling seeds, arrival times) is drawn
    from: --seed, so that runs on several seeds see several workloads."""
    return 0 if args.seed is None else args.seed


def bench_arrivals(args, num: int):
    """Seconds after the start at which each of num requests arrives (--request-rate,
    Poisson, seeded as the prompts are), or None: all at once."""
    return workload.poisson_arrivals(num, args.request_rate, bench_seed(args)) if args.request_rate else None


def bench_workload(args, params: SamplingParams):
    """--bench's requests and arrival times for the engine that runs them: engine -> Workload."""
    def make(engine) -> Workload:
        inputs, per_request = bench_requests(args, engine, params)
        return Workload([""] * len(inputs), inputs, per_request, bench_arrivals(args, len(inputs)))
    return make


def bench_requests(args, engine, params: SamplingParams):
    """The benchmark's random prompts, each of which must fit the model's context."""
    input_len = parse_range(args.input_len, "--input-len")
    if input_len[1] >= engine.max_model_len:
        raise NanoError(f"--input-len {args.input_len}: prompts must be shorter than the model "
                        f"context of {engine.max_model_len} tokens")
    output_len, vocab = parse_range(args.output_len, "--output-len"), engine.model_config.vocab_size
    if args.tenants:
        if args.prefix_len + input_len[1] >= engine.max_model_len:
            raise NanoError(f"--prefix-len {args.prefix_len} + --input-len {args.input_len}: prompts must be "
                            f"shorter than the model context of {engine.max_model_len} tokens")
        return workload.tenant_requests(args.num_seqs, args.tenants, args.prefix_len, input_len, output_len, vocab,
                                        params.ttft_slo, params.tpot_slo, bench_seed(args))
    return workload.random_requests(args.num_seqs, input_len, output_len, vocab, params.ttft_slo, params.tpot_slo,
                                    bench_seed(args))


def show_capacity(config: EngineConfig) -> None:
    """--capacity: the KV pool the engine would allocate, the batch ceiling, the decode floor."""
    from nano.bench.capacity import capacity_report, format_report
    print(format_report(capacity_report(config)))


def run_bench(args, engine, params: SamplingParams) -> int:
    inputs, per_request = bench_requests(args, engine, params)
    warm_up(engine)
    _, wall = generate(args.output, engine, [""] * len(inputs), inputs, per_request, metrics_writer(args, engine),
                       args.stall_timeout)
    summary = summarize(metrics_of(engine), wall)
    print(format_summary(summary))
    write_summary(args.summary_json, summary)
    print(f"bench: {summary['output_tokens_per_s']:.1f} output tokens/s, "
          f"{summary['total_tokens_per_s']:.1f} total tokens/s")
    print(workload.decode_floor(engine, summary))
    return 0


def rate_bench(args, config: EngineConfig, params: SamplingParams, policies: dict) -> int:
    """The same Poisson arrival trace served under each policy ({"fcfs": FCFS, "deadline":
    ...}: the classes LLMEngine takes, by name)."""
    from nano.engine import LLMEngine
    arrivals = bench_arrivals(args, args.num_seqs)
    results = {}
    for policy, policy_class in policies.items():
        engine = LLMEngine(config, policy=policy_class)
        Metrics.attach(engine)
        attach(engine, args.speculative)
        if policy == "fcfs":
            print(describe(engine), file=sys.stderr)
        inputs, per_request = bench_requests(args, engine, params)
        warm_up(engine)
        _, wall = run_all(engine, inputs, per_request, arrivals, metrics=metrics_writer(args, engine))
        results[policy] = summarize(metrics_of(engine), wall)
        print(f"--- {policy}\n{format_summary(results[policy])}")
        pool = getattr(engine.device.xp, "get_default_memory_pool", None)  # CuPy only
        del engine
        gc.collect()  # free one engine's KV pool before the next sizes its own
        if pool:
            pool().free_all_blocks()
    write_summary(args.summary_json, results)
    print(f"\n{args.num_seqs} requests at {args.request_rate} req/s (Poisson, seeded), "
          f"TTFT target {args.ttft_slo} ms, TPOT target {args.tpot_slo} ms\n{workload.policy_table(results)}")
    return 0


def policy_compare(args, config: EngineConfig, policies: dict) -> int:
    """slo_matrix.py's matrix on the real clock: a fresh engine per run, warmed up (policies:
    as rate_bench's)."""
    from nano.bench import slo_matrix
    from nano.engine import LLMEngine

    def make_engine(policy):
        gc.collect()  # free the previous engine's KV pool before this one sizes its own
        engine = LLMEngine(config, policy=policies[policy])
        Metrics.attach(engine)
        attach(engine, args.speculative)
        warm_up(engine)
        return engine

    def report(name, load, seed, policy, outcome, capacity):
        print(f"{name} {load} (capacity {capacity:.2f} req/s) seed {seed} {policy}: "
              f"{outcome.met}/{outcome.total} met, goodput {outcome.goodput:.2f} req/s", file=sys.stderr)

    vocab = make_engine("fcfs").model_config.vocab_size
    results = slo_matrix.run_matrix(make_engine, vocab, args.num_seqs, range(args.seeds), on_result=report)
    print(slo_matrix.matrix_table(results))
    print()
    print(slo_matrix.kind_table(results))
    return 0
