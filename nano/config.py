"""EngineConfig and ModelConfig: every knob in one place, validated once."""
from dataclasses import dataclass

from nano.errors import NanoError


@dataclass
class ModelConfig:
    """The Llama-family shapes the forward pass needs, read from a HF config.json."""
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "vocab_size") if k not in cfg]
        if missing:
            raise NanoError(f"config.json is not a Llama-family config: no {missing[0]!r}")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", 10000.0),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            eos_token_ids=eos,
        )


def parse_bytes(text: str) -> int:
    """'2GB', '512MiB', '1e9' -> bytes."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
             "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "K": 10**3, "M": 10**6,
             "G": 10**9, "T": 10**12, "B": 1}
    s = str(text).strip().upper()
    for unit, scale in units.items():
        if s.endswith(unit):
            s, mult = s[:-len(unit)], scale
            break
    else:
        mult = 1
    try:
        value = float(s) * mult
    except ValueError:
        raise NanoError(f"cannot read a byte size from {text!r} (e.g. 2GB, 512MiB)") from None
    if value <= 0:
        raise NanoError(f"byte size must be positive, got {text!r}")
    return int(value)


@dataclass
class EngineConfig:
    model: str | None = None                 # HF folder; None = the default model
    device: str = "auto"                     # auto | cpu | gpu
    block_size: int = 16                     # tokens per KV block
    kv_cache_memory: int | None = None       # bytes for the KV pool (None: num_blocks or a default)
    num_blocks: int | None = None            # overrides kv_cache_memory
    swap_space: int = 4 * 2**30              # bytes of host memory for swapped-out KV blocks
    max_num_batched_tokens: int = 2048       # token budget of one step
    max_num_seqs: int = 256                  # sequences in one step
    max_model_len: int | None = None         # default: the model's max_position_embeddings
    watermark: float = 0.01                  # fraction of blocks kept free at admission
    enable_prefix_caching: bool = True
    preemption: str = "auto"                 # swap | recompute | auto
    seed: int = 0                            # for requests without their own seed
    tp: int = 1                              # tensor-parallel ranks (under mpirun)
    enforce_eager: bool = False              # GPU: no CUDA graphs for decode steps (like vLLM's)
    policy: str = "fcfs"                     # fcfs | deadline (see scheduler.py)
    drop_late: bool = False                  # deadline policy: reject requests that can no longer meet their TTFT
    metrics_file: str | None = None          # JSONL metrics snapshots
    metrics_prom: str | None = None          # Prometheus text file, rewritten at each snapshot
    metrics_interval: int = 1                # steps between snapshots

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise NanoError(f"--block-size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise NanoError(f"--num-blocks must be positive, got {self.num_blocks}")
        if self.max_num_batched_tokens < 1:
            raise NanoError(f"--max-num-batched-tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise NanoError(f"--max-num-seqs must be positive, got {self.max_num_seqs}")
        if not 0.0 <= self.watermark < 1.0:
            raise NanoError(f"--watermark must be in [0, 1), got {self.watermark}")
        if self.preemption not in ("swap", "recompute", "auto"):
            raise NanoError(f"--preemption must be swap, recompute or auto, got {self.preemption!r}")
        if self.device not in ("auto", "cpu", "gpu"):
            raise NanoError(f"--device must be auto, cpu or gpu, got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise NanoError(f"--max-model-len must be at least 2, got {self.max_model_len}")
        if self.swap_space < 0:
            raise NanoError("--swap-space must not be negative")
        if self.policy not in ("fcfs", "deadline"):
            raise NanoError(f"--policy must be fcfs or deadline, got {self.policy!r}")
        if self.drop_late and self.policy != "deadline":
            raise NanoError("--drop-late needs --policy deadline")
        if self.metrics_interval < 1:
            raise NanoError(f"--metrics-interval must be positive, got {self.metrics_interval}")
        if self.tp < 1:
            raise NanoError(f"--tp must be positive, got {self.tp}")
