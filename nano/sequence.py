"""Sequence (one request's state as it moves through the engine) and SamplingParams."""
import enum
from dataclasses import dataclass, field

import numpy as np

from nano import checks


@dataclass
class SamplingParams:
    temperature: float = 1.0       # 0 = greedy
    top_p: float = 1.0             # nucleus mass, in (0, 1]
    top_k: int = -1                # -1 or 0 = off
    min_p: float = 0.0             # drop tokens below min_p x the likeliest's probability; 0 = off
    # 0 only with prompt_logprobs: the prompt scored, nothing generated
    max_tokens: int = 16
    seed: int | None = None        # same seed, same output, whatever the batch around it
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)  # each ends the output, as EOS does
    logits_processor: "LogitsProcessor | None" = None  # penalties, grammars: nano/controls
    return_logits: bool = False    # keep the logits row behind every sampled token
    # score the prompt: each token's logprob and this many top ones
    prompt_logprobs: int | None = None
    ttft_slo: float | None = None  # seconds from arrival to the first token (deadline policy)
    tpot_slo: float | None = None  # seconds per output token after the first

    def validate(self) -> None:
        # no token generated
        scores_only = self.max_tokens == 0 and self.prompt_logprobs is not None
        for name, check in FIELD_RULES.items():
            if not (scores_only and name == "max_tokens"):
                check(name, getattr(self, name))


# What each field accepts, the one place each rule is written: SamplingParams.validate applies
# them, and so does the JSONL prompt reader (its latency targets are in ms: the same rules fit).
FIELD_RULES = {
    "temperature": lambda name, v: checks.number(name, v, low=0),
    "top_p": lambda name, v: checks.number(name, v, 0, 1, open_low=True),
    "top_k": lambda name, v: checks.integer(name, v, -1, checks.INT32_MAX),
    "min_p": lambda name, v: checks.number(name, v, 0, 1),
    "max_tokens": lambda name, v: checks.integer(name, v, 1, checks.INT32_MAX),
    # any int: the sampler takes it mod 2**64
    "seed": lambda name, v: checks.integer(name, v, optional=True),
    "ignore_eos": checks.flag,
    "stop_token_ids": lambda name, v: [
        checks.integer(f"{name}[{i}]", t, 0, checks.INT32_MAX)
        for i, t in enumerate(checks.instance(name, v, (list, tuple), "a list"))],
    "logits_processor": lambda name, v: checks.instance(name, v, (LogitsProcessor, type(None)),
                                                        "a LogitsProcessor"),
    "return_logits": checks.flag,
    "prompt_logprobs": lambda name, v: checks.integer(name, v, 0, checks.INT32_MAX, optional=True),
    "ttft_slo": lambda name, v: checks.number(name, v, low=0, open_low=True, optional=True),
    "tpot_slo": lambda name, v: checks.number(name, v, low=0, open_low=True, optional=True),
}


class LogitsProcessor:
    """A request's change to its next-token logits, from its sequence on the host before each
    token it samples; the sampler applies every row's in one op each, so rows without one pay
    nothing. Per-request state lives in seq.processor_state (one object may serve several
    sequences). nano/controls implements it: penalties, logit_bias, min_tokens, grammars."""

    def edits(self, seq: "Sequence", ahead: list[int]) -> tuple[np.ndarray, ...] | None:
        """For the token after seq's and then `ahead` (drafts this step checks, as if accepted):
        (tokens (E,) int32, distinct; biases, penalties, shifts (E,) float32): each token's
        logit x, plus its bias, becomes (x / penalty if x > 0 else x * penalty) + shift (vLLM's
        order: logit_bias, then the repetition penalty, then the others); -inf bans it."""
        return None

    def mask(self, seq: "Sequence", ahead: list[int]) -> np.ndarray | None:
        """(ceil(V / 32),) int32: token t is allowed where bit t % 32 of word t // 32 is set."""
        return None


class Status(enum.Enum):
    WAITING = "waiting"      # queued: not yet admitted, or preempted by recompute
    RUNNING = "running"      # holds device blocks, scheduled every step
    SWAPPED = "swapped"      # preempted: its KV blocks live in host swap space
    HELD = "held"            # out of the batch, its blocks kept (Scheduler.hold / reserve)
    FINISHED = "finished"


class Sequence:
    def __init__(self, seq_id: int, prompt: str, prompt_token_ids: list[int],
                 params: SamplingParams, arrival_time: float, seed: int):
        self.seq_id = seq_id
        self.prompt = prompt
        self.params = params
        self.token_ids = list(prompt_token_ids)      # prompt + generated
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = Status.WAITING
        # Device block ids while RUNNING, host block ids while SWAPPED, [] otherwise.
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []            # prefix-cache hash of each full computed block
        self.num_computed_tokens = 0                 # tokens whose KV is in the cache
        # of those, found in the prefix cache at admission
        self.num_cached_tokens = 0
        # the same at the first admission (the request's hit)
        self.num_cached_prompt_tokens: int | None = None
        self.arrival_time = arrival_time
        # first admitted to run (the end of its queueing)
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.token_times: list[float] = []
        # stop | length | rejected (error says why) | aborted
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.logits: list[np.ndarray] = []           # only with params.return_logits
        # With params.prompt_logprobs, prompt token i's (logprob, rank, [(token, logprob)] best
        # first) at [i]; the first token has none. Prefill chunks fill it as they run.
        self.prompt_logprobs: list = [None]
        self.seed = seed                             # with the output count, keys each random draw
        # params.logits_processor's own, for this request
        self.processor_state = None
        # proposed to follow token_ids, checked in this step (engine.proposer)
        self.draft_token_ids: list[int] = []
        # its adapter (nano/lora's LoRARequest), whose KV blocks it shares with no one else's
        self.lora = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model: the rest of the prompt, or 1 when decoding."""
        return len(self.token_ids) - self.num_computed_tokens  # num_tokens, read on every step

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
