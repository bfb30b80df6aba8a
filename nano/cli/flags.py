"""The command line's parser and the flags every mode shares: prompts and output, sampling, the
engine (EngineConfig's fields, mapped by engine_config), metrics files. Each add-on declares
its own flags and the checks between them beside its modes (add_arguments and check_args in
nano/<add-on>/cli.py); run.py assembles the parser from them and dispatches."""
import argparse
import math
import os

from nano import checks
from nano.chat import template
from nano.cli.output import check_writable
from nano.cli.prompts import ms, read_requests
from nano.config import DEFAULT_KEY_SCHEME, DTYPES, STEP_TARGET, TOKEN_BUDGET, EngineConfig
from nano.errors import NanoError
from nano.sequence import FIELD_RULES, SamplingParams
from nano.telemetry.watchdog import DEFAULT_STALL_TIMEOUT

ENGINE = EngineConfig()      # the engine's defaults, which the flags show
SAMPLING = SamplingParams()  # the API's sampling defaults
CLI_MAX_TOKENS = 256         # the API's 16 (vLLM's) cuts a chat answer short


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage dump
        raise NanoError(message)


def given(args, add_arguments, skip=()) -> list[str]:
    """The flags of one package's add_arguments that args holds at other than their defaults
    (a mode's flags given without its mode are refused, never parsed and ignored)."""
    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    return [f"--{dest.replace('_', '-')}" for dest, default in vars(defaults.parse_args([])).items()
            if dest not in skip and getattr(args, dest) != default]


def add_arguments(p: argparse.ArgumentParser) -> None:
    io = p.add_argument_group("prompts and output")
    io.add_argument("--prompt-file", help="one prompt per line (blank lines skipped); a .jsonl file "
                    "holds one object per line: prompt, and optionally ttft_slo_ms, tpot_slo_ms, "
                    "max_tokens, temperature, top_p, top_k, seed")
    io.add_argument("--no-chat", action="store_true", help="send raw text, without the chat template")
    io.add_argument("--chat-template", help="the chat template in place of the model's, for the prompts and the "
                    "server's chats: a file's path, or the template itself (as vLLM's flag)")
    io.add_argument("--output", help="write one JSON object per prompt to this .jsonl file")
    add_sampling_arguments(p.add_argument_group("sampling"))
    e = p.add_argument_group("engine")
    add_engine_arguments(e)
    e.add_argument("--stall-timeout", type=float, default=DEFAULT_STALL_TIMEOUT,
                   help="seconds a step may go without using CPU (under mpirun: a rank without a heartbeat) "
                        "before the run is ended as stalled; a slow step that computes is never ended")
    m = p.add_argument_group("metrics")
    m.add_argument("--metrics-file", help="append a JSON metrics snapshot per step to this file")
    m.add_argument("--metrics-prom", help="keep this file rewritten with the latest snapshot in Prometheus text format")
    m.add_argument("--metrics-interval", type=int, default=1, help="steps between snapshots")
    m.add_argument("--summary-json", help="also write the run's summary as one JSON object to this file")


def add_sampling_arguments(s) -> None:
    s.add_argument("--max-tokens", type=int, default=CLI_MAX_TOKENS)
    s.add_argument("--temperature", type=float, default=SAMPLING.temperature, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=SAMPLING.top_p)
    s.add_argument("--top-k", type=int, default=SAMPLING.top_k)
    s.add_argument("--seed", type=int, default=SAMPLING.seed,
                   help="per-request seed (same seed, same output); --bench: its prompts' and arrival times' seed")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--ttft-slo", type=float, default=None, help="time-to-first-token target, ms")
    s.add_argument("--tpot-slo", type=float, default=None, help="time-per-output-token target, ms")


def add_engine_arguments(e) -> None:
    """EngineConfig's fields (engine_config maps them back)."""
    e.add_argument("--model", default=ENGINE.model, help="a Hugging Face model folder, or a name fetched "
                   "into weights/ on first use: SmolLM2-135M-Instruct (the default), gemma-3-270m")
    e.add_argument("--device", default=ENGINE.device, help="auto | cpu | gpu")
    e.add_argument("--dtype", default=ENGINE.dtype, help=" | ".join(DTYPES) + ": the GPU's weights, "
                   "activations and KV (auto: the checkpoint's torch_dtype; bfloat16 for float32 ones and "
                   "Gemma 3); the CPU computes in float32")
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
                   help="auto (--dtype's) | int8 (per-token scales; 2x / 4x the blocks)")
    e.add_argument("--kv-int8-keys", default=ENGINE.kv_int8_keys,
                   help="int8 keys: token (as they are) | rotate (Hadamard-rotated); default " + DEFAULT_KEY_SCHEME)
    e.add_argument("--tp", type=int, default=ENGINE.tp, help="tensor-parallel ranks: run under mpirun -n TP")
    e.add_argument("--enforce-eager", action="store_true", help="GPU: run decode steps eagerly, no CUDA graphs")
    e.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=ENGINE.batch_invariant,
                   help="CPU: each token's result bitwise independent of the batch and schedule (slower); "
                        "default: on for --kv-cache-dtype int8, else off")


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


def parse_range(text: str, name: str) -> tuple[int, int]:
    """'LEN' or 'MIN:MAX' -> (MIN, MAX), 1 <= MIN <= MAX."""
    try:
        lo, _, hi = text.partition(":")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise NanoError(f"{name} must be LEN or MIN:MAX, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise NanoError(f"{name} must satisfy 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def engine_config(args) -> EngineConfig:
    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
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


def check_args(args, rank: int) -> SamplingParams:
    """The shared flags, before any add-on's: the metrics files, the stall timeout, sampling.
    The files only rank 0 writes or reads are checked and read on rank 0 alone: under mpirun
    across hosts, another rank's host may have no such folder."""
    if rank == 0:
        check_writable("--metrics-file", args.metrics_file)
        check_writable("--metrics-prom", args.metrics_prom, replaced=True)
    checks.integer("--metrics-interval", args.metrics_interval, low=1)
    checks.number("--stall-timeout", args.stall_timeout, low=0, open_low=True)
    if args.chat_template is not None:
        if args.no_chat:
            raise NanoError("--chat-template with --no-chat: the prompts would not use it; drop one")
        if rank == 0:  # the rank that renders prompts, the server's included
            args.chat_template = template.load(args.chat_template)  # its text from here on
    return sampling_params(args)


def check_mode(args) -> None:
    """Something to run: prompts, or a mode that makes or takes its own."""
    if not (args.prompt_file or args.bench or args.capacity or args.serve):
        raise NanoError("give --prompt-file FILE (or --bench, --capacity, --serve or --lab NAME)")


def read_prompts(args, params: SamplingParams, rank: int):
    """After every add-on's checks: the prompt file, read (on rank 0) before the model loads,
    and the files to be written checked now, not after generating everything."""
    requests = (read_requests(args.prompt_file, params)
                if args.prompt_file and not args.bench and rank == 0 else None)
    if rank == 0:  # the rank that writes them
        check_writable("--output", args.output)
        check_writable("--summary-json", args.summary_json)
    check_distinct_files(args)
    return requests


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
