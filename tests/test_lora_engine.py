"""LoRA adapters served by the engine: a mixed batch (several adapters and the base in one
step) equals each request alone, an adapter's merged weights give the same logits, the prefix
cache never serves one adapter's blocks to another, the distinct-adapter cap, preemption and
chunked prefill."""
import re

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from families import make_model
from nano.config import EngineConfig
from nano.engine import LLMEngine
from nano.errors import NanoError
from nano.lora import LLM, LoRARequest, attach, read_adapter
from nano.lora.peft import MODULES
from nano.sequence import SamplingParams
from test_lora_pool import CFG, make_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, return_logits=True)
PROMPTS = [[5, 17, 33, 9, 80, 81, 82, 3, 4, 100, 101, 102, 7, 8, 9, 10, 11, 12, 13],
           [40, 41, 42, 43], [5, 17, 33, 9, 80, 81, 82, 3, 4, 100, 101, 102, 7, 8, 9, 10, 11, 99]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model = make_model("llama", root / "llama")
    adapters = [make_adapter(root / "a1", seed=1, r=4, alpha=8),
                make_adapter(root / "a2", seed=2, r=3, alpha=3, use_rslora=True,
                             modules=("q_proj", "v_proj", "down_proj")),
                make_adapter(root / "a3", seed=3, r=8, alpha=4, modules=("o_proj", "gate_proj"))]
    return model, [LoRARequest(f"a{i + 1}", i + 1, str(f)) for i, f in enumerate(adapters)]


def engine(model, max_loras=2, **config):
    eng = LLMEngine(EngineConfig(model=str(model), device="cpu", num_blocks=64, **config))
    attach(eng, max_loras=max_loras, max_lora_rank=8)
    return eng


def run(eng, prompts, loras):
    seqs = eng.generate(prompts, GREEDY, lora_request=loras)
    return [(s.output_token_ids, np.stack(s.logits)) for s in seqs]


def merged(model, request, folder):
    """A copy of the base checkpoint with the adapter's scale * B A added to each weight."""
    adapter = read_adapter(request, CFG, 8)
    tensors = load_file(str(model / "model.safetensors"))
    for (layer, module), (a, b) in adapter.weights.items():
        name = f"model.layers.{layer}.{MODULES[module]}.{module}.weight"
        tensors[name] = tensors[name] + np.float32(adapter.scale) * b @ a
    folder.mkdir()
    for f in model.iterdir():
        if f.name != "model.safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_each_adapter_is_its_merged_weights(folders, tmp_path):
    model, loras = folders
    for lora in loras:
        [(tokens, logits)] = run(engine(model), PROMPTS[:1], lora)
        [(want_tokens, want)] = run(LLMEngine(EngineConfig(model=str(merged(
            model, lora, tmp_path / lora.lora_name)), device="cpu", num_blocks=64)), PROMPTS[:1], None)
        assert tokens == want_tokens
        np.testing.assert_allclose(logits, want, rtol=0, atol=1e-4)
    base = run(engine(model), PROMPTS[:1], None)
    assert not np.allclose(base[0][1], run(engine(model), PROMPTS[:1], loras[0])[0][1], atol=1e-2)


def test_a_mixed_batch_equals_each_request_alone(folders):
    """Decodes and prefill chunks of two adapters and the base share steps (max_loras 2): each
    request's tokens and logits are what it gets alone."""
    model, loras = folders
    mix = [loras[0], None, loras[1], loras[0], loras[1], None]
    prompts = [PROMPTS[i % 3] for i in range(6)]
    together = run(engine(model, max_num_batched_tokens=24), prompts, mix)
    for prompt, lora, (tokens, logits) in zip(prompts, mix, together):
        [(alone_tokens, alone)] = run(engine(model), [prompt], lora)
        assert tokens == alone_tokens
        np.testing.assert_allclose(logits, alone, rtol=0, atol=1e-4)


def test_the_prefix_cache_keeps_each_adapters_blocks_apart(folders):
    """The same prompt under a1, then a2, then the base: no block computed under one is served
    to another (each computes its whole prompt), while the same adapter again hits."""
    model, loras = folders
    eng = engine(model)
    prompt = PROMPTS[0]  # 19 tokens: one full block of 16
    firsts = []
    for lora in (loras[0], loras[1], None, loras[0]):
        [seq] = eng.generate([prompt], GREEDY, lora_request=lora)
        firsts.append((seq.num_cached_prompt_tokens, seq.logits[0]))
    assert [n for n, _ in firsts] == [0, 0, 0, 16]
    np.testing.assert_allclose(firsts[3][1], firsts[0][1], rtol=0, atol=1e-5)


def test_no_more_adapters_run_at_once_than_slots(folders):
    model, loras = folders
    eng = engine(model, max_loras=2)
    seen = []
    for i, lora in enumerate([loras[0], loras[1], loras[2], None, loras[2]]):
        eng.add_request(PROMPTS[i % 3], GREEDY, lora_request=lora)
    while eng.has_unfinished():
        eng.step()
        running = {s.lora for s in eng.unfinished() if s.status.value == "running"} - {None}
        seen.append(len(running))
    assert max(seen) == 2 and eng.runner.adapters.loads >= 3


def test_preemption_by_swap_and_recompute_keeps_the_output(folders):
    model, loras = folders
    mix = [loras[0], loras[1], None, loras[0]]
    # one block each when admitted, two each by the end: 5 blocks preempt someone
    prompts = [PROMPTS[0][:14], PROMPTS[2][:15], PROMPTS[1] * 3, PROMPTS[0][2:16]]
    want = run(engine(model), prompts, mix)
    for mode in ("swap", "recompute"):
        eng = LLMEngine(EngineConfig(model=str(model), device="cpu", num_blocks=5, preemption=mode))
        attach(eng, max_loras=2, max_lora_rank=8)
        preempted = []
        eng.observers.append(type("Watch", (), {
            "on_step": lambda self, plan, *_: preempted.extend(plan.preempted),
            "on_finish": lambda self, seq: None})())
        got = run(eng, prompts, mix)
        assert {p.mode for p in preempted} == {mode}
        for (tokens, logits), (want_tokens, want_logits) in zip(got, want):
            assert tokens == want_tokens
            np.testing.assert_allclose(logits, want_logits, rtol=0, atol=1e-4)


def test_a_lora_request_without_lora_enabled_is_refused(folders):
    model, loras = folders
    eng = LLMEngine(EngineConfig(model=str(model), device="cpu", num_blocks=16))
    with pytest.raises(NanoError, match="request 0: lora_request needs LoRA enabled"):
        eng.generate(PROMPTS[:1], GREEDY, lora_request=loras[0])
    with pytest.raises(NanoError, match="2 prompts but 1 lora_requests"):
        eng.generate(PROMPTS[:2], GREEDY, lora_request=[loras[0]])
    llm = LLM(str(model), enable_lora=True, max_loras=2, max_lora_rank=8, device="cpu",
              num_blocks=16)
    out = llm.generate(PROMPTS[:2], GREEDY, lora_request=[loras[0], None])
    assert [len(o.token_ids) for o in out] == [6, 6]
    with pytest.raises(NanoError, match="lora_request must be a LoRARequest"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request="a1")


def test_batch_invariant_adapters_are_bitwise_the_same_in_any_batch(folders):
    """With batch_invariant (the int8 KV pool's default on the CPU), the LoRA products go
    through the same 8-row GEMMs as the base projections: a request's logits are bitwise
    the same in a mixed batch as alone."""
    model, loras = folders
    mix = [loras[0], None, loras[1], loras[0], loras[1]]
    prompts = [PROMPTS[i % 3] for i in range(5)]
    together = run(engine(model, batch_invariant=True), prompts, mix)
    for prompt, lora, (tokens, logits) in zip(prompts, mix, together):
        [(alone_tokens, alone)] = run(engine(model, batch_invariant=True), [prompt], lora)
        assert tokens == alone_tokens
        np.testing.assert_array_equal(logits, alone)


def test_speculation_with_adapters_keeps_each_requests_tokens(folders):
    """n-gram drafts checked under each row's adapter: greedy tokens and logits as without
    speculation, with drafts checked and some accepted."""
    from nano.speculative import attach as speculate
    from nano.telemetry.metrics import Metrics
    model, loras = folders
    mix = [loras[0], None, loras[1], loras[0]]
    prompts = [[5, 6, 7, 8] * 5, [9, 10] * 8, [5, 6, 7, 8] * 4 + [9], [40, 41, 42] * 6]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, return_logits=True)
    want = engine(model).generate(prompts, params, lora_request=mix)
    eng = engine(model)
    speculate(eng, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    metrics = Metrics.attach(eng)
    got = eng.generate(prompts, params, lora_request=mix)
    assert metrics.spec_draft_tokens > 0
    for g, w in zip(got, want):
        assert g.output_token_ids == w.output_token_ids
        np.testing.assert_allclose(np.stack(g.logits), np.stack(w.logits), rtol=0, atol=1e-4)


def test_a_grammar_holds_under_an_adapter(folders, tiny_model):
    """A regex-constrained request with an adapter, beside the same without: each output is in
    the grammar's language, and the adapter still changes the draws (tests/reference.py's tiny
    model, whose byte-level tokenizer llguidance reads, has the adapters' shapes)."""
    from nano.structured import Vocabulary, compile_grammar
    _, loras = folders
    eng = engine(tiny_model)
    regex = r"(ab|c)[0-9]{2,4}-(x|yz)"
    grammar = compile_grammar(Vocabulary.of(eng.tokenizer, eng.model_config.vocab_size), "regex", regex)
    outputs = {}
    for seed in range(3):
        params = SamplingParams(temperature=1.0, max_tokens=20, seed=seed, logits_processor=grammar)
        for seq, lora in zip(eng.generate([[5, 6, 7]] * 2, params, lora_request=[loras[0], None]),
                             ("a1", None)):
            assert seq.finish_reason == "stop" and re.fullmatch(regex, eng.detokenize(seq))
            outputs.setdefault(lora, []).append(seq.output_token_ids)
    assert outputs["a1"] != outputs[None]
