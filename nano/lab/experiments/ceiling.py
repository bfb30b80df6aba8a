"""ceiling: KV bytes set the batch ceiling. A sequence of C tokens holds ceil(C / block)
blocks of (2 x layers x KV heads x head_dim x bytes) per token; what is left beside the
weights, divided by that, is how many sequences can be resident at once. The arithmetic is
nano/kv_cache.py's (bytes_per_token, blocks_for_memory) and nano/bench/capacity.py's
(capacity_report, shard_num_params, CapacityReport.ceiling): the numbers the engine sizes
its own pool with.

Computed for real shapes on an 80 GiB float16 device; computed and then run for the size's
model: a pool of POOL_TOKENS tokens at full precision (and the same bytes in int8), C-token
sequences (a prompt of C - 1 tokens and one generated token) offered one more than the
ceiling, every one admissible in one step, the engine's peak of sequences running at once read
from metrics.peak_running."""
import numpy as np

from nano import kv_cache
from nano.bench.capacity import CapacityReport, capacity_report, shard_num_params
from nano.config import EngineConfig, ModelConfig
from nano.lab.experiment import Experiment, Size, engine, model_of, serve
from nano.sequence import SamplingParams
from nano.telemetry.metrics import metrics_of, reset_metrics
from nano.tp import partition
from nano.weights import open_model


# Real shapes as their config.json numbers (the fields the arithmetic reads), with whether
# the QKV projections carry a bias and the LM head is the embedding.
SHAPES = {
    "Llama-3-8B": (dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                        max_position_embeddings=8192), False, False),
    "Qwen2.5-7B": (dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                        max_position_embeddings=32768), True, False),
}
DEVICE_BYTES, DEVICE_ITEMSIZE = 80 * 2**30, 2       # an 80 GiB GPU, float16 weights and KV
SHAPE_CONTEXTS = (2048, 8192, 32768)
POOL_TOKENS = 256                                   # the run's pool, at full precision
RUN_CONTEXTS = {"auto": (64, 128, 256), "int8": (128,)}
BLOCK = EngineConfig().block_size


def shape_rows(name: str, cfg: ModelConfig, bias: bool, tied: bool) -> list[dict]:
    weights = shard_num_params(cfg, partition(cfg, 0, 1), bias, tied) * DEVICE_ITEMSIZE
    memory = int((DEVICE_BYTES - weights) * kv_cache.GPU_FREE_MEMORY_FRACTION)
    rows = []
    for dtype in ("auto", "int8"):
        per_token = kv_cache.bytes_per_token(cfg, cfg.num_kv_heads, dtype, DEVICE_ITEMSIZE)
        report = CapacityReport(model=name, device="gpu", kv_memory=memory, kv_dtype=dtype, block_size=BLOCK,
                                weight_bytes=weights, kv_bytes_per_token=per_token,
                                kv_bytes_per_token_full=per_token, kv_bytes_per_token_per_rank=[per_token],
                                num_blocks=kv_cache.blocks_for_memory(memory, per_token, BLOCK),
                                full_precision_blocks=None, bandwidth=0.0)
        for c in SHAPE_CONTEXTS:
            if c <= cfg.max_position_embeddings:
                rows.append({"kind": "computed", "model": name, "kv_dtype": "float16" if dtype == "auto" else dtype,
                             "context": c, "weights_GB": round(weights / 1e9, 2),
                             "kv_bytes_per_token": per_token, "kv_pool_GB": round(memory / 1e9, 2),
                             "ceiling": report.ceiling(c)})
    return rows


def run(size: Size) -> list[dict]:
    model = model_of(size)
    folder = open_model(model, tokenizer=False)
    rows = shape_rows(folder.path.name, folder.config, folder.config.attention_bias,
                      folder.config.tie_word_embeddings)
    for name, (fields, bias, tied) in SHAPES.items():
        rows += shape_rows(name, ModelConfig.from_hf(fields), bias, tied)
    full = capacity_report(EngineConfig(model=model, device=size.device, num_blocks=1))
    memory = POOL_TOKENS * full.kv_bytes_per_token
    rng = np.random.default_rng(size.seed)
    for dtype, contexts in RUN_CONTEXTS.items():
        config = dict(kv_cache_memory=memory, kv_cache_dtype=dtype, watermark=0.0, enable_prefix_caching=False)
        report = capacity_report(EngineConfig(model=model, device=size.device, **config))
        budget = report.num_blocks * BLOCK + max(contexts)  # never what limits a step
        eng = engine(size, max_num_batched_tokens=budget, **config)
        for c in contexts:
            ceiling = report.ceiling(c)
            reset_metrics(eng)
            vocab = eng.model_config.vocab_size
            seqs = serve(eng, [(rng.integers(3, vocab, c - 1).tolist(), SamplingParams(max_tokens=1, ignore_eos=True))
                               for _ in range(ceiling + 1)])
            rows.append({"kind": "run", "model": report.model, "kv_dtype": report.kv_dtype, "context": c,
                         "weights_GB": round(eng.weight_bytes / 1e9, 3),
                         "kv_bytes_per_token": eng.kv_bytes_per_token, "kv_pool_MB": round(memory / 1e6, 2),
                         "pool_blocks": eng.capacity.num_blocks, "computed_blocks": report.num_blocks,
                         "ceiling": ceiling, "offered": len(seqs), "measured_peak": metrics_of(eng).peak_running,
                         "finished": sum(s.finish_reason == "length" for s in seqs)})
    return rows


def plot(rows: list[dict], fig) -> None:
    left, right = fig.subplots(1, 2, width_ratios=(1.3, 1))
    computed = [r for r in rows if r["kind"] == "computed"]
    series = list(dict.fromkeys((r["model"], r["kv_dtype"]) for r in computed))
    x = np.arange(len(SHAPE_CONTEXTS))
    width = 0.8 / len(series)
    for i, (model, dtype) in enumerate(series):
        pick = {r["context"]: r["ceiling"] for r in computed if (r["model"], r["kv_dtype"]) == (model, dtype)}
        left.bar(x[:len(pick)] + (i - (len(series) - 1) / 2) * width, list(pick.values()), width,
                 label=f"{model}, {dtype} KV", hatch="//" if dtype == "int8" else None)
    left.set_xticks(x, [f"{c} tokens" for c in SHAPE_CONTEXTS])
    left.set_yscale("log")
    left.set_ylabel("sequences resident at once")
    left.set_title(f"computed: {DEVICE_BYTES // 2**30} GiB float16 device, pool = "
                   f"{kv_cache.GPU_FREE_MEMORY_FRACTION:.0%} of what the weights leave", fontsize=10)
    left.legend(fontsize=8)
    ran = [r for r in rows if r["kind"] == "run"]
    labels = [f"{r['kv_dtype']}\n{r['context']} tok" for r in ran]
    xr = np.arange(len(ran))
    right.bar(xr - 0.2, [r["ceiling"] for r in ran], 0.4, label="computed ceiling (bytes)")
    right.bar(xr + 0.2, [r["measured_peak"] for r in ran], 0.4, label="measured peak running")
    right.set_xticks(xr, labels, fontsize=8)
    right.set_ylabel("sequences")
    right.set_title(f"run: {ran[0]['model']}, a pool of {ran[0]['kv_pool_MB']} MB", fontsize=10)
    right.legend(fontsize=8)


def check(rows: list[dict]) -> str | None:
    for r in (r for r in rows if r["kind"] == "run"):
        if not r["ceiling"] - 1 <= r["measured_peak"] <= r["ceiling"]:
            return (f"{r['kv_dtype']} at {r['context']} tokens: measured peak {r['measured_peak']} is not "
                    f"the computed ceiling {r['ceiling']} (or one below it)")
        if r["pool_blocks"] != r["computed_blocks"]:
            return f"the engine's pool has {r['pool_blocks']} blocks, the arithmetic says {r['computed_blocks']}"
    return None


EXPERIMENT = Experiment(
    name="ceiling",
    claim="KV bytes set the batch ceiling: the sequences that fit beside the weights fall as context "
          "grows and rise with int8 KV, and the engine runs exactly as many at once as the byte "
          "arithmetic says.",
    varies="context length, KV dtype (full precision / int8), model shape (the size's model, "
           "Llama-3-8B, Qwen2.5-7B)",
    fixed=f"block size {BLOCK}; computed shapes: an 80 GiB float16 device; the run: a pool of "
          f"{POOL_TOKENS} full-precision tokens' bytes, watermark 0, a token budget that never limits",
    measures="KV bytes per token, pool blocks, the computed ceiling; the engine's peak of sequences "
             "running at once (metrics.peak_running) with one more sequence offered than the ceiling",
    run=run, plot=plot, check=check)
