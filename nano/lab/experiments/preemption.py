"""preemption: a sequence that must give its blocks up is either swapped (its KV copied to host
memory and back: cost grows with its bytes) or recomputed (its blocks dropped, its tokens
prefilled again on return: cost grows with its tokens, and with attention, faster than
linearly). Which is cheaper depends on the length and on the device's copy bandwidth against
its compute; `--preemption auto` asks the online cost model (nano/policy.py preemption_mode,
nano/cost_model.py swap_cost / recompute_cost).

Per length, both costs are measured on the engine's own paths: a swap is the runner's copy of
that many blocks out and back (LLMEngine.swap: ModelRunner.swap, what a step runs); a recompute is the prefill
step of that many tokens. The cost model's two predictions after those steps say what auto
picks. Then one tight pool is run with each mode forced, and their tokens compared (on the CPU
with --batch-invariant, so that recomputing by prefill gives bitwise the logits decoding gave)."""
import numpy as np

from nano.config import EngineConfig
from nano.device import select_device
from nano.lab.experiment import Experiment, Size, engine, serve
from nano.sequence import SamplingParams
from nano.telemetry.metrics import metrics_of, reset_metrics

BLOCK = EngineConfig().block_size
SWAP_SPACE = 512 * 2**20


def lengths(size: Size) -> tuple[int, ...]:
    return (64, 256, 1024, 2048) if size.quick else (128, 512, 1024)


def cost_rows(size: Size) -> list[dict]:
    longest = max(lengths(size))
    eng = engine(size, num_blocks=2 * longest // BLOCK + 8, max_num_batched_tokens=longest,
                 enable_prefix_caching=False, swap_space=SWAP_SPACE)
    rng = np.random.default_rng(size.seed)
    rows = []
    for n in lengths(size):
        blocks = -(-n // BLOCK)
        recompute, swap = [], []
        for _ in range(2 if size.quick else 1):  # quick: the lesser of two, less the machine's noise
            reset_metrics(eng)
            serve(eng, [(rng.integers(3, eng.model_config.vocab_size, n).tolist(), SamplingParams(max_tokens=1))])
            start, end, _, _ = metrics_of(eng).step_log[0]
            recompute.append(end - start)
            pairs = [(i, i) for i in range(blocks)]  # device block i <-> host block i; none in use now
            moved, out = eng.swap(pairs, [])
            _, back = eng.swap([], pairs)
            swap.append(out + back)
        predicted_swap, predicted_recompute = eng.cost.swap_cost(n * eng.kv_bytes_per_token), eng.cost.recompute_cost(n)
        rows.append({"kind": "cost", "tokens": n, "kv_MB": round(moved / 1e6, 2),
                     "swap_ms": round(1e3 * min(swap), 2), "recompute_ms": round(1e3 * min(recompute), 2),
                     "cheaper": "swap" if min(swap) <= min(recompute) else "recompute",
                     "auto_swap_ms": round(1e3 * predicted_swap, 2),
                     "auto_recompute_ms": round(1e3 * predicted_recompute, 2),
                     "auto_picks": "swap" if predicted_swap <= predicted_recompute else "recompute"})
    return rows


def forced_rows(size: Size) -> list[dict]:
    """Four sequences that outgrow a pool of 3/4 of their final size, each mode forced."""
    rows, outputs = [], {}
    invariant = select_device(size.device) == "cpu"
    prompt, output = (32, 64) if size.quick else (16, 32)
    for mode in ("swap", "recompute", "auto"):
        eng = engine(size, num_blocks=4 * (prompt + output) * 3 // 4 // BLOCK, preemption=mode, watermark=0.0,
                     enable_prefix_caching=False, swap_space=SWAP_SPACE, batch_invariant=invariant)
        rng = np.random.default_rng(size.seed)
        start = eng.clock.now()
        seqs = serve(eng, [(rng.integers(3, eng.model_config.vocab_size, prompt).tolist(),
                            SamplingParams(temperature=0, ignore_eos=True, max_tokens=output)) for _ in range(4)])
        outputs[mode] = [s.output_token_ids for s in seqs]
        m = metrics_of(eng)
        rows.append({"kind": "forced", "mode": mode, "preemptions": sum(m.preemptions.values()),
                     "reasons": dict(m.preemption_reasons), "swap_MB": round(m.swap_bytes / 1e6, 2),
                     "seconds": round(eng.clock.now() - start, 3), "batch_invariant": invariant,
                     "same_tokens_as_swap": outputs[mode] == outputs["swap"]})
    return rows


def run(size: Size) -> list[dict]:
    return cost_rows(size) + forced_rows(size)


def plot(rows: list[dict], fig) -> None:
    left, right = fig.subplots(1, 2)
    cost = [r for r in rows if r["kind"] == "cost"]
    n = [r["tokens"] for r in cost]
    left.plot(n, [r["swap_ms"] for r in cost], "o-", label="swap, measured (out + back in)")
    left.plot(n, [r["recompute_ms"] for r in cost], "s-", label="recompute, measured (prefill)")
    left.plot(n, [r["auto_swap_ms"] for r in cost], "o:", color="C0", label="swap, cost model")
    left.plot(n, [r["auto_recompute_ms"] for r in cost], "s:", color="C1", label="recompute, cost model")
    for r in cost:
        left.annotate(f"auto: {r['auto_picks']}", (r["tokens"], r["recompute_ms"]), fontsize=7,
                      textcoords="offset points", xytext=(-20, 8))
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xticks(n, [str(x) for x in n])
    left.set_xlabel("sequence length (tokens)")
    left.set_ylabel("ms")
    left.set_title("cost of preempting one sequence", fontsize=10)
    left.legend(fontsize=7)
    forced = [r for r in rows if r["kind"] == "forced"]
    bars = right.bar([f"{r['mode']}\n{r['preemptions']} preemptions\nsame tokens: {r['same_tokens_as_swap']}"
                      for r in forced], [r["seconds"] for r in forced], color=["C0", "C1", "C2"])
    right.bar_label(bars, fmt="%.2f s", fontsize=8)
    right.set_ylabel("seconds for the whole run")
    right.set_title("4 sequences outgrowing a pool of 3/4 their size, mode forced", fontsize=10)


def check(rows: list[dict]) -> str | None:
    forced = {r["mode"]: r for r in rows if r["kind"] == "forced"}
    for mode in ("swap", "recompute"):
        if not forced[mode]["preemptions"]:
            return f"the {mode} run preempted nothing"
    if not forced["recompute"]["same_tokens_as_swap"]:
        return "swap and recompute runs generated different tokens"
    if any(r["swap_ms"] <= 0 or r["recompute_ms"] <= 0 for r in rows if r["kind"] == "cost"):
        return "a cost was not measured"
    return None


EXPERIMENT = Experiment(
    name="preemption",
    claim="Swap costs grow with a sequence's KV bytes and recompute with its tokens, so which is "
          "cheaper depends on length and device; the cost model picks one, and either way the "
          "tokens come out the same.",
    varies="sequence length; the preemption mode (swap / recompute / auto, forced by config)",
    fixed="block size, the model; the forced runs: 4 greedy sequences of 32 + 64 tokens (full size: 16 + 32) in a pool of "
          "3/4 of that, watermark 0, no prefix caching",
    measures="the measured swap (out and back) and recompute (prefill) time per length, the cost "
             "model's predictions and pick; per forced mode: preemptions, swapped bytes, run time, "
             "whether the tokens equal the swap run's",
    run=run, plot=plot, check=check)
