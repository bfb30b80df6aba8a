"""nano's multi-LoRA forward against transformers + PEFT: each tiny model of tests/families.py
with each adapter of tests/lora_adapters.py, and what PEFT computed for exactly those weights
(tests/data/lora/<case>.json). For each family nano runs: every adapter's prompt logprobs and 16
greedy steps (tokens, logprobs, top 5) within 1e-4, the adapters and the base model in one batch
(the base's requests still equal tests/data/families), then again from the prefix cache, where
the blocks the base model and the other adapters computed for the same token ids must not be
read."""
import pytest

from nano.lora import LLM, LoRARequest
from nano.telemetry.metrics import metrics_of
from test_families import GREEDY, SCORING, SUPPORTED, check
from test_family_reference import reference as family_reference
from test_lora_data import reference
from tests import families, lora_adapters

MAX_RANK = max(v["rank"] for v in lora_adapters.VARIANTS.values())


def engine(case: str, root, **kw) -> tuple[LLM, dict]:
    """An engine for the case's model with every adapter at hand, and the adapters' requests."""
    llm = LLM(model=str(families.make_model(case, root / "base")), device="cpu", enable_lora=True,
              max_lora_rank=MAX_RANK, max_loras=len(lora_adapters.VARIANTS), **kw)
    requests = {name: LoRARequest(name, i + 1, str(lora_adapters.make_variant(case, name, root / name)))
                for i, name in enumerate(lora_adapters.VARIANTS)}
    return llm, requests


def runs(case: str, requests: dict) -> list[tuple[dict, LoRARequest | None]]:
    """(the recorded prompt, the adapter it was recorded with): every variant's, then the base
    model's (tests/data/families)."""
    out = [(ref, requests[name]) for name, v in reference(case)["variants"].items() for ref in v["prompts"]]
    return out + [(ref, None) for ref in family_reference(case)["prompts"]]


def check_outputs(pairs, outputs, scored: bool = True) -> None:
    for (ref, lora), out in zip(pairs, outputs, strict=True):
        scores = [None] + [score[0] for score in out.prompt_logprobs[1:]] if scored else None
        try:
            check(ref, out.token_ids, out.logits, scores)
        except AssertionError as e:
            raise AssertionError(f"adapter {lora.lora_name if lora else None}: {e}") from None


@pytest.mark.parametrize("case", SUPPORTED)
def test_every_adapter_and_the_base_in_one_batch(case, tmp_path):
    llm, requests = engine(case, tmp_path)
    pairs = runs(case, requests)
    outputs = llm.generate([ref["prompt_ids"] for ref, _ in pairs], SCORING, lora_request=[lora for _, lora in pairs])
    check_outputs(pairs, outputs)


@pytest.mark.parametrize("case", ["llama", "gemma3_text"])
def test_prefix_cache_per_adapter_and_chunked(case, tmp_path):
    """The recorded prompts are the same token ids under every adapter and the base. Scored
    first (a scoring request computes its prompt), their blocks are registered; then each runs
    again, greedy, in 4-token blocks and 7-token chunks: it may hit only the blocks its own
    adapter computed, and gets its own adapter's numbers."""
    llm, requests = engine(case, tmp_path, block_size=4, max_num_batched_tokens=7)
    pairs = runs(case, requests)
    prompts, loras = [ref["prompt_ids"] for ref, _ in pairs], [lora for _, lora in pairs]
    check_outputs(pairs, llm.generate(prompts, SCORING, lora_request=loras))
    metrics = metrics_of(llm.engine)
    hits = metrics.prefix_hits
    check_outputs(pairs, llm.generate(prompts, GREEDY, lora_request=loras), scored=False)
    assert metrics.prefix_hits - hits == sum((len(p) - 1) // 4 * 4 for p in prompts)
