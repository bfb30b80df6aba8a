"""Benchmark workloads and their reports (run.py --bench, --bench --request-rate).

Workload: random-token prompts with lengths uniform in the given ranges, EOS ignored,
everything seeded, so two runs (or two policies) see exactly the same requests.
"""
import numpy as np

from nano.bench.capacity import measure_copy_bandwidth
from nano.sequence import SamplingParams


def random_requests(num_seqs: int, input_len: tuple[int, int], output_len: tuple[int, int],
                    vocab_size: int, ttft_slo: float | None = None, tpot_slo: float | None = None,
                    seed: int = 0):
    rng = np.random.default_rng(seed)
    prompts, params = [], []
    for _ in range(num_seqs):
        prompts.append(rng.integers(0, vocab_size, rng.integers(input_len[0], input_len[1] + 1)).tolist())
        params.append(SamplingParams(temperature=1.0, ignore_eos=True, seed=int(rng.integers(2**31)),
                                     max_tokens=int(rng.integers(output_len[0], output_len[1] + 1)),
                                     ttft_slo=ttft_slo, tpot_slo=tpot_slo))
    return prompts, params


def tenant_requests(num_seqs: int, num_tenants: int, prefix_len: int, input_len: tuple[int, int],
                    output_len: tuple[int, int], vocab_size: int, ttft_slo: float | None = None,
                    tpot_slo: float | None = None, seed: int = 0):
    """Several tenants, each with a long system prompt of its own (prefix_len random tokens)
    that every one of its requests starts with, then input_len tokens of the request's own;
    each request's tenant drawn uniformly. Where the replicas' pools cannot each hold every
    tenant's prefix, where a request goes decides whether its prefix is computed again."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, vocab_size, prefix_len).tolist() for _ in range(num_tenants)]
    tenants = rng.integers(0, num_tenants, num_seqs)
    own, params = random_requests(num_seqs, input_len, output_len, vocab_size, ttft_slo, tpot_slo, seed + 1)
    return [prefixes[t] + p for t, p in zip(tenants, own)], params


def warm_up(engine) -> None:
    """First-use costs kept out of the figures: the whole KV pool written once (first-touch
    page faults, see ModelRunner.touch_kv_cache), then one short request (kernel compilation
    and graph capture on the GPU, BLAS thread start on the CPU; seen here: a first step of
    300 ms instead of 70). Metrics start afresh."""
    engine.touch_kv_cache()
    engine.generate([list(range(3, 19))], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.reset_metrics()


def poisson_arrivals(num: int, rate: float, seed: int = 0) -> np.ndarray:
    """Seconds after the start at which each request arrives: exponential gaps of mean 1/rate."""
    return np.cumsum(np.random.default_rng(seed + 1).exponential(1.0 / rate, num))


def decode_floor(engine, summary: dict) -> str:
    """The mean pure-decode step against its floor: every weight and every cached token read
    once, at the device's measured copy bandwidth."""
    if not summary["decode_steps"]:
        return "decode step: no pure-decode steps"
    bandwidth = measure_copy_bandwidth(engine.device.xp)
    floor = (engine.weight_bytes + summary["mean_decode_kv_tokens"] * engine.kv_bytes_per_token) / bandwidth
    mean = summary["mean_decode_step_ms"] / 1e3
    return (f"decode step: mean {1e3 * mean:.2f} ms, floor {1e3 * floor:.3f} ms (weights + KV read at "
            f"{bandwidth / 1e9:.1f} GB/s), {100 * floor / mean:.1f}% of floor")


def policy_table(results: dict[str, dict]) -> str:
    """FCFS and deadline side by side on the same arrivals."""
    rows = ["| policy | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 / p99 ms | SLO attained | goodput req/s | output tok/s |",
            "|---|---|---|---|---|---|"]
    for name, s in results.items():
        rows.append(f"| {name} | {s['ttft_p50_ms']:.0f} / {s['ttft_p90_ms']:.0f} / {s['ttft_p99_ms']:.0f} "
                    f"| {s['tpot_p50_ms']:.1f} / {s['tpot_p90_ms']:.1f} / {s['tpot_p99_ms']:.1f} "
                    f"| {100 * s['slo_attainment']:.1f}% | {s['goodput_rps']:.2f} | {s['output_tokens_per_s']:.1f} |")
    return "\n".join(rows)
