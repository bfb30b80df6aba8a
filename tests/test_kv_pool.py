"""The KV pool's size: one function (kv_cache.pool_memory / pool_blocks) for the
engine and --capacity, its formula on each device with given numbers, and the report printing
what the engine allocates."""
import pytest

from nano import device
from nano.bench.capacity import CapacityReport, capacity_report, format_report
from nano.config import EngineConfig
from nano.engine import LLMEngine
from nano.kv_cache import DEFAULT_CPU_KV_MEMORY, GPU_FREE_MEMORY_FRACTION, pool_blocks, pool_memory
from tests import families

GB = 10**9


def test_cpu_pool_is_a_fixed_default_whatever_is_free():
    for free in (GB, 100 * GB):
        assert pool_memory(EngineConfig(), "cpu", free, 0, 1) == DEFAULT_CPU_KV_MEMORY == 2 * 2**30


def test_gpu_pool_is_a_fraction_of_free_memory_split_among_the_ranks_on_the_gpu(monkeypatch):
    assert GPU_FREE_MEMORY_FRACTION == 0.9
    monkeypatch.setattr(device, "gpu_count", lambda: 1)
    assert pool_memory(EngineConfig(), "gpu", 10 * GB, 0, 1) == 9 * GB
    assert pool_memory(EngineConfig(), "gpu", 10 * GB, 0, 2) == 4.5 * GB  # tp=2 on one GPU
    monkeypatch.setattr(device, "gpu_count", lambda: 2)
    # tp=3 on two GPUs: ranks 0 and 2 share GPU 0, rank 1 has GPU 1 to itself
    assert [pool_memory(EngineConfig(), "gpu", 10 * GB, r, 3) for r in range(3)] == [4.5 * GB, 9 * GB, 4.5 * GB]


@pytest.mark.parametrize("kind", ["cpu", "gpu"], ids=["cpu_formula", "gpu_formula"])
def test_given_sizes_win_on_both_devices(kind):
    config = EngineConfig(kv_cache_memory=3 * GB, block_size=16)
    assert pool_memory(config, kind, 100 * GB, 0, 1) == 3 * GB
    assert pool_blocks(config, 3 * GB, 1000) == 3 * GB // 16_000
    config = EngineConfig(kv_cache_memory=3 * GB, num_blocks=7)
    assert pool_blocks(config, 3 * GB, 1000) == 7


@pytest.mark.parametrize("args", [{}, {"kv_cache_memory": 300_000, "block_size": 8}, {"num_blocks": 40}])
def test_plan_pool_is_the_engine_pool_on_the_cpu(tiny_model, args):
    config = EngineConfig(model=str(tiny_model), device="cpu", **args)
    report = capacity_report(config)
    engine = LLMEngine(config)
    assert report.num_blocks == engine.block_manager.num_blocks
    assert report.kv_bytes_per_token == engine.kv_bytes_per_token


@pytest.mark.gpu
def test_plan_pool_is_the_engine_pool_on_the_gpu(tiny_model):
    """The plan estimates the memory free after the weights, the engine measures it after
    loading them: the same within what the CUDA context and small buffers take."""
    import cupy
    config = EngineConfig(model=str(tiny_model), device="gpu")
    report = capacity_report(config)
    cupy.get_default_memory_pool().free_all_blocks()  # the plan's bandwidth buffers
    engine = LLMEngine(config)
    assert report.num_blocks == pytest.approx(engine.block_manager.num_blocks, rel=0.02)


@pytest.mark.parametrize("case", ["llama", "llama3", "qwen2", "qwen3", "mistral", "gemma3_text"])
def test_the_report_counts_each_familys_weights_and_kv_as_the_engine_loads_them(case, tmp_path):
    """--capacity works from shapes alone; the engine from the loaded arrays: the same bytes for
    every family (Qwen2's biases, Qwen3's head norms and head_dim, untied heads)."""
    config = EngineConfig(model=str(families.make_model(case, tmp_path)), device="cpu", num_blocks=40)
    report, engine = capacity_report(config), LLMEngine(config)
    assert (report.weight_bytes, report.kv_bytes_per_token) == (engine.weight_bytes, engine.kv_bytes_per_token)
    assert report.windows == engine.model_config.windows


def test_windowed_ceiling_counts_the_blocks_each_sliding_layer_could_keep():
    """Mistral-like (every layer a 16-key window, blocks of 4): a window spans at most 5 blocks;
    Gemma-3-like (one global layer in three) keeps the global layer's whole context."""
    report = CapacityReport("m", "cpu", 10**6, "float32", 4, 1000, 64, 256, [64], num_blocks=100,
                            full_precision_blocks=None, bandwidth=1e9, contexts=[8, 64, 4096], windows=(16, 16))
    assert (report.ceiling(64), report.windowed_ceiling(64)) == (100 // 16, 100 // 5)
    assert report.windowed_ceiling(8) == report.ceiling(8) == 50  # a context inside the window: no saving
    report.windows = (16, 16, None)
    assert report.windowed_ceiling(64) == 300 // (5 + 5 + 16)
    assert "windowed" in format_report(report) and "2 of 3 layers see only their last 16 keys" in format_report(report)
    report.windows = (None, None)
    assert "windowed" not in format_report(report)
