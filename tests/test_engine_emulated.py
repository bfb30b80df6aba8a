"""The engine's GPU path (float16 weights and KV cache, the CUDA kernels, device sampling)
on the CPU emulator (tests/cuda_host), against the CPU path: tests/test_engine_gpu.py's
comparison in a small shape (head dim 64, GQA group 2), in every run; and disaggregated
KV handoffs between two GPU pools (tests/test_disagg.py's GPU check).

It runs in a subprocess in which the emulator's CuPy stand-in is imported as `cupy`, so
that nano's GPU code takes it for the real one. Two things a GPU has are stood in for:
cuBLAS (not one of cuda/*.cu) by a float32-accumulating NumPy GEMM, and CUDA graphs, which
cannot be emulated: steps run eagerly (--enforce-eager). tests/test_engine_gpu.py and
tests/test_graphs_gpu.py cover both on a GPU.
"""
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SHAPE = dict(hidden=256, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=512)


def test_gpu_engine_path_matches_cpu_on_the_emulator(tmp_path):
    pytest.importorskip("cupy")  # nano/kernels.py's options come from CuPy's package
    from cuda_host import emulator
    if emulator.unavailable():
        pytest.skip(emulator.unavailable())
    done = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True,
                          text=True, timeout=600, cwd=TESTS.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "configs agree" in done.stdout and "disaggregated handoffs agree" in done.stdout


def emulate_gpu() -> None:
    """Make `import cupy` give the emulator's stand-in, with a NumPy GEMM for cuBLAS."""
    import numpy as np

    from cuda_host import cupy_stub
    sys.modules["cupy"] = cupy_stub
    from nano import kernels

    class Gemm:
        def linear(self, x, weight, out):
            out[...] = (np.asarray(x, np.float32) @ np.asarray(weight, np.float32).T).astype(np.float16)

    kernels.cublas.handle = lambda device_id: Gemm()


def main(workdir: str) -> None:
    emulate_gpu()
    from test_engine_gpu import GPU_CONFIGS, check_gpu_configs, prompts_for

    from reference import make_random_model

    model_dir = make_random_model(Path(workdir) / "model", max_pos=1024, dtype="float16", seed=7, **SHAPE)
    for engine, name, gpu in check_gpu_configs(model_dir, prompts_for(SHAPE["vocab"]), enforce_eager=True):
        assert engine.device.xp.__name__.endswith("cupy_stub")
        print(name, "agrees:", [s.output_token_ids for s in gpu][:2])
    print(f"{len(GPU_CONFIGS)} configs agree")
    from test_disagg import check_gpu_handoff
    for kv in ("auto", "int8"):
        check_gpu_handoff(model_dir, kv)
    print("disaggregated handoffs agree")


if __name__ == "__main__":
    sys.path[:0] = [str(TESTS), str(TESTS.parent)]
    main(sys.argv[1])
