"""nano's command line: prompts in, completions and a summary out.

    python run.py --prompt-file prompts.txt
    python run.py --bench --num-seqs 256 --input-len 100:1024 --output-len 100:1024
    mpirun -n 2 python run.py --tp 2 --prompt-file prompts.txt   (tensor parallel)
"""
import argparse
import json
import sys
import time

import numpy as np

from nano import parallel
from nano.config import EngineConfig, parse_bytes
from nano.errors import NanoError
from nano.metrics import format_summary
from nano.sequence import SamplingParams


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage dump
        raise NanoError(message)


def build_parser() -> Parser:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    io = p.add_argument_group("prompts and output")
    io.add_argument("--prompt-file", help="one prompt per line (blank lines skipped)")
    io.add_argument("--no-chat", action="store_true", help="send raw text, without the chat template")
    io.add_argument("--output", help="write one JSON object per prompt to this .jsonl file")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=256)
    s.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=-1)
    s.add_argument("--seed", type=int, default=None, help="per-request seed (same seed, same output)")
    s.add_argument("--ignore-eos", action="store_true")
    e = p.add_argument_group("engine")
    e.add_argument("--model", default=None, help="Hugging Face Llama-family folder (default: SmolLM2-135M-Instruct)")
    e.add_argument("--device", default="auto", help="auto | cpu | gpu")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--kv-cache-memory", type=parse_bytes, default=None, help="bytes for the KV pool, e.g. 2GB")
    e.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (overrides --kv-cache-memory)")
    e.add_argument("--swap-space", type=parse_bytes, default=4 * 2**30, help="host bytes for swapped-out KV")
    e.add_argument("--max-num-batched-tokens", type=int, default=2048)
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--watermark", type=float, default=0.01)
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument("--preemption", default="auto", help="swap | recompute | auto")
    e.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: run under mpirun -n TP")
    b = p.add_argument_group("benchmark")
    b.add_argument("--bench", action="store_true", help="random-token prompts, EOS ignored, fixed seed")
    b.add_argument("--num-seqs", type=int, default=256)
    b.add_argument("--input-len", default="100:1024", help="LEN or MIN:MAX")
    b.add_argument("--output-len", default="100:1024", help="LEN or MIN:MAX")
    return p


def engine_config(args) -> EngineConfig:
    return EngineConfig(
        model=args.model, device=args.device, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, num_blocks=args.num_blocks, swap_space=args.swap_space,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, watermark=args.watermark,
        enable_prefix_caching=not args.no_prefix_caching, preemption=args.preemption,
        seed=args.seed or 0, tp=args.tp)


def sampling_params(args) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos)


def read_prompts(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
    except OSError as e:
        raise NanoError(f"cannot read prompt file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise NanoError(f"prompt file {path} is not UTF-8 text") from None
    if not prompts:
        raise NanoError(f"prompt file {path} has no prompts")
    return prompts


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


def bench_requests(args, vocab_size: int):
    rng = np.random.default_rng(0)
    in_lo, in_hi = parse_range(args.input_len, "--input-len")
    out_lo, out_hi = parse_range(args.output_len, "--output-len")
    prompts, params = [], []
    for _ in range(args.num_seqs):
        prompts.append(rng.integers(0, vocab_size, rng.integers(in_lo, in_hi + 1)).tolist())
        params.append(SamplingParams(temperature=1.0, max_tokens=int(rng.integers(out_lo, out_hi + 1)),
                                     ignore_eos=True, seed=int(rng.integers(2**31))))
    return prompts, params


def main(argv=None) -> int:
    group = parallel.world()  # under mpirun: every rank runs main; rank 0 alone talks to the user
    with group.together():    # so a bad argument stops every rank, and is printed once
        args = build_parser().parse_args(argv)
        config = engine_config(args)
        config.validate()
        group.require(config.tp)
        params = sampling_params(args)
        params.validate()
        if args.bench:
            if args.num_seqs < 1:
                raise NanoError(f"--num-seqs must be positive, got {args.num_seqs}")
            parse_range(args.input_len, "--input-len")
            parse_range(args.output_len, "--output-len")
        elif not args.prompt_file:
            raise NanoError("give --prompt-file FILE (or --bench)")
        prompts = read_prompts(args.prompt_file) if not args.bench and group.rank == 0 else None

    from nano.engine import LLMEngine  # after argument checks: loading takes seconds
    engine = LLMEngine(config)
    if group.rank > 0:
        engine.run_worker()
        return 0
    print(engine.describe(), file=sys.stderr)
    if args.bench:
        inputs, per_request = bench_requests(args, engine.model_config.vocab_size)
    else:
        chat = not args.no_chat and engine.tokenizer.chat_template is not None
        inputs = [engine.tokenizer.apply_chat_template(p) if chat else p for p in prompts]
        per_request = params

    progress = Progress(len(inputs))
    start = time.perf_counter()
    seqs = engine.generate(inputs, per_request,
                           on_step=lambda done: progress.update(len(done), engine.metrics.generated_tokens))
    wall = time.perf_counter() - start
    engine.stop_workers()

    if not args.bench:
        for i, (prompt, seq) in enumerate(zip(prompts, seqs)):
            if seq.finish_reason == "rejected":
                print(f"[{i}] rejected: {seq.error}", file=sys.stderr)
            else:
                print(f"[{i}] {prompt}\n{engine.decode(seq)}\n")
    if args.output:
        write_jsonl(args.output, prompts or [""] * len(seqs), seqs, engine)
    summary = engine.metrics.summary(wall)
    print(format_summary(summary))
    if args.bench:
        print(f"bench: {summary['output_tokens_per_s']:.1f} output tokens/s, "
              f"{summary['total_tokens_per_s']:.1f} total tokens/s")
    return 0


def write_jsonl(path: str, prompts: list[str], seqs, engine) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            for prompt, seq in zip(prompts, seqs):
                record = {"prompt": prompt, "text": engine.decode(seq), "token_ids": seq.output_token_ids,
                          "finish_reason": seq.finish_reason, "num_prompt_tokens": seq.num_prompt_tokens}
                if seq.error:
                    record["error"] = seq.error
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
    except OSError as e:
        raise NanoError(f"cannot write {path}: {e.strerror}") from None


if __name__ == "__main__":
    try:
        sys.exit(main())
    except NanoError as e:
        parallel.exit_on_error(e, 2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:  # a bug: alone, show the traceback; under MPI, end every rank
        if parallel.world().world == 1:
            raise
        parallel.exit_on_error(e, 1)
