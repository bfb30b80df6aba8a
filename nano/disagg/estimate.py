"""How many prefill and decode instances a workload needs (run.py --capacity --disagg).

From the step-time model (cost_model.py: t = c0 + c_p x prompt tokens + c_d x decodes +
c_ctx x their context tokens), fitted here on this machine's real steps of the workload's
mean prompt (calibrate), for prompts of Lp tokens and outputs of Lo tokens:

  a prefill instance spends   W_P = ceil(Lp / chunk) x c0 + c_p x Lp   seconds per request,
                              so it serves C_P = 1 / W_P requests/s
  a decode instance running b sequences steps in T(b) = c0 + b x (c_d + c_ctx x (Lp + Lo / 2)),
                              each request needs Lo - 1 of them, so it serves
                              C_D = b / ((Lo - 1) x T(b)) requests/s
  at the largest b that fits its KV pool, --max-num-seqs and, if given, T(b) <= --tpot-slo.

The pools balance when P x C_P = D x C_D: P:D = C_D : C_P. At a rate R, each pool's load
is R / (P x C_P) and R / (D x C_D); the split sustains at most min(P x C_P, D x C_D).
The model is linear: it misses prefill attention's growth with the square of the prompt
and the interference of instances sharing a machine's memory system; docs/disaggregation.md compares
its estimate with a measured run.
"""
from dataclasses import dataclass

import numpy as np

from nano.sequence import SamplingParams


def calibrate(engine, prompt_len: int, output_len: int) -> np.ndarray:
    """The step-time model fitted on this engine's steps of the workload's shape: two
    prompts of prompt_len tokens, each decoded by four requests at once (the prefix cache
    shares the prompt), with outputs of 1/4 .. 4/4 of output_len, so decode steps of 8
    down to 1 sequences at about that context. Returns the coefficients."""
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    prompts, params = [], []
    for _ in range(2):
        prompt = rng.integers(0, vocab, prompt_len).tolist()
        for k in range(1, 5):
            prompts.append(prompt)
            params.append(SamplingParams(max_tokens=max(2, output_len * k // 4), ignore_eos=True, seed=k))
    engine.generate(prompts, params)
    return engine.cost.coefficients


@dataclass
class SplitEstimate:
    prompt_len: float
    output_len: float
    prefill_seconds: float       # W_P: one request's prefill on one instance
    prefill_capacity: float      # C_P, requests/s per prefill instance
    decode_batch: int            # b
    decode_step: float           # T(b), seconds
    decode_capacity: float       # C_D, requests/s per decode instance
    batch_limit: str             # what capped b
    coef: tuple                  # the step-time model (cost_model.StepCoefficients): c0, c_p, c_d, c_ctx

    @property
    def ratio(self) -> float:
        """Prefill instances per decode instance that balance the pools."""
        return self.decode_capacity / self.prefill_capacity

    def split_for(self, rate: float) -> tuple[int, int]:
        """The fewest instances of each kind that keep up with `rate`."""
        return max(1, int(np.ceil(rate / self.prefill_capacity))), max(1, int(np.ceil(rate / self.decode_capacity)))


def estimate(coef, prompt_len: float, output_len: float, chunk: int, num_blocks: int, block_size: int,
             max_num_seqs: int, tpot_slo: float | None = None) -> SplitEstimate:
    c0, cp, cd, cctx = (float(c) for c in coef)
    prefill = np.ceil(prompt_len / chunk) * c0 + cp * prompt_len
    context = prompt_len + output_len / 2

    def step(b):
        return c0 + b * (cd + cctx * context)

    per_seq = -(-int(np.ceil(prompt_len + output_len)) // block_size)
    limits = {"KV pool": max(1, num_blocks // per_seq), "--max-num-seqs": max_num_seqs}
    if tpot_slo is not None:
        per_seq_time = cd + cctx * context
        limits["--tpot-slo"] = max(1, int((tpot_slo - c0) / per_seq_time)) if per_seq_time > 0 else max_num_seqs
    limit = min(limits, key=limits.get)
    b = limits[limit]
    decode = b / (max(output_len - 1, 1) * step(b))
    return SplitEstimate(prompt_len, output_len, prefill, 1 / prefill, b, step(b), decode, limit, (c0, cp, cd, cctx))


def format_estimate(p: SplitEstimate, rate: float | None, split: tuple[int, int] | None) -> str:
    c0, cp, cd, cctx = p.coef
    lines = [
        f"step-time model     {1e3 * c0:.1f} ms + {1e3 * cp:.2f} ms per prompt token + {1e3 * cd:.2f} ms per "
        f"decode + {1e6 * cctx:.2f} us per context token (fitted on this machine)",
        f"workload            prompts of {p.prompt_len:.0f} tokens, outputs of {p.output_len:.0f} (means)",
        f"prefill instance    {1e3 * p.prefill_seconds:.0f} ms per request -> {p.prefill_capacity:.2f} req/s",
        f"decode instance     {p.decode_batch} sequences a step (capped by {p.batch_limit}), "
        f"{1e3 * p.decode_step:.1f} ms a step -> {p.decode_capacity:.2f} req/s",
        f"balanced P:D        {p.ratio:.2f} : 1 (prefill instances per decode instance)",
    ]
    if rate:
        need = p.split_for(rate)
        lines.append(f"{f'at {rate} req/s':<20}{need[0]}:{need[1]} keeps up (prefill load {rate / (need[0] * p.prefill_capacity):.0%}, "
                     f"decode load {rate / (need[1] * p.decode_capacity):.0%})")
    if split:
        P, D = split
        most = min(P * p.prefill_capacity, D * p.decode_capacity)
        line = f"{f'--disagg {P}:{D}':<20}sustains {most:.2f} req/s"
        if rate:
            line += (f"; at {rate} req/s prefill load {rate / (P * p.prefill_capacity):.0%}, "
                     f"decode load {rate / (D * p.decode_capacity):.0%}")
        lines.append(line)
    return "\n".join(lines)
