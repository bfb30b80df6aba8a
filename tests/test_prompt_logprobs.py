"""Prompt logprobs (SamplingParams.prompt_logprobs): the engine scores a prompt's tokens
from the logits of its prefill rows, whatever the schedule (chunked prefill, a prefix-cache
hit, preemption by recompute, a disaggregated handoff), and the figures are the dense
reference forward's log-softmax (tests/reference.py)."""
import numpy as np
import pytest

from nano.config import EngineConfig
from nano.engine import LLMEngine
from nano.errors import NanoError
from nano.sequence import SamplingParams
from nano.telemetry.metrics import Metrics
from test_equivalence import CONFIGS, shared_prefix_prompts

TOL = 1e-4  # float32 logits summed in another order than the reference's
TOP = 4


def reference(dense, prompt: list[int]) -> np.ndarray:
    """(len(prompt) - 1, V) log-softmax of the dense forward's rows before the last."""
    logits = dense.logits(prompt)[:-1].astype(np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))


def check_scores(dense, prompt: list[int], scores: list, k: int = TOP) -> None:
    """scores: Sequence.prompt_logprobs, against the reference, every position once."""
    assert scores[0] is None, "the first token has no logprob"
    assert len(scores) == len(prompt), f"{len(scores)} entries for a prompt of {len(prompt)} tokens"
    ref = reference(dense, prompt)
    for i, (logprob, rank, top) in enumerate(scores[1:], 1):
        row, token = ref[i - 1], prompt[i]
        assert abs(logprob - row[token]) <= TOL, f"position {i}: {logprob} vs {row[token]}"
        assert rank == 1 + int((row > row[token]).sum()), f"position {i}: rank {rank}"
        assert [t for t, _ in top] == np.argsort(-row)[:k].tolist(), f"position {i}: top tokens"
        assert np.allclose([lp for _, lp in top], np.sort(row)[::-1][:k], atol=TOL)


def scoring(max_tokens: int = 4, k: int = TOP) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=k)


SCHEDULES = {**{name: CONFIGS[name] for name in ("default", "chunked_prefill", "no_prefix_caching",
                                                 "preempt_swap", "preempt_recompute")},
             "preempt_recompute_chunked": {**CONFIGS["preempt_recompute"], "max_num_batched_tokens": 8}}


@pytest.mark.parametrize("name", SCHEDULES)
def test_prompt_logprobs_are_the_dense_log_softmax(tiny_model, tiny_dense, name):
    """Shared prefixes (prefix-cache hits for requests that do not score), a token budget of 7
    (a prompt scored over many chunks), pools small enough to preempt by swap and by
    recompute (a recomputed prompt is scored once, even one preempted halfway)."""
    prompts = shared_prefix_prompts(512, np.random.default_rng(3))
    engine = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu", **SCHEDULES[name]))
    metrics = Metrics.attach(engine)
    preempt, scored_when_preempted = engine.scheduler._preempt, []

    def watched(seq, out):
        if seq.params.prompt_logprobs is not None:
            scored_when_preempted.append((len(seq.prompt_logprobs), seq.num_prompt_tokens))
        preempt(seq, out)
    engine.scheduler._preempt = watched
    # Half score their prompt; the other half, plain, share the prefixes with them.
    params = [scoring(max_tokens=24) if i % 2 else SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]
    seqs = engine.generate(prompts, params)
    for prompt, seq in zip(prompts, seqs):
        if seq.params.prompt_logprobs is not None:
            check_scores(tiny_dense, prompt, seq.prompt_logprobs)
        assert seq.output_token_ids == tiny_dense.greedy(prompt, 24)  # sampling is untouched
    if name.startswith("preempt"):
        assert set(metrics.preemptions) == {name.split("_")[1]} and scored_when_preempted
    if name == "preempt_recompute_chunked":  # a scoring request preempted with its prompt half scored
        assert any(1 < scored < prompt for scored, prompt in scored_when_preempted), scored_when_preempted


def test_a_warm_prefix_cache_does_not_drop_the_scores(tiny_model, tiny_dense):
    """The prompt's blocks are cached (by a plain request, then by a scoring one): a scoring
    request skips the prefix cache for what it has not scored, and scores every token."""
    prompt = np.random.default_rng(4).integers(3, 512, 70).tolist()
    engine = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu"))
    metrics = Metrics.attach(engine)
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=2))
    for _ in range(2):
        hits = metrics.prefix_hits
        [seq] = engine.generate([prompt], scoring())
        check_scores(tiny_dense, prompt, seq.prompt_logprobs)
        assert seq.num_cached_tokens == 0 and metrics.prefix_hits == hits
    [plain] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=2))
    assert plain.num_cached_tokens == 64  # the scoring requests' blocks serve the others


def test_max_tokens_zero_scores_the_prompt_only(tiny_model, tiny_dense):
    prompt = np.random.default_rng(5).integers(3, 512, 30).tolist()
    engine = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu", max_num_batched_tokens=8))
    [seq, one] = engine.generate([prompt, prompt[:1]], scoring(max_tokens=0, k=0))
    assert seq.output_token_ids == [] and seq.finish_reason == "length" and seq.first_token_time is None
    check_scores(tiny_dense, prompt, seq.prompt_logprobs, k=0)
    assert one.prompt_logprobs == [None] and one.output_token_ids == []
    with pytest.raises(NanoError, match=r"max_tokens must be an integer in \[1"):
        engine.generate([prompt], SamplingParams(max_tokens=0))  # without prompt_logprobs: nothing to do


def test_top_k_is_capped_by_the_vocabulary(tiny_model, tiny_dense):
    prompt = [5, 6, 7, 8]
    [seq] = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu")).generate([prompt], scoring(k=10**6))
    check_scores(tiny_dense, prompt, seq.prompt_logprobs, k=512)


def test_prompt_logprobs_cross_a_disaggregated_handoff(tiny_model, tiny_dense):
    """Scored on the prefill instance, carried with the sequence to the decode instance."""
    from test_disagg import assert_no_leaks, cluster, serve, tiny_config
    prompts = shared_prefix_prompts(512, np.random.default_rng(6), n=4)
    config = tiny_config(tiny_model)
    nodes = cluster([config], [config])
    results = serve(nodes, prompts, [scoring(max_tokens=6)] * 3 + [scoring(max_tokens=0)])
    for prompt, seq in zip(prompts, results):
        check_scores(tiny_dense, prompt, seq.prompt_logprobs)
    assert [len(s.output_token_ids) for s in results] == [6, 6, 6, 0]
    assert_no_leaks(nodes)
