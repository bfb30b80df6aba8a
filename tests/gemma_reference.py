"""Write tests/data/gemma3_270m_greedy.json: the tokens Hugging Face transformers generates
greedily from weights/gemma-3-270m (`python -m nano.default_model gemma-3-270m` makes it),
the numbers tests/test_gemma3.py checks nano's forward against.

Run by hand in a side environment with torch, transformers and gguf (nano needs none of them;
see tests/make_family_reference.py):

    ~/nano-refenv/bin/python tests/gemma_reference.py [--gguf FILE]

For each prompt: its token ids (transformers' tokenizer of the folder, BOS first), then STEPS
greedy steps by full forwards in float32 (eos does not stop them), and the smallest gap
between the top two logits over those steps (a gap near float32 rounding would make the
comparison fragile). With --gguf (the GGUF the folder was converted from) it first checks
the conversion: transformers loading the GGUF itself must compute the same logits and
tokenize TEXTS the same as the folder (and as nano's tokenizer).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from nano.tokenizer import Tokenizer  # noqa: E402

FOLDER = ROOT / "weights" / "gemma-3-270m"
OUT = ROOT / "tests" / "data" / "gemma3_270m_greedy.json"
STEPS = 32
TURN = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"  # Gemma's chat format
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    TURN.format("What is the capital of France?"),
    TURN.format("Write a haiku about autumn."),
    # 783 tokens: past the 512-key window of the sliding layers, so they drop its first keys
    "".join(f"Day {i}: the weather was {['sunny', 'rainy', 'windy', 'cold'][i * 7 % 4]}. " for i in range(1, 80)),
]
TEXTS = PROMPTS + [
    "  leading spaces", "trailing   ", "a\nb\n\nc\n\n\n", "tabs\tand\ttabs", "1234567890 3.14159 1e-6",
    "naïve café résumé", "日本語のテキスト", "emoji 😀🎉👍🏽", "Привет мир", "مرحبا بالعالم", "한국어 텍스트",
    "<bos>already", "<unk> <pad> <mask>", "[multimodal]", "a  b   c    d", "  \n  \n", "\x00\x01 control",
    "http://example.com/a?b=c&d=e", '{"json": [1, 2, 3]}', "C++ && || != ==", "x" * 100, "", " ", "\n",
]


def greedy(model, ids: list[int]) -> tuple[list[int], float]:
    out, gap = [], float("inf")
    with torch.no_grad():
        for _ in range(STEPS):
            logits = model(torch.tensor([ids + out])).logits[0, -1]
            top = torch.topk(logits, 2).values
            gap = min(gap, float(top[0] - top[1]))
            out.append(int(logits.argmax()))
    return out, gap


def check_gguf(gguf: Path, model, tok) -> None:
    """transformers' own reading of the GGUF against the converted folder."""
    g_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    nano_tok = Tokenizer(FOLDER)
    differ = [t for t in TEXTS if not g_tok(t).input_ids == tok(t).input_ids == nano_tok.encode(t)]
    print(f"tokenizers: {len(TEXTS) - len(differ)}/{len(TEXTS)} texts the same; differ: {differ}")
    g_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([tok(p).input_ids])
            a, b = g_model(ids).logits, model(ids).logits
            print(f"logits max |GGUF - folder| {float((a - b).abs().max()):.3g} "
                  f"(max |logit| {float(b.abs().max()):.3g}) for {p!r:.40}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", type=Path, help="the GGUF file the folder was converted from")
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(FOLDER)
    model = AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32, attn_implementation="eager")
    if args.gguf:
        check_gguf(args.gguf, model, tok)
    records = []
    for p in PROMPTS:
        ids = tok(p).input_ids
        out, gap = greedy(model, ids)
        records.append({"prompt": p, "prompt_ids": ids, "greedy_ids": out, "min_top2_gap": round(gap, 4),
                        "text": tok.decode(out)})
        print(f"{p!r:.50} -> {tok.decode(out)!r} (min top-2 gap {gap:.3g})")
    OUT.write_text(dump({"model": FOLDER.name, "steps": STEPS, "dtype": "float32", "prompts": records}))
    print(f"wrote {OUT}")


def dump(data: dict) -> str:
    """JSON with a line per prompt, so that a diff shows which prompt changed."""
    head = json.dumps({k: v for k, v in data.items() if k != "prompts"}, ensure_ascii=False)[:-1]
    prompts = ",\n  ".join(json.dumps(p, ensure_ascii=False) for p in data["prompts"])
    return f'{head}, "prompts": [\n  {prompts}\n]}}\n'


if __name__ == "__main__":
    main()
