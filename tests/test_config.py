"""Byte sizes as the flags and EngineConfig take them (--kv-cache-memory, --swap-space), and
config.json values that no real model has."""
import pytest

from nano.config import ModelConfig
from nano.errors import NanoError
from nano.cli.flags import parse_bytes


@pytest.mark.parametrize("text, expected", [
    ("2GB", 2 * 10**9), ("2gb", 2 * 10**9), ("512MiB", 512 * 2**20), ("1.5GiB", 3 * 2**29),
    ("4KB", 4000), ("4KiB", 4096), ("3T", 3 * 10**12), ("1TiB", 2**40), ("100", 100), ("100B", 100),
    ("1e9", 10**9), (" 7 MB ", 7 * 10**6), ("0", 0), ("2.5K", 2500), (4096, 4096),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "two GB", "2 XB", "inf", "nan", "1e400", "-1GB", "1.2.3MB"])
def test_parse_bytes_refuses(text):
    with pytest.raises(NanoError, match="byte size"):
        parse_bytes(text)


# ---- config.json values a real model never has: refused with the bound, before anything is allocated
LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=512)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("edit,message", [
    ({"max_position_embeddings": 10**9}, f"max_position_embeddings must be an integer in [1, {2**24}], got {10**9}"),
    ({"max_position_embeddings": 10**12}, f"max_position_embeddings must be an integer in [1, {2**24}], got {10**12}"),
    ({"rope_theta": 1e-300}, "rope_theta must be a number > 1, got 1e-300"),
    ({"rms_norm_eps": 1e308}, "rms_norm_eps must be a number in (0, 0.1], got 1e+308"),
    ({"eos_token_id": 10**30}, f"eos_token_id must be an integer in [0, 511], got {10**30}"),
    ({"eos_token_id": [2, 512]}, "eos_token_id must be an integer in [0, 511], got 512"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type must be default or llama3, got 'yarn'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling type must be default or llama3, got 'linear'"),
    ({"rope_scaling": {"factor": 2.0}}, "rope_scaling type must be default or llama3, got None"),
    ({"rope_scaling": {**LLAMA3, "low_freq_factor": 4.0}},
     "rope_scaling low_freq_factor must be below high_freq_factor, got 4.0 and 4.0"),
])
def test_model_config_values_out_of_range(edit, message):
    with pytest.raises(NanoError) as e:
        ModelConfig.from_hf({**LLAMA, **edit})
    assert str(e.value) == f"config.json {message}"


def test_model_config_rope_types():
    """"default" is plain RoPE; old configs name the type under "type"."""
    assert ModelConfig.from_hf({**LLAMA, "rope_scaling": {"rope_type": "default"}}).rope_scaling is None
    old = {key: value for key, value in LLAMA3.items() if key != "rope_type"} | {"type": "llama3"}
    assert ModelConfig.from_hf({**LLAMA, "rope_scaling": old}).rope_scaling == LLAMA3 | {"type": "llama3"}
