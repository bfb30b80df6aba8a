"""Write tests/data/families/<case>.json: what Hugging Face transformers computes for each tiny
model of tests/families.py, the numbers nano's forward of each family is checked against.

Run by hand, in a side environment outside the repository: neither nano nor its tests need
torch or transformers (torch==2.13.0 is pinned to a CPU build: plain `torch` pulls a CUDA
build of several GB).

    python3 -m venv ~/nano-refenv
    ~/nano-refenv/bin/pip install torch==2.13.0 transformers safetensors tokenizers numpy
    ~/nano-refenv/bin/python tests/make_family_reference.py            # every case
    ~/nano-refenv/bin/python tests/make_family_reference.py mistral    # or some

For each case it makes the folder, loads it (float32, eager attention) and checks that
transformers reads it as meant: every tensor used, no tensor missing, and the config's v5
spelling read as the same numbers as its v4 spelling and the same logits. For each prompt
(token ids drawn from the seed, lengths PROMPT_LENGTHS, the longest past every sliding window)
it records the log-probability of each prompt token given its prefix (null for the first),
then STEPS greedy steps by full forwards (eos does not stop them): each step's token, its
log-probability and the top TOP log-probabilities. A prompt whose greedy steps come near a
tie (top-1 minus top-2 logit below MIN_GAP, which float32 rounding could break either way) is
drawn again. Also recorded: the largest difference from the same model in float64 (how tight
a comparison the numbers allow), from decoding with transformers' KV cache, and the effect of
each feature the case is there for (its logprobs with that feature changed: a number far
above the comparison's tolerance says the data catch a forward that gets it wrong).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.numpy import save_file
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests import families  # noqa: E402

OUT = Path(__file__).resolve().parent / "data" / "families"
PROMPT_LENGTHS = (5, 20, 48)
STEPS, TOP, MIN_GAP = 16, 5, 1e-3
DIGITS = 7  # significant digits kept: float32 holds about 7
MIN_EFFECT = 1e-3  # ten times the 1e-4 a float32 forward is held to


def _without_qk_norms(name: str, tensor):
    """Every tensor but Qwen3's q_norm and k_norm weights (dropped)."""
    return None if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")) else tensor


def _swapped_norm(name: str, tensor):
    """Qwen3's k_norm weight where its q_norm is and the other way round; other tensors as they are."""
    for this, other in (("q_norm", "k_norm"), ("k_norm", "q_norm")):
        if name.endswith(f"self_attn.{this}.weight"):
            return families.weights("qwen3")[name.replace(this, other)]
    return tensor


# Each case's features, as changes to its v4 config (or a pair: that and a change to its
# tensors, as variant() takes them): the model with one changed must compute other logprobs.
FEATURES = {
    "llama": {"rope_theta 1e4 -> 1e6": {"rope_theta": 1e6}},
    "llama3": {"no rope_scaling": {"rope_scaling": None}},
    "qwen2": {"no q/k/v biases": ({}, lambda name, tensor: 0 * tensor if name.endswith(".bias") else tensor),
              "sliding_window honoured": {"use_sliding_window": True, "max_window_layers": 0}},
    "qwen3": {"rope_theta 1e6 -> 1e4": {"rope_theta": 1e4},
              # transformers' Llama forward on the same weights less the norms: Qwen3's without them
              "no q/k norms": ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, _without_qk_norms),
              "q_norm and k_norm swapped": ({}, _swapped_norm)},
    "mistral": {"sliding_window 16 -> 15": {"sliding_window": 15},
                "sliding_window 16 -> 17": {"sliding_window": 17},
                "no sliding window": {"sliding_window": None}},
    "gemma3_text": {"sliding_window 12 -> 11": {"sliding_window": 11},
                    "sliding_window 12 -> 13": {"sliding_window": 13},
                    "no sliding window (window 256)": {"sliding_window": 256},
                    "global layer 2 -> 3 (sliding_window_pattern 4)": {"sliding_window_pattern": 4},
                    "rope_local_base_freq 1e4 -> 1e6": {"rope_local_base_freq": 1e6},
                    "query_pre_attn_scalar 24 -> head_dim 32": {"query_pre_attn_scalar": 32},
                    "GELU exact, not tanh": {"hidden_activation": "gelu"}},
}


def load(folder: Path, dtype=torch.float32):
    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                       output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"{folder}: {problems}"
    return model.to(dtype).eval()


@torch.no_grad()
def logprobs(model, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(T, vocab) logits and log-softmax of one full causal forward, in float64."""
    logits = model(torch.tensor([ids])).logits[0].double()
    return logits.numpy(), torch.log_softmax(logits, -1).numpy()


@torch.no_grad()
def cached_logprobs(model, ids: list[int], prompt_len: int) -> np.ndarray:
    """Log-softmax rows of ids[prompt_len - 1:], the prompt prefilled then one token a step
    through transformers' cache (sliding-window layers keep only their window)."""
    out = model(torch.tensor([ids[:prompt_len]]), use_cache=True)
    rows, cache = [out.logits[0, -1]], out.cache
    for tok in ids[prompt_len:]:
        out = model(torch.tensor([[tok]]), cache=cache, use_cache=True)
        rows.append(out.logits[0, -1])
        cache = out.cache
    return torch.log_softmax(torch.stack(rows).double(), -1).numpy()


def greedy(model, prompt: list[int]) -> dict | None:
    """The prompt's record, or None if a greedy step comes within MIN_GAP of a tie."""
    ids = list(prompt)
    for _ in range(STEPS):
        logits, _ = logprobs(model, ids)
        ids.append(int(np.argmax(logits[-1])))
    logits, lp = logprobs(model, ids[:-1])
    rows = np.arange(len(prompt) - 1, len(ids) - 1)  # the rows that chose the greedy tokens
    top2 = np.sort(logits[rows], axis=-1)[:, -2:]
    gaps = top2[:, 1] - top2[:, 0]
    if gaps.min() < MIN_GAP:
        return None
    top = np.argsort(-lp[rows], axis=-1, kind="stable")[:, :TOP]
    return {"prompt_ids": prompt,
            "prompt_logprobs": [None] + [lp[t - 1, prompt[t]] for t in range(1, len(prompt))],
            "greedy_ids": ids[len(prompt):],
            "greedy_logprobs": [lp[r, ids[r + 1]] for r in rows],
            "top_ids": top.tolist(),
            "top_logprobs": np.take_along_axis(lp[rows], top, -1).tolist(),
            "top2_logit_gaps": gaps.tolist()}


def draw_prompts(case: str, model) -> list[dict]:
    """A prompt of each length, its ids drawn from the case's ordinary words (no special
    token); drawn again while its greedy steps near a tie."""
    cfg, specials = families.CASES[case]["config"], families.CASES[case]["specials"]
    words = np.array([i for i in range(cfg["vocab_size"]) if i not in specials])
    rng, records = np.random.default_rng(families.CASES[case]["seed"]), []
    for length in PROMPT_LENGTHS:
        for _ in range(20):
            record = greedy(model, rng.choice(words, length).tolist())
            if record:
                records.append(record)
                break
        else:
            raise RuntimeError(f"{case}: every prompt of length {length} nears a tie")
    return records


def full_ids(record: dict) -> list[int]:
    """The prompt and its greedy tokens but the last: what scores every recorded row."""
    return record["prompt_ids"] + record["greedy_ids"][:-1]


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def unchanged(name, tensor):
    return tensor


def variant(case: str, root: Path, name: str, change: dict, keep=unchanged) -> Path:
    """The case's folder with its v4 config updated by `change` and each tensor replaced by
    keep(name, tensor) (dropped where that is None)."""
    folder = families.make_model(case, root / name)
    (folder / "config.json").write_text(json.dumps(families.config(case) | change))
    kept = {k: keep(k, v) for k, v in families.weights(case).items()}
    save_file({k: v for k, v in kept.items() if v is not None}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return folder


def window_keys(case: str, root: Path, window: int) -> str:
    """Which keys a query at position p sees in a sliding layer, found by experiment: the
    model cut to its first layer (a sliding one), a token changed at p - W or p - W + 1 and
    the logits at p compared."""
    folder = variant(case, root, f"{case}_one_layer", {"num_hidden_layers": 1},
                     lambda name, tensor: None if name.startswith("model.layers.") and
                     not name.startswith("model.layers.0.") else tensor)
    model = load(folder)
    assert getattr(model.config, "layer_types", ["sliding_attention"])[0] == "sliding_attention"
    ids, p = list(range(10, 10 + window + 4)), window + 3

    def changes(position):
        changed = ids[:position] + [ids[position] + 1] + ids[position + 1:]
        return not np.allclose(logprobs(model, ids)[0][p], logprobs(model, changed)[0][p], atol=0, rtol=0)

    assert changes(p - window + 1)
    return "p-W..p" if changes(p - window) else "p-W+1..p"


def feature_effects(case: str, root: Path, prompts: list[dict], runs: list[np.ndarray]) -> dict:
    """For each of the case's FEATURES, the largest change to its logprobs when changed."""
    effects = {}
    for i, (name, change) in enumerate(FEATURES[case].items()):
        change, keep = change if isinstance(change, tuple) else (change, unchanged)
        model = load(variant(case, root, f"{case}_{i}", change, keep))
        effects[name] = max_diff(runs, [logprobs(model, full_ids(r))[1] for r in prompts])
    return effects


def record_case(case: str, root: Path) -> dict:
    folder = families.make_model(case, root / case)
    config = AutoConfig.from_pretrained(folder).to_dict()
    mismatched = {k: (v, config.get(k)) for k, v in families.config(case, "v5").items() if config.get(k) != v}
    assert not mismatched, f"{case}: transformers reads the v4 config as {mismatched} (key: ours, its)"
    model = load(folder)
    prompts = draw_prompts(case, model)
    runs = [logprobs(model, full_ids(r)) for r in prompts]
    v5 = load(families.make_model(case, root / f"{case}_v5", "v5"))
    model64 = load(folder, torch.float64)
    runs64 = [logprobs(model64, full_ids(r)) for r in prompts]
    cached = [cached_logprobs(model, full_ids(r), len(r["prompt_ids"])) for r in prompts]
    effects = feature_effects(case, root, prompts, [lp for _, lp in runs])
    window = families.config(case).get("sliding_window")
    honoured = window and families.config(case).get("use_sliding_window", True)
    return {
        "case": case, "architecture": config["architectures"][0],
        "made_by": "tests/make_family_reference.py",
        "transformers": transformers.__version__, "torch": torch.__version__,
        "dtype": "float32", "attn_implementation": "eager",
        "weights_sha256": families.weights_checksum(folder),
        "config": families.config(case),
        "config_v5": families.config(case, "v5"),
        "window_keys": window_keys(case, root, window) if honoured else None,
        "max_abs_diff": {
            "float64_logprobs": max_diff([lp for _, lp in runs], [lp for _, lp in runs64]),
            "float64_logits": max_diff([lg for lg, _ in runs], [lg for lg, _ in runs64]),
            "kv_cache_decode_logprobs": max_diff([lp[len(r["prompt_ids"]) - 1:] for r, (_, lp) in zip(prompts, runs)],
                                                 cached),
            "v5_spelling_logprobs": max_diff([lp for _, lp in runs], [logprobs(v5, full_ids(r))[1] for r in prompts]),
        },
        "feature_effects": effects,
        "prompts": prompts,
    }


def rounded(x):
    if isinstance(x, float):
        return float(f"{x:.{DIGITS}g}")
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [rounded(v) for v in x]
    return x


def dumps(record: dict) -> str:
    """Indented JSON with each list of numbers on one line: a few KB, readable in a diff."""
    text = json.dumps(rounded(record), indent=1)
    return re.sub(r"\[[^\[\]{}]*\]", lambda m: re.sub(r"\s+", " ", m.group()).replace("[ ", "[").replace(" ]", "]"),
                  text) + "\n"


def record_cases(doc: str, record_case, check, out: Path) -> None:
    """Record the cases the command line names (default: all) with record_case(case, tmp)
    into out/<case>.json, after check(case, record) has asserted what the data must show;
    doc's first paragraph is the command's description."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", help=f"some of {', '.join(families.CASES)} (default: all)")
    args = parser.parse_args()
    unknown = sorted(set(args.cases) - set(families.CASES))
    if unknown:
        print(f"error: no case {unknown[0]!r} (cases: {', '.join(families.CASES)})", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases or families.CASES:
            record = record_case(case, Path(tmp))
            check(case, record)
            path = out / f"{case}.json"
            path.write_text(dumps(record))
            print(f"{case}: {path.stat().st_size} bytes")


def check_features(case: str, record: dict) -> None:
    """Assert that each feature the case is there for moves the logprobs well above the
    comparison's tolerance, and say how far the data are from float64 and a KV cache."""
    effects = record["feature_effects"]
    weak = {k: v for k, v in effects.items() if v < MIN_EFFECT}
    assert not weak, f"{case}: features barely change the logprobs: {weak}"
    print(f"{case}: window {record['window_keys']}, max diffs {record['max_abs_diff']}, effects {effects}")


def main():
    record_cases(__doc__, record_case, check_features, OUT)

if __name__ == "__main__":
    main()
