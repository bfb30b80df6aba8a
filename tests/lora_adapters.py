"""LoRA adapters for the tiny models of tests/families.py, each made from a seed: the adapters
whose transformers + PEFT outputs are recorded in tests/data/lora/<case>.json (by
tests/make_lora_reference.py, run by hand; see docs/testing.md).

make_adapter(case, folder, seed, rank, alpha, targets) writes a folder as PEFT's
save_pretrained writes one: adapter_config.json, with every key PEFT 0.21 writes, and
adapter_model.safetensors, float32, under PEFT's saved names
(base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight, (rank, in_features), and
...lora_B.weight, (out_features, rank)). PEFT's own initialisation makes every B zero, an
adapter that changes nothing; here A and B are both normal draws, B scaled so that each
adapted projection's output moves by about DELTA of its base output, whatever the rank and
scaling: far above a float32 forward's 1e-4, yet the same model.

VARIANTS names the adapters the reference data cover, for every case: all seven projections
at rank 8, attention alone at rank 4 with use_rslora (scaling alpha / sqrt(r)), and the MLP
alone at an odd rank. adapter_checksum says which tensors a JSON was recorded from. merge
folds an adapter into its base model's weights, W + scaling * B @ A: a plain checkpoint that
computes what the adapter on the base computes, for a forward that knows no LoRA.

Imports nothing but NumPy, safetensors and the standard library: the tests import it in CI,
where there is no torch or PEFT."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from tests import families

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION + MLP  # the order their tensors are drawn in, layer by layer
DELTA = 0.5  # an adapted projection's change, relative to its base output

# Each variant: the seed of its tensors (drawn with the case's own seed), rank, lora_alpha,
# targets and use_rslora. Every scaling differs from 1 and from the other rule's (alpha / r
# against alpha / sqrt(r)), so a forward that scales wrongly is caught.
VARIANTS = {
    "all_r8": dict(seed=1, rank=8, alpha=16, targets=TARGETS),
    "attn_r4_rslora": dict(seed=2, rank=4, alpha=6, targets=ATTENTION, use_rslora=True),
    "mlp_r3": dict(seed=3, rank=3, alpha=5, targets=MLP),
}

# adapter_config.json as PEFT 0.21's save_pretrained writes it for a LoraConfig that sets
# r, lora_alpha, target_modules, use_rslora and task_type: every other key at PEFT's default.
PEFT_DEFAULTS = {
    "alora_invocation_tokens": None, "alpha_pattern": {}, "arrow_config": None, "auto_mapping": None,
    "bias": "none", "corda_config": None, "ensure_weight_tying": False, "eva_config": None,
    "exclude_modules": None, "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
    "kasa_config": None, "layer_replication": None, "layers_pattern": None, "layers_to_transform": None,
    "loftq_config": {}, "lora_bias": False, "lora_dropout": 0.0, "lora_ga_config": None,
    "megatron_config": None, "megatron_core": "megatron.core", "modules_to_save": None,
    "monteclora_config": None, "peft_type": "LORA", "peft_version": "0.21.2", "qalora_group_size": 16,
    "rank_pattern": {}, "revision": None, "target_parameters": None, "task_type": "CAUSAL_LM",
    "trainable_token_indices": None, "use_bdlora": None, "use_dora": False, "use_qalora": False,
    "velora_config": None,
}


def scaling(rank: int, alpha: float, use_rslora: bool = False) -> float:
    """What PEFT multiplies B @ A by: alpha / sqrt(r) with use_rslora, else alpha / r."""
    return alpha / rank ** 0.5 if use_rslora else alpha / rank


def adapter_config(rank: int, alpha: float, targets, use_rslora: bool = False, base_model: str = "") -> dict:
    """adapter_config.json's contents, keys sorted as PEFT writes them."""
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown or not targets:
        raise ValueError(f"targets must be some of {TARGETS}, got {list(targets)}")
    mine = {"base_model_name_or_path": base_model, "r": rank, "lora_alpha": alpha,
            "target_modules": list(targets), "use_rslora": use_rslora}
    return dict(sorted((PEFT_DEFAULTS | mine).items()))


def lora_names(layer: int, target: str) -> tuple[str, str]:
    """The saved names of one projection's A and B."""
    module = "self_attn" if target in ATTENTION else "mlp"
    prefix = f"base_model.model.model.layers.{layer}.{module}.{target}"
    return f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"


def base_name(name: str) -> str:
    """The base weight a saved A or B name adapts: model.layers.{i}.self_attn.q_proj.weight."""
    return name.removeprefix("base_model.model.").replace("lora_A.", "").replace("lora_B.", "")


def tensors(case: str, seed: int, rank: int, alpha: float, targets, use_rslora: bool = False,
            edit: dict | None = None) -> dict[str, np.ndarray]:
    """The adapter's tensors by saved name, for the case's model (edit: as in
    families.make_model). A: (rank, in) with std 1/sqrt(in), so A x is about as large as x's
    entries; B: (out, rank) with std DELTA / (scaling * sqrt(rank)), so that scaling * B A x is
    about DELTA times W x. float64 draws from (the case's seed, seed), rounded to float32."""
    cfg = families.CASES[case]["config"] | (edit or {})
    shapes = families._weight_shapes(cfg)
    rng = np.random.default_rng([families.CASES[case]["seed"], seed])
    b_std = DELTA / (scaling(rank, alpha, use_rslora) * rank ** 0.5)
    out = {}
    for layer in range(cfg["num_hidden_layers"]):
        for target in (t for t in TARGETS if t in targets):
            a_name, b_name = lora_names(layer, target)
            rows, cols = shapes[base_name(a_name)][0]
            out[a_name] = (rng.standard_normal((rank, cols)) * cols ** -0.5).astype(np.float32)
            out[b_name] = (rng.standard_normal((rows, rank)) * b_std).astype(np.float32)
    return out


def make_adapter(case: str, folder: Path, seed: int, rank: int, alpha: float, targets, use_rslora: bool = False,
                 base_model: str | None = None, edit: dict | None = None) -> Path:
    """Write the adapter into `folder` (made if missing) and return it. base_model: what
    base_model_name_or_path names (the case's name by default)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = adapter_config(rank, alpha, targets, use_rslora, case if base_model is None else base_model)
    (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(tensors(case, seed, rank, alpha, targets, use_rslora, edit),
              str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    return folder


def make_variant(case: str, variant: str, folder: Path, base_model: str | None = None) -> Path:
    """The case's adapter named `variant` (VARIANTS), written into `folder`."""
    return make_adapter(case, folder, base_model=base_model, **VARIANTS[variant])


def adapter_checksum(folder: Path) -> str:
    """sha256 of a folder's adapter tensors by content, as families.weights_checksum."""
    return families.weights_checksum(folder, "adapter_model.safetensors")


def merge(base: Path, adapter: Path, folder: Path) -> Path:
    """Copy the base model folder into `folder` with the adapter folded into its weights
    (float64 sums rounded to float32), as PEFT's merge_and_unload does, and return it."""
    folder = Path(folder)
    shutil.copytree(base, folder)
    cfg = json.loads((Path(adapter) / "adapter_config.json").read_text())
    scale = scaling(cfg["r"], cfg["lora_alpha"], cfg["use_rslora"])
    lora = load_file(str(Path(adapter) / "adapter_model.safetensors"))
    weights = load_file(str(folder / "model.safetensors"))
    for name, a in lora.items():
        if ".lora_A." in name:
            b = lora[name.replace(".lora_A.", ".lora_B.")]
            merged = weights[base_name(name)] + scale * (b.astype(np.float64) @ a.astype(np.float64))
            weights[base_name(name)] = merged.astype(np.float32)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
