"""The engine's GPU path on the CPU emulator (tests/cuda_host), against the CPU path, in every
run: float16 and bfloat16 weights and KV cache (--dtype), every kernel, cuBLAS through nano/cublas.py's ctypes calls
(the stand-in library), device sampling, CUDA graphs for decode steps (recorded and replayed
by the CuPy stand-in), prompt logprobs on device arrays, disaggregated KV handoffs between two
GPU pools, a Qwen3 model (its q/k head norms), a Gemma 3 model (GeGLU, its norms, sliding
and global layers with their own RoPE tables), and tensor parallelism's all-reduce on device
arrays under mpirun -n 2 (in bfloat16, whose sums convert through float32). These are tests/test_engine_gpu.py's, test_graphs_gpu.py's and
test_disagg.py's GPU checks, in a small shape (head dim 64, GQA group 2).

Each runs in a subprocess (this file as a script; the engine checks in four parts, which a
run's workers share) in which the emulator's CuPy stand-in is `cupy` (cupy_stub.install), so
that nano's GPU code takes it for the real one.
"""
import pickle
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

TESTS = Path(__file__).resolve().parent
if __name__ == "__main__":  # the subprocess: the imports pytest's configuration gives the tests
    sys.path[:0] = [str(TESTS), str(TESTS.parent)]
from test_tp import launch, needs_mpi  # noqa: E402
SHAPE = dict(hidden=256, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=512)


@pytest.fixture(autouse=True)
def emulator_available():
    pytest.importorskip("cupy")  # nano/kernels.py's options come from CuPy's package
    from cuda_host import emulator
    if emulator.unavailable():
        pytest.skip(emulator.unavailable())


# The engine checks in four parts of similar length, each its own subprocess, so that a run's
# workers can share them: {part: what its output must say}.
PARTS = {"configs": ("configs agree", "bfloat16 agrees"),
         "features": ("graphs agree", "prompt logprobs agree", "speculation agrees", "disaggregated handoffs agree",
                      "qwen3 agrees"),
         "lora": ("lora agrees",), "gemma3": ("gemma3 agrees", "batch invariance refused")}


@pytest.mark.parametrize("part", PARTS)
def test_gpu_engine_path_matches_cpu_on_the_emulator(tmp_path, part):
    done = subprocess.run([sys.executable, __file__, part, str(tmp_path)], capture_output=True,
                          text=True, timeout=600, cwd=TESTS.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    for what in PARTS[part]:
        assert what in done.stdout, what


@needs_mpi
def test_tensor_parallel_on_device_arrays_matches_cpu_on_the_emulator(tmp_path):
    """mpirun -n 2, --tp 2 on the emulated GPU in bfloat16: the all-reduces go through device
    arrays (parallel.Group.all_reduce's CuPy branch, bfloat16 widened to float32 and rounded
    back); rank 0's greedy tokens and logits against one CPU rank's."""
    from reference import assert_greedy_runs_agree
    from nano.device import BFLOAT16
    from test_engine_gpu import LOGIT_TOLS, generate, prompts_for
    model = model_for_checks(tmp_path)
    done = launch([__file__, "tp", str(model), str(tmp_path / "gpu.pkl")], ranks=2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    gpu = pickle.loads((tmp_path / "gpu.pkl").read_bytes())
    cpu = generate(model, "cpu", prompts_for(SHAPE["vocab"]), num_blocks=256)[1]
    assert_greedy_runs_agree(cpu, gpu, LOGIT_TOLS[BFLOAT16])


def model_for_checks(workdir, name: str = "model", **family) -> Path:
    """Make the checks' random float16 model in SHAPE at workdir/name; family's flags (qwen3=True)
    make it another family's."""
    from reference import make_random_model
    return make_random_model(Path(workdir) / name, max_pos=1024, dtype="float16", seed=7, **family, **SHAPE)


def config_checks(workdir: str) -> None:
    """Every engine configuration in float16, two in bfloat16 (--dtype), each against the CPU."""
    from nano.device import BFLOAT16
    from test_engine_gpu import GPU_CONFIGS, check_gpu_config, prompts_for
    model_dir, cpu_runs = model_for_checks(workdir), {}
    prompts = prompts_for(SHAPE["vocab"])
    for name in GPU_CONFIGS:  # decode steps replay CUDA graphs (the default)
        engine, gpu = check_gpu_config(model_dir, prompts, name, cpu_runs)
        assert engine.device.xp.__name__.endswith("cupy_stub") and engine.runner.graphs.captured
        print(name, "agrees:", [s.output_token_ids for s in gpu][:2])
    print(f"{len(GPU_CONFIGS)} configs agree")
    # The float16 checkpoint in bfloat16 (--dtype): weights rounded on loading, every kernel's
    # bfloat16 instance, a bfloat16 or int8 pool, decode graphs.
    for name in ("default", "int8_chunked_prefill"):
        engine, _ = check_gpu_config(model_dir, prompts, name, cpu_runs, dtype="bfloat16")
        assert engine.device.dtype == BFLOAT16 and engine.runner.graphs.captured
    print("bfloat16 agrees")


def feature_checks(workdir: str) -> None:
    """CUDA graphs against eager steps, prompt logprobs, speculation, KV handoffs, Qwen3."""
    from test_disagg import check_gpu_handoff
    from test_engine_gpu import check_gpu_config, check_prompt_logprobs, check_speculation, prompts_for
    from test_graphs_gpu import check_graphs_keep_greedy_output, check_replay_with_padding
    model_dir, prompts = model_for_checks(workdir), prompts_for(SHAPE["vocab"])
    for kv in ("auto", "int8"):
        check_graphs_keep_greedy_output(model_dir, SHAPE["vocab"], kv, max_tokens=(2, 3, 4, 6, 8, 10, 12))
        check_replay_with_padding(model_dir, 3 if kv == "auto" else 13, kv)
    print("graphs agree with eager steps")
    for dtype in ("float16", "bfloat16"):
        worst = check_prompt_logprobs(model_dir, prompts[:2], dtype=dtype)
        print(f"prompt logprobs agree in {dtype}: largest difference {worst:.2e}")
    kinds = check_speculation(model_dir, prompts[:3])
    print(f"speculation agrees: {kinds.accepted} drafts accepted; steps {Counter(kinds.kinds)}")
    for kv in ("auto", "int8"):
        check_gpu_handoff(model_dir, kv)
    print("disaggregated handoffs agree")
    qwen3 = model_for_checks(workdir, "qwen3", qwen3=True)
    cpu_runs = {}
    for name in ("default", "int8"):  # its q/k head norms in the cache-writing kernel, eager and in graphs
        check_gpu_config(qwen3, prompts, name, cpu_runs)
    print("qwen3 agrees")


def lora_checks(workdir: str) -> None:
    """LoRA adapters in float16 and bfloat16."""
    from test_engine_gpu import check_lora, prompts_for
    model_dir, prompts = model_for_checks(workdir), prompts_for(SHAPE["vocab"])
    for dtype in ("float16", "bfloat16"):
        check_lora(model_dir, prompts[:3], Path(workdir) / "lora", dtype)
    print("lora agrees")


def gemma3_checks(workdir: str) -> None:
    """Gemma 3 in bfloat16, its default on a GPU; and --batch-invariant refused."""
    from nano.config import EngineConfig
    from nano.device import BFLOAT16
    from nano.engine import LLMEngine
    from nano.errors import NanoError
    from test_engine_gpu import check_gpu_config, prompts_for
    from tests import families
    gemma3, cpu_runs = families.make_model("gemma3_text", Path(workdir) / "gemma3", edit={"head_dim": 64}), {}
    for name in ("default", "chunked_prefill", "int8"):  # GeGLU, sandwich norms, two RoPE tables, windows of 12
        engine, _ = check_gpu_config(gemma3, prompts_for(SHAPE["vocab"]), name, cpu_runs)
        assert engine.device.dtype == BFLOAT16  # float32 weights, and Gemma 3: bfloat16 by default
    print("gemma3 agrees")
    with pytest.raises(NanoError, match="--batch-invariant is CPU-only"):
        LLMEngine(EngineConfig(model=str(model_for_checks(workdir)), device="gpu", batch_invariant=True))
    print("batch invariance refused")


def tensor_parallel_rank(model_dir: str, out: str) -> None:
    """One rank of an emulated --tp 2 run; rank 0 writes its sequences' tokens and logits."""
    from nano import parallel
    from nano.config import EngineConfig
    from nano.engine import LLMEngine
    from nano.fleet.worker import Worker
    from test_engine_gpu import generate, prompts_for
    config = dict(num_blocks=256, tp=2, dtype="bfloat16")
    if parallel.tp_group().rank:
        Worker(EngineConfig(model=model_dir, device="gpu", **config)).run()
        return
    engine, seqs = generate(model_dir, "gpu", prompts_for(SHAPE["vocab"]), **config)
    assert isinstance(engine, LLMEngine) and engine.device.kind == "gpu" and engine.group.world == 2
    assert engine.device.dtype.name == "uint16"  # bfloat16's bits
    engine.stop_workers()
    Path(out).write_bytes(pickle.dumps([SimpleNamespace(seq_id=s.seq_id, output_token_ids=s.output_token_ids,
                                                        logits=s.logits) for s in seqs]))


if __name__ == "__main__":
    from cuda_host import cupy_stub
    cupy_stub.install()
    {"configs": config_checks, "features": feature_checks, "lora": lora_checks, "gemma3": gemma3_checks,
     "tp": tensor_parallel_rank}[sys.argv[1]](*sys.argv[2:])
