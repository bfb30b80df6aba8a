"""The engine computes the same function however it schedules the work.

Greedy tokens and teacher-forced logits must match a plain dense forward pass
(tests/reference.py, no paging) with prefix caching on or off, with a token
budget small enough to force chunked prefill, and with a KV pool small enough
to force preemption by swap and by recompute.
"""
import numpy as np
import pytest

from nano.chat.template import render as render_chat
from nano.config import EngineConfig
from nano.engine import LLMEngine
from nano.sequence import SamplingParams
from nano.telemetry.metrics import Metrics, metrics_of
from nano.tokenizer import Tokenizer
from reference import DenseLlama, make_random_model

# float32 everywhere; the engine sums attention in a different order (paged, chunked),
# so logits agree to rounding: relative to the logit scale, 1e-4 is ~100x the noise seen.
LOGIT_RTOL = 1e-4

CHAT = ["What is the capital of France?", "Name three colours.",
        "Why is the sky blue?", "Write a haiku about autumn."]


def run(model_dir, prompts, max_tokens, **engine_args):
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", **engine_args))
    Metrics.attach(engine)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, return_logits=True)
    seqs = engine.generate(prompts, params)
    return engine, seqs


def check_against_dense(dense, prompts, seqs):
    for prompt, seq in zip(prompts, seqs):
        out = seq.output_token_ids
        assert out == dense.greedy(prompt, len(out)), f"greedy tokens differ for seq {seq.seq_id}"
        ref = dense.logits(prompt + out[:-1])[-len(out):]
        got = np.stack(seq.logits)
        scale = np.abs(ref).max()
        assert np.abs(got - ref).max() <= LOGIT_RTOL * scale


def shared_prefix_prompts(vocab, rng, n=6, prefix_len=37):
    prefix = rng.integers(3, vocab, prefix_len).tolist()
    return [prefix + rng.integers(3, vocab, int(rng.integers(1, 20))).tolist() for _ in range(n)]


CONFIGS = {
    "default": {},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "chunked_prefill": {"max_num_batched_tokens": 7},
    "one_at_a_time": {"max_num_seqs": 1},
    "preempt_swap": {"num_blocks": 12, "watermark": 0.0, "preemption": "swap"},
    "preempt_recompute": {"num_blocks": 12, "watermark": 0.0, "preemption": "recompute"},
    "preempt_auto_chunked": {"num_blocks": 12, "watermark": 0.0, "max_num_batched_tokens": 16},
}


@pytest.mark.parametrize("name", CONFIGS)
def test_tiny_model_matches_dense(tiny_model, tiny_dense, name):
    rng = np.random.default_rng(1)
    prompts = shared_prefix_prompts(512, rng)
    engine, seqs = run(tiny_model, prompts, max_tokens=24, **CONFIGS[name])
    check_against_dense(tiny_dense, prompts, seqs)
    m = metrics_of(engine)
    if name.startswith("preempt"):
        assert sum(m.preemptions.values()) > 0
    if name in ("preempt_swap", "preempt_recompute"):
        assert set(m.preemptions) == {name.removeprefix("preempt_")}
    if name == "chunked_prefill":  # admitted after the first prompt's prefix blocks were computed
        assert m.prefix_hits > 0
    if name == "no_prefix_caching":
        assert m.prefix_hits == 0


def test_prefix_cache_hits_across_requests(tiny_model, tiny_dense):
    """A second batch finds the first batch's blocks, freed but still cached."""
    rng = np.random.default_rng(2)
    prompts = shared_prefix_prompts(512, rng, n=3, prefix_len=50)
    engine = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu"))
    metrics = Metrics.attach(engine)
    params = SamplingParams(temperature=0, max_tokens=8, return_logits=True)
    engine.generate(prompts, params)
    hits_before = metrics.prefix_hits
    seqs = engine.generate(prompts, params)
    assert metrics.prefix_hits - hits_before >= 3 * 48  # three full blocks per prompt
    check_against_dense(tiny_dense, prompts, seqs)


@pytest.mark.parametrize("name", ["default", "chunked_prefill", "preempt_swap", "preempt_recompute"])
def test_default_model_matches_dense(default_model, default_dense, name):
    tok = Tokenizer(default_model)
    prompts = [tok.encode(render_chat(tok, p)) for p in CHAT]
    args = dict(CONFIGS[name])
    if name.startswith("preempt"):
        args["num_blocks"] = 14  # 4 prompts of ~40 tokens + 12 generated need 16
    _, seqs = run(default_model, prompts, max_tokens=12, **args)
    check_against_dense(default_dense, prompts, seqs)


@pytest.mark.parametrize("variant", [dict(bias=True, tie=False), dict(dtype="bfloat16"),
                                     dict(dtype="float16", kv_heads=1), dict(kv_heads=4)])
def test_checkpoint_variants_match_dense(tmp_path, variant):
    """q/k/v biases (Qwen2) and a separate LM head, bfloat16 / float16 files, MQA and MHA."""
    model_dir = make_random_model(tmp_path, seed=5, **variant)
    prompts = shared_prefix_prompts(512, np.random.default_rng(3), n=3)
    _, seqs = run(model_dir, prompts, max_tokens=10, max_num_batched_tokens=16)
    check_against_dense(DenseLlama(model_dir), prompts, seqs)
