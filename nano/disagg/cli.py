"""run.py's disaggregated modes: --disagg P:D under mpirun, --bench --disagg-compare P:D (one
command: colocated here, then disaggregated under mpirun) and --capacity --disagg [P:D]."""
import gc
import os
import sys

from nano.bench import workload
from nano.bench.cli import bench_arrivals, bench_requests, parse_range
from nano.cli.offline import run_all
from nano.cli.output import OutputFile, Progress, describe, metrics_writer, print_completions, write_summary
from nano.cli.prompts import model_inputs
from nano.config import EngineConfig
from nano.disagg import compare, serving
from nano.disagg import metrics as disagg_metrics
from nano.sequence import SamplingParams
from nano.telemetry.summary import format_summary


def run_disagg(args, config: EngineConfig, params: SamplingParams, requests) -> int:
    """--disagg P:D under mpirun: every rank an instance (serving.py); rank 0 routes and
    reports."""
    num_prefill, num_decode = serving.parse_split(args.disagg)
    run = RankRun(args, params, requests, f"disaggregated: {num_prefill} prefill + {num_decode} decode instances, "
                                          "one rank each")
    try:
        ran = serving.launch(config, num_prefill, num_decode, run.make_requests, args.bench, run.on_result,
                             lambda engine: metrics_writer(args, export=disagg_metrics.PoolExport(
                                 engine.model_name)))
    finally:
        run.close()
    return run.report(ran, disagg_metrics.summary, disagg_metrics.format_disagg)


class RankRun:
    """Rank 0's side of a run over several ranks (--disagg, --dp) on the command line: the
    requests as sequences, the progress bar, the --output file in input order."""

    def __init__(self, args, params: SamplingParams, requests, banner: str):
        self.args, self.params, self.requests, self.banner = args, params, requests, banner
        self.generated, self.output = 0, None

    def make_requests(self, engine) -> list:
        seqs, self.prompts = sequences(self.args, engine, self.params, self.requests)
        self.index = {seq.seq_id: i for i, seq in enumerate(seqs)}
        self.progress = Progress(len(seqs))
        if self.args.output:
            self.output = OutputFile(self.args.output, self.prompts, engine.detokenize)
        print(f"{self.banner}; each {describe(engine)}", file=sys.stderr)
        return seqs

    def on_result(self, seq, **where) -> None:
        """A request's end; where: what the --output line says of where it ran (replica=...)."""
        self.generated += seq.num_output_tokens
        self.progress.update(1, self.generated)
        if self.output:
            self.output.write(self.index[seq.seq_id], seq, **where)

    def close(self) -> None:
        if self.output:
            self.output.close()

    def report(self, ran, summarize, format_add_on) -> int:
        """Rank 0 at the end (ran: launch's (router, engine, wall seconds); None on the other
        ranks): the completions in input order, the summary, the add-on's own lines."""
        if ran is None:
            return 0
        router, engine, wall = ran
        if not self.args.bench:
            seqs = sorted(router.results.values(), key=lambda q: self.index[q.seq_id])
            print_completions(self.prompts, seqs, engine.detokenize)
        summary = summarize(router, wall)
        print(format_summary(summary))
        print(format_add_on(summary))
        write_summary(self.args.summary_json, summary)
        return 0


def sequences(args, engine, params: SamplingParams, requests):
    """The run's requests as sequences (arrival times in seconds after the start), and their
    prompts' text for the output."""
    if args.bench:
        inputs, per_request = bench_requests(args, engine, params)
        arrivals = bench_arrivals(args, len(inputs))
        arrivals = [0.0] * len(inputs) if arrivals is None else arrivals
        prompts = [""] * len(inputs)
    else:
        prompts = [p for p, _ in requests]
        inputs = model_inputs(engine.tokenizer, prompts, chat=not args.no_chat)
        per_request, arrivals = [sp for _, sp in requests], [0.0] * len(inputs)
    return [engine.make_sequence(p, sp, t) for p, sp, t in zip(inputs, per_request, arrivals)], prompts

def disagg_compare(args, argv: list[str], config: EngineConfig, params: SamplingParams) -> int:
    """--bench --disagg-compare P:D: colocated here, then disaggregated under mpirun."""
    from nano.engine import LLMEngine
    engine = LLMEngine(config)
    print(describe(engine), file=sys.stderr)
    inputs, per_request = bench_requests(args, engine, params)
    workload.warm_up(engine)
    seqs, wall = run_all(engine, inputs, per_request, bench_arrivals(args, len(inputs)))
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
    workload.warm_up(engine)
    print(f"\nfitting the step-time model on this machine ({engine.device.kind}, prompts of "
          f"{prompt_len:.0f} tokens) ...", file=sys.stderr)
    coef = estimate.calibrate(engine, int(prompt_len), int(output_len))
    split = estimate.estimate(coef, prompt_len, output_len, config.token_budget,
                              engine.capacity.num_blocks, config.block_size, config.max_num_seqs,
                              params.tpot_slo)
    print("\ndisaggregated serving, one engine per instance on this machine's share of it:")
    print(estimate.format_estimate(split, args.request_rate,
                                   serving.parse_split(args.disagg) if args.disagg else None))
