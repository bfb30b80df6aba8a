"""nano and Hugging Face transformers side by side on the CPU, and where nano's decode step stands.

    python tests/bench_cpu.py [--hf-python PATH] [--pairs N]

The default model, 64 prompt tokens, 64 generated, greedy, batch 1 and 32: nano as a user runs
it (`run.py --bench`, BLAS threads by contention) and, given a Python that has torch and
transformers (--hf-python; not a dependency), `generate` on a thread per core, alternately N
times each (this machine's speed drifts over minutes). Output tokens/s of the whole run, the
prompts' prefill included on both sides. It prints which BLAS kernels NumPy runs here
(threadpoolctl), this machine's copy bandwidth and float32 GEMM peak (measured here, with
as many threads as nano starts with), and each nano run's mean decode step against both: the
bandwidth floor (every weight and cached token read once) and the time its FLOPs take at peak.
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import nano  # noqa: E402, F401  (before NumPy: the OpenBLAS settings nano runs with, nano/cpu_setup.py)
import numpy as np  # noqa: E402
from bench_contention import CORES, hf_command, nano_command, tokens_per_second, user_env  # noqa: E402
from threadpoolctl import threadpool_info  # noqa: E402

from nano.bench.capacity import capacity_report, measure_copy_bandwidth  # noqa: E402
from nano.config import EngineConfig  # noqa: E402
from nano.weights import open_model  # noqa: E402

BATCHES, OUTPUT_LEN = (1, 32), 64


def gemm_peak(n: int = 2048, reps: int = 5) -> float:
    """float32 FLOP/s of NumPy's BLAS on one large square product, the best of reps."""
    a = np.ones((n, n), np.float32)
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        a @ a
        times.append(time.perf_counter() - start)
    return 2 * n ** 3 / min(times[1:])


def decode_fractions(summary: dict, batch: int, bandwidth: float, peak: float) -> tuple[float, float, float]:
    """The mean decode step (every step of this workload decodes all `batch` sequences)
    against the bandwidth floor and against its FLOPs at GEMM peak: a row multiplies every
    weight once (2 FLOPs each; the embedding table is the LM head) and attends over its
    context (4 FLOPs per query head, channel and cached token)."""
    report = capacity_report(EngineConfig(device="cpu"))
    cfg = open_model(None, tokenizer=False).config
    kv_tokens, step = summary["mean_decode_kv_tokens"], summary["mean_decode_step_ms"] / 1e3
    floor = (report.weight_bytes + kv_tokens * report.kv_bytes_per_token) / bandwidth
    flops = 2 * report.weight_bytes / 4 * batch + 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers * kv_tokens
    return step, floor / step, flops / peak / step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf-python", help="a Python with torch and transformers")
    p.add_argument("--pairs", type=int, default=3, help="alternating runs of each engine per batch size")
    args = p.parse_args()
    for lib in threadpool_info():
        print(f"BLAS: {lib['internal_api']} {lib['version']}, {lib['architecture']} kernels, "
              f"{lib['threading_layer']} threading, {lib['num_threads']} threads ({lib['filepath']})")
    bandwidth, peak = measure_copy_bandwidth(np), gemm_peak()
    print(f"machine: {CORES} cores, copy {bandwidth / 1e9:.1f} GB/s (read + write), "
          f"float32 GEMM peak {peak / 1e9:.0f} GFLOP/s (2048^3 product)", flush=True)
    rows = []
    for batch in BATCHES:
        nano_figures, hf_figures, steps = [], [], []
        for _ in range(args.pairs):
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                nano_figures.append(tokens_per_second(nano_command(batch, OUTPUT_LEN) + ["--summary-json", f.name],
                                                      user_env()))
                steps.append(decode_fractions(json.loads(Path(f.name).read_text()), batch, bandwidth, peak))
            if args.hf_python:
                hf_figures.append(tokens_per_second(hf_command(args.hf_python, batch, OUTPUT_LEN), user_env()))
            print(f"batch {batch}: nano {nano_figures[-1]:.1f}"
                  + (f", transformers {hf_figures[-1]:.1f}" if hf_figures else "") + " out tok/s", flush=True)
        nano_med = statistics.median(nano_figures)
        hf = (f"{statistics.median(hf_figures):.1f} ({' / '.join(f'{x:.1f}' for x in hf_figures)}) | "
              f"{nano_med / statistics.median(hf_figures):.2f}x" if hf_figures else "- | -")
        step, of_floor, of_peak = (statistics.median(x) for x in zip(*steps))
        rows.append(f"| {batch} | {nano_med:.1f} ({' / '.join(f'{x:.1f}' for x in nano_figures)}) | {hf} | "
                    f"{1e3 * step:.1f} ms | {100 * of_floor:.0f}% | {100 * of_peak:.0f}% |")
    print(f"\n64 prompt tokens, {OUTPUT_LEN} generated, greedy; output tok/s, median (runs)\n\n"
          "| batch | nano | transformers | nano / transformers | nano decode step (median) | of bandwidth floor | of GEMM peak |\n"
          "|---|---|---|---|---|---|---|\n" + "\n".join(rows))


if __name__ == "__main__":
    sys.exit(main())
