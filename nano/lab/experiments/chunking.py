"""chunking: the token budget bounds prefill's interference with decodes. A step carries the
running decodes first and then as much of a waiting prompt as the budget (max_num_batched_tokens)
leaves, so a long prompt is cut into chunks over several steps (nano/scheduler.py,
_schedule_running). A small budget keeps every step short (decodes stall little) and
stretches the long prompt over more steps (its first token comes later)."""
import numpy as np

from nano.lab.experiment import Experiment, Size, engine, serve
from nano.sequence import SamplingParams
from nano.telemetry.metrics import ttft_of

DECODERS = 4


def scale(size: Size) -> dict:
    if size.quick:
        return dict(budgets=(64, 256, 1024), long=1024, arrivals=(0.05, 0.15, 0.25), decode_tokens=240)
    return dict(budgets=(64, 512), long=512, arrivals=(0.5, 2.0), decode_tokens=48)


def run(size: Size) -> list[dict]:
    s = scale(size)
    rows = []
    for budget in s["budgets"]:
        eng = engine(size, max_num_batched_tokens=budget, enable_prefix_caching=False,
                     num_blocks=(DECODERS * (16 + s["decode_tokens"]) + len(s["arrivals"]) * (s["long"] + 8)) // 16 + 16)
        vocab = eng.model_config.vocab_size
        gen = np.random.default_rng(size.seed)  # the same requests at every budget
        decoders = [(gen.integers(3, vocab, 16).tolist(),
                     SamplingParams(temperature=0, ignore_eos=True, max_tokens=s["decode_tokens"]))
                    for _ in range(DECODERS)]
        longs = [(gen.integers(3, vocab, s["long"]).tolist(), SamplingParams(temperature=0, ignore_eos=True, max_tokens=2), t)
                 for t in s["arrivals"]]
        seqs = serve(eng, decoders + longs)
        prefilling = [(q.arrival_time, q.first_token_time) for q in seqs[DECODERS:]]
        gaps = [b - a for q in seqs[:DECODERS] for a, b in zip(q.token_times, q.token_times[1:])
                if any(a < end and b > start for start, end in prefilling)]
        ttft = [ttft_of(q) for q in seqs[DECODERS:]]
        rows.append({"budget": budget, "long_prompt": s["long"], "decode_gaps": len(gaps),
                     "tpot_p50_ms": round(1e3 * float(np.percentile(gaps, 50)), 2) if gaps else None,
                     "tpot_p99_ms": round(1e3 * float(np.percentile(gaps, 99)), 2) if gaps else None,
                     "long_ttft_mean_ms": round(1e3 * float(np.mean(ttft)), 1),
                     "long_ttft_max_ms": round(1e3 * float(np.max(ttft)), 1)})
    return rows


def plot(rows: list[dict], fig) -> None:
    left, right = fig.subplots(1, 2)
    budgets = [r["budget"] for r in rows]
    left.plot(budgets, [r["tpot_p50_ms"] for r in rows], "o-", label="decode TPOT p50")
    left.plot(budgets, [r["tpot_p99_ms"] for r in rows], "s-", label="decode TPOT p99")
    left.set_ylabel("ms between a decode's tokens")
    right.plot(budgets, [r["long_ttft_mean_ms"] for r in rows], "o-", color="C2", label="long prompt TTFT mean")
    right.plot(budgets, [r["long_ttft_max_ms"] for r in rows], "s--", color="C2", label="long prompt TTFT max")
    right.set_ylabel("ms")
    for ax, title in ((left, "decode TPOT while a long prompt prefills"), (right, f"{rows[0]['long_prompt']}-token prompts: TTFT")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("token budget per step (max_num_batched_tokens)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)


def check(rows: list[dict]) -> str | None:
    small, large = rows[0], rows[-1]
    if small["tpot_p99_ms"] is None or large["tpot_p99_ms"] is None:
        return "no decode ran while a long prompt prefilled"
    if not small["tpot_p99_ms"] < large["tpot_p99_ms"]:
        return (f"budget {small['budget']}: decode TPOT p99 {small['tpot_p99_ms']} ms is not below "
                f"budget {large['budget']}'s {large['tpot_p99_ms']} ms")
    return None


EXPERIMENT = Experiment(
    name="chunking",
    claim="A smaller token budget per step lowers the decodes' time per output token while long "
          "prompts prefill, and pays for it in the long prompts' time to first token.",
    varies="the token budget of a step (max_num_batched_tokens)",
    fixed=f"{DECODERS} decoding requests (16-token prompts, long outputs); long prompts arriving "
          "while they decode, at fixed times (three at quick size, two at full); greedy, EOS ignored, no prefix caching",
    measures="decode TPOT p50/p99 over the gaps between a decode's tokens that overlap a long prompt's "
             "prefill; the long prompts' TTFT",
    run=run, plot=plot, check=check)
