"""The Python API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""
from dataclasses import dataclass, field, fields

import numpy as np

from nano.config import EngineConfig
from nano.engine import LLMEngine
from nano.errors import NanoError
from nano.policy import FCFS
from nano.sequence import SamplingParams, Sequence


@dataclass
class RequestOutput:
    prompt: str
    text: str
    token_ids: list[int]                  # generated tokens only
    finish_reason: str                    # stop | length | rejected
    num_prompt_tokens: int
    error: str | None = None              # why a request was rejected
    # with SamplingParams(return_logits=True)
    logits: list[np.ndarray] = field(default_factory=list)
    # with SamplingParams(prompt_logprobs=k): Sequence.prompt_logprobs
    prompt_logprobs: list | None = None


class LLM:
    def __init__(self, model: str | None = None, policy=FCFS, **engine_args):
        """policy: the scheduling policy's class (policy.py), e.g. nano.deadline.policy.Deadline."""
        unknown = set(engine_args) - {f.name for f in fields(EngineConfig)}
        if unknown:
            raise NanoError(f"unknown engine argument {sorted(unknown)[0]!r}")
        if not callable(policy):
            raise NanoError(f"policy must be a policy class (nano/policy.py), got {policy!r:.40}")
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args), policy=policy)

    def generate(self, prompts: list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Bad input raises NanoError before any work starts, and leaves this LLM usable."""
        seqs = self.engine.generate(prompts, SamplingParams() if params is None else params)
        return [self.output(seq) for seq in seqs]

    def output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(seq.prompt, self.engine.detokenize(seq), seq.output_token_ids,
                             seq.finish_reason, seq.num_prompt_tokens, seq.error, seq.logits,
                             (seq.prompt_logprobs if seq.params.prompt_logprobs is not None
                              else None))
