"""What the command line writes: what the engine loaded (stderr), completions (stdout and
--output), progress (stderr), metrics snapshots (--metrics-file, --metrics-prom) and the
run's summary (stdout and --summary-json)."""
import json
import os
import stat
import sys
import time

import numpy as np
from tqdm import tqdm

from nano import invariant, kv_cache, ops, parallel, tp
from nano.device import BFLOAT16
from nano.errors import NanoError
from nano.fleet.world import started
from nano.telemetry.export import MetricsWriter, writing
from nano.telemetry.watchdog import abort_all


def exit_on_error(error: Exception, code: int, rank: int | None = None) -> None:
    """Print one line and end this process and, under MPI, every other rank too.
    An error every rank shares is printed once (by rank 0) and the ranks exit together;
    any other one is printed with its rank (or `rank`, where it happened) and MPI_Abort
    ends the whole job."""
    group = started()
    message = str(error) if isinstance(error, NanoError) else f"{type(error).__name__}: {error}"
    if group is None or group.world == 1 or isinstance(error, parallel.SharedError):
        if group is None or group.rank == 0:
            print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(code)
    print(f"error: rank {group.rank if rank is None else rank}: {message}", file=sys.stderr, flush=True)
    abort_all(code)


def describe(engine) -> str:
    """What the engine loaded and allocated, in words: the model, the KV pool (and the int8
    gain), the batch ceiling, swap space; under TP each rank's heads and pool."""
    config, (num_blocks, _, num_swap_blocks, _) = engine.config, engine.kv_blocks()
    bs, per_token = config.block_size, engine.kv_bytes_per_token
    per_seq = -(-engine.max_model_len // bs)
    return (f"model {engine.model_name} on {engine.device.kind} ({_dtype(engine)}): "
            f"weights {engine.weight_bytes / 1e6:.0f} MB; "
            f"KV cache {per_token} bytes/token "
            f"({kv_label(config.kv_cache_dtype, config.key_scheme, engine.device.dtype)}), "
            f"{num_blocks} blocks of {bs} tokens "
            f"({num_blocks * bs} tokens, {num_blocks * bs * per_token / 1e9:.2f} GB"
            + _int8_gain(engine) + "); "
            f"batch ceiling {num_blocks // per_seq} sequences of {engine.max_model_len} tokens; "
            f"swap space {num_swap_blocks} blocks"
            + _ops(engine.ops) + _ranks(engine))


def kv_label(kv_cache_dtype: str, key_scheme: str | None, device_dtype) -> str:
    """What a KV pool holds, for start-up lines and plans: 'bfloat16', or 'int8, rotate keys'."""
    if kv_cache_dtype == "int8":
        return f"int8, {key_scheme} keys"
    return dtype_name(device_dtype)


def dtype_name(dtype) -> str:
    """A device dtype's name: bfloat16 for its bits' uint16 arrays."""
    return "bfloat16" if np.dtype(dtype) == BFLOAT16 else np.dtype(dtype).name


def _dtype(engine) -> str:
    """The dtype the engine computes in, and, once per run, that the CPU path keeps float32
    where --dtype asked for another."""
    name, asked = dtype_name(engine.device.dtype), engine.config.dtype
    if asked in ("auto", name):
        return name
    return f"{name}: --dtype {asked} is the GPU's; the CPU path computes in float32"


def _ops(chosen: ops.OpSet) -> str:
    return "; batch-invariant forward" if chosen is invariant.BATCH_INVARIANT else ""


def _int8_gain(engine) -> str:
    if engine.config.kv_cache_dtype == "auto":
        return ""
    heads = tp.partition(engine.model_config, 0, engine.config.tp).num_kv_heads  # rank 0's
    full = kv_cache.bytes_per_token(engine.model_config, heads, "auto", engine.device.itemsize)
    return f", {full / engine.kv_bytes_per_token:.2f}x the tokens of a full-precision pool"


def _ranks(engine) -> str:
    """Under TP the figures above are rank 0's. Every rank has the same number of blocks
    (so the same batch ceiling), but a block holds only that rank's KV heads."""
    world, num_blocks = engine.config.tp, engine.capacity.num_blocks
    if world == 1:
        return ""
    lines = [f"\ntensor parallel over {world} ranks (figures above: rank 0), each {num_blocks} blocks:"]
    for p in (tp.partition(engine.model_config, r, world) for r in range(world)):
        per_token = kv_cache.bytes_per_token(engine.model_config, p.num_kv_heads, engine.config.kv_cache_dtype,
                                             engine.device.itemsize)
        pool = num_blocks * engine.config.block_size * per_token
        lines.append(f"  rank {p.rank}: query heads {p.q_heads.start}..{p.q_heads.stop - 1}, "
                     f"KV heads {p.kv_heads.start}..{p.kv_heads.stop - 1}: "
                     f"KV cache {per_token} bytes/token, {pool / 1e9:.2f} GB")
    return "\n".join(lines)


def check_writable(flag: str, path: str | None, replaced: bool = False) -> None:
    """A file this process can create or overwrite, checked without touching it (so that a
    run refuses a bad path before loading the model, and leaves the old file alone). replaced:
    the file is rewritten by renaming a new one over it, which would put a regular file in the
    place of a device or a pipe (as root, /dev/null itself), so it must be a regular file."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise NanoError(f"cannot write {flag} {path}: it is a folder")
    if replaced and os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
        raise NanoError(f"cannot write {flag} {path}: not a regular file (it is replaced whole at "
                        f"every snapshot)")
    if not os.path.isdir(folder):
        raise NanoError(f"cannot write {flag} {path}: no folder {folder}")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise NanoError(f"cannot write {flag} {path}: permission denied")


def metrics_writer(args, engine=None, model_name: str | None = None, export=None) -> MetricsWriter | None:
    """--metrics-file / --metrics-prom, every --metrics-interval snapshots; the Prometheus
    file is export's registry (by default the engine's, telemetry.prometheus.EngineExport,
    labelled model_name: by default the engine's; with --enable-lora, vLLM's LoRA gauge too)."""
    if not (args.metrics_file or args.metrics_prom):
        return None
    from nano.telemetry.prometheus import EngineExport  # prometheus_client: needed only here
    max_loras = args.max_loras if getattr(args, "enable_lora", False) else None
    return MetricsWriter(args.metrics_file, args.metrics_prom, export or EngineExport(engine, model_name, max_loras),
                         args.metrics_interval)


def print_completions(prompts: list[str], seqs, detokenize) -> None:
    """Each prompt and its completion on stdout; a rejected request's reason on stderr."""
    for i, (prompt, seq) in enumerate(zip(prompts, seqs)):
        if seq.finish_reason == "rejected":
            print(f"[{i}] rejected: {seq.error}", file=sys.stderr)
        else:
            print(f"[{i}] {prompt}\n{detokenize(seq)}\n")


def write_summary(path: str | None, summary: dict) -> None:
    if path:
        with writing(path), open(path, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)


class Progress:
    """Requests finished and the rate of generated tokens, as a tqdm bar on stderr; off when
    stderr is not a terminal (tqdm's disable=None), so that logs and pipes get no bar."""

    def __init__(self, total: int):
        self.bar = tqdm(total=total, unit="req", file=sys.stderr, disable=None, dynamic_ncols=True)
        self.start = time.perf_counter()

    def update(self, finished: int, generated: int) -> None:
        if finished:
            rate = generated / max(time.perf_counter() - self.start, 1e-9)  # of finished requests
            self.bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)
            self.bar.update(finished)
        if self.bar.n >= self.bar.total:
            self.bar.close()


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

    def write(self, index: int, seq, **extra) -> None:
        """extra: more fields of the record (a data-parallel run's replica)."""
        record = {"index": index, "prompt": self.prompts[index], "text": self.decode(seq),
                  "token_ids": seq.output_token_ids, "finish_reason": seq.finish_reason,
                  "num_prompt_tokens": seq.num_prompt_tokens, **extra}
        if seq.error:
            record["error"] = seq.error
        self.records[index] = json.dumps(record, ensure_ascii=False) + "\n"
        with writing(self.path):
            if self.file is None:
                self.file = open(self.path, "w", encoding="utf-8")
            self.file.write(self.records[index])
            self.file.flush()

    def close(self) -> None:
        """A regular file is then rewritten in input order; a pipe or a device (/dev/stdout)
        keeps the records in the order they finished, and must never be renamed over."""
        if self.file is None:
            return
        file, self.file = self.file, None  # closed once, even if closing fails (a full disk)
        with writing(self.path):
            regular = stat.S_ISREG(os.fstat(file.fileno()).st_mode)
            file.close()
            if regular:
                tmp = self.path + ".tmp"
                with open(tmp, "w", encoding="utf-8") as f:
                    f.writelines(self.records[i] for i in sorted(self.records))
                os.replace(tmp, self.path)
