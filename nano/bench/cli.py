"""The benchmark and planning modes of run.py: --bench, --bench --request-rate (FCFS vs
deadline on one arrival trace), --bench --policy-compare (slo_matrix.py) and --capacity."""
import gc
import sys

from nano import checks
from nano.bench import workload
from nano.cli.offline import generate, run_all
from nano.cli.output import describe, metrics_writer, write_summary
from nano.config import EngineConfig
from nano.deadline.cli import POLICIES, policy_factory
from nano.errors import NanoError
from nano.sequence import SamplingParams
from nano.telemetry.summary import format_summary, summarize


def parse_range(text: str, name: str) -> tuple[int, int]:
    try:
        lo, _, hi = text.partition(":")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise NanoError(f"{name} must be LEN or MIN:MAX, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise NanoError(f"{name} must satisfy 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


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
    workload.warm_up(engine)
    _, wall = generate(args.output, engine, [""] * len(inputs), inputs, per_request, metrics_writer(args, engine),
                       args.stall_timeout)
    summary = summarize(engine.metrics, wall)
    print(format_summary(summary))
    write_summary(args.summary_json, summary)
    print(f"bench: {summary['output_tokens_per_s']:.1f} output tokens/s, "
          f"{summary['total_tokens_per_s']:.1f} total tokens/s")
    print(workload.decode_floor(engine, summary))
    return 0


def rate_bench(args, config: EngineConfig, params: SamplingParams) -> int:
    """The same Poisson arrival trace served under FCFS and under the deadline policy."""
    from nano.engine import LLMEngine
    arrivals = bench_arrivals(args, args.num_seqs)
    results = {}
    for policy in POLICIES:
        engine = LLMEngine(config, policy=policy_factory(policy, args.drop_late and policy == "deadline"))
        if policy == "fcfs":
            print(describe(engine), file=sys.stderr)
        inputs, per_request = bench_requests(args, engine, params)
        workload.warm_up(engine)
        _, wall = run_all(engine, inputs, per_request, arrivals, metrics=metrics_writer(args, engine))
        results[policy] = summarize(engine.metrics, wall)
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


def policy_compare(args, config: EngineConfig) -> int:
    """slo_matrix.py's matrix on the real clock: a fresh engine per run, warmed up."""
    from nano.bench import slo_matrix
    from nano.engine import LLMEngine

    def make_engine(policy):
        gc.collect()  # free the previous engine's KV pool before this one sizes its own
        engine = LLMEngine(config, policy=policy_factory(policy, args.drop_late and policy == "deadline"))
        workload.warm_up(engine)
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
