"""speculation: what speculative decoding buys at one sequence at a time, against how many of
its drafts are right and how many it checks per step (k).

A step that checks k drafts runs k + 1 query rows for the sequence and keeps the drafts up to
the first one the model would not have sampled, plus the model's own token after them
(nano/engine.py, `_propose` and `_postprocess`). Decoding one sequence on a CPU reads every
weight once per step whatever the rows, so a step of k + 1 rows costs little more than a step
of one, and the speed-up is about the tokens a step yields.

To set the acceptance rate rather than hope for it, most runs use an oracle proposer on the
engine's proposer seam (`engine.proposer`): it drafts the greedy continuation, known from a
run without speculation, and replaces each draft token by a wrong one with probability
1 - accuracy (a fixed mask, the same in every run). Accuracy 0 is all cost and no gain;
accuracy 1 is k + 1 tokens a step. The n-gram proposer (nano/speculative) runs on the same
prompts for the points a real proposer reaches. Greedy, so every run must give exactly the
tokens of the run without speculation; the check requires it."""
import time

import numpy as np

from nano.chat.template import render
from nano.lab.experiment import Experiment, Size, engine, serve
from nano.sequence import SamplingParams
from nano.speculative import attach
from nano.telemetry.metrics import reset_metrics

ACCURACIES = (0.0, 0.5, 0.8, 1.0)  # at k = 4
KS = (1, 2, 4, 8)                  # at accuracy 0 and 1
SLACK = 0.05                       # neighbouring accuracies may tie within this (timing noise)

ASKS = ('Here is a JSON object:\n{\n  "id": 7,\n  "name": "Grace Hopper",\n  "email": "grace@example.com",\n'
        '  "city": "Arlington",\n  "active": false,\n  "tags": ["navy", "compilers"]\n}\n\n'
        'Repeat this JSON object exactly, but set active to true. Output only the JSON.',
        "Rename the function add_all to total in this code and show the whole code:\n\n"
        "def add_all(xs):\n    result = 0\n    for x in xs:\n        result = result + x\n    return result\n\n\n"
        "print(add_all([1, 2, 3]))\nprint(add_all([4, 5, 6]))\n",
        "Write a short story about a lighthouse keeper who finds a message in a bottle.")


class Oracle:
    """Drafts the known greedy continuation of each prompt, each token wrong where its mask says."""

    def __init__(self, references: dict, masks: dict, k: int, vocab: int):
        self.references, self.masks, self.k, self.vocab = references, masks, k, vocab

    def propose(self, seq) -> list[int]:
        key = tuple(seq.token_ids[:seq.num_prompt_tokens])
        ref, wrong, at = self.references[key], self.masks[key], seq.num_output_tokens
        drafts = ref[at:at + self.k]
        return [(t + 1) % self.vocab if wrong[at + j, j] else t for j, t in enumerate(drafts)]


def settings(size: Size) -> dict:
    return dict(max_tokens=64, reps=2) if size.quick else dict(max_tokens=64, reps=1)


def prompts_for(size: Size, eng) -> list:
    if size.quick:  # the tiny model: random ids (its chat template is not a real one)
        rng = np.random.default_rng(size.seed)
        return [rng.integers(3, eng.model_config.vocab_size, 32).tolist() for _ in range(2)]
    return [eng.tokenizer.encode(render(eng.tokenizer, ask)) for ask in ASKS]


def timed(eng, prompts: list, params: SamplingParams, reps: int):
    """The prompts one at a time (B = 1), the faster of reps runs: tokens per prompt, seconds, counts."""
    best = None
    for _ in range(reps):
        counts = reset_metrics(eng)  # nano/telemetry's counts of this run's drafts
        start, outputs = time.perf_counter(), []
        for p in prompts:
            outputs += [s.output_token_ids for s in serve(eng, [(p, params)])]
        seconds = time.perf_counter() - start
        if best is None or seconds < best[1]:
            best = outputs, seconds, (counts.spec_draft_tokens, counts.spec_accepted, counts.spec_drafts)
    return best


def run(size: Size) -> list[dict]:
    s = settings(size)
    eng = engine(size, enable_prefix_caching=False)  # every run computes its prompts afresh
    params = SamplingParams(temperature=0, max_tokens=s["max_tokens"], ignore_eos=size.quick)
    prompts = prompts_for(size, eng)
    attach(eng, {"method": "ngram", "num_speculative_tokens": max(KS)})  # warm the verify step's shapes
    serve(eng, [(prompts[0], SamplingParams(temperature=0, max_tokens=8))])
    attach(eng, None)
    references, off_s, _ = timed(eng, prompts, params, 2)  # every speed-up's base: the faster of two
    refs = {tuple(p): r for p, r in zip(prompts, references)}
    tokens = sum(len(r) for r in references)
    rng = np.random.default_rng(size.seed)
    noise = {key: rng.random((s["max_tokens"] + max(KS), max(KS))) for key in refs}

    rows = [{"proposer": "none", "k": 0, "accuracy": None, "tokens": tokens, "seconds": round(off_s, 3),
             "tokens_per_s": round(tokens / off_s, 1), "speedup": 1.0, "acceptance": None,
             "tokens_per_step": 1.0, "same_output": True}]
    runs = [("oracle", 4, a) for a in ACCURACIES] + [("oracle", k, a) for k in KS if k != 4 for a in (0.0, 1.0)]
    runs += [("ngram", k, None) for k in (2, 4, 8)]
    for proposer, k, accuracy in runs:
        if proposer == "oracle":
            masks = {key: n >= accuracy for key, n in noise.items()}
            eng.proposer = Oracle(refs, masks, k, eng.model_config.vocab_size)
        else:
            attach(eng, {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                         "prompt_lookup_min": 2})
        outputs, seconds, (drafts, accepted, verifies) = timed(eng, prompts, params, s["reps"])
        eng.proposer = None
        rows.append({"proposer": proposer, "k": k, "accuracy": accuracy, "tokens": tokens,
                     "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
                     "speedup": round(off_s / seconds, 3),
                     "acceptance": round(accepted / drafts, 3) if drafts else 0.0,
                     "tokens_per_step": round(1 + accepted / verifies, 2) if verifies else 1.0,
                     "same_output": outputs == references})
    return rows


def plot(rows: list[dict], fig) -> None:
    ax_acc, ax_k = fig.subplots(1, 2)
    oracle4 = sorted((r for r in rows if r["proposer"] == "oracle" and r["k"] == 4), key=lambda r: r["acceptance"])
    ax_acc.plot([100 * r["acceptance"] for r in oracle4], [r["speedup"] for r in oracle4], "o-",
                label="oracle drafts, k = 4 (accuracy 0 / 0.5 / 0.8 / 1)")
    for r in rows:
        if r["proposer"] == "ngram":
            ax_acc.scatter(100 * r["acceptance"], r["speedup"], marker="s", color="tab:orange", zorder=3,
                           label="n-gram lookup" if r is next(x for x in rows if x["proposer"] == "ngram") else None)
            ax_acc.annotate(f"k={r['k']}", (100 * r["acceptance"], r["speedup"]), fontsize=8,
                            textcoords="offset points", xytext=(4, -10))
    ax_acc.axhline(1, color="grey", lw=0.8, ls="--")
    ax_acc.set_xlabel("acceptance rate (accepted / draft tokens, %)")
    ax_acc.set_title("speed-up over no speculation (B = 1)", fontsize=10)
    ax_acc.legend(fontsize=8)
    for accuracy, style in ((1.0, "o-"), (0.0, "x--")):
        pick = sorted((r for r in rows if r["proposer"] == "oracle" and r["accuracy"] == accuracy), key=lambda r: r["k"])
        ax_k.plot([r["k"] for r in pick], [r["speedup"] for r in pick], style,
                  label=f"every draft {'right' if accuracy else 'wrong'}")
        if accuracy:
            ax_k.plot([r["k"] for r in pick], [r["tokens_per_step"] for r in pick], ":", color="grey",
                      label="tokens per step (the ceiling)")
    ax_k.axhline(1, color="grey", lw=0.8, ls="--")
    ax_k.set_xscale("log", base=2)
    ax_k.set_xticks(KS, [str(k) for k in KS])
    ax_k.set_xlabel("k (drafts checked per step)")
    ax_k.set_title("speed-up against k", fontsize=10)
    ax_k.legend(fontsize=8)


def check(rows: list[dict]) -> str | None:
    if not all(r["same_output"] for r in rows):
        bad = next(r for r in rows if not r["same_output"])
        return f"{bad['proposer']} k={bad['k']}: the greedy output changed with speculation"
    oracle = [r for r in rows if r["proposer"] == "oracle"]
    at4 = sorted((r for r in oracle if r["k"] == 4), key=lambda r: r["accuracy"])
    for low, high in zip(at4, at4[1:]):
        if not low["speedup"] < high["speedup"] * (1 + SLACK):
            return (f"k=4: speed-up {low['speedup']}x at acceptance {low['acceptance']} is above "
                    f"{high['speedup']}x at {high['acceptance']}")
    if not at4[0]["speedup"] < at4[-1]["speedup"]:
        return "k=4: every draft right is not faster than every draft wrong"
    right = sorted((r for r in oracle if r["accuracy"] == 1.0), key=lambda r: r["k"])
    for low, high in zip(right, right[1:]):
        if not low["speedup"] < high["speedup"]:
            return f"every draft right: speed-up at k={high['k']} ({high['speedup']}x) is not above k={low['k']}'s"
    for r in oracle:
        if r["accuracy"] == 0.0 and not r["speedup"] < 1:
            return f"k={r['k']}, every draft wrong: speed-up {r['speedup']}x, yet its steps only cost more"
        if not r["speedup"] < r["tokens_per_step"]:
            return f"k={r['k']}, accuracy {r['accuracy']}: speed-up {r['speedup']}x reaches the tokens per step"
    return None


EXPERIMENT = Experiment(
    name="speculation",
    claim="At one sequence at a time, speculation's speed-up grows with the acceptance rate and, when the "
          "drafts are right, with k, but stays below the tokens a verify step yields: a step of k + 1 rows "
          "costs more than a one-row decode (on the CPU several times: each GEMM repacks every weight, one "
          "row is a GEMV), so drafts that are all wrong make it slower; the output is the same.",
    varies="draft accuracy (an oracle proposer: 0, 0.5, 0.8, 1 at k = 4; 0 and 1 at k = 1, 2, 8) and "
           "the n-gram proposer at k = 2, 4, 8",
    fixed="the prompts (random ids at quick size; a JSON edit, a code rename and a story), greedy, "
          "max_tokens 64, one sequence at a time, prefix caching off",
    measures="output tokens/s (prefill included) against no speculation, acceptance rate "
             "(accepted / draft tokens), tokens per verify step, the outputs identical",
    run=run, plot=plot, check=check)
