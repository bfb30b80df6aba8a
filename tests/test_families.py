"""nano's forward of each model family against transformers: the tiny models of
tests/families.py, and what transformers computed for exactly those weights
(tests/data/families/<case>.json). For each family nano runs: the prompt logprobs and 16
greedy steps (tokens, logprobs, top 5) within TOL, whatever the schedule (alone, batched,
chunked, from the prefix cache, batch-invariant, under --tp 2) and whichever config.json
spelling. The other families are refused, one line naming the architecture, before any weights
load."""
import json
import shutil

import numpy as np
import pytest

from nano import invariant
from nano.config import ARCHITECTURES, ModelConfig
from nano.errors import NanoError
from nano.llm import LLM
from nano.sequence import SamplingParams
from nano.telemetry.metrics import metrics_of
from nano.weights import load_config
from test_family_reference import STEPS, TOP, reference
from test_tp import launch, needs_mpi
from tests import families

TOL = 1e-4       # float32 sums in another order than transformers' (its own float64 gap is ~2e-6)
SUPPORTED = ("llama", "llama3", "qwen2", "qwen3", "mistral", "gemma3_text")
SCORING = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, return_logits=True, prompt_logprobs=0)
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, return_logits=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(case, spelling) -> the case's model folder, made once."""
    made = {}

    def folder(case, spelling="v4"):
        if (case, spelling) not in made:
            made[case, spelling] = families.make_model(case, tmp_path_factory.mktemp(f"{case}-{spelling}"), spelling)
        return made[case, spelling]
    return folder


def log_softmax(logits) -> np.ndarray:
    rows = np.asarray(logits, dtype=np.float64)
    rows = rows - rows.max(axis=-1, keepdims=True)
    return rows - np.log(np.exp(rows).sum(axis=-1, keepdims=True))


def check(ref: dict, token_ids: list[int], logits: list, prompt_logprobs: list | None = None) -> None:
    """One prompt's outputs against its reference: the prompt logprobs when scored (None, then
    each token's), each greedy token, its logprob and the top TOP logprobs (the reference's top
    tokens read from nano's row, and nano's own best TOP: the same tokens but for a near-tie)."""
    if prompt_logprobs is not None:
        assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ref["prompt_ids"])
        np.testing.assert_allclose(prompt_logprobs[1:], ref["prompt_logprobs"][1:], rtol=0, atol=TOL,
                                   err_msg="prompt logprobs")
    assert token_ids == ref["greedy_ids"]
    rows = log_softmax(logits)
    assert rows.shape[0] == STEPS
    steps = np.arange(STEPS)
    np.testing.assert_allclose(rows[steps, ref["greedy_ids"]], ref["greedy_logprobs"], rtol=0, atol=TOL)
    np.testing.assert_allclose(np.take_along_axis(rows, np.array(ref["top_ids"]), 1), ref["top_logprobs"],
                               rtol=0, atol=TOL, err_msg="the reference's top tokens")
    np.testing.assert_allclose(-np.sort(-rows)[:, :TOP], ref["top_logprobs"], rtol=0, atol=TOL,
                               err_msg="nano's top tokens")


def check_all(case: str, outputs, scored: bool = True) -> None:
    for ref, out in zip(reference(case)["prompts"], outputs, strict=True):
        scores = [None] + [score[0] for score in out.prompt_logprobs[1:]] if scored else None
        check(ref, out.token_ids, out.logits, scores)


def test_the_supported_cases_are_the_architectures_nano_runs():
    """Every family with a case runs and is compared: a case added for a family nano does not
    run yet fails here until its forward lands."""
    runs = {case: cfg["config"]["architectures"][0] in ARCHITECTURES for case, cfg in families.CASES.items()}
    assert runs == {case: case in SUPPORTED for case in families.CASES}


@pytest.mark.parametrize("case", SUPPORTED)
def test_each_prompt_alone(case, folders):
    llm = LLM(model=str(folders(case)), device="cpu")
    check_all(case, [llm.generate([ref["prompt_ids"]], SCORING)[0] for ref in reference(case)["prompts"]])


@pytest.mark.parametrize("case", SUPPORTED)
@pytest.mark.parametrize("spelling", families.SPELLINGS)
def test_batched_with_other_requests_in_both_spellings(case, spelling, folders):
    """The reference prompts among others (sampled, their own lengths) in the same steps. The
    v5 spelling (rope_parameters) reads as the same ModelConfig, hence the same numbers."""
    folder = folders(case, spelling)
    assert ModelConfig.from_hf(load_config(folder)) == ModelConfig.from_hf(families.config(case))
    vocab, rng = families.CASES[case]["config"]["vocab_size"], np.random.default_rng(5)
    others = [rng.integers(3, vocab, n).tolist() for n in (9, 33, 2)]
    prompts = [ref["prompt_ids"] for ref in reference(case)["prompts"]]
    params = [SCORING] * len(prompts) + [SamplingParams(temperature=1.0, max_tokens=24, seed=1)] * len(others)
    outputs = LLM(model=str(folder), device="cpu").generate(prompts + others, params)
    check_all(case, outputs[:len(prompts)])


@pytest.mark.parametrize("case", SUPPORTED)
def test_chunked_prefill(case, folders):
    """A 7-token budget: every prompt but the shortest is prefilled over several steps."""
    prompts = [ref["prompt_ids"] for ref in reference(case)["prompts"]]
    assert sum(len(p) > 7 for p in prompts) == len(prompts) - 1
    check_all(case, LLM(model=str(folders(case)), device="cpu", max_num_batched_tokens=7).generate(prompts, SCORING))


@pytest.mark.parametrize("case", SUPPORTED)
def test_batch_invariant_mode(case, folders):
    """The batch-invariant op set (invariant.BATCH_INVARIANT: its own GEMMs and attention), the
    prompts batched."""
    llm = LLM(model=str(folders(case)), device="cpu", batch_invariant=True)
    assert llm.engine.runner.model.ops is invariant.BATCH_INVARIANT
    check_all(case, llm.generate([ref["prompt_ids"] for ref in reference(case)["prompts"]], SCORING))


@pytest.mark.parametrize("case", SUPPORTED)
def test_prefix_cache_hits(case, folders):
    """Each prompt a second time, its 4-token blocks read from the cache (a request that scores
    its prompt computes it, so the second run only generates)."""
    llm = LLM(model=str(folders(case)), device="cpu", block_size=4)
    prompts = [ref["prompt_ids"] for ref in reference(case)["prompts"]]
    check_all(case, llm.generate(prompts, SCORING))
    metrics = metrics_of(llm.engine)
    hits = metrics.prefix_hits
    check_all(case, llm.generate(prompts, GREEDY), scored=False)
    assert metrics.prefix_hits - hits == sum((len(p) - 1) // 4 * 4 for p in prompts)


@needs_mpi
def test_tp2(folders, tmp_path):
    """Every supported case under mpirun -n 2 (tests/tp_families.py), in one launch."""
    out = tmp_path / "tp2.json"
    proc = launch(["tests/tp_families.py", str(out), *(f"{case}={folders(case)}" for case in SUPPORTED)], 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert sorted(results) == sorted(SUPPORTED)
    for case in SUPPORTED:
        for ref, got in zip(reference(case)["prompts"], results[case], strict=True):
            check(ref, got["token_ids"], got["logits"], got["prompt_logprobs"])


def test_a_qwen3_folder_said_to_be_a_llama_is_refused(folders, tmp_path):
    """Its config.json edited to Llama's: its q/k norms are tensors the Llama forward would not
    read, so the folder is refused with one line rather than run without them."""
    folder = shutil.copytree(folders("qwen3"), tmp_path / "m")
    cfg = load_config(folder) | {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NanoError) as e:
        LLM(model=str(folder), device="cpu")
    assert str(e.value) == "checkpoint tensor model.layers.0.self_attn.k_norm.weight is not used by the Llama forward (5 more)"


@pytest.mark.parametrize("spelling", families.SPELLINGS)
def test_a_family_without_a_forward_is_refused(spelling, folders, tmp_path):
    """Gemma 2, the nearest family nano has no forward for (its soft-capped logits, its other
    norms), as a Gemma 3 folder relabelled: refused by name, one line, before any weights load."""
    folder = shutil.copytree(folders("gemma3_text", spelling), tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"")  # never read
    cfg = load_config(folder) | {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NanoError) as e:
        LLM(model=str(folder), device="cpu")
    message = str(e.value)
    assert message.startswith("config.json architectures ['Gemma2ForCausalLM'] is not one nano runs: it runs ")
    assert "\n" not in message
