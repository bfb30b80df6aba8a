"""gqa: what sharing the model's KV heads further costs, keys against values.

Grouped-query attention already shares each KV head among several query heads (the default
model: 9 query heads, 3 KV heads). Sharing further, without retraining, is GQA's
mean-pooling: the K (or V) projection rows of a group of KV heads are replaced by their
average, so the heads of a group become one head, copied. The shapes stay, so the engine
runs the modified model unchanged; a model whose every KV head is shared in keys and values
alike is exactly one with a single KV head, which the experiment also runs (config.json's
num_key_value_heads = 1, the averaged rows once) to show the same distributions at a
third of the KV bytes. Each variant is scored teacher-forced against the original model
(nano/lab/scoring.py).
"""
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from nano.lab import scoring
from nano.lab.experiment import Experiment, Size, engine, model_of
from nano.weights import open_model, resolve_model

SHARED = ("keys", "values", "both")


def settings(size: Size) -> dict:
    return dict(tokens=128 if size.quick else 512, memory=16 * 2**20 if size.quick else 256 * 2**20)


def groups_of(num_kv_heads: int, heads_after: int) -> list[np.ndarray]:
    """The KV heads cut into heads_after contiguous groups, the first ones larger."""
    return np.array_split(np.arange(num_kv_heads), heads_after)


def shared_model(source: Path, dest: Path, groups: list[np.ndarray], shared: str, merge: bool = False) -> Path:
    """A copy of the model folder at dest whose K and/or V projections are averaged over each
    group of KV heads; with merge, each group is stored once and config.json says so."""
    folder = open_model(str(source), tokenizer=False)
    cfg, reader = folder.config, folder.reader
    d = cfg.head_dim
    which = {"keys": ("k_proj",), "values": ("v_proj",), "both": ("k_proj", "v_proj")}[shared]
    tensors = {}
    for name in reader.names():
        w = reader.get(name)
        if name.split(".")[-2] in which:  # model.layers.N.self_attn.k_proj.weight (or .bias)
            heads = w.reshape(cfg.num_kv_heads, d, *w.shape[1:])
            means = [heads[g].mean(axis=0) for g in groups]
            w = (np.stack(means) if merge else np.stack([means[i] for i, g in enumerate(groups) for _ in g]))
            w = np.ascontiguousarray(w.reshape(-1, *w.shape[2:]))
        tensors[name] = w
    dest.mkdir(parents=True)
    save_file(tensors, str(dest / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    if merge:
        config["num_key_value_heads"] = len(groups)
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(source / name, dest / name)
    return dest


def run(size: Size) -> list[dict]:
    s = settings(size)
    source = resolve_model(model_of(size))
    base_engine = engine(size, kv_cache_memory=s["memory"])
    nkv = base_engine.model_config.num_kv_heads
    texts = scoring.evaluation_texts(base_engine.tokenizer, s["tokens"])
    base, base_bytes = scoring.score(base_engine, texts), base_engine.kv_bytes_per_token
    del base_engine
    variants = [(after, shared, False) for after in range(nkv - 1, 0, -1) for shared in SHARED]
    variants.append((1, "both", True))  # the single-KV-head model itself
    rows = []
    with tempfile.TemporaryDirectory(prefix="nano-lab-gqa-") as tmp:
        for i, (after, shared, merge) in enumerate(variants):
            folder = shared_model(source, Path(tmp) / str(i), groups_of(nkv, after), shared, merge)
            eng = engine(Size(size.quick, str(folder), size.device, size.seed), kv_cache_memory=s["memory"])
            # What the cache would hold if the shared heads were stored once: K and V are half each.
            kv_heads = after if shared == "both" else (after + nkv) / 2
            rows.append({"kv_heads": f"{nkv} -> {after}", "shared": shared,
                         "model": "one KV head" if merge else "heads averaged",
                         "kv_bytes_per_token": eng.kv_bytes_per_token if merge else round(base_bytes * kv_heads / nkv),
                         **scoring.compare(base, scoring.score(eng, texts), texts)})
            del eng
            shutil.rmtree(folder)
    ppl = scoring.perplexity(base, texts)
    for row in rows:
        row["ppl_delta"] = row["ppl"] / ppl - 1
    return rows


def plot(rows: list[dict], fig) -> None:
    ax_kld, ax_top1 = fig.subplots(1, 2)
    averaged = [r for r in rows if r["model"] == "heads averaged"]
    cuts = list(dict.fromkeys(r["kv_heads"] for r in averaged))
    width = 0.8 / len(SHARED)
    for j, shared in enumerate(SHARED):
        sel = [next(r for r in averaged if r["kv_heads"] == c and r["shared"] == shared) for c in cuts]
        x = np.arange(len(cuts)) + (j - (len(SHARED) - 1) / 2) * width
        ax_kld.bar(x, [r["kld"] for r in sel], width, label=f"{shared} shared")
        ax_top1.bar(x, [100 * r["top1"] for r in sel], width, label=f"{shared} shared")
    for ax in (ax_kld, ax_top1):
        ax.set_xticks(range(len(cuts)), [f"KV heads {c}" for c in cuts])
    ax_kld.set_title("mean KLD against the model (nats)")
    ax_kld.legend()
    ax_top1.set_title("top-1 agreement with the model (%)")
    merged = next(r for r in rows if r["model"] == "one KV head")
    ax_top1.text(0.98, 0.97, f"the model with one KV head: KLD {merged['kld']:.3g},\n"
                 f"{merged['kv_bytes_per_token']} KV bytes/token", transform=ax_top1.transAxes, fontsize=8,
                 ha="right", va="top")


def check(rows: list[dict]) -> str | None:
    averaged = {(r["kv_heads"], r["shared"]): r["kld"] for r in rows if r["model"] == "heads averaged"}
    cuts = list(dict.fromkeys(cut for cut, _ in averaged))  # fewest heads merged first
    for cut in cuts:
        if not averaged[cut, "both"] >= max(averaged[cut, "keys"], averaged[cut, "values"]):
            return f"KV heads {cut}: sharing both cost less KLD than sharing one half alone"
    for fewer, more in zip(cuts, cuts[1:]):
        for shared in SHARED:
            if not averaged[more, shared] > averaged[fewer, shared]:
                return f"{shared} shared: KV heads {more} cost no more KLD than {fewer}"
    merged = next(r for r in rows if r["model"] == "one KV head")
    same = averaged[merged["kv_heads"], "both"]
    if abs(merged["kld"] - same) > 1e-3 * same + 1e-6:
        return f"the one-KV-head model's KLD {merged['kld']:.4g} differs from its averaged copy's {same:.4g}"
    return None


EXPERIMENT = Experiment(
    name="gqa",
    claim="Sharing KV heads further without retraining cuts KV bytes in proportion but costs accuracy steeply: "
          "more with every head merged, most with keys and values both shared; which half costs more is "
          "measured, not assumed (the expectation is keys).",
    varies="KV heads shared (groups of the model's KV heads averaged into one): keys only, values only, both",
    fixed="model weights otherwise, evaluation texts (teacher-forced in 256-token chunks), full-precision KV",
    measures="mean KLD and top-1 agreement of the next-token distributions against the unmodified model, "
             "KV bytes per token",
    run=run, plot=plot, check=check)
