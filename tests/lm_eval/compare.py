"""lm-evaluation-harness's per-choice log-likelihoods, from a run of its local-completions
model against nano's server (its --log_samples file), against the dense reference forward
(tests/reference.py) on the same token ids. By hand, not in CI (docs/server.md):

    python tests/lm_eval/compare.py SAMPLES.jsonl [MODEL_DIR]

It tokenizes each (context, continuation) as lm-eval's TemplateLM._encode_pair does (a
trailing space of the context moves to the continuation; the continuation's tokens are those
of context + continuation after the context's) and prints the largest difference and both
accuracies."""
import json
import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

TESTS = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(TESTS), str(TESTS.parent)]  # reference.py, and the nano it reads files with
from reference import DenseLlama  # noqa: E402


def encode_pair(tok: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False).ids
    ctx = tok.encode(context, add_special_tokens=False).ids
    return ctx, whole[len(ctx):]


def loglikelihood(dense: DenseLlama, ctx: list[int], cont: list[int]) -> float:
    logits = dense.logits(ctx + cont).astype(np.float64)[len(ctx) - 1:-1]
    logits -= logits.max(axis=1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return float(logp[np.arange(len(cont)), cont].sum())


def main(samples: str, model_dir: str = "weights/SmolLM2-135M-Instruct") -> None:
    tok, dense = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")), DenseLlama(model_dir)
    worst, right, ref_right, items = 0.0, 0, 0, 0
    for line in Path(samples).read_text().splitlines():
        sample = json.loads(line)
        args = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
        served = [float(r[0]) for r in sample["filtered_resps"]]
        ref = [loglikelihood(dense, *encode_pair(tok, c, x)) for c, x in args]
        worst = max(worst, *(abs(a - b) for a, b in zip(served, ref)))
        right += int(np.argmax(served)) == int(sample["target"])
        ref_right += int(np.argmax(ref)) == int(sample["target"])
        items += 1
    print(f"{items} items, {sum(1 for _ in args)} choices each: max |server - reference| = {worst:.2e}; "
          f"accuracy {right / items:.2f} (server), {ref_right / items:.2f} (reference)")


if __name__ == "__main__":
    main(*sys.argv[1:])
