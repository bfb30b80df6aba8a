"""nano's command line: prompts in, completions and a summary out.

    python run.py --prompt-file prompts.txt
    python run.py --bench --num-seqs 256 --input-len 100:1024 --output-len 100:1024
    python run.py --bench --request-rate 4 --ttft-slo 2000 --tpot-slo 100   (FCFS vs deadline)
    python run.py --capacity --kv-cache-memory 2GB               (capacity planning)
    mpirun -n 2 python run.py --tp 2 --prompt-file prompts.txt   (tensor parallel)
    mpirun -n 2 python run.py --disagg 1:1 --prompt-file prompts.txt   (prefill and decode apart)
    mpirun -n 2 python run.py --dp 2 --prompt-file prompts.txt   (replicas behind a KV-aware router)
    python run.py --serve --port 8000                           (OpenAI-compatible HTTP server)
    python run.py --lab list                                     (the lab: each concept's claim measured)

This file is the flags and the dispatch; each mode's code lives with its package: nano/cli
(prompts in, completions out), nano/bench (benchmarks, capacity), nano/disagg, nano/dp, nano/server,
nano/lab (experiments).
"""
import argparse
import math
import os
import signal
import sys

from nano import checks, default_model, parallel
from nano.bench.cli import check_bench_args
from nano.cli.output import check_writable
from nano.cli.prompts import ms, read_requests
from nano.config import DEFAULT_KEY_SCHEME, STEP_TARGET, TOKEN_BUDGET, EngineConfig
from nano.deadline.cli import policy_factory
from nano.errors import NanoError
from nano.sequence import FIELD_RULES, SamplingParams
from nano.telemetry import heartbeat
from nano.telemetry.watchdog import DEFAULT_STALL_TIMEOUT

ENGINE = EngineConfig()      # the engine's defaults, which the flags show
SAMPLING = SamplingParams()  # the API's sampling defaults
CLI_MAX_TOKENS = 256         # the API's 16 (vLLM's) cuts a chat answer short
LAB_OUT = "lab"              # --lab-out's default (git-ignored; docs/lab holds the documented runs)
LAB_FLAGS = {"lab", "lab_quick", "lab_out", "model", "device", "seed"}  # what --lab reads


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
    s.add_argument("--seed", type=int, default=SAMPLING.seed,
                   help="per-request seed (same seed, same output); --bench: its prompts' and arrival times' seed")
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
    e.add_argument("--max-num-batched-tokens", type=int, default=ENGINE.max_num_batched_tokens,
                   help=f"tokens in one step (default: up to {TOKEN_BUDGET}, fewer where the step-time model "
                        f"says a step would take over {STEP_TARGET:g} s: every stream's longest pause)")
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
                        "under mpirun -n P+D (nano/disagg); with --capacity, P:D is optional")
    e.add_argument("--dp", type=int, default=None,
                   help="data parallel: DP replicas, each of --tp ranks, behind a router on rank 0: run "
                        "under mpirun -n DP x TP (nano/dp)")
    e.add_argument("--dp-policy", default="kv-aware",
                   help="--dp routing: round-robin | least-loaded (queued tokens, then KV occupancy) | "
                        "kv-aware (prompt tokens left after the replica's cached prefix + queued tokens)")
    e.add_argument("--enforce-eager", action="store_true", help="GPU: run decode steps eagerly, no CUDA graphs")
    e.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=ENGINE.batch_invariant,
                   help="CPU: each token's result bitwise independent of the batch and schedule (slower); "
                        "default: on for --kv-cache-dtype int8, else off")
    e.add_argument("--policy", default="fcfs", help="fcfs | deadline (by slack to the latency targets)")
    e.add_argument("--drop-late", action="store_true", help="deadline: reject requests that can no longer make their TTFT")
    e.add_argument("--stall-timeout", type=float, default=DEFAULT_STALL_TIMEOUT,
                   help="seconds a step may go without using CPU (under mpirun: a rank without a heartbeat) "
                        "before the run is ended as stalled; a slow step that computes is never ended")
    h = p.add_argument_group("HTTP server (OpenAI-compatible, nano/server)")
    h.add_argument("--serve", action="store_true", help="serve /v1/completions, /v1/chat/completions, ... "
                   "(under mpirun --tp N: rank 0 serves)")
    h.add_argument("--host", default="127.0.0.1")
    h.add_argument("--port", type=int, default=8000)
    h.add_argument("--max-queued-requests", type=int, default=256,
                   help="requests in flight beyond this are answered 503")
    import os
    from nano.server.limits import LOG_LEVELS, SHUTDOWN_TIMEOUT, Limits
    limits = Limits()
    h.add_argument("--api-key", default=os.environ.get("NANO_API_KEY"),
                   help="requests to /v1/* need the header Authorization: Bearer KEY (default: $NANO_API_KEY; "
                        "/health and /metrics stay open)")
    h.add_argument("--allowed-hosts", help="comma-separated names the Host header may hold ('*': any; default: "
                   "localhost, 127.0.0.1, [::1] and --host, or any when --host is 0.0.0.0 or ::)")
    h.add_argument("--max-request-bytes", type=parse_bytes, default=limits.body_bytes,
                   help="a request body's size (413 beyond, before parsing)")
    h.add_argument("--max-prompt-chars", type=int, default=limits.prompt_chars,
                   help="a prompt's characters, all chat messages together (checked before tokenizing)")
    h.add_argument("--max-stop-strings", type=int, default=limits.stop_strings, help="stop strings in a request")
    h.add_argument("--max-stop-chars", type=int, default=limits.stop_chars, help="characters in a stop string")
    h.add_argument("--max-request-tokens", type=int, default=limits.request_tokens,
                   help="n x max_tokens of a request (max_tokens capped by the context first)")
    h.add_argument("--max-stream-backlog", type=int, default=limits.stream_backlog,
                   help="chunks a stream may leave unread before its choices are aborted")
    h.add_argument("--shutdown-timeout", type=float, default=SHUTDOWN_TIMEOUT,
                   help="seconds open requests get after SIGTERM or Ctrl-C; then they end with an error")
    h.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                   help="the server's log on stderr: one line per request (4xx at warning, 5xx at error) "
                        "and uvicorn's own lines")
    m = p.add_argument_group("metrics and planning")
    m.add_argument("--metrics-file", help="append a JSON metrics snapshot per step to this file")
    m.add_argument("--metrics-prom", help="keep this file rewritten with the latest snapshot in Prometheus text format")
    m.add_argument("--metrics-interval", type=int, default=1, help="steps between snapshots")
    m.add_argument("--summary-json", help="also write the run's summary as one JSON object to this file")
    m.add_argument("--capacity", action="store_true",
                   help="print the KV pool, the batch ceiling and the decode-step floor, then exit")
    b = p.add_argument_group("benchmark")
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
    b.add_argument("--dp-compare", action="store_true",
                   help="with --dp: the same requests and arrivals under each --dp-policy, one table "
                        "(nano/dp/cli.py)")
    b.add_argument("--disagg-compare", metavar="P:D",
                   help="the same requests and arrivals served colocated (one engine, all cores), then "
                        "disaggregated (mpirun -n P+D, a core each) (nano/disagg/compare.py)")
    lab = p.add_argument_group("the lab (nano/lab): one serving concept's claim measured per experiment")
    lab.add_argument("--lab", metavar="NAME", help="run experiment NAME (a table, NAME.png and NAME.json); "
                     "list: the experiments and their claims; all: every one. Takes --model, --device, --seed")
    lab.add_argument("--lab-quick", action="store_true", help="the CI size: a tiny random model, seconds each")
    lab.add_argument("--lab-out", default=LAB_OUT, help="folder for NAME.png and NAME.json")
    return p


def parse_bytes(text: str) -> int:
    """'2GB', '512MiB', '1e9' -> bytes."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
             "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "K": 10**3, "M": 10**6,
             "G": 10**9, "T": 10**12, "B": 1}
    s = str(text).strip().upper()
    for unit, scale in units.items():
        if s.endswith(unit):
            s, mult = s[:-len(unit)], scale
            break
    else:
        mult = 1
    try:
        value = float(s) * mult
    except ValueError:
        value = math.nan
    if not math.isfinite(value):  # also 'inf' and 'nan', which float() reads
        raise NanoError(f"cannot read a byte size from {text!r} (e.g. 2GB, 512MiB)")
    if value < 0:
        raise NanoError(f"byte size must not be negative, got {text!r}")
    return int(value)  # the flag's own check says whether it is enough (EngineConfig.validate)


def engine_config(args) -> EngineConfig:
    return EngineConfig(
        model=args.model, device=args.device, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, num_blocks=args.num_blocks, swap_space=args.swap_space,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, watermark=args.watermark,
        enable_prefix_caching=not args.no_prefix_caching, preemption=args.preemption,
        kv_cache_dtype=args.kv_cache_dtype, kv_int8_keys=args.kv_int8_keys,
        seed=ENGINE.seed if args.seed is None else args.seed, tp=args.tp, enforce_eager=args.enforce_eager,
        batch_invariant=args.batch_invariant)


def sampling_params(args) -> SamplingParams:
    """The sampling flags, each checked by its field's rule (FIELD_RULES) under the flag's
    name: --ttft-slo and --tpot-slo are in ms, which the same rules fit."""
    for field in ("temperature", "top_p", "top_k", "max_tokens", "seed", "ttft_slo", "tpot_slo"):
        FIELD_RULES[field]("--" + field.replace("_", "-"), getattr(args, field))
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos,
                          ttft_slo=ms(args.ttft_slo), tpot_slo=ms(args.tpot_slo))


def main(argv=None) -> int:
    group = parallel.tp_group()  # under mpirun every rank runs main; rank 0 alone talks to the user,
    with group.together():       # so a bad argument stops every rank, and is printed once
        heartbeat.start(group)   # every rank watched from here on (--stall-timeout), this collective included
        args, config, policy, params, requests = parse(argv, group.rank)
        heartbeat.set_timeout(args.stall_timeout)
        if not args.capacity and not args.disagg and not args.dp:  # a report for --tp N is computed in one process
            group.require(config.tp)
        if not args.lab:  # the lab fetches the default model only for a full-size run
            default_model.ensure(config.model)  # fetched and converted on first use
    if args.lab:
        from nano.lab.cli import run_lab
        return run_lab(args)
    if args.capacity:
        from nano.bench.cli import show_capacity
        show_capacity(config)
        if args.disagg is not None:
            from nano.disagg.cli import show_estimate
            show_estimate(args, config, params)
        return 0
    if args.bench and args.policy_compare:
        from nano.bench.cli import policy_compare
        return policy_compare(args, config)
    if args.dp:
        from nano.dp.cli import run_dp
        return run_dp(args, config, params, requests, policy)
    if args.disagg:
        from nano.disagg.cli import run_disagg
        return run_disagg(args, config, params, requests, policy)
    if args.disagg_compare:
        from nano.disagg.cli import disagg_compare
        return disagg_compare(args, argv if argv is not None else sys.argv[1:], config, params, policy)
    if args.bench and args.request_rate:
        from nano.bench.cli import rate_bench
        return rate_bench(args, config, params)
    if group.rank > 0:
        from nano.worker import Worker  # after argument checks: loading takes seconds
        worker = Worker(config)
        if args.bench:  # as rank 0's warm-up does: page faults stay out of the figures
            worker.runner.touch_kv_cache()
        worker.run()
        return 0
    from nano.cli.output import describe
    from nano.engine import LLMEngine
    engine = LLMEngine(config, policy=policy)
    print(describe(engine), file=sys.stderr)
    if args.serve:
        from nano.server.cli import serve
        return serve(args, engine)
    if args.bench:
        from nano.bench.cli import run_bench
        return run_bench(args, engine, params)
    from nano.cli.offline import run_prompts
    return run_prompts(args, engine, requests)


def check_distinct_files(args) -> None:
    """No file written over the prompt file, nor two outputs into one file."""
    files = {"--prompt-file": args.prompt_file, "--output": args.output, "--metrics-file": args.metrics_file,
             "--metrics-prom": args.metrics_prom, "--summary-json": args.summary_json}
    seen = {}
    for flag, path in files.items():
        if path:
            real = os.path.realpath(path)
            if real in seen:
                raise NanoError(f"{flag} {path} is also {seen[real]}: give each its own file")
            seen[real] = flag


def check_lab_args(args) -> None:
    """--lab sets each experiment's engine knobs and workload itself: any other flag given
    would be ignored, so it is refused."""
    from nano.lab.cli import check_name, check_out
    check_name(args.lab)
    defaults = vars(build_parser().parse_args([]))
    given = [k for k, v in vars(args).items() if k not in LAB_FLAGS and v != defaults[k]]
    if given:
        raise NanoError(f"--lab takes only --model, --device, --seed, --lab-quick and --lab-out: drop "
                        f"--{given[0].replace('_', '-')}")
    FIELD_RULES["seed"]("--seed", args.seed)
    check_out(args.lab_out)


def parse(argv, rank: int):
    """Flags, checked; the scheduling policy's class; the prompt file, read (on rank 0) before
    the model loads."""
    args = build_parser().parse_args(argv)
    config = engine_config(args)
    config.validate()
    policy = policy_factory(args.policy, args.drop_late)
    if args.lab is not None:
        check_lab_args(args)
        return args, config, policy, None, None
    if args.lab_quick or args.lab_out != LAB_OUT:
        raise NanoError("--lab-quick and --lab-out go with --lab NAME")
    check_writable("--metrics-file", args.metrics_file)
    check_writable("--metrics-prom", args.metrics_prom, replaced=True)
    checks.integer("--metrics-interval", args.metrics_interval, low=1)
    checks.number("--stall-timeout", args.stall_timeout, low=0, open_low=True)
    params = sampling_params(args)
    estimate_disagg = args.capacity and args.disagg is not None
    if args.bench or estimate_disagg:  # --capacity --disagg sizes the pools for the bench flags' workload
        check_bench_args(args, config)
    if not args.bench and (args.policy_compare or args.disagg_compare or args.dp_compare or
                           args.tenants is not None or args.prefix_len is not None or
                           (args.request_rate is not None and not estimate_disagg)):
        raise NanoError("--policy-compare, --request-rate, --tenants, --dp-compare and --disagg-compare are "
                        "--bench modes: add --bench")
    if not (args.prompt_file or args.bench or args.capacity or args.serve):
        raise NanoError("give --prompt-file FILE (or --bench, --capacity, --serve or --lab NAME)")
    if args.serve:
        checks.integer("--port", args.port, 0, 65535)
        checks.integer("--max-queued-requests", args.max_queued_requests, low=1)
        from nano.server.cli import check_args
        check_args(args)
        if args.prompt_file or args.bench or args.disagg is not None:
            raise NanoError("--serve takes its prompts over HTTP: drop --prompt-file, --bench and --disagg")
    if args.disagg == "" and not args.capacity:
        raise NanoError("--disagg needs P:D, e.g. --disagg 1:1 (only --capacity --disagg estimates it)")
    if args.disagg:
        from nano.disagg.serving import parse_split
        parse_split(args.disagg)
        if config.tp > 1:
            raise NanoError("--disagg runs each instance on one rank: drop --tp")
        if args.policy_compare or args.disagg_compare:
            raise NanoError("--policy-compare and --disagg-compare run in one process: drop --disagg")
    if args.disagg_compare:
        from nano.disagg.serving import parse_split
        parse_split(args.disagg_compare)
        if rank > 0 or args.policy_compare or config.tp > 1:
            raise NanoError("--disagg-compare runs alone (it starts mpirun itself): no mpirun, --tp "
                            "or --policy-compare")
        if args.output or args.metrics_file or args.metrics_prom:
            raise NanoError("--disagg-compare writes a table (and --summary-json), no completions or "
                            "metrics files: drop --output, --metrics-file and --metrics-prom")
    if args.dp is not None:
        from nano.dp.cli import check_args as check_dp_args
        check_dp_args(args, config)
    elif args.dp_compare or args.dp_policy != "kv-aware":
        raise NanoError("--dp-policy and --dp-compare route between replicas: add --dp N (under mpirun -n N)")
    if args.summary_json and args.policy_compare:
        raise NanoError("--policy-compare prints its matrix: drop --summary-json")
    requests = (read_requests(args.prompt_file, params)
                if args.prompt_file and not args.bench and rank == 0 else None)
    check_writable("--output", args.output)  # now, not after generating everything
    check_writable("--summary-json", args.summary_json)
    check_distinct_files(args)
    return args, config, policy, params, requests


class Terminated(KeyboardInterrupt):
    """SIGTERM on rank 0: the run ends as after a Ctrl-C (its finished outputs written in order)."""


def on_sigterm(*_) -> None:
    """SIGTERM: what Slurm and Kubernetes send, and what mpirun, given SIGTERM or Ctrl-C,
    sends every rank 0.25 s before it kills them all. Rank 0 says so at once, then ends the
    run; another rank tells world rank 0, as for a Ctrl-C, and goes on until then."""
    group = parallel.world()
    if group.rank > 0:
        group.tell_interrupted()
        return
    if not heartbeat.just_resumed():  # else another rank found this one stopped and said so
        os.write(launcher_stderr(), b"error: terminated (SIGTERM)\n")
    raise Terminated


def launcher_stderr() -> int:
    """Where a rank's last line reaches the user: under Open MPI's mpirun, which stops passing
    on the ranks' output the moment it gets a signal, the stderr of the launcher that started
    this rank (prterun, which mpirun is, or its daemon prted on another host); else ours."""
    parent = f"/proc/{os.getppid()}"
    try:
        if os.path.basename(os.readlink(parent + "/exe")) in ("prterun", "prted"):
            return os.open(parent + "/fd/2", os.O_WRONLY | os.O_APPEND)
    except OSError:  # not Open MPI's launcher, or its stderr out of reach
        pass
    return sys.stderr.fileno()


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        sys.exit(main())
    except NanoError as e:
        parallel.exit_on_error(e, 2)
    except BrokenPipeError:  # stdout's reader went away (| head): end quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush into it
        parallel.abort_all(141)
    except Terminated:  # said already (on_sigterm)
        sys.stdout.flush()
        parallel.abort_all(143)
    except KeyboardInterrupt as e:  # here, or on another rank (PeerInterrupted): every rank ends
        parallel.exit_on_error(NanoError("interrupted"), 130, e.args[0] if e.args else None)
    except Exception as e:  # a bug: alone, show the traceback; under MPI, end every rank
        if parallel.alone():
            raise
        parallel.exit_on_error(e, 1)
