"""watermark: admission keeps a fraction of the KV pool free (EngineConfig.watermark; the
scheduler admits a request only if the free blocks after it stay at or above it), as
headroom for the running sequences' growth. More headroom: fewer preemptions, fewer
sequences admitted at once. And a request that could never fit the pool is rejected at once
(Scheduler._never_fits) rather than held at the head of a queue that never skips ahead.

That rejection is not a switch: the never-fit rows compare the same workload with the request
present (and rejected) and absent. Without the rejection, FCFS admission (which stops at the
first request that does not fit, so that a large one is not starved) would wait on it for
ever and no request behind it would run: that side is stated, not run."""
import numpy as np

from nano.config import EngineConfig
from nano.lab.experiment import Experiment, Size, engine, serve
from nano.sequence import SamplingParams
from nano.telemetry.metrics import metrics_of, ttft_of

BLOCK = EngineConfig().block_size
WATERMARKS = (0.0, 0.1, 0.2, 0.3)


def scale(size: Size) -> dict:
    if size.quick:
        return dict(blocks=48, requests=16, prompt=(32, 64), output=(32, 96), watermarks=WATERMARKS)
    return dict(blocks=16, requests=10, prompt=(16, 32), output=(16, 48), watermarks=WATERMARKS[::3])


def workload(size: Size, vocab: int):
    s, rng = scale(size), np.random.default_rng(size.seed)
    return [(rng.integers(3, vocab, int(rng.integers(s["prompt"][0], s["prompt"][1] + 1))).tolist(),
             SamplingParams(temperature=0, ignore_eos=True,
                            max_tokens=int(rng.integers(s["output"][0], s["output"][1] + 1))))
            for _ in range(s["requests"])]


def measure(size: Size, watermark: float, never_fit: bool) -> dict:
    blocks = scale(size)["blocks"]
    eng = engine(size, num_blocks=blocks, watermark=watermark, enable_prefix_caching=False)
    vocab = eng.model_config.vocab_size
    requests = workload(size, vocab)
    if never_fit:  # first in line: more tokens than the whole pool holds, though within the context
        requests.insert(0, (np.random.default_rng(size.seed + 1).integers(3, vocab, blocks * BLOCK + 1).tolist(),
                            SamplingParams(max_tokens=1)))
    start = eng.clock.now()
    seqs = serve(eng, requests)
    seconds = eng.clock.now() - start
    others = seqs[1:] if never_fit else seqs
    m = metrics_of(eng)
    return {"watermark": watermark, "never_fit": "present" if never_fit else "absent", "pool_blocks": blocks,
            "rejected": m.rejected, "finished": sum(s.finish_reason == "length" for s in others),
            "preemptions": sum(m.preemptions.values()), "peak_running": m.peak_running,
            "tokens_per_s": round(m.generated_tokens / seconds, 1),
            "others_ttft_mean_ms": round(1e3 * float(np.mean([ttft_of(s) for s in others])), 1),
            "others_ttft_max_ms": round(1e3 * float(np.max([ttft_of(s) for s in others])), 1)}


def run(size: Size) -> list[dict]:
    rows = [measure(size, w, False) for w in scale(size)["watermarks"]]
    return rows + [measure(size, rows[0]["watermark"], True)]  # against the first row: the same, less it


def plot(rows: list[dict], fig) -> None:
    a, b, c = fig.subplots(1, 3)
    sweep = rows[:-1]
    w = [100 * r["watermark"] for r in sweep]
    a.plot(w, [r["preemptions"] for r in sweep], "o-", label="preemptions")
    a.plot(w, [r["peak_running"] for r in sweep], "s-", label="peak running")
    a.set_title("preemptions vs sequences at once", fontsize=10)
    b.plot(w, [r["tokens_per_s"] for r in sweep], "o-", color="C2", label="output tokens/s")
    b.set_ylabel("output tokens/s", color="C2")
    twin = b.twinx()
    twin.plot(w, [r["others_ttft_mean_ms"] for r in sweep], "s--", color="C3", label="TTFT mean")
    twin.set_ylabel("TTFT mean, ms", color="C3")
    b.set_title("throughput and waiting", fontsize=10)
    a.legend(fontsize=8)
    for ax in (a, b):
        ax.set_xlabel(f"watermark, % of {rows[0]['pool_blocks']} blocks")
    pair = [rows[0], rows[-1]]
    c.bar([f"never-fit {r['never_fit']}\n(rejected: {r['rejected']})" for r in pair],
          [r["others_ttft_mean_ms"] for r in pair], color=["C0", "C1"])
    c.set_ylabel("the others' TTFT mean, ms")
    c.set_title(f"never-fit request first in line, watermark {pair[0]['watermark']}", fontsize=9)


def check(rows: list[dict]) -> str | None:
    sweep, absent, present = rows[:-1], rows[0], rows[-1]
    if present["rejected"] != 1 or present["finished"] != absent["finished"]:
        return (f"the never-fit request: {present['rejected']} rejected, {present['finished']} others "
                f"finished (without it: {absent['finished']})")
    if sweep[-1]["preemptions"] > sweep[0]["preemptions"]:
        return (f"watermark {sweep[-1]['watermark']}: {sweep[-1]['preemptions']} preemptions, more "
                f"than {sweep[0]['preemptions']} at {sweep[0]['watermark']}")
    return None


EXPERIMENT = Experiment(
    name="watermark",
    claim="A larger admission watermark trades sequences at once for fewer preemptions; a request "
          "that can never fit is rejected at once and costs the others nothing.",
    varies=f"the watermark ({', '.join(f'{w:.0%}' for w in WATERMARKS)} of the pool; full size: the ends); a never-fit "
           "request first in line, present or absent",
    fixed=f"a pool of 48 (quick) or 16 blocks of {BLOCK} tokens; 16 requests (32-64-token prompts, 32-96 "
          "output tokens) or 10 (16-32, 16-48) that outgrow it together; greedy, EOS ignored, preemption auto",
    measures="preemptions, peak sequences running, output tokens/s, the other requests' TTFT",
    run=run, plot=plot, check=check)
