"""32 sequences over 4 LoRA adapters vs 32 on the base model, output tok/s on the CPU.

    python tests/bench_lora.py [--seqs 32] [--adapters 4] [--rank 16] [--input-len 32]
                               [--output-len 64] [--repeats 3] [--out FILE.json]

The default model; random PEFT adapters of --rank on all seven projections, written to a
temporary folder; random-token prompts, greedy, EOS ignored, prefix caching off. Three runs of
the same prompts, alternated --repeats times on warmed engines: the base model on an engine
without LoRA, the base model on an engine with LoRA attached (every row without an adapter),
and the sequences spread round-robin over the adapters. Prints a markdown table of output
tokens per second of wall time and per second of this process's CPU time: on a machine other
processes share, the wall clock moves with their load, while with one BLAS thread
(OPENBLAS_NUM_THREADS=1) the CPU time is the work done."""
import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import nano  # noqa: E402, F401  (first: nano's BLAS settings, before anything loads NumPy)
import numpy as np  # noqa: E402

from nano.cli.offline import warm_up  # noqa: E402
from nano.config import EngineConfig  # noqa: E402
from nano.engine import LLMEngine  # noqa: E402
from nano.lora import LoRARequest, attach  # noqa: E402
from nano.sequence import SamplingParams  # noqa: E402
from test_lora_pool import make_adapter  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", type=int, default=32)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args()
    blocks = args.seqs * -(-(args.input_len + args.output_len) // 16) + 16
    config = EngineConfig(device="cpu", enable_prefix_caching=False, num_blocks=blocks)
    plain, base, mixed = LLMEngine(config), LLMEngine(config), LLMEngine(config)
    for engine in (base, mixed):
        attach(engine, max_loras=args.adapters, max_lora_rank=args.rank)
    rng = np.random.default_rng(0)
    prompts = rng.integers(100, plain.model_config.vocab_size - 100,
                           (args.seqs, args.input_len)).tolist()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        requests = [LoRARequest(f"a{i}", i + 1, str(make_adapter(
            Path(tmp) / f"a{i}", seed=i, r=args.rank, alpha=2 * args.rank, cfg=plain.model_config)))
            for i in range(args.adapters)]
        runs = {"base, no LoRA": (plain, [None] * args.seqs),
                "base, LoRA attached": (base, [None] * args.seqs),
                f"{args.adapters} adapters": (mixed, list(itertools.islice(
                    itertools.cycle(requests), args.seqs)))}
        for engine in (plain, base, mixed):
            warm_up(engine)
        wall = {name: [] for name in runs}
        cpu = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, (seconds, cpu_seconds, tokens) in interleaved(runs, prompts, params).items():
                wall[name].append(tokens / seconds)
                cpu[name].append(tokens / cpu_seconds)
    print(f"| run | output tok/s, wall (median of {args.repeats}) | runs | vs base | tok per CPU s "
          f"| runs | vs base |")
    print("|---|---|---|---|---|---|---|")
    first = next(iter(runs))
    for name in runs:
        cells = []
        for figures in (wall, cpu):
            median = np.median(figures[name])
            cells += [f"{median:.1f}", ", ".join(f"{t:.1f}" for t in figures[name]),
                      f"{median / np.median(figures[first]):.2f}x"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "tok_s": wall, "tok_per_cpu_s": cpu},
                                             indent=1))


def interleaved(runs: dict, prompts, params) -> dict:
    """Every run's requests queued on its engine, then the engines stepped in turn until all
    are done. Returns name -> (wall seconds, CPU seconds, output tokens) of its own steps."""
    seqs = {name: [engine.add_request(prompt, params, lora_request=lora)
                   for prompt, lora in zip(prompts, loras)] for name, (engine, loras) in runs.items()}
    taken = {name: [0.0, 0.0] for name in runs}
    while any(engine.has_unfinished() for engine, _ in runs.values()):
        for name, (engine, _) in runs.items():
            if engine.has_unfinished():
                wall, cpu = time.perf_counter(), time.process_time()
                engine.step()
                taken[name][0] += time.perf_counter() - wall
                taken[name][1] += time.process_time() - cpu
    return {name: (*taken[name], sum(s.num_output_tokens for s in seqs[name])) for name in runs}


if __name__ == "__main__":
    main()
