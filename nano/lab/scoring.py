"""How far one engine's next-token distributions are from another's, teacher-forced on real
English text: the measure of the kv-quant and gqa experiments.

Each evaluation text (english_text: English prose shipped with Python, so nothing is
downloaded) is fed through the model in chunks of CHUNK tokens, each chunk a prefill over
the blocks of the ones before, with logits at every position. Every query therefore
attends to cached K/V only, its own chunk's included, as decode steps read the pool: an int8 pool quantizes each token once, when it is written,
and every later query reads it back quantized. Over every scored position (each text's
tokens but the last):
  KLD     mean KL(p_reference || p) of the next-token distributions, nats
  top-1   fraction of positions whose most likely next token is the same
  PPL     perplexity of the text's actual next tokens
"""
from pathlib import Path

import numpy as np

from nano.chat.template import render as render_chat
from nano.model import ForwardBatch
from nano.sequence import SamplingParams

CHUNK = 256
EVALUATION_TOPICS = ("execmodel", "import", "customization")
PROMPTS = Path(__file__).resolve().parents[2] / "prompts.txt"  # the checkout's example prompts


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits - logits.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def english_text(topic: str) -> str:
    """One topic of the language reference that ships with Python (pydoc_data, the text
    behind help()), whatever the running Python ships."""
    from pydoc_data.topics import topics  # 0.5 MB of text: loaded only when asked for
    return topics[topic]


def evaluation_texts(tokenizer, tokens_per_text: int) -> list[np.ndarray]:
    """The first tokens_per_text ids of each evaluation topic's text."""
    return [np.asarray(tokenizer.encode(english_text(t))[:tokens_per_text], np.int32) for t in EVALUATION_TOPICS]


def teacher_forced(engine, token_ids: np.ndarray) -> np.ndarray:
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
        logits = engine.forward(batch)
        out.append(log_softmax(engine.device.to_host(logits).astype(np.float32)))
    return np.concatenate(out)


def score(engine, texts: list[np.ndarray]) -> list[np.ndarray]:
    """The engine's teacher-forced log-probabilities on each text."""
    return [teacher_forced(engine, ids) for ids in texts]


def perplexity(logps: list[np.ndarray], texts: list[np.ndarray]) -> float:
    nll = -np.concatenate([lp[np.arange(len(ids) - 1), ids[1:]] for lp, ids in zip(logps, texts)])
    return float(np.exp(nll.mean()))


def compare(reference: list[np.ndarray], other: list[np.ndarray], texts: list[np.ndarray]) -> dict:
    """KLD, top-1 agreement and perplexity of `other` against `reference` (log-probs per text)."""
    kld = np.concatenate([(np.exp(r) * (r - o)).sum(axis=-1) for r, o in zip(reference, other)])
    top1 = np.concatenate([r.argmax(-1) == o.argmax(-1) for r, o in zip(reference, other)])
    return {"kld": float(kld.mean()), "kld_p99": float(np.percentile(kld, 99)), "top1": float(top1.mean()),
            "ppl": perplexity(other, texts), "positions": int(len(kld))}


def greedy_answers(engine, max_tokens: int) -> list[list[int]]:
    """Greedy answers to prompts.txt (in the model's chat template when it has one)."""
    prompts = [line.strip() for line in PROMPTS.read_text().splitlines() if line.strip()]
    if engine.tokenizer.chat_template is not None:
        prompts = [render_chat(engine.tokenizer, p) for p in prompts]
    seqs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    return [s.output_token_ids for s in seqs]
