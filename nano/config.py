"""EngineConfig and ModelConfig: every knob in one place, validated once."""
from dataclasses import dataclass

from nano import checks
from nano.errors import NanoError

# The architectures nano runs: (model_type, its forward as errors name it, the config.json keys
# of which that forward implements one value, the one a missing key means; transformers' values
# of missing keys where they are not nano's). A family added later declares itself here and its
# tensors in tp.checkpoint_shapes. Keys that change no result are not read. Which keys each
# family fixes, and why: docs/models.md.
ARCHITECTURES = {"LlamaForCausalLM": ("llama", "Llama", {"hidden_act": "silu", "mlp_bias": False,
                                                         "sliding_window": None}, {}),
                 "Qwen2ForCausalLM": ("qwen2", "Qwen2",
                                      {"hidden_act": "silu", "attention_bias": True,
                                                         "use_sliding_window": False},
                                      {"num_key_value_heads": 32}),
                 "Qwen3ForCausalLM": ("qwen3", "Qwen3",
                                      {"hidden_act": "silu", "attention_bias": False,
                                                         "use_sliding_window": False},
                                      {"num_key_value_heads": 32, "head_dim": 128}),
                 "MistralForCausalLM": ("mistral", "Mistral",
                                        {"hidden_act": "silu", "attention_bias": False},
                                        {"num_key_value_heads": 8, "sliding_window": 4096}),
                 "Gemma3ForCausalLM": ("gemma3_text", "Gemma3", {
                     "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
                     "attn_logit_softcapping": None, "final_logit_softcapping": None,
                     "use_bidirectional_attention": False}, {
                     "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256,
                     "sliding_window": 4096, "sliding_window_pattern": 6,
                     "max_position_embeddings": 131072, "tie_word_embeddings": True})}
# The RoPE types the forward implements (tp.rope_cos_sin), and the bounds of each one's numbers
# (docs/models.md).
ROPE_TYPES = {"default": {}, "llama3": {"factor": (1, 1024), "low_freq_factor": (1e-3, 1024),
                                        "high_freq_factor": (1e-3, 1024),
                                        "original_max_position_embeddings": (1, 2**24)}}
EVERY_FORWARD = {"partial_rotary_factor": 1.0}  # the keys no forward implements another value of
# --dtype, vLLM's values: the element type of weights, activations and the KV pool on the GPU
# (EngineConfig.element_dtype); the CPU path computes in float32.
DTYPES = ("auto", "bfloat16", "float16", "float32")


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
    # per layer: a sliding window of that many keys, None = all keys
    windows: tuple[int | None, ...]
    # q, k, v carry a bias (an o_proj bias is a tensor no forward reads)
    attention_bias: bool = False
    # an RMSNorm of each q and k head before RoPE (Qwen3, Gemma 3)
    qk_norm: bool = False
    # RoPE base of the sliding-window layers (Gemma 3); None: rope_theta
    local_rope_theta: float | None = None
    # scores scaled by its -1/2 power, not head_dim's (Gemma 3)
    query_pre_attn_scalar: float | None = None
    # the MLP's gate: silu (SwiGLU) or gelu_tanh (GeGLU, Gemma 3)
    activation: str = "silu"
    embed_scale: float = 1.0                # embedding rows times this (Gemma 3: sqrt(hidden_size))
    # RMSNorms on the attention's and MLP's outputs too (Gemma 3)
    sandwich_norms: bool = False
    # every RMSNorm multiplies by offset + weight (Gemma 3: 1 + w)
    norm_offset: float = 0.0
    architecture: str = "LlamaForCausalLM"  # a key of ARCHITECTURES
    # --dtype auto on the GPU, by vLLM's rule: config.json's torch_dtype (transformers 5:
    # dtype), but bfloat16 for float32 weights (vLLM's choice on sm_80+) and for Gemma 3, whose
    # activations overflow float16
    gpu_dtype: str = "bfloat16"

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
        architecture = _architecture(cfg)
        _, _, fixed, defaults = ARCHITECTURES[architecture]
        cfg = fixed | defaults | cfg  # a key missing means its one value, or transformers' default

        def count(key, default=None, high=None):
            return checks.integer(f"config.json {key}", cfg.get(key, default), 1, high)

        def number(key, default, low, high=None):  # bounds no real model comes near
            return checks.number(f"config.json {key}", cfg.get(key, default), low, high,
                                 open_low=True)

        heads, hidden = count("num_attention_heads"), count("hidden_size")
        kv_heads = count("num_key_value_heads", heads)
        # then the head dimension is hidden / heads
        if cfg.get("head_dim") is None and hidden % heads:
            raise NanoError(f"config.json hidden_size ({hidden}) must be a multiple of "
                            f"num_attention_heads ({heads})")
        if heads % kv_heads:
            raise NanoError(f"config.json num_attention_heads ({heads}) must be a multiple of "
                            f"num_key_value_heads ({kv_heads})")
        head_dim = count("head_dim") if cfg.get("head_dim") is not None else hidden // heads
        if head_dim < 2 or head_dim % 2:
            raise NanoError(f"config.json head dimension must be even (RoPE rotates pairs), got "
                            f"{head_dim}")
        gemma, eos, vocab = (architecture == "Gemma3ForCausalLM", cfg.get("eos_token_id"),
                             count("vocab_size"))
        (rope_theta, rope_scaling), local_theta = _ropes(cfg, gemma)
        torch_dtype = checks.choice("config.json torch_dtype",
                                    cfg.get("dtype", cfg.get("torch_dtype", "float32")), DTYPES[1:])
        eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
        # Qwen2's and Qwen3's sliding_window counts only with use_sliding_window (fixed false).
        window = None if "use_sliding_window" in fixed else checks.integer(
            "config.json sliding_window", cfg.get("sliding_window"), 1, checks.INT32_MAX,
                                                                           optional=True)
        # 2^24: past any real context
        return cls(
            hidden_size=hidden,
            intermediate_size=count("intermediate_size"),
            num_layers=(layers := count("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=vocab,
            rms_norm_eps=number("rms_norm_eps", 1e-6, 0, 0.1),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=count("max_position_embeddings", 2048, 2**24),
            tie_word_embeddings=checks.flag("config.json tie_word_embeddings",
                                            cfg.get("tie_word_embeddings", False)),
            eos_token_ids=tuple(checks.integer("config.json eos_token_id", t, 0,
                                               vocab - 1) for t in eos),
            windows=tuple(window if kind == "sliding_attention" else None
                          for kind in _layer_types(cfg, layers, gemma)),
            attention_bias=checks.flag("config.json attention_bias",
                                       cfg.get("attention_bias", False)),
            qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            local_rope_theta=local_theta,
            query_pre_attn_scalar=number("query_pre_attn_scalar", None, 0) if gemma else None,
            activation="gelu_tanh" if gemma else "silu",
            embed_scale=hidden ** 0.5 if gemma else 1.0,
            sandwich_norms=gemma,
            norm_offset=1.0 if gemma else 0.0,
            architecture=architecture,
            gpu_dtype="bfloat16" if gemma or torch_dtype == "float32" else torch_dtype,
        )


def _architecture(cfg: dict) -> str:
    """The ARCHITECTURES key config.json names, its model_type and fixed keys checked. A config
    naming neither is Llama's: transformers writes both, so it was written by hand in the format
    nano reads."""
    model_type = cfg.get("model_type")
    names = cfg.get("architectures", [a for a, family in ARCHITECTURES.items()
                                      if family[0] == (model_type or "llama")])
    if not (isinstance(names, list) and len(names) == 1 and names[0] in list(ARCHITECTURES)):
        runs = ", ".join(f"{name} (model_type {family[0]})"
                         for name, family in ARCHITECTURES.items())
        given = f"architectures {names}" if "architectures" in cfg else f"model_type {model_type!r}"
        raise NanoError(f"config.json {given:.80} is not one nano runs: it runs {runs}")
    own_type, forward, fixed, _ = ARCHITECTURES[names[0]]
    if model_type not in (None, own_type):
        raise NanoError(f"config.json model_type {model_type!r:.40} is not {names[0]}'s "
                        f"({own_type!r})")
    for key, value in (fixed | EVERY_FORWARD).items():
        if cfg.get(key, value) != value:
            raise NanoError(f"config.json {key} {cfg[key]!r:.40} is not implemented by the "
                            f"{forward} forward")
    return names[0]


def max_model_len(config: "EngineConfig", model: ModelConfig) -> int:
    """The longest sequence the engine serves: --max-model-len, at most the model's
    max_position_embeddings (the RoPE table's length)."""
    return min(config.max_model_len or model.max_position_embeddings, model.max_position_embeddings)


def _layer_types(cfg: dict, layers: int, gemma: bool) -> list[str]:
    """Each layer's attention. Gemma 3's: transformers 5's layer_types, else every
    sliding_window_pattern-th layer global. The other families' layers are alike (sliding wherever a
    window is set)."""
    if not gemma:
        return ["sliding_attention"] * layers
    pattern = checks.integer("config.json sliding_window_pattern",
                             cfg.get("sliding_window_pattern"), 1)
    kinds = cfg.get("layer_types") or [("full_attention" if (i + 1) % pattern == 0
                                        else "sliding_attention")
                                       for i in range(layers)]
    if not (isinstance(kinds, list) and len(kinds) == layers
            and set(kinds) <= {"full_attention", "sliding_attention"}):
        raise NanoError(f"config.json layer_types must list full_attention or sliding_attention "
                        f"for each of "
                        f"the {layers} layers, got {kinds!r:.60}")
    return kinds


def _ropes(cfg: dict, gemma: bool) -> tuple[tuple[float, dict | None], float | None]:
    """The global layers' RoPE; Gemma 3's sliding layers' base (rope_local_base_freq, or by layer
    type)."""
    if not gemma:
        return _rope(cfg), None
    by_type = cfg.get("rope_parameters") or {}
    if not (isinstance(by_type, dict) and set(by_type) <= {"full_attention", "sliding_attention"}):
        raise NanoError(f"config.json rope_parameters must be an object by layer type, got "
                        f"{by_type!r:.60}")
    local = {"rope_theta": cfg.get("rope_local_base_freq"),
             "rope_parameters": by_type.get("sliding_attention")}
    theta, scaling = _rope(local, 10000.0)
    if scaling:
        raise NanoError("config.json rope_parameters sliding_attention must be of rope_type "
                        "default")
    return _rope(cfg | {"rope_parameters": by_type.get("full_attention")}, 1e6), theta


def _rope(cfg: dict, default: float = 10000.0) -> tuple[float, dict | None]:
    """rope_theta and rope_scaling, read the same from both spellings: those keys, and transformers
    5's rope_parameters (the scaling object with rope_theta inside). Both given must agree."""
    def theta(key, value):  # at most 1, frequencies would rise along a head
        return checks.number(f"config.json {key}", default if value is None else value, 1,
                             open_low=True)

    def used(scaling):  # what the forward reads of it (old configs name its type "type")
        return scaling and [scaling[key] for key in ("rope_type",
                                                     *ROPE_TYPES[scaling["rope_type"]])]

    old = theta("rope_theta", cfg.get("rope_theta")), _rope_scaling("rope_scaling",
                                                                    cfg.get("rope_scaling"))
    if (params := cfg.get("rope_parameters")) is None:
        return old
    scaling = _rope_scaling("rope_parameters", params)
    new = theta("rope_parameters rope_theta",
                params.get("rope_theta", cfg.get("rope_theta"))), scaling
    if ((cfg.get("rope_theta") is not None and old[0] != new[0])
            or (cfg.get("rope_scaling") is not None and used(old[1]) != used(new[1]))):
        raise NanoError("config.json rope_parameters and rope_theta / rope_scaling disagree")
    return new


def _rope_scaling(key: str, scaling) -> dict | None:
    """None for plain RoPE, or the dict (less rope_theta) with its type as rope_type and its numbers
    checked."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise NanoError(f"config.json {key} must be an object or null, got {scaling!r:.40}")
    kind = checks.choice(f"config.json {key} type", scaling.get("rope_type", scaling.get("type")),
                         [*ROPE_TYPES])
    for name, (low, high) in ROPE_TYPES[kind].items():
        checks.number(f"config.json {key} {name}", scaling.get(name), low, high)
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:  # transformers 5 may write it here
        raise NanoError(f"config.json {key} partial_rotary_factor is not implemented: nano rotates "
                        "all of each head")
    # its blend divides by their gap
    if kind == "llama3" and scaling["low_freq_factor"] >= scaling["high_freq_factor"]:
        raise NanoError(f"config.json {key} low_freq_factor must be below high_freq_factor, got "
                        f"{scaling['low_freq_factor']} and {scaling['high_freq_factor']}")
    return None if kind == "default" else (
        {k: v for k, v in scaling.items() if k != "rope_theta"} | {"rope_type": kind})


TOKEN_BUDGET = 2048  # a step's tokens when --max-num-batched-tokens is not given, and then
# seconds a step is kept near (by the step-time model): every stream's longest gap
STEP_TARGET = 1.0
KV_CACHE_DTYPES = ("auto", "int8")   # vLLM's flag values: auto = the model's (device's) dtype
KEY_SCHEMES = ("token", "rotate")    # int8 keys: as they are, or Hadamard-rotated
DEFAULT_KEY_SCHEME = "rotate"        # (kv_cache.py, docs/int8-kv.md)


@dataclass
class EngineConfig:
    model: str | None = None                 # HF folder; None = the default model
    device: str = "auto"                     # auto | cpu | gpu
    dtype: str = "auto"                      # one of DTYPES (element_dtype)
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
    # auto (the device's float dtype) | int8 (nano/kv_cache.py)
    kv_cache_dtype: str = "auto"
    kv_int8_keys: str | None = None          # int8 keys: token | rotate (None: DEFAULT_KEY_SCHEME)
    preemption: str = "auto"                 # swap | recompute | auto
    seed: int = 0                            # for requests without their own seed
    tp: int = 1                              # tensor-parallel ranks (under mpirun)
    enforce_eager: bool = False              # GPU: no CUDA graphs for decode steps (like vLLM's)
    # CPU: each token's result bitwise independent of the batch (ops.py); None: on for an int8
    # KV cache on the CPU (shard.py)
    batch_invariant: bool | None = None

    @property
    def token_budget(self) -> int:
        return self.max_num_batched_tokens or TOKEN_BUDGET

    @property
    def key_scheme(self) -> str | None:
        """How an int8 pool quantizes keys (kv_cache.py); None for a full-precision pool."""
        if self.kv_cache_dtype != "int8":
            return None
        return self.kv_int8_keys or DEFAULT_KEY_SCHEME

    def element_dtype(self, model: ModelConfig, kind: str) -> str:
        """The dtype a run on device `kind` computes in: --dtype, auto being the model's
        (ModelConfig.gpu_dtype). The CPU path keeps float32 whatever is asked (its start-up
        line says so), and the GPU's kernels have no float32."""
        if kind == "cpu":
            return "float32"
        if self.dtype == "float32":
            raise NanoError("--dtype float32 runs on the CPU only: the GPU's kernels are bfloat16 "
                            "and float16 (give --dtype auto, bfloat16 or float16)")
        return model.gpu_dtype if self.dtype == "auto" else self.dtype

    def validate(self) -> None:
        checks.integer("--block-size", self.block_size, low=1)
        if self.block_size & (self.block_size - 1):
            raise NanoError(f"--block-size must be a power of two, got {self.block_size}")
        checks.integer("--kv-cache-memory", self.kv_cache_memory, low=1, optional=True)
        checks.integer("--num-blocks", self.num_blocks, low=1, optional=True)
        checks.integer("--swap-space", self.swap_space, low=0)
        checks.integer("--max-num-batched-tokens", self.max_num_batched_tokens, low=1,
                       optional=True)
        checks.integer("--max-num-seqs", self.max_num_seqs, low=1)
        checks.integer("--max-model-len", self.max_model_len, low=2, optional=True)
        checks.number("--watermark", self.watermark, 0, 1, open_high=True)
        for name in ("enable_prefix_caching", "enforce_eager"):
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
        checks.choice("--dtype", self.dtype, DTYPES)
        checks.integer("--seed", self.seed)
        checks.integer("--tp", self.tp, low=1)
