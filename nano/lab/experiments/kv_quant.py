"""kv-quant: what an int8 KV cache costs in accuracy, per key scheme, and what it buys in
blocks. Every int8 run is scored teacher-forced against the same engine with a
full-precision cache (float32 on the CPU, float16 on a GPU), nano/lab/scoring.py; then
greedy answers to prompts.txt, full precision vs each scheme. The scheme: docs/int8-kv.md."""
from nano.config import KEY_SCHEMES
from nano.lab import scoring
from nano.lab.experiment import Experiment, Size, engine

TOP1_FLOOR = 0.95   # every scheme's top-1 agreement with full precision (the default model: 98-99%)


def settings(size: Size) -> dict:
    """Tokens of each evaluation text, the KV pool every run gets, the greedy answers' length."""
    if size.quick:
        return dict(tokens=128, memory=16 * 2**20, answer=16)
    return dict(tokens=512, memory=512 * 2**20, answer=64)


def run(size: Size) -> list[dict]:
    s = settings(size)
    runs = [("full precision", {})] + [(f"int8, {k} keys", dict(kv_cache_dtype="int8", kv_int8_keys=k))
                                       for k in KEY_SCHEMES]
    rows, texts, base = [], None, None
    for name, knobs in runs:
        eng = engine(size, kv_cache_memory=s["memory"], **knobs)
        if texts is None:
            texts = scoring.evaluation_texts(eng.tokenizer, s["tokens"])
        logps = scoring.score(eng, texts)
        answers = scoring.greedy_answers(eng, s["answer"])
        if base is None:
            base = dict(logps=logps, answers=answers, blocks=eng.capacity.num_blocks,
                        bytes=eng.kv_bytes_per_token)
        row = {"kv_cache": name, "keys": knobs.get("kv_int8_keys", "-"),
               "kv_bytes_per_token": eng.kv_bytes_per_token, "blocks": eng.capacity.num_blocks,
               "blocks_gained": eng.capacity.num_blocks / base["blocks"],
               "bytes_ratio": base["bytes"] / eng.kv_bytes_per_token,
               **scoring.compare(base["logps"], logps, texts),
               "greedy_same": sum(a == b for a, b in zip(answers, base["answers"])),
               "greedy_answers": len(answers)}
        row["ppl_delta"] = row["ppl"] / scoring.perplexity(base["logps"], texts) - 1
        rows.append(row)
        del eng
    return rows


def plot(rows: list[dict], fig) -> None:
    int8 = rows[1:]
    names = [r["keys"] for r in int8]
    ax_kld, ax_top1, ax_blocks = fig.subplots(1, 3)
    ax_kld.bar(names, [r["kld"] for r in int8], color="tab:red")
    for i, r in enumerate(int8):
        ax_kld.annotate(f"{r['kld']:.2e}", (i, r["kld"]), ha="center", va="bottom", fontsize=8)
    ax_kld.set_title("mean KLD vs full precision (nats)")
    ax_kld.set_xlabel("int8 key scheme")
    ax_top1.bar(names, [100 * r["top1"] for r in int8], color="tab:blue")
    low = min(100 * r["top1"] for r in int8)
    ax_top1.set_ylim(max(0, low - 2 * (100 - low)), 100)
    ax_top1.set_title("top-1 agreement (%)")
    ax_top1.set_xlabel("int8 key scheme")
    for i, r in enumerate(int8):
        ax_top1.annotate(f"{100 * r['top1']:.2f}%", (i, 100 * r["top1"]), ha="center", va="bottom", fontsize=8)
    ax_blocks.bar(["full precision", "int8"], [rows[0]["blocks"], int8[0]["blocks"]], color=["grey", "tab:green"])
    ax_blocks.set_title(f"KV blocks in the same pool ({int8[0]['blocks_gained']:.2f}x)")


def check(rows: list[dict]) -> str | None:
    for r in rows[1:]:
        if r["top1"] < TOP1_FLOOR:
            return f"{r['kv_cache']}: top-1 agreement {100 * r['top1']:.2f}% is below {100 * TOP1_FLOOR:.0f}%"
        if abs(r["blocks_gained"] / r["bytes_ratio"] - 1) > 0.02:
            return (f"{r['kv_cache']}: {r['blocks_gained']:.2f}x the blocks, but its bytes per token "
                    f"promise {r['bytes_ratio']:.2f}x")
        if r["blocks_gained"] < 1.5:
            return f"{r['kv_cache']}: only {r['blocks_gained']:.2f}x the blocks of full precision"
    return None


EXPERIMENT = Experiment(
    name="kv-quant",
    claim="An int8 KV cache holds ~3.9x the blocks of a float32 one (1.9x of float16) in the same memory, "
          "and with rotated keys costs little accuracy; keys quantized as they are cost more.",
    varies="KV cache: full precision, or int8 values with keys quantized per token as they are or "
           "Hadamard-rotated",
    fixed="model, KV pool memory, evaluation texts (teacher-forced in 256-token chunks), prompts.txt",
    measures="mean KLD and top-1 agreement of the next-token distributions against full precision, "
             "perplexity, blocks in the pool, greedy answers identical to full precision's",
    run=run, plot=plot, check=check)
