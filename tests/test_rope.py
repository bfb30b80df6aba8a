"""RoPE tables: plain theta, and Llama 3's long-context scaling against the published recipe."""
import math

import numpy as np

from nano.config import ModelConfig
from nano.model import rope_cos_sin


def config(**kw):
    base = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=2, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128, rope_theta=500000.0,
                max_position_embeddings=131072)
    return ModelConfig.from_hf({**base, **kw})


def test_plain_rope_angles():
    table = rope_cos_sin(config(rope_theta=10000.0), 10)
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(table[7, :32], np.cos(7 * inv_freq), atol=1e-6)
    np.testing.assert_allclose(table[7, 32:], np.sin(7 * inv_freq), atol=1e-6)


def test_llama3_scaling_matches_the_loop_recipe():
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    table = rope_cos_sin(config(rope_scaling=scaling), 9000)
    expected = []
    for freq in 1.0 / 500000.0 ** (np.arange(0, 64, 2) / 64):  # as written in Meta's reference code
        wavelen = 2 * math.pi / freq
        if wavelen < 8192 / 4.0:
            expected.append(freq)
        elif wavelen > 8192 / 1.0:
            expected.append(freq / 32.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            expected.append((1 - smooth) * freq / 32.0 + smooth * freq)
    np.testing.assert_allclose(table[8999, :32], np.cos(8999 * np.array(expected)), atol=2e-5)
    np.testing.assert_allclose(table[8999, 32:], np.sin(8999 * np.array(expected)), atol=2e-5)
