"""The recorded transformers outputs (tests/data/families/<case>.json, written by
tests/make_family_reference.py) still belong to the models tests/families.py makes, and hold
what a forward's test will read from them. No torch needed."""
import json
from pathlib import Path

import numpy as np
import pytest

from tests import families

DATA = Path(__file__).resolve().parent / "data" / "families"
STEPS, TOP, MIN_GAP = 16, 5, 1e-3  # as make_family_reference.py records them


def reference(case: str) -> dict:
    return json.loads((DATA / f"{case}.json").read_text())


def test_every_case_has_its_data():
    assert sorted(p.stem for p in DATA.glob("*.json")) == sorted(families.CASES)


@pytest.mark.parametrize("case", families.CASES)
def test_data_were_recorded_from_the_models_made_now(case, tmp_path):
    """Changing a case's weights or config without running the generator again fails here."""
    ref = reference(case)
    assert families.weights_checksum(families.make_model(case, tmp_path)) == ref["weights_sha256"]
    assert json.loads((tmp_path / "config.json").read_text()) == ref["config"]
    assert ref["architecture"] == ref["config"]["architectures"][0]


@pytest.mark.parametrize("case", families.CASES)
def test_data_shapes(case):
    ref = reference(case)
    vocab, window = ref["config"]["vocab_size"], ref["config"].get("sliding_window")
    assert ref["prompts"] and all(
        v < 1e-4 for v in ref["max_abs_diff"].values()), "float32 must agree with float64 and the KV cache"
    if window and ref["config"].get("use_sliding_window", True):
        assert ref["window_keys"] == "p-W+1..p"
        assert max(len(p["prompt_ids"]) for p in ref["prompts"]) > window, "no prompt crosses the window"
    check_prompts(ref["prompts"], vocab)


def check_prompts(prompts: list[dict], vocab: int) -> None:
    """The prompt records (make_family_reference.greedy's) hold what a forward's test reads."""
    assert prompts
    for p in prompts:
        ids, lps = p["prompt_ids"], p["prompt_logprobs"]
        assert len(lps) == len(ids) and lps[0] is None and all(lp <= 0 for lp in lps[1:])
        assert len(p["greedy_ids"]) == len(p["greedy_logprobs"]) == len(p["top2_logit_gaps"]) == STEPS
        assert np.shape(p["top_ids"]) == np.shape(p["top_logprobs"]) == (STEPS, TOP)
        assert all(0 <= t < vocab for t in ids + p["greedy_ids"] + sum(p["top_ids"], []))
        assert [row[0] for row in p["top_ids"]] == p["greedy_ids"]
        assert [row[0] for row in p["top_logprobs"]] == p["greedy_logprobs"]
        assert all(np.all(np.diff(row) <= 0) for row in p["top_logprobs"]), "top log-probabilities not sorted"
        assert min(p["top2_logit_gaps"]) >= MIN_GAP, "a greedy step is a near-tie"


@pytest.mark.parametrize("case", families.CASES)
def test_tokenizer_fits_the_vocab(case, tmp_path):
    from tokenizers import Tokenizer

    folder = families.make_model(case, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert max(tok.get_vocab(with_added_tokens=True).values()) + 1 == tok.get_vocab_size() == cfg["vocab_size"]
    eos = json.loads((folder / "tokenizer_config.json").read_text())["eos_token"]
    assert tok.token_to_id(eos) in np.atleast_1d(cfg["eos_token_id"])
    assert tok.encode("w7 w42").ids == [7, 42]


@pytest.mark.parametrize("case", families.CASES)
def test_v5_spelling_is_the_one_transformers_read(case, tmp_path):
    """The generator checked that transformers reads config_v5 as the v4 config, number for
    number, and computes the same logprobs from it; a changed spelling fails here."""
    folder = families.make_model(case, tmp_path, "v5")
    assert json.loads((folder / "config.json").read_text()) == reference(case)["config_v5"]
    assert families.weights_checksum(folder) == reference(case)["weights_sha256"]
    with pytest.raises(ValueError):
        families.config(case, "v6")
