"""tensor-parallel: what splitting the model over ranks does to each rank's memory and to
the step. The bytes come from the partition itself (nano/tp.py: each rank's query and KV
heads and MLP columns; nano/bench/capacity.py counts the weights a partition loads); the
times from real runs of `run.py --bench`, one rank and two ranks under mpirun (one BLAS
thread per rank), each writing its summary: the mean step and the time rank 0 spends in
all-reduces (Metrics.all_reduce_time, which includes waiting for the slower rank)."""
import os

from nano import kv_cache
from nano.bench.capacity import shard_num_params
from nano.config import EngineConfig
from nano.device import Device, select_device
from nano.disagg.compare import mpirun_command, run_summary
from nano.lab.experiment import Experiment, Size, model_of
from nano.tp import partition
from nano.weights import open_model

RANKS = (1, 2)


def bench_args(size: Size) -> list[str]:
    work = (["--num-seqs", "4", "--input-len", "16:32", "--output-len", "8"] if size.quick else
            ["--num-seqs", "8", "--input-len", "64:128", "--output-len", "32"])
    model = model_of(size)
    return ["--bench", *(["--model", model] if model else []), "--device", size.device, "--seed", str(size.seed),
            "--kv-cache-memory", "64MB" if size.quick else "256MB", *work]


def shard_bytes(size: Size, world: int) -> list[dict]:
    """Per rank: its heads, its weight bytes and its KV bytes per token, from the partition."""
    folder = open_model(model_of(size), tokenizer=False)
    cfg = folder.config
    bias, tied = cfg.attention_bias, cfg.tie_word_embeddings
    kind = select_device(size.device)
    itemsize = Device(kind, 0, EngineConfig().element_dtype(cfg, kind)).itemsize
    out = []
    for rank in range(world):
        part = partition(cfg, rank, world)
        out.append({"q_heads": part.num_heads, "kv_heads": part.num_kv_heads,
                    "weight_bytes": shard_num_params(cfg, part, bias, tied) * itemsize,
                    "kv_bytes_per_token": kv_cache.bytes_per_token(cfg, part.num_kv_heads, "auto", itemsize)})
    return out


def run(size: Size) -> list[dict]:
    # One BLAS thread per rank; ranks that share cores yield while they wait in a collective.
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", OMPI_MCA_mpi_yield_when_idle="1")
    rows = []
    for world in RANKS:
        launcher = mpirun_command(world, "--lab tensor-parallel") if world > 1 else []
        s = run_summary([*bench_args(size), "--tp", str(world)], f"the {world}-rank run", launcher, env)
        shards = shard_bytes(size, world)
        rows.append({"tp": world,
                     "q_heads_per_rank": [r["q_heads"] for r in shards],
                     "kv_heads_per_rank": [r["kv_heads"] for r in shards],
                     "weight_mb_per_rank": [round(r["weight_bytes"] / 1e6, 2) for r in shards],
                     "kv_bytes_per_token_per_rank": [r["kv_bytes_per_token"] for r in shards],
                     "step_ms": s["mean_step_ms"], "decode_step_ms": s["mean_decode_step_ms"],
                     "all_reduce_ms_per_step": s["all_reduce_ms_per_step"],
                     "all_reduce_share": s["all_reduce_ms_per_step"] / s["mean_step_ms"],
                     "all_reduce_kb_per_step": s["all_reduce_bytes_per_step"] / 1e3,
                     "output_tokens_per_s": s["output_tokens_per_s"]})
    return rows


def plot(rows: list[dict], fig) -> None:
    ax_w, ax_kv, ax_t = fig.subplots(1, 3)
    labels, weights, kv = [], [], []
    for r in rows:
        for rank, (w, k) in enumerate(zip(r["weight_mb_per_rank"], r["kv_bytes_per_token_per_rank"])):
            labels.append(f"tp={r['tp']}\nrank {rank}")
            weights.append(w)
            kv.append(k)
    colors = ["tab:blue" if lab.startswith("tp=1") else "tab:orange" for lab in labels]
    ax_w.bar(labels, weights, color=colors)
    ax_w.set_title("weights per rank (MB)")
    ax_kv.bar(labels, kv, color=colors)
    ax_kv.set_title("KV bytes per token per rank")
    names = [f"tp={r['tp']}" for r in rows]
    compute = [r["step_ms"] - r["all_reduce_ms_per_step"] for r in rows]
    ax_t.bar(names, compute, label="compute (rank 0)", color="tab:blue")
    ax_t.bar(names, [r["all_reduce_ms_per_step"] for r in rows], bottom=compute, label="all-reduce", color="tab:red")
    for i, r in enumerate(rows):
        ax_t.annotate(f"{100 * r['all_reduce_share']:.0f}%", (i, r["step_ms"]), ha="center", va="bottom", fontsize=8)
    ax_t.set_title("mean step (ms), all-reduce share")
    ax_t.legend(fontsize=8)


def check(rows: list[dict]) -> str | None:
    one, two = rows
    if max(two["weight_mb_per_rank"]) > 0.75 * one["weight_mb_per_rank"][0]:
        return f"a tp=2 rank holds {max(two['weight_mb_per_rank'])} MB of the model's {one['weight_mb_per_rank'][0]}"
    if sum(two["kv_bytes_per_token_per_rank"]) != one["kv_bytes_per_token_per_rank"][0]:
        return "the tp=2 ranks' KV bytes per token do not add up to one rank's: KV heads copied"
    if not two["all_reduce_ms_per_step"] > 0 or one["all_reduce_ms_per_step"] != 0:
        return "all-reduce time: none at tp=2, or some at tp=1"
    return None


EXPERIMENT = Experiment(
    name="tensor-parallel",
    claim="Two tensor-parallel ranks each hold about half the layers' weights and their share of the KV "
          "heads, so each rank's memory shrinks; every step pays two all-reduces a layer for it.",
    varies="tensor-parallel ranks: 1, 2 (mpirun)",
    fixed="model, seeded random bench requests, KV pool memory per rank, one BLAS thread per rank",
    measures="weight bytes and KV bytes per token per rank (from nano/tp.py's partition), mean step time, "
             "rank 0's all-reduce time per step and its share",
    run=run, plot=plot, check=check)
