"""The CPU half of each step of tests/device_check.sh, timed on a machine without a GPU: the
work the GPU machine's CPU does in that step too (random models built, weights loaded, CPU
reference runs, NumPy references of the kernel tests), so that each step's time limit comes
from a measurement (docs/h200_figures.md). Prints a table and writes JSON.

    .venv/bin/python tests/device_budget.py [--json OUT.json] [--skip STEP ...]
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path[:0] = [str(TESTS), str(TESTS.parent)]


def kernels() -> float:
    """tests/test_kernels.py's cases on the emulator, less the time in emulated launches: the
    NumPy references and input preparation, which the GPU cases run on the CPU too."""
    import pytest

    from cuda_host import emulator
    in_launches = [0.0]
    run = emulator.Function._run

    def timed(self, *args):
        start = time.perf_counter()
        try:
            return run(self, *args)
        finally:
            in_launches[0] += time.perf_counter() - start
    emulator.Function._run = timed
    start = time.perf_counter()
    pytest.main(["-q", "-p", "no:cacheprovider", str(TESTS / "test_kernels.py"), "-k", "emulator"])
    return time.perf_counter() - start - in_launches[0]


def models(shapes: dict, max_pos: int, seed: int, uniform: bool = False) -> float:
    from reference import make_random_model
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in shapes.items():
            make_random_model(Path(tmp) / name, max_pos=max_pos, dtype="float16", seed=seed, uniform=uniform,
                              **shape)
    return time.perf_counter() - start


def gpu_weight_load(model: Path) -> None:
    """The host half of a GPU engine's weight load (checkpoint to float16 arrays; the upload
    is the GPU half)."""
    import numpy as np

    from nano.tp import load_model, partition
    from nano.weights import open_model
    folder = open_model(str(model), tokenizer=False)

    def put(host, keep_float32=False, cpu_column_major=False):  # Device.put for a GPU, less the upload
        return np.ascontiguousarray(host, dtype=np.float32 if keep_float32 else np.float16)
    load_model(folder.reader, folder.config, partition(folder.config, 0, 1), put, 4096)


def engine() -> dict:
    """Per shape of tests/test_engine_gpu.py, in the order its tests do them: the model built,
    the host half of the GPU's one weight load (weights_loaded_once), the CPU's one weight
    load, the CPU reference of each KV pool type its configs use (as the `cpu_runs` cache
    computes them), and the prompt-logprobs test's CPU run (SmolLM2 shape only)."""
    from nano.config import EngineConfig
    from nano.engine import LLMEngine
    from nano.sequence import SamplingParams
    from reference import make_random_model
    from test_engine_gpu import (ENGINE_CASES, GPU_CONFIGS, SHAPES, WORKLOADS, cpu_reference, kv_args, prompts_for,
                                 weights_loaded_once)
    times = {}

    def timed(part, fn, *args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        times[part] = time.perf_counter() - start
        return result

    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in SHAPES.items():
            model = timed(f"{name} model", make_random_model, Path(tmp) / name, max_pos=4096, dtype="float16",
                          seed=7, uniform=True, **shape)
            timed(f"{name} GPU weight load, host half", gpu_weight_load, model)
            with weights_loaded_once():
                timed(f"{name} CPU weight load", LLMEngine, EngineConfig(model=str(model), device="cpu",
                                                                       num_blocks=256))
                work = WORKLOADS[name]
                prompts = prompts_for(shape["vocab"], **work["prompts"])
                pools = {tuple(sorted(kv_args(GPU_CONFIGS[c]).items())) for s, c in ENGINE_CASES if s == name}
                for kv in sorted(pools):
                    timed(f"{name} CPU reference, {dict(kv) or 'float16 KV'}", cpu_reference, model, prompts,
                          work["max_tokens"], **dict(kv))
                if name == "smollm2_135m":
                    engine = LLMEngine(EngineConfig(model=str(model), device="cpu", num_blocks=256))
                    timed(f"{name} prompt logprobs, CPU run", engine.generate, prompts_for(shape["vocab"], n=2),
                          SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=3))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--skip", nargs="*", default=[])
    args = parser.parse_args()
    from reference import LLAMA_32_1B, SMOLLM2_135M
    from test_graphs_gpu import SHAPES as GRAPH_SHAPES
    steps = {
        "kernels": kernels,
        "graphs": lambda: models(GRAPH_SHAPES, 2048, seed=3),
        "engine": engine,
        "bench_engine": lambda: models({"smollm2-135m": SMOLLM2_135M, "llama-3.2-1b": LLAMA_32_1B}, 1024, seed=1,
                                       uniform=True),
    }
    results = {}
    for name, fn in steps.items():
        if name not in args.skip:
            results[name] = fn()
            print(name, json.dumps(results[name], indent=1), flush=True)
    print("\n| step | CPU half (s) |\n|---|---|")
    for name, value in results.items():
        parts = value if isinstance(value, dict) else {"": value}
        for part, seconds in parts.items():
            print(f"| {name} {part} | {seconds:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
