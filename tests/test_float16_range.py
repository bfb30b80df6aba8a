"""The GPU path keeps activations in float16, whose largest finite value is 65,504. The GPU
tests run random-weight models, whose activations say nothing about a trained model's, so the
default model's real weights are checked here, on the CPU path (float32): every array the
forward pass makes (the embedding, the residual stream and each norm, QKV, rotated q,
attention, the MLP, logits), over the example prompts and a longer text, must stay under
float16's largest value by a margin of MARGIN."""
import dataclasses
import functools
from pathlib import Path

import numpy as np

from nano import ops
from nano.config import EngineConfig
from nano.engine import LLMEngine
from nano.sequence import SamplingParams

PROMPTS = Path(__file__).resolve().parent.parent / "prompts.txt"
FLOAT16_MAX = float(np.finfo(np.float16).max)
MARGIN = 2.0
SET_OPS = ("embedding", "add_rms_norm", "linear", "silu_mul", "rope_store_kvcache")  # the model calls its op set's
ATTENTION = ("paged_attention", "prefill_attention")  # ops.attention binds these, as paged= and prefill=
OPS = SET_OPS + ATTENTION
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based inks and a screw press into a system that could produce "
        "books at a scale no scribe could match. Within fifty years, presses were running in more than two "
        "hundred cities across Europe, and the price of a book had fallen by an order of magnitude.")


def test_the_default_models_activations_fit_float16(default_model, monkeypatch):
    largest = {}

    def watched(name, op):
        def run(*args, **kwargs):
            out = op(*args, **kwargs)
            for array in out if isinstance(out, tuple) else (out,):
                if array is not None and array.size:
                    largest[name] = max(largest.get(name, 0.0), float(np.abs(array).max()))
            return out
        return run
    attention = functools.partial(ops.REFERENCE.attention, **{
        name.split("_")[0]: watched(name, getattr(ops, name)) for name in ATTENTION})
    monkeypatch.setattr(ops, "REFERENCE", dataclasses.replace(
        ops.REFERENCE, attention=attention, **{name: watched(name, getattr(ops.REFERENCE, name)) for name in SET_OPS}))
    prompts = [line for line in PROMPTS.read_text().splitlines() if line]
    engine = LLMEngine(EngineConfig(model=str(default_model), device="cpu"))
    engine.generate(prompts + [TEXT], SamplingParams(temperature=0, max_tokens=16))
    worst = max(largest, key=largest.get)
    print(f"largest activation: {largest[worst]:.0f} ({worst}), float16 margin {FLOAT16_MAX / largest[worst]:.2f}x")
    assert set(largest) == set(OPS)
    assert largest[worst] * MARGIN <= FLOAT16_MAX, largest
