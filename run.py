"""nano's command line: prompts in, completions and a summary out.

    python run.py --prompt-file prompts.txt
    python run.py --bench --num-seqs 256 --input-len 100:1024 --output-len 100:1024
    python run.py --bench --request-rate 4 --ttft-slo 2000 --tpot-slo 100   (FCFS vs deadline)
    python run.py --plan --kv-cache-memory 2GB                   (capacity planning)
    mpirun -n 2 python run.py --tp 2 --prompt-file prompts.txt   (tensor parallel)
    mpirun -n 2 python run.py --disagg 1:1 --prompt-file prompts.txt   (prefill and decode apart)
    python run.py --serve --port 8000                           (OpenAI-compatible HTTP server)
"""
import argparse
import dataclasses
import gc
import json
import os
import sys
import time

from nano import bench, checks, parallel
from nano.config import EngineConfig, parse_bytes
from nano.errors import NanoError, writing
from nano.kv_cache import DEFAULT_KEY_SCHEME
from nano.metrics import format_summary
from nano.sequence import FIELD_RULES, SamplingParams


ENGINE = EngineConfig()      # the engine's defaults, which the flags show
SAMPLING = SamplingParams()  # the API's sampling defaults
CLI_MAX_TOKENS = 256         # the API's 16 (vLLM's) cuts a chat answer short


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage dump
        raise NanoError(message)


def build_parser() -> Parser:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    io = p.add_argument_group("prompts and output")
    io.add_argument("--prompt-file", help="one prompt per line (blank lines skipped); a .jsonl file "
                    "holds one object per line: prompt, and optionally ttft_slo_ms, tpot_slo_ms, "
                    "max_tokens, temperature, top_p, top_k, seed")
    io.add_argument("--no-chat", action="store_true", help="send raw text, without the chat template")
    io.add_argument("--output", help="write one JSON object per prompt to this .jsonl file")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=CLI_MAX_TOKENS)
    s.add_argument("--temperature", type=float, default=SAMPLING.temperature, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=SAMPLING.top_p)
    s.add_argument("--top-k", type=int, default=SAMPLING.top_k)
    s.add_argument("--seed", type=int, default=SAMPLING.seed, help="per-request seed (same seed, same output)")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--ttft-slo", type=float, default=None, help="time-to-first-token target, ms")
    s.add_argument("--tpot-slo", type=float, default=None, help="time-per-output-token target, ms")
    e = p.add_argument_group("engine")
    e.add_argument("--model", default=ENGINE.model, help="Hugging Face Llama-family folder (default: SmolLM2-135M-Instruct)")
    e.add_argument("--device", default=ENGINE.device, help="auto | cpu | gpu")
    e.add_argument("--block-size", type=int, default=ENGINE.block_size)
    e.add_argument("--kv-cache-memory", type=parse_bytes, default=ENGINE.kv_cache_memory,
                   help="bytes for the KV pool, e.g. 2GB")
    e.add_argument("--num-blocks", type=int, default=ENGINE.num_blocks,
                   help="KV pool size in blocks (overrides --kv-cache-memory)")
    e.add_argument("--swap-space", type=parse_bytes, default=ENGINE.swap_space, help="host bytes for swapped-out KV")
    e.add_argument("--max-num-batched-tokens", type=int, default=ENGINE.max_num_batched_tokens)
    e.add_argument("--max-num-seqs", type=int, default=ENGINE.max_num_seqs)
    e.add_argument("--max-model-len", type=int, default=ENGINE.max_model_len)
    e.add_argument("--watermark", type=float, default=ENGINE.watermark)
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument("--preemption", default=ENGINE.preemption, help="swap | recompute | auto")
    e.add_argument("--kv-cache-dtype", default=ENGINE.kv_cache_dtype,
                   help="auto (float16 GPU, float32 CPU) | int8 (per-token scales; 2x / 4x the blocks)")
    e.add_argument("--kv-int8-keys", default=ENGINE.kv_int8_keys,
                   help="int8 keys: token (as they are) | channel (channels pre-scaled, calibrated at "
                        "load) | rotate (Hadamard-rotated); default " + DEFAULT_KEY_SCHEME)
    e.add_argument("--tp", type=int, default=ENGINE.tp, help="tensor-parallel ranks: run under mpirun -n TP")
    e.add_argument("--disagg", metavar="P:D", nargs="?", const="",
                   help="disaggregated serving: P prefill and D decode instances, one rank each: run "
                        "under mpirun -n P+D (nano/disagg.py); with --plan, P:D is optional")
    e.add_argument("--enforce-eager", action="store_true", help="GPU: run decode steps eagerly, no CUDA graphs")
    e.add_argument("--policy", default=ENGINE.policy, help="fcfs | deadline (by slack to the latency targets)")
    e.add_argument("--drop-late", action="store_true", help="deadline: reject requests that can no longer make their TTFT")
    h = p.add_argument_group("HTTP server (OpenAI-compatible, nano/server.py)")
    h.add_argument("--serve", action="store_true", help="serve /v1/completions, /v1/chat/completions, ... "
                   "(under mpirun --tp N: rank 0 serves)")
    h.add_argument("--host", default="127.0.0.1")
    h.add_argument("--port", type=int, default=8000)
    h.add_argument("--max-queued-requests", type=int, default=256,
                   help="requests in flight beyond this are answered 503")
    m = p.add_argument_group("metrics and planning")
    m.add_argument("--metrics-file", help="append a JSON metrics snapshot per step to this file")
    m.add_argument("--metrics-prom", help="keep this file rewritten with the latest snapshot in Prometheus text format")
    m.add_argument("--metrics-interval", type=int, default=ENGINE.metrics_interval, help="steps between snapshots")
    m.add_argument("--summary-json", help="also write the run's summary as one JSON object to this file")
    m.add_argument("--plan", action="store_true", help="print the KV capacity plan and the bandwidth floor, then exit")
    b = p.add_argument_group("benchmark")
    b.add_argument("--bench", action="store_true", help="random-token prompts, EOS ignored, fixed seed")
    b.add_argument("--num-seqs", type=int, default=256)
    b.add_argument("--input-len", default="100:1024", help="LEN or MIN:MAX")
    b.add_argument("--output-len", default="100:1024", help="LEN or MIN:MAX")
    b.add_argument("--request-rate", type=float, default=None,
                   help="requests/s arriving by a seeded Poisson process; runs FCFS and deadline side by side")
    b.add_argument("--policy-compare", action="store_true",
                   help="FCFS vs deadline over three workloads x three loads x --seeds seeds, "
                        "--num-seqs requests each (nano/slo_bench.py)")
    b.add_argument("--seeds", type=int, default=3, help="--policy-compare: seeds per workload and load")
    b.add_argument("--disagg-compare", metavar="P:D",
                   help="the same requests and arrivals served colocated (one engine, all cores), then "
                        "disaggregated (mpirun -n P+D, a core each) (nano/disagg_bench.py)")
    return p


def engine_config(args) -> EngineConfig:
    return EngineConfig(
        model=args.model, device=args.device, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, num_blocks=args.num_blocks, swap_space=args.swap_space,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, watermark=args.watermark,
        enable_prefix_caching=not args.no_prefix_caching, preemption=args.preemption,
        kv_cache_dtype=args.kv_cache_dtype, kv_int8_keys=args.kv_int8_keys,
        seed=ENGINE.seed if args.seed is None else args.seed, tp=args.tp, enforce_eager=args.enforce_eager, policy=args.policy,
        drop_late=args.drop_late,
        metrics_file=args.metrics_file, metrics_prom=args.metrics_prom,
        metrics_interval=args.metrics_interval)


def sampling_params(args) -> SamplingParams:
    """The sampling flags, each checked by its field's rule (FIELD_RULES) under the flag's
    name: --ttft-slo and --tpot-slo are in ms, which the same rules fit."""
    for field in ("temperature", "top_p", "top_k", "max_tokens", "seed", "ttft_slo", "tpot_slo"):
        FIELD_RULES[field]("--" + field.replace("_", "-"), getattr(args, field))
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos,
                          ttft_slo=ms(args.ttft_slo), tpot_slo=ms(args.tpot_slo))


def ms(value: float | None) -> float | None:
    return None if value is None else value / 1e3


def read_requests(path: str, defaults: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """Prompts and their sampling parameters: plain text, one prompt per line, or JSONL with
    per-request overrides (latency targets in ms)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(i, line.rstrip("\n")) for i, line in enumerate(f, 1) if line.strip()]
    except OSError as e:
        raise NanoError(f"cannot read prompt file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise NanoError(f"prompt file {path} is not UTF-8 text") from None
    if not lines:
        raise NanoError(f"prompt file {path} has no prompts")
    if not path.endswith(".jsonl"):
        return [(line, defaults) for _, line in lines]
    return [_jsonl_request(path, i, line, defaults) for i, line in lines]


JSONL_FIELDS = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
                "top_k": "top_k", "seed": "seed", "ttft_slo_ms": "ttft_slo", "tpot_slo_ms": "tpot_slo"}


def _jsonl_request(path: str, lineno: int, line: str, defaults: SamplingParams):
    """One line's prompt and its SamplingParams, each field checked by SamplingParams' own
    rule (FIELD_RULES) under the name the file gives it."""
    where = f"{path} line {lineno}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise NanoError(f"{where}: not JSON ({e.msg})") from None
    except ValueError:  # Python reads no integer of over 4300 digits
        raise NanoError(f"{where}: a number too long to read") from None
    except RecursionError:
        raise NanoError(f"{where}: nested too deeply") from None
    if not isinstance(record, dict) or "prompt" not in record:
        raise NanoError(f'{where}: expected an object with a "prompt" string')
    unknown = set(record) - set(JSONL_FIELDS) - {"prompt"}
    if unknown:
        raise NanoError(f"{where}: unknown field {sorted(unknown)[0]!r}")
    prompt = checks.text(f"{where}: field prompt", record.pop("prompt"))
    overrides = {}
    for key, value in record.items():
        field = JSONL_FIELDS[key]
        value = FIELD_RULES[field](f"{where}: field {key}", value)
        overrides[field] = ms(value) if key.endswith("_ms") else value
    return prompt, dataclasses.replace(defaults, **overrides)


def parse_range(text: str, name: str) -> tuple[int, int]:
    try:
        lo, _, hi = text.partition(":")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise NanoError(f"{name} must be LEN or MIN:MAX, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise NanoError(f"{name} must satisfy 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int):
        self.total, self.done, self.start = total, 0, time.perf_counter()
        self.tty = sys.stderr.isatty()

    def update(self, finished: int, generated: int) -> None:
        self.done += finished
        if not self.tty and self.done < self.total:
            return
        width = 30
        fill = width * self.done // max(self.total, 1)
        rate = generated / max(time.perf_counter() - self.start, 1e-9)  # of finished requests
        end = "\n" if self.done == self.total else ""
        print(f"\r[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} requests, "
              f"{rate:.1f} tok/s", end=end, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    group = parallel.tp_group()  # under mpirun every rank runs main; rank 0 alone talks to the user,
    with group.together():       # so a bad argument stops every rank, and is printed once
        args, config, params, requests = parse(argv, group.rank)
        if not args.plan and not args.disagg:  # a plan for --tp N is computed in one process
            group.require(config.tp)
    if args.plan:
        return show_plan(args, config, params)
    if args.bench and args.policy_compare:
        return policy_compare(args, config)
    if args.disagg:
        return run_disagg(args, config, params, requests)
    if args.disagg_compare:
        return disagg_compare(args, argv if argv is not None else sys.argv[1:], config, params)
    if args.bench and args.request_rate:
        return rate_bench(args, config, params)
    if group.rank > 0:
        from nano.worker import Worker  # after argument checks: loading takes seconds
        return serve_rank(args, Worker(config))
    from nano.engine import LLMEngine
    engine = LLMEngine(config)
    print(engine.describe(), file=sys.stderr)
    if args.serve:
        return serve(args, engine)
    if args.bench:
        return run_bench(args, engine, params)
    return run_prompts(args, engine, requests)


def parse(argv, rank: int):
    """Flags, checked; the prompt file, read (on rank 0) before the model loads."""
    args = build_parser().parse_args(argv)
    config = engine_config(args)
    config.validate()
    params = sampling_params(args)
    plan_disagg = args.plan and args.disagg is not None
    if args.bench or plan_disagg:  # --plan --disagg sizes the pools for the bench flags' workload
        check_bench_args(args, config)
    if not args.bench and (args.policy_compare or args.disagg_compare or
                           (args.request_rate is not None and not plan_disagg)):
        raise NanoError("--policy-compare, --request-rate and --disagg-compare are --bench modes: add --bench")
    if not (args.prompt_file or args.bench or args.plan or args.serve):
        raise NanoError("give --prompt-file FILE (or --bench, --plan or --serve)")
    if args.serve:
        checks.integer("--port", args.port, 0, 65535)
        checks.integer("--max-queued-requests", args.max_queued_requests, low=1)
        if args.prompt_file or args.bench or args.disagg is not None:
            raise NanoError("--serve takes its prompts over HTTP: drop --prompt-file, --bench and --disagg")
    if args.disagg == "" and not args.plan:
        raise NanoError("--disagg needs P:D, e.g. --disagg 1:1 (only --plan --disagg estimates it)")
    if args.disagg:
        from nano.disagg import parse_split
        parse_split(args.disagg)
        if config.tp > 1:
            raise NanoError("--disagg runs each instance on one rank: drop --tp")
        if args.policy_compare or args.disagg_compare:
            raise NanoError("--policy-compare and --disagg-compare run in one process: drop --disagg")
    if args.disagg_compare:
        from nano.disagg import parse_split
        parse_split(args.disagg_compare)
        if rank > 0 or args.policy_compare or config.tp > 1:
            raise NanoError("--disagg-compare runs alone (it starts mpirun itself): no mpirun, --tp "
                            "or --policy-compare")
        if args.output or config.metrics_file or config.metrics_prom:
            raise NanoError("--disagg-compare writes a table (and --summary-json), no completions or "
                            "metrics files: drop --output, --metrics-file and --metrics-prom")
    if args.summary_json and args.policy_compare:
        raise NanoError("--policy-compare prints its matrix: drop --summary-json")
    requests = (read_requests(args.prompt_file, params)
                if args.prompt_file and not args.bench and rank == 0 else None)
    checks.writable_file("--output", args.output)  # now, not after generating everything
    checks.writable_file("--summary-json", args.summary_json)
    return args, config, params, requests


def show_plan(args, config: EngineConfig, params: SamplingParams) -> int:
    from nano.capacity import format_plan, plan_from_config
    print(format_plan(plan_from_config(config)))
    if args.disagg is not None:
        show_disagg_plan(args, config, params)
    return 0


def show_disagg_plan(args, config: EngineConfig, params: SamplingParams) -> None:
    """--plan --disagg: P:D for the workload of --input-len, --output-len (their means) and
    --request-rate, from the step-time model fitted on this machine (nano/disagg_plan.py)."""
    from nano import disagg_plan
    from nano.disagg import parse_split
    from nano.engine import LLMEngine
    prompt_len, output_len = (sum(parse_range(r, name)) / 2 for r, name in
                              ((args.input_len, "--input-len"), (args.output_len, "--output-len")))
    engine = LLMEngine(config)
    bench.warm_up(engine)
    print(f"\nfitting the step-time model on this machine ({engine.device.kind}, prompts of "
          f"{prompt_len:.0f} tokens) ...", file=sys.stderr)
    coef = disagg_plan.calibrate(engine, int(prompt_len), int(output_len))
    plan = disagg_plan.estimate(coef, prompt_len, output_len, config.max_num_batched_tokens,
                                engine.block_manager.num_blocks, config.block_size, config.max_num_seqs,
                                params.tpot_slo)
    print("\ndisaggregated serving, one engine per instance on this machine's share of it:")
    print(disagg_plan.format_disagg_plan(plan, args.request_rate, parse_split(args.disagg) if args.disagg else None))


def serve_rank(args, worker) -> int:
    """A TP rank > 0: runs the steps rank 0 broadcasts until it says stop."""
    if args.bench:  # as rank 0's bench.warm_up does: page faults stay out of the figures
        worker.runner.touch_kv_cache()
    worker.run()
    return 0


def serve(args, engine) -> int:
    """--serve: the HTTP server until Ctrl-C; then the TP ranks are told to stop."""
    try:
        from nano.server import serve as serve_http
    except ImportError as e:
        raise NanoError(f"--serve needs FastAPI and uvicorn (pip install -r requirements.txt): {e}") from None
    print(f"serving {engine.shard.model_dir.name} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    try:
        serve_http(engine, args.host, args.port, args.max_queued_requests)
    finally:
        engine.stop_workers()
    return 0


def run_prompts(args, engine, requests) -> int:
    chat = not args.no_chat and engine.tokenizer.chat_template is not None
    prompts = [p for p, _ in requests]
    inputs = [engine.tokenizer.apply_chat_template(p) if chat else p for p in prompts]
    seqs, wall = generate(args.output, engine, prompts, inputs, [sp for _, sp in requests])
    for i, (prompt, seq) in enumerate(zip(prompts, seqs)):
        if seq.finish_reason == "rejected":
            print(f"[{i}] rejected: {seq.error}", file=sys.stderr)
        else:
            print(f"[{i}] {prompt}\n{engine.detokenize(seq)}\n")
    summary = engine.metrics.summary(wall)
    print(format_summary(summary))
    write_summary(args.summary_json, summary)
    return 0


def run_bench(args, engine, params: SamplingParams) -> int:
    inputs, per_request = bench_requests(args, engine, params)
    bench.warm_up(engine)
    _, wall = generate(args.output, engine, [""] * len(inputs), inputs, per_request)
    summary = engine.metrics.summary(wall)
    print(format_summary(summary))
    write_summary(args.summary_json, summary)
    print(f"bench: {summary['output_tokens_per_s']:.1f} output tokens/s, "
          f"{summary['total_tokens_per_s']:.1f} total tokens/s")
    print(bench.decode_floor(engine, summary))
    return 0


def generate(path: str | None, engine, prompts, inputs, per_request):
    """run_all, with --output written as requests finish and put in input order at the end,
    also on Ctrl-C or an error; then the TP ranks are told to stop."""
    output = OutputFile(path, prompts, engine.detokenize) if path else None
    try:
        seqs, wall = run_all(engine, inputs, per_request, output=output)
    finally:
        if output:
            output.close()
    engine.stop_workers()
    return seqs, wall


def run_disagg(args, config: EngineConfig, params: SamplingParams, requests) -> int:
    """--disagg P:D under mpirun: every rank an instance (nano/disagg.py); rank 0 routes and
    reports."""
    from nano import disagg, disagg_metrics
    num_prefill, num_decode = disagg.parse_split(args.disagg)
    run = {"generated": 0}  # rank 0's: filled in by make_requests

    def make_requests(engine):
        if args.bench:
            inputs, per_request = bench_requests(args, engine, params)
            arrivals = (bench.poisson_arrivals(len(inputs), args.request_rate) if args.request_rate
                        else [0.0] * len(inputs))
            prompts = [""] * len(inputs)
        else:
            chat = not args.no_chat and engine.tokenizer.chat_template is not None
            prompts = [p for p, _ in requests]
            inputs = [engine.tokenizer.apply_chat_template(p) if chat else p for p in prompts]
            per_request, arrivals = [sp for _, sp in requests], [0.0] * len(inputs)
        seqs = [engine.make_sequence(p, sp, t) for p, sp, t in zip(inputs, per_request, arrivals)]
        run.update(prompts=prompts, index={seq.seq_id: i for i, seq in enumerate(seqs)},
                   progress=Progress(len(seqs)),
                   output=OutputFile(args.output, prompts, engine.detokenize) if args.output else None)
        print(f"disaggregated: {num_prefill} prefill + {num_decode} decode instances, one rank each; "
              f"each {engine.describe()}", file=sys.stderr)
        return seqs

    def on_result(seq):
        run["generated"] += seq.num_output_tokens
        run["progress"].update(1, run["generated"])
        if run["output"]:
            run["output"].write(run["index"][seq.seq_id], seq)

    try:
        ran = disagg.launch(config, num_prefill, num_decode, make_requests, args.bench, on_result)
    finally:
        if run.get("output"):
            run["output"].close()
    if ran is None:
        return 0
    router, engine, wall = ran
    seqs = sorted(router.results.values(), key=lambda q: run["index"][q.seq_id])
    if not args.bench:
        for i, (prompt, seq) in enumerate(zip(run["prompts"], seqs)):
            if seq.finish_reason == "rejected":
                print(f"[{i}] rejected: {seq.error}", file=sys.stderr)
            else:
                print(f"[{i}] {prompt}\n{engine.detokenize(seq)}\n")
    summary = disagg_metrics.summary(router, wall)
    print(format_summary(summary))
    print(disagg_metrics.format_disagg(summary))
    write_summary(args.summary_json, summary)
    return 0


def write_summary(path: str | None, summary: dict) -> None:
    if path:
        with writing(path), open(path, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)


def disagg_compare(args, argv: list[str], config: EngineConfig, params: SamplingParams) -> int:
    """--bench --disagg-compare P:D: colocated here, then disaggregated under mpirun."""
    from nano import disagg_bench
    from nano.engine import LLMEngine
    engine = LLMEngine(config)
    print(engine.describe(), file=sys.stderr)
    inputs, per_request = bench_requests(args, engine, params)
    bench.warm_up(engine)
    arrivals = bench.poisson_arrivals(len(inputs), args.request_rate) if args.request_rate else None
    seqs, wall = run_all(engine, inputs, per_request, arrivals)
    colocated = disagg_bench.colocated_summary(engine, seqs, wall)
    print(f"--- colocated\n{format_summary(colocated)}\n--- disaggregated {args.disagg_compare}", flush=True)
    del engine, seqs
    gc.collect()  # its KV pool freed before the ranks allocate theirs
    disaggregated = disagg_bench.run_disaggregated(argv, args.disagg_compare)
    print(f"\n{args.num_seqs} requests, --input-len {args.input_len} --output-len {args.output_len}, "
          f"{args.request_rate or 'all at once'} req/s (Poisson, seeded), TTFT target {args.ttft_slo} ms, "
          f"TPOT target {args.tpot_slo} ms; {os.cpu_count()} cores either way")
    results = {"colocated": colocated, f"disaggregated {args.disagg_compare}": disaggregated}
    print(disagg_bench.table(results))
    for name, s in results.items():
        print(disagg_bench.targets(name, s))
    write_summary(args.summary_json, {"colocated": colocated, "disaggregated": disaggregated})
    return 0


def check_bench_args(args, config: EngineConfig) -> None:
    checks.integer("--num-seqs", args.num_seqs, low=1)
    parse_range(args.input_len, "--input-len")
    parse_range(args.output_len, "--output-len")
    checks.number("--request-rate", args.request_rate, low=0, open_low=True, optional=True)
    checks.integer("--seeds", args.seeds, low=1)
    if (args.request_rate is not None or args.policy_compare) and config.tp > 1:
        raise NanoError("--request-rate and --policy-compare compare two policies in one process: "
                        "run them without --tp")


def bench_requests(args, engine, params: SamplingParams):
    """The benchmark's random prompts, each of which must fit the model's context."""
    input_len = parse_range(args.input_len, "--input-len")
    if input_len[1] >= engine.max_model_len:
        raise NanoError(f"--input-len {args.input_len}: prompts must be shorter than the model "
                        f"context of {engine.max_model_len} tokens")
    return bench.random_requests(args.num_seqs, input_len, parse_range(args.output_len, "--output-len"),
                                 engine.model_config.vocab_size, params.ttft_slo, params.tpot_slo)


def run_all(engine, inputs, per_request, arrivals=None, output=None):
    """Generate everything (arrivals: seconds from now at which each request arrives; output:
    an OutputFile that gets each request as it finishes)."""
    progress = Progress(len(inputs))
    start = engine.clock.now()
    seqs = [engine.add_request(p, sp, None if arrivals is None else start + t)
            for p, sp, t in zip(inputs, per_request, arrivals if arrivals is not None else [None] * len(inputs))]
    index = {seq.seq_id: i for i, seq in enumerate(seqs)}
    while engine.has_unfinished():
        finished = engine.step()
        progress.update(len(finished), engine.metrics.generated_tokens)
        if output:
            for seq in finished:
                output.write(index[seq.seq_id], seq)
    return seqs, engine.clock.now() - start


def rate_bench(args, config: EngineConfig, params: SamplingParams) -> int:
    """The same Poisson arrival trace served under FCFS and under the deadline policy."""
    from nano.engine import LLMEngine
    arrivals = bench.poisson_arrivals(args.num_seqs, args.request_rate)
    results = {}
    for policy in ("fcfs", "deadline"):
        engine = LLMEngine(dataclasses.replace(config, policy=policy))
        if policy == "fcfs":
            print(engine.describe(), file=sys.stderr)
        inputs, per_request = bench_requests(args, engine, params)
        bench.warm_up(engine)
        _, wall = run_all(engine, inputs, per_request, arrivals)
        results[policy] = engine.metrics.summary(wall)
        print(f"--- {policy}\n{format_summary(results[policy])}")
        pool = getattr(engine.device.xp, "get_default_memory_pool", None)  # CuPy only
        del engine
        gc.collect()  # free one engine's KV pool before the next sizes its own
        if pool:
            pool().free_all_blocks()
    write_summary(args.summary_json, results)
    print(f"\n{args.num_seqs} requests at {args.request_rate} req/s (Poisson, seeded), "
          f"TTFT target {args.ttft_slo} ms, TPOT target {args.tpot_slo} ms\n{bench.policy_table(results)}")
    return 0


def policy_compare(args, config: EngineConfig) -> int:
    """nano/slo_bench.py's matrix on the real clock: a fresh engine per run, warmed up."""
    from nano import slo_bench
    from nano.engine import LLMEngine

    def make_engine(policy):
        gc.collect()  # free the previous engine's KV pool before this one sizes its own
        engine = LLMEngine(dataclasses.replace(config, policy=policy))
        bench.warm_up(engine)
        return engine

    def report(name, load, seed, policy, outcome, capacity):
        print(f"{name} {load} (capacity {capacity:.2f} req/s) seed {seed} {policy}: "
              f"{outcome.met}/{outcome.total} met, goodput {outcome.goodput:.2f} req/s", file=sys.stderr)

    vocab = make_engine("fcfs").model_config.vocab_size
    results = slo_bench.run_matrix(make_engine, vocab, args.num_seqs, range(args.seeds), on_result=report)
    print(slo_bench.matrix_table(results))
    print()
    print(slo_bench.kind_table(results))
    return 0


class OutputFile:
    """--output F.jsonl: one JSON object per prompt, `index` its position in the input. Each
    is appended, and flushed, the moment its request finishes, so a run that is interrupted
    or killed keeps every finished completion; close() (at the end, and on Ctrl-C or an
    error) then puts them in input order in one step, a rename. The file is not touched
    before the first request finishes."""

    def __init__(self, path: str, prompts: list[str], decode):
        self.path, self.prompts, self.decode = path, prompts, decode
        self.records: dict[int, str] = {}  # index -> JSON line
        self.file = None

    def write(self, index: int, seq) -> None:
        record = {"index": index, "prompt": self.prompts[index], "text": self.decode(seq),
                  "token_ids": seq.output_token_ids, "finish_reason": seq.finish_reason,
                  "num_prompt_tokens": seq.num_prompt_tokens}
        if seq.error:
            record["error"] = seq.error
        self.records[index] = json.dumps(record, ensure_ascii=False) + "\n"
        with writing(self.path):
            if self.file is None:
                self.file = open(self.path, "w", encoding="utf-8")
            self.file.write(self.records[index])
            self.file.flush()

    def close(self) -> None:
        if self.file is None:
            return
        self.file.close()
        tmp = self.path + ".tmp"
        with writing(self.path):
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(self.records[i] for i in sorted(self.records))
            os.replace(tmp, self.path)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except NanoError as e:
        parallel.exit_on_error(e, 2)
    except KeyboardInterrupt:  # under mpirun, on any rank: every rank ends (exit_on_error)
        parallel.exit_on_error(NanoError("interrupted"), 130)
    except Exception as e:  # a bug: alone, show the traceback; under MPI, end every rank
        if parallel.alone():
            raise
        parallel.exit_on_error(e, 1)
