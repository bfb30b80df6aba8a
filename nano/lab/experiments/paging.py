"""paging: fixed-size blocks handed out as a sequence grows waste at most one partly filled
block per sequence; a contiguous extent must be reserved at admission for the most the
sequence may ever hold. Same pool bytes for both.

The engine has only paging (nano/block_manager.py), so the two sides differ in kind: the
contiguous schemes are COMPUTED (how many of the same requests, in order, a reservation of
max_model_len, or of prompt + max_tokens, tokens each admits from the pool's tokens, and what
that reservation leaves unwritten at each sequence's end), paging is RUN (the engine's peak
and mean of sequences running at once, at three block sizes)."""
import numpy as np

from nano.bench.capacity import capacity_report
from nano.config import EngineConfig
from nano.lab.experiment import Experiment, Size, engine, model_of, serve
from nano.sequence import SamplingParams
from nano.telemetry.metrics import metrics_of

BLOCK_SIZES = (8, 32)


def scale(size: Size) -> dict:
    """pool: its bytes, as tokens at block size 16; max_tokens: what every request may
    generate (its reservation must cover it)."""
    if size.quick:
        return dict(pool=2048, max_model_len=1024, max_tokens=192, requests=24)
    return dict(pool=768, max_model_len=512, max_tokens=96, requests=16)


def workload(size: Size, vocab: int) -> list[tuple[list[int], int]]:
    """(prompt, output length): outputs end at spread lengths, as EOS would end them."""
    s, rng = scale(size), np.random.default_rng(size.seed)
    return [(rng.integers(3, vocab, int(rng.integers(16, 65))).tolist(), int(rng.integers(16, s["max_tokens"] + 1)))
            for _ in range(s["requests"])]


def contiguous(reserve: list[int], lengths: list[int], pool: int) -> tuple[int, float]:
    """Requests admitted in order while their reservations fit the pool's tokens, and the
    share of those reservations never written (each sequence at its end)."""
    admitted = int(np.searchsorted(np.cumsum(reserve), pool, side="right"))
    used, held = sum(lengths[:admitted]), sum(reserve[:admitted])
    return admitted, 1 - used / held


def run(size: Size) -> list[dict]:
    per_token = capacity_report(EngineConfig(model=model_of(size), device=size.device, num_blocks=1)).kv_bytes_per_token
    s = scale(size)
    memory = s["pool"] * per_token
    rows, requests = [], None
    for block in BLOCK_SIZES:
        eng = engine(size, kv_cache_memory=memory, block_size=block, max_model_len=s["max_model_len"],
                     enable_prefix_caching=False)
        requests = requests or workload(size, eng.model_config.vocab_size)
        seqs = serve(eng, [(p, SamplingParams(temperature=0, ignore_eos=True, max_tokens=n)) for p, n in requests])
        lengths = [s.num_tokens - 1 for s in seqs]  # the last token's KV is never written
        slots = [-(-n // block) * block for n in lengths]
        decodes = [d for _, _, _, d in metrics_of(eng).step_log if d]
        rows.append({"scheme": f"paged, {block}-token blocks", "side": "run", "block_size": block,
                     "pool_blocks": eng.capacity.num_blocks,
                     "admitted_at_once": metrics_of(eng).peak_running,
                     "mean_running": round(float(np.mean(decodes)), 1),
                     "preemptions": sum(metrics_of(eng).preemptions.values()),
                     "waste_pct": round(100 * (1 - sum(lengths) / sum(slots)), 1)})
    lengths = [len(p) + n - 1 for p, n in requests]
    for name, reserve in (("contiguous, max_model_len", [s["max_model_len"]] * len(requests)),
                          ("contiguous, prompt + max_tokens", [len(p) + s["max_tokens"] for p, _ in requests])):
        admitted, waste = contiguous(reserve, lengths, s["pool"])
        rows.append({"scheme": name, "side": "computed", "admitted_at_once": admitted, "pool_tokens": s["pool"],
                     "waste_pct": round(100 * waste, 1)})
    return rows


def plot(rows: list[dict], fig) -> None:
    left, right = fig.subplots(1, 2)
    names = [r["scheme"].replace(", ", "\n") for r in rows]
    colors = ["C0" if r["side"] == "run" else "C3" for r in rows]
    y = np.arange(len(rows))
    left.barh(y, [r["admitted_at_once"] for r in rows], color=colors)
    for r, yi in zip(rows, y):
        if "mean_running" in r:
            left.plot(r["mean_running"], yi, "k|", markersize=18)
    left.set_yticks(y, names, fontsize=8)
    left.set_xlabel("sequences resident at once (bar: peak; tick: mean over steps)")
    left.set_title(f"same pool bytes ({rows[-1]['pool_tokens']} tokens); blue: run, red: computed", fontsize=10)
    right.barh(y, [r["waste_pct"] for r in rows], color=colors)
    right.set_yticks(y, names, fontsize=8)
    right.set_xlabel("% of the memory held that is never written")
    right.set_title("memory wasted (each sequence at its end)", fontsize=10)


def check(rows: list[dict]) -> str | None:
    best = max(r["admitted_at_once"] for r in rows if r["side"] == "computed")
    for r in (r for r in rows if r["side"] == "run"):
        if not r["mean_running"] > best:
            return f"{r['scheme']}: {r['mean_running']} running on average, not more than contiguous extents' {best}"
    return None


EXPERIMENT = Experiment(
    name="paging",
    claim="Paged blocks admit several times the sequences that contiguous worst-case extents do from "
          "the same memory, and waste under one block per sequence.",
    varies="KV allocation (paged blocks of 8 / 32 tokens, run; contiguous extents of "
           "max_model_len or prompt + max_tokens tokens, computed)",
    fixed="the pool's bytes (2048 tokens quick, 768 full), max_model_len (1024 / 512), max_tokens (192 / "
          "96); 24 / 16 requests with 16-64-token prompts whose outputs end at lengths spread up to "
          "max_tokens, all arriving at once",
    measures="sequences resident at once (peak and mean over steps), preemptions, the share of held "
             "memory never written",
    run=run, plot=plot, check=check)
