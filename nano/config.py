"""EngineConfig and ModelConfig: every knob in one place, validated once."""
from dataclasses import dataclass

from nano import checks
from nano.errors import NanoError
from nano.kv_cache import DEFAULT_KEY_SCHEME, KEY_SCHEMES, KV_CACHE_DTYPES

# The RoPE types the forward pass implements (tp.rope_cos_sin), with the numbers each needs.
ROPE_TYPES = {"default": (), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                        "original_max_position_embeddings")}


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
        """From a config.json's contents, every field it uses checked (a wrong one would
        otherwise fail as a reshape or index error while loading or running the model)."""
        if not isinstance(cfg, dict):
            raise NanoError("config.json is not a JSON object")
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "vocab_size") if k not in cfg]
        if missing:
            raise NanoError(f"config.json is not a Llama-family config: no {missing[0]!r}")

        def count(key, default=None, high=None):
            return checks.integer(f"config.json {key}", cfg.get(key, default), 1, high)

        def number(key, default, low, high=None):  # bounds no real model comes near
            return checks.number(f"config.json {key}", cfg.get(key, default), low, high, open_low=True)

        heads, hidden = count("num_attention_heads"), count("hidden_size")
        kv_heads = count("num_key_value_heads", heads)
        if heads % kv_heads:
            raise NanoError(f"config.json num_attention_heads ({heads}) must be a multiple of "
                            f"num_key_value_heads ({kv_heads})")
        head_dim = count("head_dim") if cfg.get("head_dim") is not None else hidden // heads
        if head_dim < 2 or head_dim % 2:
            raise NanoError(f"config.json head dimension must be even (RoPE rotates pairs), got {head_dim}")
        eos, vocab = cfg.get("eos_token_id"), count("vocab_size")
        eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
        return cls(
            hidden_size=hidden,
            intermediate_size=count("intermediate_size"),
            num_layers=count("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=vocab,
            rms_norm_eps=number("rms_norm_eps", 1e-6, 0, 0.1),
            rope_theta=number("rope_theta", 10000.0, 1),  # at most 1, frequencies would rise along a head
            rope_scaling=_rope_scaling(cfg.get("rope_scaling")),
            max_position_embeddings=count("max_position_embeddings", 2048, 2**24),  # 2^24: past any real context
            tie_word_embeddings=checks.flag("config.json tie_word_embeddings",
                                            cfg.get("tie_word_embeddings", False)),
            eos_token_ids=tuple(checks.integer("config.json eos_token_id", t, 0, vocab - 1) for t in eos),
        )


def max_model_len(config: "EngineConfig", model: ModelConfig) -> int:
    """The longest sequence the engine serves: --max-model-len, at most the model's
    max_position_embeddings (the RoPE table's length)."""
    return min(config.max_model_len or model.max_position_embeddings, model.max_position_embeddings)


@dataclass(frozen=True)
class Capacity:
    """What one request can ever have of an engine: its model context, its KV pool less the
    watermark. The one never-fit rule: its scheduler's at admission, and a disaggregated
    router's (nano/disagg), which holds every instance's, before it sends a request anywhere."""
    max_model_len: int
    block_size: int
    num_blocks: int
    usable_blocks: int

    def never_fits(self, seq) -> str | None:
        """Why a Sequence could never be served here, or None."""
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


def _rope_scaling(scaling) -> dict | None:
    """None for plain RoPE, or the dict with its type as rope_type and its numbers checked."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise NanoError(f"config.json rope_scaling must be an object or null, got {scaling!r:.40}")
    kind = checks.choice("config.json rope_scaling type", scaling.get("rope_type", scaling.get("type")), [*ROPE_TYPES])
    for key in ROPE_TYPES[kind]:
        checks.number(f"config.json rope_scaling {key}", scaling.get(key), low=0, open_low=True)
    if kind == "llama3" and scaling["low_freq_factor"] >= scaling["high_freq_factor"]:  # its blend divides by their gap
        raise NanoError(f"config.json rope_scaling low_freq_factor must be below high_freq_factor, got "
                        f"{scaling['low_freq_factor']} and {scaling['high_freq_factor']}")
    return None if kind == "default" else {**scaling, "rope_type": kind}


TOKEN_BUDGET = 2048  # a step's tokens when --max-num-batched-tokens is not given, and then
STEP_TARGET = 1.0    # seconds a step is kept near (by the step-time model): every stream's longest gap


@dataclass
class EngineConfig:
    model: str | None = None                 # HF folder; None = the default model
    device: str = "auto"                     # auto | cpu | gpu
    block_size: int = 16                     # tokens per KV block
    kv_cache_memory: int | None = None       # bytes for the KV pool (None: num_blocks or a default)
    num_blocks: int | None = None            # overrides kv_cache_memory
    swap_space: int = 4 * 2**30              # bytes of host memory for swapped-out KV blocks
    max_num_batched_tokens: int | None = None  # token budget of one step; None: up to TOKEN_BUDGET,
                                             # fewer where a step would pass STEP_TARGET (policy.py)
    max_num_seqs: int = 256                  # sequences in one step
    max_model_len: int | None = None         # default: the model's max_position_embeddings
    watermark: float = 0.01                  # fraction of blocks kept free at admission
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"             # auto (the device's float dtype) | int8 (nano/kv_cache.py)
    kv_int8_keys: str | None = None          # int8 keys: token | channel | rotate (None: kv_cache.DEFAULT_KEY_SCHEME)
    preemption: str = "auto"                 # swap | recompute | auto
    seed: int = 0                            # for requests without their own seed
    tp: int = 1                              # tensor-parallel ranks (under mpirun)
    enforce_eager: bool = False              # GPU: no CUDA graphs for decode steps (like vLLM's)
    policy: str = "fcfs"                     # fcfs | deadline (see policy.py)
    drop_late: bool = False                  # deadline policy: reject requests that can no longer meet their TTFT
    batch_invariant: bool | None = None      # CPU: each token's result bitwise independent of the batch
                                             # (ops.py); None: on for an int8 KV cache on the CPU (shard.py)

    @property
    def token_budget(self) -> int:
        return self.max_num_batched_tokens or TOKEN_BUDGET

    @property
    def key_scheme(self) -> str | None:
        """How an int8 pool quantizes keys (kv_cache.py); None for a full-precision pool."""
        if self.kv_cache_dtype != "int8":
            return None
        return self.kv_int8_keys or DEFAULT_KEY_SCHEME

    def validate(self) -> None:
        checks.integer("--block-size", self.block_size, low=1)
        if self.block_size & (self.block_size - 1):
            raise NanoError(f"--block-size must be a power of two, got {self.block_size}")
        checks.integer("--kv-cache-memory", self.kv_cache_memory, low=1, optional=True)
        checks.integer("--num-blocks", self.num_blocks, low=1, optional=True)
        checks.integer("--swap-space", self.swap_space, low=0)
        checks.integer("--max-num-batched-tokens", self.max_num_batched_tokens, low=1, optional=True)
        checks.integer("--max-num-seqs", self.max_num_seqs, low=1)
        checks.integer("--max-model-len", self.max_model_len, low=2, optional=True)
        checks.number("--watermark", self.watermark, 0, 1, open_high=True)
        for name in ("enable_prefix_caching", "enforce_eager", "drop_late"):
            checks.flag(name, getattr(self, name))
        if self.batch_invariant is not None:
            checks.flag("batch_invariant", self.batch_invariant)
        checks.choice("--preemption", self.preemption, ("swap", "recompute", "auto"))
        checks.choice("--kv-cache-dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.kv_int8_keys is not None:
            checks.choice("--kv-int8-keys", self.kv_int8_keys, KEY_SCHEMES)
        if self.kv_int8_keys is not None and self.kv_cache_dtype != "int8":
            raise NanoError("--kv-int8-keys needs --kv-cache-dtype int8")
        checks.choice("--device", self.device, ("auto", "cpu", "gpu"))
        checks.choice("--policy", self.policy, ("fcfs", "deadline"))
        if self.drop_late and self.policy != "deadline":
            raise NanoError("--drop-late needs --policy deadline")
        checks.integer("--seed", self.seed)
        checks.integer("--tp", self.tp, low=1)
