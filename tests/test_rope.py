"""RoPE tables: plain theta, and Llama 3's long-context scaling against the published recipe."""
import math

import numpy as np

from nano import ops
from nano.config import ModelConfig
from nano.kv_cache import LayerKV
from nano.tp import rope_cos_sin


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


def test_rope_scaling_by_its_old_key_and_the_default_type():
    """Older configs name the type under "type"; "default" is plain RoPE."""
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    llama3 = rope_cos_sin(config(rope_scaling={**scaling, "rope_type": "llama3"}), 200)
    assert not np.array_equal(llama3, rope_cos_sin(config(), 200))
    np.testing.assert_array_equal(rope_cos_sin(config(rope_scaling={**scaling, "type": "llama3"}), 200), llama3)
    np.testing.assert_array_equal(rope_cos_sin(config(rope_scaling={"rope_type": "default"}), 200),
                                  rope_cos_sin(config(), 200))


def test_rope_store_skips_slot_minus_one_and_rotates_each_token_by_its_own_position():
    """Tokens with slot -1 (already cached; CUDA-graph padding rows) write nothing, and the
    others' keys still get their own positions' angles: equal to one call per token."""
    rng = np.random.default_rng(0)
    t, nq, nkv, d, num_blocks, block_size = 7, 4, 2, 16, 5, 4
    q, k, v = (rng.standard_normal((t, n, d)).astype(np.float32) for n in (nq, nkv, nkv))
    positions = rng.permutation(20)[:t]
    slots = np.array([-1, 3, 17, -1, 8, 0, -1], np.int32)
    cos_sin = rope_cos_sin(config(head_dim=d, rope_theta=10000.0), 20)
    caches = [rng.standard_normal((num_blocks, nkv, block_size, d)).astype(np.float32) for _ in range(2)]
    expected, before = [c.copy() for c in caches], [c.copy() for c in caches]
    rows = [ops.rope_store_kvcache(q[i:i + 1], k[i:i + 1], v[i:i + 1], positions[i:i + 1], cos_sin,
                                   LayerKV(*expected), slots[i:i + 1]) for i in range(t)]
    got = ops.rope_store_kvcache(q, k, v, positions, cos_sin, LayerKV(*caches), slots)
    np.testing.assert_array_equal(got, np.concatenate(rows))
    np.testing.assert_array_equal(caches[0], expected[0])
    np.testing.assert_array_equal(caches[1], expected[1])
    written = np.zeros(num_blocks * block_size, bool)
    written[slots[slots >= 0]] = True
    for cache, original in zip(caches, before):  # the slots >= 0 changed, no other
        np.testing.assert_array_equal((cache != original).any(axis=(1, 3)).reshape(-1), written)


def test_both_rope_spellings_give_the_same_logits(tmp_path):
    """The same model with transformers 4's rope_theta + rope_scaling and with transformers 5's
    rope_parameters: the same ModelConfig and, bit for bit, the same logits (long-context
    scaling on, so that a spelling read as plain RoPE would show)."""
    import json

    from nano import LLM, SamplingParams
    from reference import make_random_model

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    spellings = {"old": {"rope_theta": 5e5, "rope_scaling": scaling},
                 "new": {"rope_parameters": {**scaling, "rope_theta": 5e5}}}
    engines, logits = {}, {}
    for name, rope in spellings.items():
        folder = make_random_model(tmp_path / name)
        config = {k: v for k, v in json.loads((folder / "config.json").read_text()).items() if k != "rope_theta"}
        (folder / "config.json").write_text(json.dumps(config | rope))
        engines[name] = LLM(model=str(folder), num_blocks=16)
        out = engines[name].generate([list(range(3, 40))], SamplingParams(temperature=0, max_tokens=4, return_logits=True))
        logits[name] = np.stack(out[0].logits)
    assert engines["old"].engine.model_config == engines["new"].engine.model_config
    assert engines["old"].engine.model_config.rope_scaling["rope_type"] == "llama3"
    np.testing.assert_array_equal(logits["old"], logits["new"])
