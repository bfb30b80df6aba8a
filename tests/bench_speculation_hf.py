"""Reference timing of Hugging Face transformers' own prompt-lookup decoding.

For each prompt in a JSONL file ({"name", "kind", "prompt"}, prompt already chat-formatted),
this runs greedy generation at batch size 1 twice: plain `generate(...)` and
`generate(..., prompt_lookup_num_tokens=4)`, each after one untimed warm-up, on the CPU in
float32 with 2 threads. It records per prompt the output tokens, seconds and tok/s of both,
whether the two outputs are identical, and the totals (sum tokens / sum seconds); it prints
a markdown table and writes everything as JSON. It gives the number nano's own n-gram
speculation is compared against.

It runs in a separate environment that has torch and transformers; neither is ever a
dependency of nano. Prompts are tokenized with add_special_tokens=False (the text already
carries the <|im_start|> markers); nano's tokenizer gives the same ids for these prompts.

    python tests/bench_speculation_hf.py --model weights/SmolLM2-135M-Instruct \
        --prompts tests/data/copy_prompts.jsonl --max-tokens 128 --out result.json
"""
import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def timed(model, ids, max_tokens, **kw):
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, **kw)
    return out[0, ids.shape[1]:].tolist(), time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="weights/SmolLM2-135M-Instruct")
    ap.add_argument("--prompts", default="tests/data/copy_prompts.jsonl")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--lookup", type=int, default=4, help="prompt_lookup_num_tokens")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    rows = []
    for line in open(args.prompts):
        p = json.loads(line)
        ids = torch.tensor([tok(p["prompt"], add_special_tokens=False).input_ids])
        res = {"name": p["name"], "kind": p.get("kind", ""), "prompt_tokens": ids.shape[1]}
        for mode, kw in (("plain", {}), ("lookup", {"prompt_lookup_num_tokens": args.lookup})):
            timed(model, ids, args.max_tokens, **kw)  # warm-up
            out, secs = timed(model, ids, args.max_tokens, **kw)
            res[mode] = {"tokens": len(out), "seconds": round(secs, 4),
                         "tok_s": round(len(out) / secs, 2), "ids": out}
        res["identical"] = res["plain"]["ids"] == res["lookup"]["ids"]
        rows.append(res)
        print(f"{p['name']}: {res['plain']['tok_s']} -> {res['lookup']['tok_s']} tok/s", flush=True)

    total = {m: round(sum(r[m]["tokens"] for r in rows) / sum(r[m]["seconds"] for r in rows), 2)
             for m in ("plain", "lookup")}
    total["ratio"] = round(total["lookup"] / total["plain"], 3)
    total["identical"] = sum(r["identical"] for r in rows)
    print("\n| prompt | kind | tokens | plain tok/s | lookup tok/s | ratio | identical |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['kind']} | {r['plain']['tokens']} | {r['plain']['tok_s']} "
              f"| {r['lookup']['tok_s']} | {r['lookup']['tok_s'] / r['plain']['tok_s']:.2f} "
              f"| {r['identical']} |")
    print(f"| **total** | | | {total['plain']} | {total['lookup']} | {total['ratio']} "
          f"| {total['identical']}/{len(rows)} |")
    meta = {"model": args.model, "prompts": args.prompts, "max_tokens": args.max_tokens,
            "prompt_lookup_num_tokens": args.lookup, "threads": 2, "dtype": "float32",
            "torch": torch.__version__, "transformers": __import__("transformers").__version__}
    with open(args.out, "w") as f:  # one prompt per line keeps the file small and diffable
        f.write(f'{{"meta": {json.dumps(meta)},\n "total": {json.dumps(total)},\n "prompts": [\n')
        f.write(",\n".join(json.dumps(r) for r in rows) + "\n]}\n")


if __name__ == "__main__":
    main()
