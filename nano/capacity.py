"""The scheduler's never-fit rule, which a disaggregated router (nano/disagg) shares."""
from dataclasses import dataclass

from nano.sequence import Sequence


@dataclass(frozen=True)
class Capacity:
    """What one request can ever have of an engine: its model context, its KV pool less the
    watermark. Its scheduler rejects at admission what never fits; a router, before sending it."""
    max_model_len: int
    block_size: int
    num_blocks: int
    usable_blocks: int

    def never_fits(self, seq: Sequence) -> str | None:
        """Why seq could never be served here, or None."""
        if not seq.num_tokens:
            return "empty prompt"
        # Room for the prompt and one generated token (whose KV the next step writes), or
        # for every token of one that has output already (handed over, or recomputed).
        need = max(seq.num_prompt_tokens + 1, seq.num_tokens)
        if need > self.max_model_len:
            return (f"prompt of {seq.num_tokens} tokens leaves no room to generate within the "
                    f"model context of {self.max_model_len} tokens")
        blocks = -(-need // self.block_size)
        if blocks > self.usable_blocks:
            return (f"prompt of {seq.num_tokens} tokens needs {blocks} KV blocks but the pool "
                    f"can ever give one request {self.usable_blocks} (of {self.num_blocks})")
        return None
