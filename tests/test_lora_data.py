"""The recorded transformers + PEFT outputs (tests/data/lora/<case>.json, written by
tests/make_lora_reference.py) still belong to the models tests/families.py and the adapters
tests/lora_adapters.py make, and hold what a multi-LoRA forward's test will read from them.
No torch needed."""
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from nano.config import ModelConfig
from nano.lora import LoRARequest, read_adapter
from test_family_reference import check_prompts
from tests import families, lora_adapters
from tests.reference import DenseLlama

DATA = Path(__file__).resolve().parent / "data" / "lora"
TOL = 1e-4  # what a float32 forward is held to against the data
FAR = 100 * TOL  # the least an adapter, or a mistake in applying it, must move a log-probability


def reference(case: str) -> dict:
    return json.loads((DATA / f"{case}.json").read_text())


def test_every_case_has_its_data():
    assert sorted(p.stem for p in DATA.glob("*.json")) == sorted(families.CASES)
    for case in families.CASES:
        assert list(reference(case)["variants"]) == list(lora_adapters.VARIANTS), case


@pytest.mark.parametrize("case", families.CASES)
def test_data_were_recorded_from_the_adapters_made_now(case, tmp_path):
    """Changing a case's weights, or an adapter's tensors or config, without running the
    generator again fails here."""
    ref = reference(case)
    assert families.weights_checksum(families.make_model(case, tmp_path / "base")) == ref["weights_sha256"]
    for name, variant in ref["variants"].items():
        folder = lora_adapters.make_variant(case, name, tmp_path / name)
        assert lora_adapters.adapter_checksum(folder) == variant["adapter_sha256"], name
        assert json.loads((folder / "adapter_config.json").read_text()) == variant["adapter_config"], name
        assert variant["adapter"] == json.loads(json.dumps(lora_adapters.VARIANTS[name]))
        cfg = variant["adapter_config"]
        rule = lora_adapters.scaling(cfg["r"], cfg["lora_alpha"], cfg["use_rslora"])
        assert variant["scaling"] == pytest.approx(rule), "PEFT scaled by another rule"


@pytest.mark.parametrize("case", families.CASES)
def test_the_data_catch_a_wrong_adapter_forward(case):
    """Each adapter moves the log-probabilities far beyond the tolerance, and so does each
    mistake the generator tried (the other scaling rule, each target module left out), while
    float64 and PEFT's merged weights stay within it."""
    for name, variant in reference(case)["variants"].items():
        targets = variant["adapter_config"]["target_modules"]
        assert variant["effect_size"] > FAR, name
        assert len(variant["mistake_effects"]) == 1 + (len(targets) if len(targets) > 1 else 0)
        assert all(f"{t} left out" in variant["mistake_effects"] for t in targets if len(targets) > 1)
        assert min(variant["mistake_effects"].values()) > FAR, name
        assert all(v < TOL for v in variant["max_abs_diff"].values()), name
        check_prompts(variant["prompts"], families.CASES[case]["config"]["vocab_size"])


def test_the_variants_cover_ranks_scalings_and_target_subsets():
    variants = lora_adapters.VARIANTS.values()
    assert {v["rank"] % 2 for v in variants} == {0, 1}, "an odd rank and an even one"
    assert {v.get("use_rslora", False) for v in variants} == {False, True}
    assert {tuple(v["targets"]) for v in variants} >= {lora_adapters.TARGETS, lora_adapters.ATTENTION,
                                                       lora_adapters.MLP}
    for v in variants:
        rules = {lora_adapters.scaling(v["rank"], v["alpha"], rslora) for rslora in (False, True)}
        assert len(rules | {1.0}) == 3, "a scaling left out or the rules mixed up must show"


@pytest.mark.parametrize("case", ["qwen3", "gemma3_text"])
def test_adapter_folder_is_peft_s(case, tmp_path):
    """The names, shapes and dtype PEFT saves: A (rank, in_features), B (out_features, rank)
    of each targeted projection of each layer, float32, and its config's LoRA keys."""
    base = load_file(str(families.make_model(case, tmp_path / "base") / "model.safetensors"))
    folder = lora_adapters.make_adapter(case, tmp_path / "a", seed=7, rank=3, alpha=5,
                                        targets=("k_proj", "down_proj"), use_rslora=True)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    assert {k: cfg[k] for k in ("peft_type", "base_model_name_or_path", "r", "lora_alpha", "target_modules",
                                "use_rslora", "use_dora", "bias", "modules_to_save", "task_type")} == {
        "peft_type": "LORA", "base_model_name_or_path": case, "r": 3, "lora_alpha": 5,
        "target_modules": ["k_proj", "down_proj"], "use_rslora": True, "use_dora": False, "bias": "none",
        "modules_to_save": None, "task_type": "CAUSAL_LM"}
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    layers = families.CASES[case]["config"]["num_hidden_layers"]
    expected = {}
    for i in range(layers):
        for target, module in (("k_proj", "self_attn"), ("down_proj", "mlp")):
            out, inp = base[f"model.layers.{i}.{module}.{target}.weight"].shape
            prefix = f"base_model.model.model.layers.{i}.{module}.{target}"
            expected |= {f"{prefix}.lora_A.weight": (3, inp), f"{prefix}.lora_B.weight": (out, 3)}
    assert {k: v.shape for k, v in tensors.items()} == expected
    assert all(v.dtype == np.float32 and np.all(v != 0) for v in tensors.values()), "PEFT's zero B would do nothing"
    with pytest.raises(ValueError, match="embed_tokens"):
        lora_adapters.make_adapter(case, tmp_path / "b", seed=7, rank=3, alpha=5, targets=("embed_tokens",))


def log_softmax(logits) -> np.ndarray:
    rows = np.asarray(logits, dtype=np.float64)
    rows = rows - rows.max(axis=-1, keepdims=True)
    return rows - np.log(np.exp(rows).sum(axis=-1, keepdims=True))


def test_the_data_are_the_adapter_folded_into_the_weights(tmp_path):
    """The Llama case's data against tests/reference.py's dense forward of its weights with each
    adapter merged (W + scaling * B @ A): the LoRA product each name, shape and scaling rule
    stands for, read as a forward without LoRA would, agrees with PEFT's within TOL."""
    base = families.make_model("llama", tmp_path / "base")
    for name, variant in reference("llama")["variants"].items():
        adapter = lora_adapters.make_variant("llama", name, tmp_path / name)
        dense = DenseLlama(lora_adapters.merge(base, adapter, tmp_path / f"{name}-merged"))
        for ref in variant["prompts"]:
            ids = ref["prompt_ids"] + ref["greedy_ids"][:-1]
            rows = log_softmax(dense.logits(ids))
            n = len(ref["prompt_ids"])
            got = rows[np.arange(n - 1), ids[1:n]]
            np.testing.assert_allclose(got, ref["prompt_logprobs"][1:], rtol=0, atol=TOL, err_msg=name)
            steps = rows[n - 1:]
            assert steps.argmax(-1).tolist() == ref["greedy_ids"], name
            np.testing.assert_allclose(steps.max(-1), ref["greedy_logprobs"], rtol=0, atol=TOL, err_msg=name)


@pytest.mark.parametrize("case", families.CASES)
def test_nano_reads_each_adapter_as_peft_did(case, tmp_path):
    """nano's reader takes each folder as PEFT 0.21 writes it (every key of its config), with
    the scaling PEFT applied and every tensor where PEFT put it."""
    cfg = ModelConfig.from_hf(families.config(case))
    for i, (name, variant) in enumerate(reference(case)["variants"].items()):
        folder = lora_adapters.make_variant(case, name, tmp_path / name)
        adapter = read_adapter(LoRARequest(name, i + 1, str(folder)), cfg, 8)
        assert adapter.rank == variant["adapter_config"]["r"]
        assert adapter.scale == pytest.approx(variant["scaling"], rel=1e-6)  # 7 digits kept
        saved = load_file(str(folder / "adapter_model.safetensors"))
        assert len(adapter.weights) * 2 == len(saved)
        for (layer, module), (a, b) in adapter.weights.items():
            a_name, b_name = lora_adapters.lora_names(layer, module)
            assert np.array_equal(a, saved[a_name]) and np.array_equal(b, saved[b_name])
