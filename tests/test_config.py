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
    ({"rope_scaling": {**LLAMA3, "factor": 1e308}}, "rope_scaling factor must be a number in [1, 1024], got 1e+308"),
    ({"rope_scaling": {**LLAMA3, "factor": 0.5}}, "rope_scaling factor must be a number in [1, 1024], got 0.5"),
    ({"rope_scaling": {**LLAMA3, "factor": float("nan")}}, "rope_scaling factor must be a number in [1, 1024], got nan"),
    ({"rope_scaling": {**LLAMA3, "low_freq_factor": 1e-320}},
     "rope_scaling low_freq_factor must be a number in [0.001, 1024], got 1e-320"),
    ({"rope_scaling": {**LLAMA3, "high_freq_factor": float("inf")}},
     "rope_scaling high_freq_factor must be a number in [0.001, 1024], got inf"),
    ({"rope_scaling": {**LLAMA3, "original_max_position_embeddings": 0.5}},
     f"rope_scaling original_max_position_embeddings must be a number in [1, {2**24}], got 0.5"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not implemented by the Llama forward"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}},
     "rope_parameters partial_rotary_factor is not implemented: nano rotates all of each head"),
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


# ---- the architecture: one nano runs, or a clear no before any weights load
RUNS = ("it runs LlamaForCausalLM (model_type llama), Qwen2ForCausalLM (model_type qwen2), "
        "Qwen3ForCausalLM (model_type qwen3), MistralForCausalLM (model_type mistral), "
        "Gemma3ForCausalLM (model_type gemma3_text)")
QWEN2 = {**LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_key_value_heads": 2}
QWEN3 = {**LLAMA, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_key_value_heads": 2}
MISTRAL = {**LLAMA, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "num_key_value_heads": 2}
GEMMA3 = {**LLAMA, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_key_value_heads": 2}


@pytest.mark.parametrize("edit,message", [
    ({"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"},
     f"architectures ['Phi3ForCausalLM'] is not one nano runs: {RUNS}"),
    ({"model_type": "phi3"}, f"model_type 'phi3' is not one nano runs: {RUNS}"),
    ({"architectures": "LlamaForCausalLM"}, f"architectures LlamaForCausalLM is not one nano runs: {RUNS}"),
    ({"architectures": ["LlamaForCausalLM", "MistralForCausalLM"]},
     f"architectures ['LlamaForCausalLM', 'MistralForCausalLM'] is not one nano runs: {RUNS}"),
    ({"architectures": [{}]}, f"architectures [{{}}] is not one nano runs: {RUNS}"),
    ({"architectures": ["LlamaForCausalLM"], "model_type": "mistral"},
     "model_type 'mistral' is not LlamaForCausalLM's ('llama')"),
    # keys that change the forward, of which it implements one value
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh' is not implemented by the Llama forward"),
    ({"mlp_bias": True}, "mlp_bias True is not implemented by the Llama forward"),
    ({"sliding_window": 4096}, "sliding_window 4096 is not implemented by the Llama forward"),
    ({"sliding_window": 0}, "sliding_window 0 is not implemented by the Llama forward"),
    ({"attention_bias": "yes"}, "attention_bias must be true or false, got 'yes'"),
    # Qwen2: no sliding window yet; its q/k/v biases are not optional
    ({**QWEN2, "use_sliding_window": True}, "use_sliding_window True is not implemented by the Qwen2 forward"),
    ({**QWEN2, "attention_bias": False}, "attention_bias False is not implemented by the Qwen2 forward"),
    ({**QWEN2, "hidden_act": "gelu"}, "hidden_act 'gelu' is not implemented by the Qwen2 forward"),
    ({**QWEN2, "model_type": "llama"}, "model_type 'llama' is not Qwen2ForCausalLM's ('qwen2')"),
    # Qwen3: no sliding window yet; no q/k/v biases (the key would add an o_proj bias too)
    ({**QWEN3, "use_sliding_window": True}, "use_sliding_window True is not implemented by the Qwen3 forward"),
    ({**QWEN3, "attention_bias": True}, "attention_bias True is not implemented by the Qwen3 forward"),
    ({**QWEN3, "hidden_act": "gelu"}, "hidden_act 'gelu' is not implemented by the Qwen3 forward"),
    ({**QWEN3, "model_type": "llama"}, "model_type 'llama' is not Qwen3ForCausalLM's ('qwen3')"),
    # Mistral: a window of at least one key, or none; no q/k/v biases
    ({**MISTRAL, "sliding_window": 0}, "sliding_window must be an integer in [1, 2147483647], got 0"),
    ({**MISTRAL, "sliding_window": -4}, "sliding_window must be an integer in [1, 2147483647], got -4"),
    ({**MISTRAL, "sliding_window": 16.0}, "sliding_window must be an integer in [1, 2147483647], got 16.0"),
    ({**MISTRAL, "sliding_window": True}, "sliding_window must be an integer in [1, 2147483647], got True"),
    ({**MISTRAL, "sliding_window": 2**31}, "sliding_window must be an integer in [1, 2147483647], got 2147483648"),
    ({**MISTRAL, "attention_bias": True}, "attention_bias True is not implemented by the Mistral forward"),
    ({**MISTRAL, "hidden_act": "gelu"}, "hidden_act 'gelu' is not implemented by the Mistral forward"),
    # Gemma 3: no logit soft-capping, no bidirectional attention; its layer kinds and RoPE by kind checked
    ({**GEMMA3, "attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0 is not implemented by the Gemma3 forward"),
    ({**GEMMA3, "final_logit_softcapping": 30.0}, "final_logit_softcapping 30.0 is not implemented by the Gemma3 forward"),
    ({**GEMMA3, "use_bidirectional_attention": True},
     "use_bidirectional_attention True is not implemented by the Gemma3 forward"),
    ({**GEMMA3, "hidden_activation": "gelu"}, "hidden_activation 'gelu' is not implemented by the Gemma3 forward"),
    ({**GEMMA3, "sliding_window": 0}, "sliding_window must be an integer in [1, 2147483647], got 0"),
    ({**GEMMA3, "sliding_window_pattern": 0}, "sliding_window_pattern must be an integer >= 1, got 0"),
    ({**GEMMA3, "query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be a number > 0, got 0"),
    ({**GEMMA3, "layer_types": ["full_attention"]}, "layer_types must list full_attention or sliding_attention "
     "for each of the 2 layers, got ['full_attention']"),
    ({**GEMMA3, "layer_types": ["full_attention", "chunked_attention"]}, "layer_types must list full_attention or "
     "sliding_attention for each of the 2 layers, got ['full_attention', 'chunked_attention']"),
    ({**GEMMA3, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
     "rope_parameters must be an object by layer type, got {'rope_type': 'default', 'rope_theta': 1000000.0}"),
    ({**GEMMA3, "rope_parameters": {"sliding_attention": {**LLAMA3, "rope_theta": 1e4}}},
     "rope_parameters sliding_attention must be of rope_type default"),
    ({"hidden_size": 66}, "hidden_size (66) must be a multiple of num_attention_heads (4)"),
])
def test_model_config_architecture_and_forward_keys_refused(edit, message):
    with pytest.raises(NanoError) as e:
        ModelConfig.from_hf({**LLAMA, **edit})
    assert str(e.value) == f"config.json {message}"


@pytest.mark.parametrize("edit", [
    {},  # neither architectures nor model_type: written by hand for nano, read as Llama
    {"architectures": ["LlamaForCausalLM"]}, {"model_type": "llama"},
    {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "mlp_bias": False,
     "sliding_window": None, "attention_bias": False},
    {"pretraining_tp": 2, "attention_dropout": 0.1},  # the same result: not read
    {"hidden_size": 66, "head_dim": 16},  # an explicit head_dim need not divide hidden_size
])
def test_model_config_llama_spellings_accepted(edit):
    config = ModelConfig.from_hf({**LLAMA, **edit})
    assert config.architecture == "LlamaForCausalLM" and config.attention_bias == edit.get("attention_bias", False)


@pytest.mark.parametrize("cfg", [
    QWEN2, {**LLAMA, "model_type": "qwen2", "num_key_value_heads": 4},  # no architectures: its model_type's
    {**QWEN2, "hidden_act": "silu", "attention_bias": True, "use_sliding_window": False},
    # without use_sliding_window, the window's keys change nothing (as in transformers): not read
    {**QWEN2, "sliding_window": 4096, "max_window_layers": 28},
    {**QWEN2, "sliding_window": None, "max_window_layers": "any"},
])
def test_model_config_qwen2_spellings_accepted(cfg):
    config = ModelConfig.from_hf(cfg)
    assert config.architecture == "Qwen2ForCausalLM" and config.attention_bias  # q/k/v biases, always
    assert not config.qk_norm


@pytest.mark.parametrize("cfg,head_dim", [
    (QWEN3, 128), ({**LLAMA, "model_type": "qwen3", "num_key_value_heads": 4}, 128),  # no head_dim: transformers' 128
    ({**QWEN3, "head_dim": 32}, 32),  # not hidden_size / num_attention_heads (16)
    ({**QWEN3, "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False, "head_dim": 16}, 16),
    # without use_sliding_window, the window's keys change nothing (as in transformers): not read
    ({**QWEN3, "sliding_window": 4096, "max_window_layers": 28, "head_dim": 16}, 16),
])
def test_model_config_qwen3_spellings_accepted(cfg, head_dim):
    config = ModelConfig.from_hf(cfg)
    assert config.architecture == "Qwen3ForCausalLM" and config.qk_norm and not config.attention_bias
    assert config.head_dim == head_dim


@pytest.mark.parametrize("architecture,kv_heads,head_dim", [
    ("LlamaForCausalLM", 64, 64), ("Qwen2ForCausalLM", 32, 64), ("Qwen3ForCausalLM", 32, 128),
    ("MistralForCausalLM", 8, 64)])
def test_model_config_keys_left_out_mean_what_transformers_reads(architecture, kv_heads, head_dim):
    """Llama's missing num_key_value_heads is one per query head, Qwen2's and Qwen3's 32 and
    Mistral's 8 (their configs' defaults); Qwen3's missing head_dim is 128, the others' hidden_size
    / heads. A config whose query heads those KV heads do not divide is refused, not read some
    other way."""
    cfg = {**LLAMA, "architectures": [architecture], "hidden_size": 4096, "num_attention_heads": 64}
    config = ModelConfig.from_hf(cfg)
    assert (config.num_kv_heads, config.head_dim) == (kv_heads, head_dim)
    if architecture != "LlamaForCausalLM":
        with pytest.raises(NanoError, match=rf"num_attention_heads \(4\) must be a multiple of num_key_value_heads \({kv_heads}\)"):
            ModelConfig.from_hf({**LLAMA, "architectures": [architecture]})


@pytest.mark.parametrize("edit, windows", [
    ({"sliding_window": 16}, (16, 16)),
    ({"sliding_window": None}, (None, None)),  # Mistral 7B v0.2 on: no window
    ({}, (4096, 4096)),  # transformers' default for a missing key
    ({"sliding_window": 1, "head_dim": None}, (1, 1)),  # head_dim null: hidden_size / heads, as in transformers
])
def test_model_config_mistral_windows(edit, windows):
    config = ModelConfig.from_hf({**MISTRAL, **edit})
    assert config.architecture == "MistralForCausalLM" and config.windows == windows
    assert config.head_dim == 16 and not config.attention_bias


def test_only_a_family_that_reads_the_window_has_one():
    """Llama's window must be null; Qwen2's counts only with use_sliding_window (refused for now)."""
    assert ModelConfig.from_hf(LLAMA).windows == (None, None)
    assert ModelConfig.from_hf({**QWEN2, "sliding_window": 16}).windows == (None, None)


# ---- RoPE: rope_theta + rope_scaling, or transformers 5's rope_parameters, read the same
OLD_LLAMA3 = {key: value for key, value in LLAMA3.items() if key != "rope_type"}


@pytest.mark.parametrize("old,new", [
    ({}, {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    ({"rope_theta": 5e5}, {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}),
    ({"rope_theta": 5e5, "rope_scaling": LLAMA3}, {"rope_parameters": {**LLAMA3, "rope_theta": 5e5}}),
    ({"rope_theta": 5e5, "rope_scaling": {**LLAMA3, "type": "llama3"}},
     {"rope_parameters": {**LLAMA3, "type": "llama3", "rope_theta": 5e5}}),
    # both spellings, agreeing (theta given once, at the top or inside)
    ({"rope_theta": 5e5, "rope_scaling": LLAMA3}, {"rope_theta": 5e5, "rope_parameters": {**LLAMA3}}),
    ({"rope_theta": 5e5, "rope_scaling": LLAMA3},  # its type as "type" in one, "rope_type" in the other
     {"rope_scaling": {**OLD_LLAMA3, "type": "llama3"}, "rope_parameters": {**LLAMA3, "rope_theta": 5e5}}),
])
def test_both_rope_spellings_read_the_same(old, new):
    old_config, new_config = ModelConfig.from_hf({**LLAMA, **old}), ModelConfig.from_hf({**LLAMA, **new})
    assert old_config == new_config
    assert old_config.rope_theta == old.get("rope_theta", 10000.0)


@pytest.mark.parametrize("edit,message", [
    ({"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
     "rope_parameters and rope_theta / rope_scaling disagree"),
    ({"rope_scaling": LLAMA3, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
     "rope_parameters and rope_theta / rope_scaling disagree"),
    ({"rope_scaling": {"rope_type": "default"}, "rope_parameters": {**LLAMA3, "rope_theta": 5e5}},
     "rope_parameters and rope_theta / rope_scaling disagree"),
    ({"rope_scaling": LLAMA3, "rope_parameters": {**LLAMA3, "factor": 16.0}},
     "rope_parameters and rope_theta / rope_scaling disagree"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "rope_parameters type must be default or llama3, got 'yarn'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}},
     "rope_parameters factor must be a number in [1, 1024], got None"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0.5}},
     "rope_parameters rope_theta must be a number > 1, got 0.5"),
    ({"rope_parameters": [10000.0]}, "rope_parameters must be an object or null, got [10000.0]"),
])
def test_rope_parameters_refused(edit, message):
    with pytest.raises(NanoError) as e:
        ModelConfig.from_hf({**LLAMA, **edit})
    assert str(e.value) == f"config.json {message}"
