"""nano/lora: PEFT adapter folders read and checked (each refusal by name), each tensor-parallel
rank's share of an adapter, and the pool's two LRUs (host memory, device slots)."""
import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from families import config as family_config
from nano.config import ModelConfig
from nano.device import Device
from nano.errors import NanoError
from nano.lora import AdapterPool, LoRARequest, read_adapter
from nano.lora.peft import MODULES, TENSOR, expected_shapes
from nano.lora.pool import FUSED
from nano.tp import partition

CFG = ModelConfig.from_hf(family_config("llama"))  # 2 layers, hidden 64, 4 / 2 heads of 16


def make_adapter(folder, seed=0, r=4, alpha=8, modules=tuple(MODULES), cfg=CFG, **config):
    """A random PEFT LoRA folder for the tiny llama: adapter_config.json with these keys, and A
    and B for every module of every layer (nonzero B, unlike a fresh PEFT adapter)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    shapes, tensors = expected_shapes(cfg), {}
    for layer in range(cfg.num_layers):
        for module in modules:
            out, inp = shapes[module]
            name = TENSOR.format(layer=layer, block=MODULES[module], module=module, half="{}")
            tensors[name.format("A")] = rng.normal(0, 0.2, (r, inp)).astype(np.float32)
            tensors[name.format("B")] = rng.normal(0, 0.2, (out, r)).astype(np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(modules),
         "bias": "none", "use_dora": False, "modules_to_save": None, "lora_dropout": 0.05,
         "task_type": "CAUSAL_LM", **config}))
    return folder


def request(folder, name="a", lora_id=1):
    return LoRARequest(name, lora_id, str(folder))


def test_reads_each_module_and_scales_by_alpha_over_r(tmp_path):
    adapter = read_adapter(request(make_adapter(tmp_path / "a", r=4, alpha=8)), CFG, 16)
    assert adapter.rank == 4 and adapter.scale == 2.0
    assert len(adapter.weights) == CFG.num_layers * len(MODULES)
    a, b = adapter.weights[1, "k_proj"]
    assert a.shape == (4, 64) and b.shape == (32, 4)
    rslora = read_adapter(request(make_adapter(tmp_path / "b", r=4, alpha=8, use_rslora=True)),
                          CFG, 16)
    assert rslora.scale == 4.0  # alpha / sqrt(r)


@pytest.mark.parametrize("edit, named", [
    ({"use_dora": True}, "DoRA (use_dora=True)"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "lora_only"}, "trained biases"),
    ({"layers_to_transform": [0]}, "layers_to_transform"),
    ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
    ({"alpha_pattern": {"q_proj": 2}}, "alpha_pattern"),
    ({"some_new_feature": 3}, "some_new_feature"),
    ({"target_modules": ["q_proj", "lm_head"]}, "embedding / LM-head"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "embedding / LM-head"),
    ({"target_modules": ".*proj"}, "target_modules as a pattern"),
    ({"r": 32}, "rank 32 is above --max-lora-rank 16"),
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not LORA"),
])
def test_refuses_what_nano_does_not_implement_by_name(tmp_path, edit, named):
    folder = make_adapter(tmp_path / "a")
    config = json.loads((folder / "adapter_config.json").read_text()) | edit
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(NanoError, match="^LoRA adapter 'a': .*" + named.replace("(", r"\(")
                       .replace(")", r"\)").replace("*", r"\*").replace(".", r"\.")) as e:
        read_adapter(request(folder), CFG, 16)
    assert "\n" not in str(e.value)


def test_refuses_another_base_model_and_unused_tensors(tmp_path):
    other = ModelConfig.from_hf(family_config("llama3"))  # hidden 128
    folder = make_adapter(tmp_path / "a", cfg=other)
    with pytest.raises(NanoError, match="has shape .*another base model"):
        read_adapter(request(folder), CFG, 16)
    folder = make_adapter(tmp_path / "b")
    extra = {"base_model.model.lm_head.lora_A.weight": np.zeros((4, 64), np.float32)}
    from safetensors.numpy import load_file
    save_file(load_file(str(folder / "adapter_model.safetensors")) | extra,
              str(folder / "adapter_model.safetensors"))
    with pytest.raises(NanoError, match="lm_head.lora_A.weight is not one nano uses"):
        read_adapter(request(folder), CFG, 16)
    with pytest.raises(NanoError, match="no adapter_config.json"):
        read_adapter(request(tmp_path / "missing"), CFG, 16)


def product(pool, slot, layer, proj, x):
    """The pool's LoRA product for one slot: scale * x A^T B^T, (T, N)."""
    a, b = pool.layers[layer][proj]
    return pool.scales[slot] * (x @ a[slot].T) @ b[slot].T


@pytest.mark.parametrize("world", [2, 3])
def test_tensor_parallel_shares_add_up_to_the_whole_product(tmp_path, world):
    """Column-parallel qkv / gate_up: each rank's output rows; row-parallel o_proj / down: each
    rank's input columns, whose partial products sum (as the all-reduce sums them) to the
    whole."""
    cfg = ModelConfig.from_hf(family_config("llama") | {"num_key_value_heads": 4})
    req = request(make_adapter(tmp_path / "a", r=3, cfg=cfg))
    cpu = Device("cpu")
    whole = AdapterPool(cfg, partition(cfg, 0, 1), cpu, 2, 4)
    whole.resolve(req)
    whole.place(np.array([1], np.int32))
    ranks = []
    for rank in range(world):
        pool = AdapterPool(cfg, partition(cfg, rank, world), cpu, 2, 4)
        pool.resolve(req)
        pool.place(np.array([1], np.int32))
        ranks.append((pool, partition(cfg, rank, world)))
    rng = np.random.default_rng(0)
    d = cfg.head_dim
    for proj in FUSED:
        a, _ = whole.layers[1][proj]
        x = rng.normal(size=(5, a.shape[2])).astype(np.float32)
        full = product(whole, 0, 1, proj, x)
        if proj in ("o_proj", "down"):
            cols = [slice(p.q_heads.start * d, p.q_heads.stop * d) if proj == "o_proj" else p.inter
                    for _, p in ranks]
            summed = sum(product(pool, 0, 1, proj, x[:, c]) for (pool, _), c in zip(ranks, cols))
            np.testing.assert_allclose(summed, full, rtol=1e-5, atol=1e-5)
        else:
            parts = [product(pool, 0, 1, proj, x) for pool, _ in ranks]
            sizes = [len(range(p.shape[1])) for p in parts]
            assert sum(sizes) == full.shape[1]
            # each rank's outputs are its rows of each fused module, in module order
            q_rows = [slice(p.q_heads.start * d, p.q_heads.stop * d) for _, p in ranks]
            kv_rows = [slice(p.kv_heads.start * d, p.kv_heads.stop * d) for _, p in ranks]
            heights = ([cfg.num_heads * d] + [cfg.num_kv_heads * d] * 2 if proj == "qkv"
                       else [cfg.intermediate_size] * 2)
            slices = ([q_rows, kv_rows, kv_rows] if proj == "qkv" else [[p.inter for _, p in ranks]] * 2)
            for rank, part in enumerate(parts):
                top, wanted = 0, []
                for height, per_rank in zip(heights, slices):
                    wanted.append(full[:, top:top + height][:, per_rank[rank]])
                    top += height
                np.testing.assert_allclose(part, np.concatenate(wanted, axis=1), rtol=1e-5,
                                           atol=1e-5)


def test_zero_padding_keeps_the_product_of_a_smaller_rank(tmp_path):
    req = request(make_adapter(tmp_path / "a", r=3, alpha=6))
    pool = AdapterPool(CFG, partition(CFG, 0, 1), Device("cpu"), 2, 8)
    pool.resolve(req)
    assert pool.place(np.array([-1, 1, 1], np.int32)).tolist() == [-1, 0, 0]
    adapter = read_adapter(req, CFG, 8)
    x = np.random.default_rng(1).normal(size=(4, 64)).astype(np.float32)
    a_q, b_q = adapter.weights[0, "q_proj"]
    want = 2.0 * (x @ a_q.T) @ b_q.T
    np.testing.assert_allclose(product(pool, 0, 0, "qkv", x)[:, :64], want, rtol=1e-5, atol=1e-6)


def test_slots_are_least_recently_used_and_never_evict_the_steps_own(tmp_path):
    pool = AdapterPool(CFG, partition(CFG, 0, 1), Device("cpu"), 2, 4, max_cpu_loras=3)
    for i in (1, 2, 3):
        pool.resolve(request(make_adapter(tmp_path / str(i), seed=i), f"a{i}", i))
    assert len(pool.host) == 3
    first = pool.place(np.array([1, 2], np.int32)).tolist()
    assert sorted(first) == [0, 1] and pool.loads == 2
    assert pool.place(np.array([2, 1, -1], np.int32)).tolist() == [first[1], first[0], -1]
    assert pool.loads == 2  # resident: nothing copied again
    pool.place(np.array([1], np.int32))  # 2, loaded after 1, is now the least recently used
    slots = pool.place(np.array([3], np.int32)).tolist()
    assert slots == [first[1]] and set(pool.slots) == {1, 3} and pool.loads == 3
    # 1 is the least recently used now, but this step runs it: 2 takes 3's slot
    assert pool.place(np.array([1, 2], np.int32)).tolist() == [first[0], first[1]]
    assert set(pool.slots) == {1, 2} and pool.loads == 4
    slots = pool.place(np.array([3], np.int32)).tolist()
    with pytest.raises(RuntimeError, match="3 adapters for 2 slots"):
        pool.place(np.array([1, 2, 3], np.int32))
    # the slot it holds computes 3's product, not the evicted adapter's
    x = np.ones((1, 64), np.float32)
    a3, b3 = read_adapter(pool.known[3], CFG, 4).weights[0, "v_proj"]
    got = product(pool, slots[0], 0, "qkv", x)[:, 64 + 32:]
    np.testing.assert_allclose(got, 2.0 * (x @ a3.T) @ b3.T, rtol=1e-5, atol=1e-6)


def test_host_memory_keeps_max_cpu_loras_and_reads_an_evicted_one_again(tmp_path):
    pool = AdapterPool(CFG, partition(CFG, 0, 1), Device("cpu"), 1, 4, max_cpu_loras=2)
    for i in (1, 2, 3):
        pool.resolve(request(make_adapter(tmp_path / str(i), seed=i), f"a{i}", i))
    assert list(pool.host) == [2, 3]
    pool.place(np.array([1], np.int32))  # read from its folder again
    assert list(pool.host) == [3, 1]
    with pytest.raises(NanoError, match="--max-cpu-loras .1. must be at least --max-loras .2."):
        AdapterPool(CFG, partition(CFG, 0, 1), Device("cpu"), 2, 4, max_cpu_loras=1)


def test_an_id_and_a_name_each_name_one_adapter(tmp_path):
    pool = AdapterPool(CFG, partition(CFG, 0, 1), Device("cpu"), 2, 4)
    a, b = make_adapter(tmp_path / "a"), make_adapter(tmp_path / "b", seed=1)
    pool.resolve(request(a, "a", 1))
    pool.resolve(request(a, "a", 1))  # the same again is fine
    with pytest.raises(NanoError, match="lora_int_id 1 is adapter 'a'"):
        pool.resolve(request(b, "b", 1))
    with pytest.raises(NanoError, match="'a' is already lora_int_id 1"):
        pool.resolve(request(b, "a", 2))
    with pytest.raises(NanoError, match="lora_int_id must be"):
        pool.resolve(LoRARequest("c", 0, str(b)))
    with pytest.raises(NanoError, match="lora_request must be a LoRARequest"):
        pool.resolve({"lora_name": "a"})


def test_a_retired_adapter_frees_its_name_and_is_forgotten_after_its_sequences(tmp_path):
    """A server's unload: retire frees the name for another folder while the old adapter still
    loads into a slot for the sequences that use it; forget then drops its host copy and slot."""
    pool = AdapterPool(CFG, partition(CFG, 0, 1), Device("cpu"), 1, 4, max_cpu_loras=2)
    old = pool.resolve(request(make_adapter(tmp_path / "old"), "a", 1))
    pool.retire(1)
    new = pool.resolve(request(make_adapter(tmp_path / "new", seed=1), "a", 2))  # the name, another folder
    pool.host.clear()  # dropped from host memory: a slot load reads the retired folder again
    assert pool.place(np.array([1], np.int32)).tolist() == [0] and list(pool.host) == [old.lora_int_id]
    pool.forget(1)
    assert 1 not in pool.host and 1 not in pool.slots and 1 not in pool.leaving
    assert pool.place(np.array([2], np.int32)).tolist() == [0] and pool.known == {2: new}
