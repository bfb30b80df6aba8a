"""--generation-config (vLLM's): the sampling defaults a model's generation_config.json
recommends, which requests that leave a field out (or send null) get in place of nano's
neutral ones. "auto" reads the model folder's file (none there: no defaults), "vllm" none, a
folder that folder's file. Only the keys vLLM takes (its ModelConfig.get_diff_sampling_param)
are read; the file's other keys (eos_token_id, do_sample, ...) are ignored, as vLLM ignores them."""
import json
from pathlib import Path

from nano.controls import RULES
from nano.errors import NanoError
from nano.sequence import FIELD_RULES

# The keys vLLM takes, each with transformers' GenerationConfig default: vLLM reads the file's
# difference from those (to_diff_dict), so a key at its default is not applied (top_k 50 among them).
KEYS = {"repetition_penalty": 1.0, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None,
        "max_new_tokens": None}


def read(choice: str, model_dir: Path | None) -> dict:
    """The defaults, named as the request's fields (max_new_tokens as max_tokens): {} for
    "vllm"; "auto": model_dir's file (None: not read yet, {}). A folder without the file, or a
    file that is not JSON, not an object or holds a value out of its field's range: a NanoError."""
    if choice == "vllm" or (choice == "auto" and model_dir is None):
        return {}
    path = Path(model_dir if choice == "auto" else choice) / "generation_config.json"
    if not path.is_file():
        if choice == "auto":
            return {}
        raise NanoError(f"--generation-config: {path} does not exist (give a model folder that has one, auto or vllm)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise NanoError(f"--generation-config: {path} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise NanoError(f"--generation-config: {path} holds {type(config).__name__}, not a JSON object")
    defaults = {}
    for key, default in KEYS.items():
        value = config.get(key)
        if value is None or value == default:
            continue
        field = "max_tokens" if key == "max_new_tokens" else key
        (FIELD_RULES.get(field) or RULES[field])(f"--generation-config: {path}: {key}", value)
        defaults[field] = value
    return defaults
