"""Write tests/data/lora/<case>.json: what transformers + PEFT compute for each tiny model of
tests/families.py with each adapter of tests/lora_adapters.py, the numbers nano's multi-LoRA
forward is checked against.

Run by hand, in the side environment of tests/make_family_reference.py with PEFT added:
neither nano nor its tests need torch, transformers or PEFT.

    python3 -m venv ~/nano-refenv
    ~/nano-refenv/bin/pip install torch==2.13.0 transformers peft safetensors tokenizers numpy
    ~/nano-refenv/bin/python tests/make_lora_reference.py            # every case
    ~/nano-refenv/bin/python tests/make_lora_reference.py mistral    # or some

For each case and each adapter of lora_adapters.VARIANTS it makes the base folder and the
adapter folder, loads the base (float32, eager attention) and the adapter on it with PEFT's
PeftModel.from_pretrained, and checks that PEFT read the adapter as meant: its config saved
again is the file's, its state dict is exactly the file's tensors (every one used, none
missing), and each adapted layer's scaling is alpha / r, or alpha / sqrt(r) with use_rslora.
For each prompt (drawn as make_family_reference.py draws them, again where the adapter brings
a greedy step near a tie) it records what make_family_reference.py records: each prompt
token's log-probability, STEPS greedy steps, their log-probabilities and the top TOP. Also
recorded: the effect size (the largest change of a log-probability from the base model to the
adapted one), the largest difference from the same adapter on a float64 model and from PEFT's
merge_and_unload (the adapter folded into the base weights), and the effect of the mistakes
a LoRA forward can make (the other scaling rule, one target module left out): each far above
the comparison's tolerance says the data catch a forward that makes it.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import peft
import torch
import transformers
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from peft.utils import get_peft_model_state_dict
from safetensors.numpy import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests import families, lora_adapters  # noqa: E402
from tests.make_family_reference import (MIN_EFFECT, draw_prompts, full_ids, load, logprobs,  # noqa: E402
                                         max_diff, record_cases)

OUT = Path(__file__).resolve().parent / "data" / "lora"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def load_adapted(base: Path, adapter: Path, dtype=torch.float32):
    """The base model with the adapter on it, unmerged, after checking that PEFT read every
    tensor and the config as they are written."""
    model = PeftModel.from_pretrained(load(base, dtype), adapter).eval()
    written = json.loads((adapter / "adapter_config.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        model.peft_config["default"].save_pretrained(tmp)
        read = json.loads((Path(tmp) / "adapter_config.json").read_text())
    read["target_modules"] = sorted(read["target_modules"])  # PEFT keeps them as a set
    assert read == written | {"target_modules": sorted(written["target_modules"])}, f"{adapter}: {read}"
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    used = {k: v.float().numpy() for k, v in get_peft_model_state_dict(model).items()}
    assert used.keys() == saved.keys(), f"{adapter}: PEFT holds {sorted(used.keys() ^ saved.keys())} differently"
    assert all((used[k] == v).all() for k, v in saved.items()), f"{adapter}: a tensor changed on loading"
    expected = lora_adapters.scaling(written["r"], written["lora_alpha"], written["use_rslora"])
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    assert len(layers) == len(saved) // 2 and all(m.scaling["default"] == expected for m in layers)
    dtypes = {m.lora_A["default"].weight.dtype for m in layers} | {m.lora_B["default"].weight.dtype for m in layers}
    assert dtypes == {dtype}, f"PEFT computes the adapter in {dtypes}, not {dtype}"
    return model


def edited(adapter: Path, folder: Path, change: dict) -> Path:
    """The adapter with its config updated by `change`, and the tensors of target modules
    that the new config leaves out dropped."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((adapter / "adapter_config.json").read_text()) | change
    (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    kept = {k: v for k, v in load_file(str(adapter / "adapter_model.safetensors")).items()
            if k.split(".")[-3] in cfg["target_modules"]}
    save_file(kept, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    return folder


def mistakes(adapter: Path) -> dict[str, dict]:
    """The mistakes a LoRA forward can make, each as a change to the adapter's config."""
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    targets = cfg["target_modules"]
    rule = "alpha / r, not alpha / sqrt(r)" if cfg["use_rslora"] else "alpha / sqrt(r), not alpha / r"
    return {f"scaling {rule}": {"use_rslora": not cfg["use_rslora"]}} | {
        f"{t} left out": {"target_modules": [o for o in targets if o != t]} for t in targets if len(targets) > 1}


def record_variant(case: str, variant: str, base: Path, root: Path) -> dict:
    adapter = lora_adapters.make_variant(case, variant, root / f"{case}-{variant}")
    model = load_adapted(base, adapter)
    prompts = draw_prompts(case, model)
    ids = [full_ids(r) for r in prompts]
    runs = [logprobs(model, x)[1] for x in ids]
    base_model = load(base)
    runs64 = [logprobs(load_adapted(base, adapter, torch.float64), x)[1] for x in ids]
    merged = load_adapted(base, adapter).merge_and_unload()
    assert not any(isinstance(m, LoraLayer) for m in merged.modules())
    effects = {}
    for i, (name, change) in enumerate(mistakes(adapter).items()):
        wrong = load_adapted(base, edited(adapter, root / f"{case}-{variant}-{i}", change))
        effects[name] = max_diff(runs, [logprobs(wrong, x)[1] for x in ids])
    return {
        "adapter": lora_adapters.VARIANTS[variant],
        "adapter_config": json.loads((adapter / "adapter_config.json").read_text()),
        "adapter_sha256": lora_adapters.adapter_checksum(adapter),
        "scaling": next(m for m in model.modules() if isinstance(m, LoraLayer)).scaling["default"],  # PEFT's
        "effect_size": max_diff(runs, [logprobs(base_model, x)[1] for x in ids]),
        "max_abs_diff": {
            "float64_logprobs": max_diff(runs, runs64),
            "merged_logprobs": max_diff(runs, [logprobs(merged, x)[1] for x in ids]),
        },
        "mistake_effects": effects,
        "prompts": prompts,
    }


def record_case(case: str, root: Path) -> dict:
    base = families.make_model(case, root / case)
    return {
        "case": case, "made_by": "tests/make_lora_reference.py",
        "transformers": transformers.__version__, "torch": torch.__version__, "peft": peft.__version__,
        "dtype": "float32", "attn_implementation": "eager",
        "weights_sha256": families.weights_checksum(base),
        "variants": {v: record_variant(case, v, base, root) for v in lora_adapters.VARIANTS},
    }


def check_variants(case: str, record: dict) -> None:
    """Assert that every planted mistake moves the logprobs well above the comparison's
    tolerance, and say how large each adapter's effect is."""
    for name, v in record["variants"].items():
        weak = {k: x for k, x in v["mistake_effects"].items() if x < MIN_EFFECT}
        assert not weak, f"{case} {name}: mistakes barely change the logprobs: {weak}"
        print(f"{case} {name}: effect {v['effect_size']:.3g}, max diffs {v['max_abs_diff']}, "
              f"smallest mistake {min(v['mistake_effects'].values()):.3g}")


def main():
    record_cases(__doc__, record_case, check_variants, OUT)

if __name__ == "__main__":
    main()
