"""Where a CPU decode step's time goes, op by op, in CPU time (robust to other processes).

    OPENBLAS_NUM_THREADS=1 taskset -c 1 python tests/profile_decode.py [--batch 32] [--steps 16] [--model M]

The default model (or --model), `batch` random 64-token prompts, greedy: after the prefill and a few
decode steps, `steps` decode steps with every `ops.*` call (the linear ones told apart by
weight: qkv, o, gate_up, down, LM head) and every part of the engine's step timed by
time.process_time; "Python between ops" is the forward pass less its ops. Then the whole
run of the same workload (64 generated tokens, prefill included) in output tokens per
CPU-second. docs/perf_notes.md's CPU breakdowns come from here.
"""
import argparse
import collections
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import numpy as np  # noqa: E402

from nano import ops  # noqa: E402
from nano.cli.offline import warm_up  # noqa: E402
from nano.config import EngineConfig  # noqa: E402
from nano.engine import LLMEngine  # noqa: E402
from nano.sequence import SamplingParams  # noqa: E402

OPS = ("embedding", "add_rms_norm", "linear", "rope_store_kvcache", "paged_attention", "silu_mul", "gelu_tanh_mul",
       "sample")


def engine_and_prompts(batch: int, model: str | None = None):
    engine = LLMEngine(EngineConfig(model=model, device="cpu", kv_cache_memory=256 * 2**20, max_num_seqs=batch))
    warm_up(engine)
    return engine, [np.random.default_rng(0).integers(10, 40000, 64).tolist() for _ in range(batch)]


def timed(owner, name: str, totals: collections.Counter, label=None) -> None:
    """Replace owner.name by a wrapper that adds its CPU time to totals[label(args)]."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.process_time()
        out = inner(*args, **kwargs)
        totals[label(args) if label else name] += time.process_time() - start
        return out
    setattr(owner, name, wrapper)


def breakdown(batch: int, steps: int, model: str | None) -> None:
    engine, prompts = engine_and_prompts(batch, model)
    model, totals = engine.runner.model, collections.Counter()
    names = {id(model.lm_head): "LM head"} | {id(getattr(w, n)): n for w in model.layers
                                               for n in ("qkv", "o_proj", "gate_up", "down")}
    for name in OPS:  # model.py and sampler.py call them through op sets, ops.attention by module name
        timed(ops, name, totals, (lambda args: "linear: " + names[id(args[1])]) if name == "linear" else None)
    timed_ops = {f.name: getattr(ops, f.name) for f in dataclasses.fields(model.ops) if f.name in OPS}
    model.ops = dataclasses.replace(model.ops, **timed_ops)
    engine.sampler.ops = model.ops
    parts = {"runner.prepare": (engine.runner, "prepare"), "forward": (engine, "forward"),  # the one steps call
             "scheduler.schedule": (engine.scheduler, "schedule"), "engine postprocess": (engine, "_postprocess"),
             "engine metrics": (engine, "_observe")}
    for label, (owner, name) in parts.items():
        timed(owner, name, totals, lambda args, label=label: label)
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(temperature=0, ignore_eos=True, max_tokens=steps + 8))
    for _ in range(4):  # the prefill, then a few decodes
        engine.step()
    totals.clear()
    start = time.process_time()
    for _ in range(steps):
        engine.step()
    total = time.process_time() - start
    totals["Python between ops"] = totals.pop("forward") - sum(v for k, v in totals.items() if k.split(":")[0] in OPS)
    print(f"batch {batch}: {1e3 * total / steps:.2f} CPU ms per decode step ({steps} steps)")
    for name, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {name:24s} {1e3 * seconds / steps:8.2f} ms  {100 * seconds / total:5.1f}%")


def whole_run(batch: int, model: str | None) -> None:
    engine, prompts = engine_and_prompts(batch, model)
    start = time.process_time()
    engine.generate(prompts, SamplingParams(temperature=0, ignore_eos=True, max_tokens=64))
    print(f"batch {batch}, 64 prompt + 64 generated tokens: "
          f"{batch * 64 / (time.process_time() - start):.1f} output tokens per CPU-second")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--model", help="a folder or a name run.py knows (default: the default model)")
    args = p.parse_args()
    whole_run(args.batch, args.model)  # first: breakdown() leaves the ops wrapped
    breakdown(args.batch, args.steps, args.model)


if __name__ == "__main__":
    main()
