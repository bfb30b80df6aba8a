"""PEFT LoRA adapter folders (adapter_config.json + adapter_model.safetensors), read and checked
against the base model: what nano does not implement is refused by name, in one line, before
any weight is used (docs/lora.md#what-is-refused)."""
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nano import checks
from nano.config import ModelConfig
from nano.errors import NanoError, read_json
from nano.weights import CheckpointReader

# The projections an adapter may target, and where PEFT names them in a layer.
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
TENSOR = "base_model.model.model.layers.{layer}.{block}.{module}.lora_{half}.weight"
# Keys that only shape training or PEFT's own bookkeeping: they change no output, so any value.
# qalora_group_size (16 in every config PEFT 0.21 writes) acts only with use_qalora, refused.
TRAINING_KEYS = {"task_type", "base_model_name_or_path", "revision", "inference_mode",
                 "lora_dropout", "init_lora_weights", "auto_mapping", "peft_version",
                 "layers_pattern", "megatron_core", "exclude_modules", "qalora_group_size"}
# Keys of features nano does not implement, with the value that means "off" (also refused
# when absent from the list but set: any other key must be null, false or empty).
OFF = {"use_dora": False, "modules_to_save": None, "bias": "none", "fan_in_fan_out": False,
       "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
       "layer_replication": None, "lora_bias": False, "use_qalora": False,
       "trainable_token_indices": None, "target_parameters": None, "megatron_config": None,
       "loftq_config": {}}
# What each refused feature is, for the error.
FEATURE = {"use_dora": "DoRA", "modules_to_save": "modules_to_save (fully trained modules)",
           "bias": "trained biases", "fan_in_fan_out": "transposed (Conv1D) weights",
           "lora_bias": "a bias on lora_B"}


@dataclass(frozen=True)
class LoRARequest:
    """A request's adapter, vLLM's shape: lora_int_id names the adapter (one path per id and
    per name), lora_path is its PEFT folder."""
    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass
class Adapter:
    """A read adapter: rank, scaling, and each targeted projection's (A (r, in), B (out, r))
    float32 per layer, whole (pool.py takes a tensor-parallel rank's slices)."""
    request: LoRARequest
    rank: int
    scale: float
    weights: dict  # (layer, module) -> (A, B)


def check_request(request) -> LoRARequest:
    """A LoRARequest whose fields have their types (the Python API and the server pass them)."""
    if not isinstance(request, LoRARequest):
        raise NanoError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
    checks.text("lora_name", request.lora_name)
    if not request.lora_name:
        raise NanoError("lora_name must not be empty")
    checks.integer("lora_int_id", request.lora_int_id, 1, checks.INT32_MAX)
    checks.text("lora_path", request.lora_path)
    return request


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each projection's (out, in) in the base model: what its A and B must fit."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}


def read_adapter(request: LoRARequest, cfg: ModelConfig, max_rank: int) -> Adapter:
    """Read and check request's folder for a base model of config cfg and ranks up to max_rank."""
    folder = Path(check_request(request).lora_path)
    where = f"LoRA adapter {request.lora_name!r:.40}"
    if not (folder / "adapter_config.json").is_file():
        raise NanoError(f"{where}: no adapter_config.json in {str(folder):.200}")
    config = read_json(folder / "adapter_config.json")
    if not isinstance(config, dict):
        raise NanoError(f"{where}: adapter_config.json is not a JSON object")
    rank, scale, modules = _read_config(config, where, max_rank)
    reader = CheckpointReader(folder, single="adapter_model.safetensors")
    shapes, weights = expected_shapes(cfg), {}
    names = set(reader.names())
    for layer in range(cfg.num_layers):
        for module in modules:
            a_name, b_name = (TENSOR.format(layer=layer, block=MODULES[module], module=module,
                                            half=half) for half in "AB")
            if a_name not in names and b_name not in names:
                continue
            out, inp = shapes[module]
            for name, shape in ((a_name, (rank, inp)), (b_name, (out, rank))):
                if name not in names:
                    raise NanoError(f"{where}: {name} is missing (its other half is there)")
                if reader.shape(name) != shape:
                    raise NanoError(f"{where}: tensor {name} has shape {reader.shape(name)}, the "
                                    f"base model and r={rank} imply {shape} (another base model?)")
            weights[layer, module] = reader.get(a_name), reader.get(b_name)
            names -= {a_name, b_name}
    if names:
        raise NanoError(f"{where}: tensor {sorted(names)[0]} is not one nano uses (it reads "
                        f"lora_A / lora_B of {', '.join(modules)} in layers 0.."
                        f"{cfg.num_layers - 1})")
    if not weights:
        raise NanoError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    return Adapter(request, rank, scale, weights)


def _read_config(config: dict, where: str, max_rank: int) -> tuple[int, float, list[str]]:
    """(r, the scaling lora_alpha / r or / sqrt(r) with use_rslora, the target modules)."""
    if config.get("peft_type", "LORA") != "LORA":
        raise NanoError(f"{where}: peft_type {config['peft_type']!r:.40} is not LORA")
    for key, value in config.items():
        if key in TRAINING_KEYS or key in ("peft_type", "r", "lora_alpha", "use_rslora",
                                           "target_modules"):
            continue
        off = OFF.get(key)
        if value != off and value not in (None, False, {}, []):
            feature = FEATURE.get(key, key)
            raise NanoError(f"{where}: {feature} ({key}={value!r:.40}) is not supported")
    rank = checks.integer(f"{where}: r", config.get("r"), 1)
    if rank > max_rank:
        raise NanoError(f"{where}: rank {rank} is above --max-lora-rank {max_rank}")
    alpha = checks.number(f"{where}: lora_alpha", config.get("lora_alpha", 8), low=0,
                          open_low=True)
    rslora = checks.flag(f"{where}: use_rslora", config.get("use_rslora", False))
    targets = config.get("target_modules")
    if isinstance(targets, str):
        raise NanoError(f"{where}: target_modules as a pattern ({targets!r:.40}) is not "
                        f"supported: list the modules")
    if not isinstance(targets, list) or not targets:
        raise NanoError(f"{where}: target_modules must be a list of module names")
    for module in targets:
        if module not in MODULES:
            kind = ("embedding / LM-head adapters are" if module in ("embed_tokens", "lm_head")
                    else "it is")
            raise NanoError(f"{where}: target module {module!r:.40} is not supported ({kind} not "
                            f"among {', '.join(MODULES)})")
    return rank, alpha / (np.sqrt(rank) if rslora else rank), list(dict.fromkeys(targets))
