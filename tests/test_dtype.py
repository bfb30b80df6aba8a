"""--dtype: the element type a run computes in, by vLLM's rule (nano/config.py's
EngineConfig.element_dtype), and the host's float32 <-> bfloat16 conversions every bfloat16
array passes through (nano/device.py: weights onto the GPU, TP all-reduces, logits read back).
The kernels' own bfloat16 is tests/test_kernels.py's."""
from types import SimpleNamespace

import numpy as np
import pytest

from nano.cli import output
from nano.config import EngineConfig, ModelConfig
from nano.device import BFLOAT16, from_float32, to_float32
from nano.errors import NanoError
from tests import families


def model(case="llama", **keys) -> ModelConfig:
    return ModelConfig.from_hf(families.config(case, "v4") | keys)


@pytest.mark.parametrize("keys, auto", [
    ({"torch_dtype": "bfloat16"}, "bfloat16"),
    ({"torch_dtype": "float16"}, "float16"),
    ({"torch_dtype": "float32"}, "bfloat16"),   # vLLM on sm_80+: float32 weights run in bfloat16
    ({"torch_dtype": None}, "bfloat16"),        # no dtype named: float32, transformers' default
    ({"torch_dtype": None, "dtype": "float16"}, "float16"),  # transformers 5's key
])
def test_auto_is_the_checkpoints_dtype_and_bfloat16_for_float32(keys, auto):
    cfg = ModelConfig.from_hf({k: v for k, v in (families.config("llama", "v4") | keys).items()
                               if v is not None})
    assert EngineConfig().element_dtype(cfg, "gpu") == auto
    for given in ("bfloat16", "float16"):
        assert EngineConfig(dtype=given).element_dtype(cfg, "gpu") == given


def test_gemma3_runs_in_bfloat16_unless_told():
    """Its activations overflow float16, so auto never picks float16 for it."""
    gemma = model("gemma3_text", torch_dtype="float16")
    assert EngineConfig().element_dtype(gemma, "gpu") == "bfloat16"
    assert EngineConfig(dtype="float16").element_dtype(gemma, "gpu") == "float16"
    assert EngineConfig().element_dtype(model(torch_dtype="float16"), "gpu") == "float16"


@pytest.mark.parametrize("dtype", ["auto", "bfloat16", "float16", "float32"])
def test_the_cpu_path_keeps_float32(dtype):
    assert EngineConfig(dtype=dtype).element_dtype(model(torch_dtype="bfloat16"), "cpu") == "float32"


def test_what_nano_does_not_run_is_refused():
    with pytest.raises(NanoError, match="--dtype float32 runs on the CPU only"):
        EngineConfig(dtype="float32").element_dtype(model(), "gpu")
    with pytest.raises(NanoError, match="--dtype must be auto, bfloat16, float16 or float32, got 'fp8'"):
        EngineConfig(dtype="fp8").validate()
    with pytest.raises(NanoError, match="config.json torch_dtype must be .* got 'int8'"):
        model(torch_dtype="int8")


def reference_bfloat16(x: np.ndarray) -> np.ndarray:
    """float64 -> the nearest bfloat16, ties to the even one, by search over the two
    neighbours: no bit trick shared with the code under test."""
    x = np.asarray(x, np.float64)
    mantissa, exponent = np.frexp(x)               # x = mantissa * 2^exponent, |mantissa| in [0.5, 1)
    step = np.ldexp(1.0, exponent - 8)             # bfloat16 keeps 8 significant bits
    low = np.floor(x / step) * step
    high = low + step
    pick_high = (x - low > high - x) | ((x - low == high - x) & (np.floor(low / step) % 2 == 1))
    return np.where(pick_high, high, low)


def test_float32_to_bfloat16_rounds_to_nearest_even():
    """Ties (a float32 exactly halfway) go to the even neighbour, either way: next to 1 the
    bfloat16 values are 2^-7 apart, so 1 + 2^-8 is a tie between 1 and 1 + 2^-7 (down: 1 is
    even), 1 + 3 * 2^-8 one between 1 + 2^-7 and 1 + 2^-6 (up); past halfway rounds up, short
    of it down."""
    rng = np.random.default_rng(0)
    ties = np.float32([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3 * 2**-10 + 2**-2])
    near = np.float32([1 + 2**-8 + 2**-20, 1 + 2**-8 - 2**-20, 1 + 2**-7])
    x = np.concatenate([ties, near, rng.normal(size=1000).astype(np.float32),
                        (rng.normal(size=1000) * 1e30).astype(np.float32), np.float32([0, -0.0])])
    bits = from_float32(x, BFLOAT16)
    assert bits.dtype == np.uint16
    np.testing.assert_array_equal(to_float32(bits), reference_bfloat16(x).astype(np.float32))
    np.testing.assert_array_equal(to_float32(bits[:2]), np.float32([1, 1 + 2**-6]))


def test_bfloat16_values_round_trip_exactly():
    """A bfloat16 checkpoint's weights, widened on reading (weights.py), go onto the GPU as
    the same bits; float16 and float32 arrays convert as NumPy does."""
    bits = np.random.default_rng(1).integers(0, 2**16, 4096).astype(np.uint16)
    bits = bits[np.isfinite(to_float32(bits))]
    np.testing.assert_array_equal(from_float32(to_float32(bits), BFLOAT16), bits)
    halves = np.float16([0.1, -2.5, 65504])
    assert to_float32(halves).dtype == np.float32 and from_float32(to_float32(halves), np.float16).tolist() == halves.tolist()



@pytest.mark.parametrize("kind, dtype, asked, said", [
    ("gpu", BFLOAT16, "auto", "bfloat16"),
    ("gpu", np.dtype(np.float16), "float16", "float16"),
    ("cpu", np.dtype(np.float32), "auto", "float32"),
    ("cpu", np.dtype(np.float32), "bfloat16", "float32: --dtype bfloat16 is the GPU's; the CPU path computes in float32"),
])
def test_the_start_up_line_names_the_dtype(kind, dtype, asked, said):
    """What the run computes in, and on the CPU, once, that it kept float32 where asked for
    another (the start-up line, printed once per run)."""
    engine = SimpleNamespace(device=SimpleNamespace(kind=kind, dtype=dtype), config=EngineConfig(dtype=asked))
    assert output._dtype(engine) == said
