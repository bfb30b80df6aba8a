"""What an int8 KV cache costs in accuracy, per key scheme, against the same engine with a
full-precision cache (float32 on the CPU, float16 on a GPU):

    python tests/kv_accuracy.py [--device cpu|gpu] [--model DIR] [--tokens-per-text N]

Teacher-forced: each evaluation text (nano/corpus.py: English prose shipped with Python,
different topics from the ones the "channel" scheme calibrates on) is fed through the
model in chunks of CHUNK tokens, each chunk a prefill over the blocks of the ones before,
with logits at every position. Every query therefore attends to cached K/V only, the
chunk's own included, exactly as decode steps read the pool; an int8 run quantizes each
token once when it is written and reads it back quantized ever after.
Per scheme, over every scored position (each text's tokens but the last):
  KLD     mean KL(p_full || p_int8) of the next-token distributions, nats
  top-1   fraction of positions whose most likely next token is the same
  PPL     perplexity of the text's actual next tokens; delta relative to full precision
Then greedy answers (chat template, 64 tokens) to prompts.txt, full precision vs each scheme.
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from nano.chat.template import render as render_chat  # noqa: E402
from nano.cli.output import describe  # noqa: E402
from nano.config import EngineConfig  # noqa: E402
from nano.corpus import EVALUATION_TOPICS, english_text  # noqa: E402
from nano.engine import LLMEngine  # noqa: E402
from nano.kv_cache import KEY_SCHEMES  # noqa: E402
from nano.model import ForwardBatch  # noqa: E402
from nano.sequence import SamplingParams  # noqa: E402

CHUNK = 256
PROMPTS = Path(__file__).resolve().parent.parent / "prompts.txt"


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits - logits.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def teacher_forced(engine: LLMEngine, token_ids: np.ndarray):
    """Log-probabilities (n - 1, V) of the next token at every position but the last, from
    chunked prefills into blocks 0.. of the engine's (idle) pool."""
    xp, bs, n = engine.device.xp, engine.config.block_size, len(token_ids)
    tables = xp.asarray(np.arange(-(-n // bs), dtype=np.int32)[None])
    out = []
    for start in range(0, n - 1, CHUNK):
        end = min(start + CHUNK, n - 1)
        positions = np.arange(start, end, dtype=np.int32)
        batch = ForwardBatch(
            input_ids=xp.asarray(token_ids[start:end]), positions=xp.asarray(positions),
            slot_mapping=xp.asarray(positions), num_decodes=0, context_lens=xp.asarray([end], np.int32),
            block_tables=tables, cu_seqlens_q=xp.asarray([0, end - start], np.int32),
            logits_indices=xp.asarray(np.arange(end - start, dtype=np.int32)))
        logits = engine.runner.forward(batch)
        out.append(log_softmax(engine.device.to_host(logits).astype(np.float32)))
    return np.concatenate(out)


def greedy(engine: LLMEngine, prompts: list[str]) -> list[str]:
    chat = [render_chat(engine.tokenizer, p) for p in prompts]
    seqs = engine.generate(chat, SamplingParams(temperature=0, max_tokens=64))
    return [engine.detokenize(s) for s in seqs]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--tokens-per-text", type=int, default=1536)
    args = p.parse_args()
    runs = [("full precision", {})] + [(f"int8, {s} keys", dict(kv_cache_dtype="int8", kv_int8_keys=s))
                                       for s in KEY_SCHEMES]
    prompts = [line.strip() for line in PROMPTS.read_text().splitlines() if line.strip()]
    texts, results, answers = None, {}, {}
    for name, kw in runs:
        start = time.perf_counter()
        engine = LLMEngine(EngineConfig(model=args.model, device=args.device, **kw))
        if texts is None:
            texts = [np.asarray(engine.tokenizer.encode(english_text(t))[:args.tokens_per_text], np.int32)
                     for t in EVALUATION_TOPICS]
        results[name] = [teacher_forced(engine, ids) for ids in texts]
        answers[name] = greedy(engine, prompts)
        print(f"{name}: {describe(engine).splitlines()[0]}; {time.perf_counter() - start:.0f} s", file=sys.stderr)
        del engine

    base = results["full precision"]
    targets = [ids[1:] for ids in texts]
    scored = sum(len(t) for t in targets)

    def ppl(logps):
        nll = -np.concatenate([lp[np.arange(len(t)), t] for lp, t in zip(logps, targets)])
        return float(np.exp(nll.mean()))

    base_ppl = ppl(base)
    print(f"\n{len(texts)} texts ({', '.join(EVALUATION_TOPICS)}), {scored} scored positions, "
          f"full-precision PPL {base_ppl:.3f}\n")
    print("| KV cache | mean KLD | top-1 agreement | PPL | delta PPL |")
    print("|---|---|---|---|---|")
    for name, _ in runs[1:]:
        kld = np.concatenate([(np.exp(b) * (b - q)).sum(axis=-1) for b, q in zip(base, results[name])])
        top1 = np.concatenate([b.argmax(-1) == q.argmax(-1) for b, q in zip(base, results[name])])
        q_ppl = ppl(results[name])
        print(f"| {name} | {kld.mean():.2e} | {100 * top1.mean():.2f}% | {q_ppl:.3f} | "
              f"{100 * (q_ppl - base_ppl) / base_ppl:+.2f}% |")

    print("\nGreedy answers (64 tokens), full precision vs int8:")
    for i, prompt in enumerate(prompts):
        print(f"\n[{i}] {prompt}\n  full precision: {answers['full precision'][i]!r}")
        for name, _ in runs[1:]:
            same = "same" if answers[name][i] == answers["full precision"][i] else "differs"
            print(f"  {name} ({same}): {answers[name][i]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
