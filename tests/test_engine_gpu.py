"""The whole engine on the GPU (float16 weights and KV, CUDA kernels) against the CPU path
(float32 NumPy) on the same random-weight models, in real model shapes.

Tolerances: weights are stored as float16 so both paths use identical weight values; the
GPU keeps activations and the KV cache in float16 (11-bit mantissa, ~5e-4 relative per
rounding) through 16-30 layers, so logits differ by up to a few percent of their scale.
We require max |gpu - cpu| <= LOGIT_TOL * max |cpu| on every teacher-forced step (steps
where both paths have been fed the same tokens), and every GPU greedy token to be exactly
the argmax of the logits row it was sampled from. The greedy tokens of the two paths must
agree, except where the CPU's top two logits are within twice the tolerance (a near-tie,
which rounding may break either way); the comparison stops there, as inputs differ.
Prompt logprobs (log-softmax on the device of the same logits) within LOGIT_TOL of their
size (at least 1 nat). The random models are float16 checkpoints, which --dtype auto runs in
float16; a run in bfloat16 (Gemma 3's default, or dtype="bfloat16") is held to its own
tolerance (LOGIT_TOLS).

One test per (shape, config), so that no test runs long (tests/device_check.sh gives each a
time limit): the CPU reference runs once per model and KV pool type, and is shared by the
configs with that pool (the `cpu_runs` cache). It runs the non-batch-invariant CPU path,
which is the faster one for an int8 pool and compared within the same tolerance. Every engine
of one model, the CPU's and the GPU's, shares the weights the first of its kind loaded
(`weights_loaded_once`). The Llama-3.2-1B shape, whose CPU references take most of the time,
runs a smaller workload (WORKLOADS), the configs of two pool types (float16, int8 with rotated
keys: the other key schemes run the same kernels) and leaves prompt logprobs to the smaller
shape.
"""
import contextlib

import numpy as np
import pytest

import nano.ops
import nano.shard
import nano.tp
from nano.config import TOKEN_BUDGET, EngineConfig
from nano.device import BFLOAT16
from nano.engine import LLMEngine
from nano.graphs import GraphStep
from nano.sequence import LogitsProcessor, SamplingParams
from nano.telemetry.metrics import Metrics, metrics_of
from reference import LLAMA_32_1B, SMOLLM2_135M, assert_greedy_runs_agree, make_random_model

pytestmark = pytest.mark.gpu

LOGIT_TOL = 3e-2
# By the GPU run's dtype: bfloat16 keeps 8 significant bits to float16's 11, so each of its
# roundings is 8x coarser; its tolerance is ~3x the largest error seen on the emulator's
# small model (3.5e-2 on a step of a float16 checkpoint run in bfloat16).
LOGIT_TOLS = {np.dtype(np.float16): LOGIT_TOL, BFLOAT16: 1e-1}

SHAPES = {"smollm2_135m": SMOLLM2_135M, "llama_3.2_1b": LLAMA_32_1B}


@contextlib.contextmanager
def weights_loaded_once():
    """Inside, the engines of each device kind and op set share the weights the first of them loaded
    (nano.shard's load_model, remembered), so it must hold the engines of one model alone.
    Engines of one model differ in their KV pools and schedulers, not in their weights, and
    the host work of a load (float16 to float32 and back; a float32 copy in column-major order
    for the CPU) would be repeated by every engine: ~13 s (GPU) and ~25 s (CPU) for the
    Llama-3.2-1B shape on a 2-core VM, which a test step of tests/device_check.sh cannot pay
    a dozen times."""
    loaded = {}

    def load_once(reader, cfg, part, to_device, max_positions, all_reduce=None, ops=nano.ops.REFERENCE):
        key = (to_device.__self__.kind, max_positions, ops)  # to_device: the engine's Device.put
        if key not in loaded:
            loaded[key] = nano.tp.load_model(reader, cfg, part, to_device, max_positions, all_reduce, ops)
        return loaded[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(nano.shard, "load_model", load_once)
        yield


@pytest.fixture(scope="module", params=list(SHAPES))
def shaped_model(request, tmp_path_factory):
    """(model folder, vocab, shape name). Uniform random weights: the Llama-3.2-1B shape is
    built in ~5 s rather than ~40 (make_random_model)."""
    shape = SHAPES[request.param]
    model = make_random_model(tmp_path_factory.mktemp(request.param), max_pos=4096, dtype="float16",
                              seed=7, uniform=True, **shape)
    with weights_loaded_once():
        yield model, shape["vocab"], request.param


def prompts_for(vocab, n=4, seed=0, shared=40, longest=60):
    """n prompts of a shared prefix of `shared` tokens (prefix-cache hits where one prompt's
    blocks are cached before another's are scheduled) and 1 to `longest` - 1 tokens of
    their own."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, vocab, shared).tolist()
    return [prefix + rng.integers(3, vocab, int(rng.integers(1, longest))).tolist() for _ in range(n)]


MAX_TOKENS = 8
# The sequences a test's engine seats, more than any test here runs at once: a GPU engine captures
# a decode graph for every batch-size bucket at its first decode step (1, 2, 4, 8 here; 20 at the
# default 256, each two forward passes, which on the emulator cost more than the whole test).
SEATS = 8


def generate(model_dir, device, prompts, max_tokens=MAX_TOKENS, **engine_args):
    engine = LLMEngine(EngineConfig(model=str(model_dir), device=device, **{"max_num_seqs": SEATS, **engine_args}))
    Metrics.attach(engine)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, return_logits=True)
    return engine, engine.generate(prompts, params)


INT8 = {"kv_cache_dtype": "int8"}
# 13 blocks for prompts_for's default prompts: the fourth prompt is admitted late and a decode
# then runs out (checked on the CPU). Another workload gives its own number (WORKLOADS).
TIGHT = {"num_blocks": 13, "watermark": 0.0}
GPU_CONFIGS = {
    "default": {},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "chunked_prefill": {"max_num_batched_tokens": 24},
    "preempt_swap": {**TIGHT, "preemption": "swap"},
    "preempt_recompute": {**TIGHT, "preemption": "recompute"},
    # An int8 pool, each key scheme, and its scales through prefix hits, chunks and swaps.
    "int8": INT8,
    "int8_token_keys": {**INT8, "kv_int8_keys": "token"},
    "int8_chunked_prefill": {**INT8, "max_num_batched_tokens": 24},
    "int8_preempt_swap": {**INT8, **TIGHT, "preemption": "swap"},
    "int8_preempt_recompute": {**INT8, **TIGHT, "preemption": "recompute"},
}


# Per shape: the prompts (prompts_for's arguments), the tokens generated for each, and the
# blocks of the TIGHT configs. The CPU references of the Llama-3.2-1B shape (float32 NumPy through
# 1.2B weights, every step reading them all) are most of its step's time, so it runs 3 prompts
# of 31-40 tokens rather than 4 of 48-86, and 4 tokens rather than 8: a 30-token shared prefix
# (a block of prefix hits), every prompt longer than chunked_prefill's 24-token steps, 3 decode
# steps, and a pool of 6 blocks that a decode runs out of. Checked on the CPU: every TIGHT config
# preempts, with this model (whose CPU steps are slow) and with a small one whose steps are as
# fast as a GPU's, with which pools of 3 to 8 blocks all do.
WORKLOADS = {
    "smollm2_135m": {"prompts": {}, "max_tokens": MAX_TOKENS, "tight_blocks": TIGHT["num_blocks"]},
    "llama_3.2_1b": {"prompts": {"n": 3, "shared": 30, "longest": 12}, "max_tokens": 4, "tight_blocks": 6},
}


def kv_args(args: dict) -> dict:
    """The flags that choose what the KV pool holds: the CPU run to compare with uses them too."""
    return {k: v for k, v in args.items() if k.startswith("kv_")}


def cpu_reference(model_dir, prompts, max_tokens=MAX_TOKENS, **kv):
    """The CPU run that GPU configs with this KV pool type (kv) are compared with. Every prompt
    in one step: else the scheduler, having learned how slow the CPU's steps are, would cut the
    prompts into chunks, each step reading all the weights again."""
    return generate(model_dir, "cpu", prompts, max_tokens, num_blocks=256, batch_invariant=False,
                    max_num_batched_tokens=TOKEN_BUDGET, **kv)[1]


def check_lora(model_dir, prompts, folder, dtype="auto") -> None:
    """Two LoRA adapters and the base model in one batch on the GPU path (cuda/lora.cu, decode
    steps from CUDA graphs, prefill chunks eager) against the CPU path: greedy tokens, logits
    within LOGIT_TOL. The adapters come after a first request, so graphs captured without them
    must not be replayed with them."""
    from nano.lora import LoRARequest, attach
    from test_lora_pool import make_adapter
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, return_logits=True)
    runs = {}
    for device in ("cpu", "gpu"):
        engine = LLMEngine(EngineConfig(model=str(model_dir), device=device, num_blocks=256, max_num_seqs=SEATS,
                                        max_num_batched_tokens=64, dtype=dtype))
        cfg = engine.model_config
        loras = [LoRARequest("a", 1, str(make_adapter(folder / "a", seed=1, r=4, alpha=4, cfg=cfg))),
                 LoRARequest("b", 2, str(make_adapter(folder / "b", seed=2, r=3, alpha=3, cfg=cfg,
                                                      modules=("q_proj", "v_proj", "down_proj"))))]
        engine.generate(prompts, params)  # decode graphs of these batch sizes captured, no adapters
        attach(engine, max_loras=2, max_lora_rank=4)
        runs[device] = engine.generate(prompts, params, lora_request=[loras[0], None, loras[1], loras[0]][:len(prompts)])
    assert_greedy_runs_agree(runs["cpu"], runs["gpu"], LOGIT_TOLS[engine.device.dtype])  # the GPU engine's


def check_gpu_config(model_dir, prompts, name, cpu_runs: dict, max_tokens=MAX_TOKENS, **gpu_args):
    """GPU_CONFIGS[name], with gpu_args over it, against the CPU path with the same KV pool
    type (from cpu_runs, or run and kept there). Returns the GPU engine and its sequences."""
    args = GPU_CONFIGS[name]
    key = (str(model_dir), tuple(sorted(kv_args(args).items())))
    if key not in cpu_runs:
        cpu_runs[key] = cpu_reference(model_dir, prompts, max_tokens, **kv_args(args))
    engine, gpu = generate(model_dir, "gpu", prompts, max_tokens, **{"num_blocks": 256, **args, **gpu_args})
    assert engine.device.kind == "gpu"
    assert_greedy_runs_agree(cpu_runs[key], gpu, LOGIT_TOLS[engine.device.dtype])
    preempt = name.split("preempt_")[-1] if "preempt_" in name else None
    if preempt:
        assert metrics_of(engine).preemptions[preempt] > 0, name
    return engine, gpu


class StepKinds:
    """An observer: each step's kind, "graph" (a replayed decode graph), "drafts" (an eager step
    that checked drafts) or "eager", and how many drafts were accepted."""

    def __init__(self, engine):
        self.kinds, self.accepted, forward = [], 0, engine.forward
        engine.forward = lambda inputs: (self.kinds.append("graph" if isinstance(inputs, GraphStep) else "eager"),
                                         forward(inputs))[1]

    def on_step(self, plan, *_):
        if any(sample.drafts for sample in plan.samples):
            self.kinds[-1] = "drafts"
        # A draft was accepted if the output token at its row's output count is it.
        self.accepted += sum(len(s.seq.output_token_ids) > s.output_count + j
                             and s.seq.output_token_ids[s.output_count + j] == d
                             for s in plan.samples for j, d in enumerate(s.drafts))

    def on_finish(self, seq):
        pass

    def on_abort(self, seq):
        pass


def check_speculation(model_dir, prompts, max_tokens=16) -> StepKinds:
    """n-gram speculation on the GPU path, drafts checked through the prefill attention kernel,
    against the CPU path without it; the steps that check no draft still replay CUDA graphs
    (a step with a draft anywhere in it runs eagerly, the whole batch)."""
    from nano.speculative import attach
    ref = cpu_reference(model_dir, prompts, max_tokens)
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="gpu", max_num_seqs=SEATS, num_blocks=256))
    attach(engine, {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    kinds = StepKinds(engine)
    engine.observers.append(kinds)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, return_logits=True)
    assert_greedy_runs_agree(ref, engine.generate(prompts, params), LOGIT_TOL)
    assert "graph" in kinds.kinds and "drafts" in kinds.kinds, kinds.kinds
    return kinds


def check_prompt_logprobs(model_dir, prompts, **gpu_args):
    """Prompt logprobs scored on the device (Sampler.score on device arrays) against the
    CPU's: each token's logprob and the k best logprobs, by value (a near-tie may order two
    tokens either way). Returns the largest difference relative to the logprob's size."""
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    cpu = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", num_blocks=256)).generate(prompts, params)
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="gpu", max_num_seqs=SEATS, num_blocks=256, **gpu_args))
    gpu = engine.generate(prompts, params)
    worst = 0.0
    for c, g in zip(cpu, gpu):
        assert c.prompt_logprobs[0] is None and g.prompt_logprobs[0] is None
        for (lp_c, _, top_c), (lp_g, rank_g, top_g) in zip(c.prompt_logprobs[1:], g.prompt_logprobs[1:]):
            assert len(top_g) == 3 and rank_g >= 1
            pairs = [(lp_c, lp_g)] + [(a[1], b[1]) for a, b in zip(top_c, top_g)]
            worst = max(worst, *(abs(a - b) / max(1.0, abs(a)) for a, b in pairs))
    assert worst <= LOGIT_TOLS[engine.device.dtype], worst
    return worst


# The tests of the GPU alone come first (pytest keeps this order within each shape), so that
# the model's build and the GPU's weight load fall in other tests than the CPU's weight load
# and first CPU reference: each test has its own time limit in tests/device_check.sh.
def test_gpu_sampling_is_seeded(shaped_model):
    """Same seed, same batch: same tokens; another seed: other tokens. The batch is kept the
    same (prefix caching off) because float16 logits may differ in their last bits between
    batch shapes, which can flip a sampled token at a near-tie."""
    model_dir, vocab, _ = shaped_model
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="gpu", max_num_seqs=SEATS, num_blocks=256,
                                    enable_prefix_caching=False))
    prompts = prompts_for(vocab, n=2)

    def run(seed):
        params = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=seed, max_tokens=8)
        return [s.output_token_ids for s in engine.generate(prompts, params)]

    assert run(5) == run(5)
    assert run(5) != run(6)


class EvenTokensOnly(LogitsProcessor):
    """Allows the even token ids alone and bans one more: a mask and an edit through the kernels."""
    def __init__(self, vocab, ban):
        self.bits, self.ban = np.packbits(np.arange(vocab) % 2 == 0, bitorder="little"), ban

    def edits(self, seq, ahead):
        return np.int32([self.ban]), np.float32([0.0]), np.float32([1.0]), np.float32([-np.inf])

    def mask(self, seq, ahead):
        return np.pad(self.bits, (0, -len(self.bits) % 4)).view(np.int32)


def test_gpu_logits_processors_change_their_rows_only(shaped_model):
    """Greedy rows: one with a processor (even ids only, its first greedy token banned), one
    without, which keeps the tokens it gets alone; a min_p row stays within min_p's set."""
    model_dir, vocab, _ = shaped_model
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="gpu", max_num_seqs=SEATS, num_blocks=256, enable_prefix_caching=False))
    prompts = prompts_for(vocab, n=2)
    alone = [s.output_token_ids for s in engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8))]
    ban = alone[1][0] if alone[1][0] % 2 == 0 else 0
    params = [SamplingParams(temperature=0, max_tokens=8),
              SamplingParams(temperature=0, max_tokens=8, logits_processor=EvenTokensOnly(vocab, ban))]
    plain, processed = [s.output_token_ids for s in engine.generate(prompts, params)]
    assert plain == alone[0]
    assert all(t % 2 == 0 and t != ban for t in processed), processed
    sampled = engine.generate(prompts * 4, SamplingParams(temperature=1.0, min_p=0.5, max_tokens=4, return_logits=True))
    for seq in sampled:  # every token within min_p of the likeliest, on the raw logits it was drawn from
        for row, token in zip(seq.logits, seq.output_token_ids):
            assert row[token] >= np.float32(row.max() + np.log(np.float32(0.5))), (token, row[token], row.max())


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_swap_round_trip_is_exact(shaped_model, kv_cache_dtype):
    """Swap-out then swap-in through the runner returns the KV bytes (and an int8 pool's
    scales) exactly."""
    import cupy

    model_dir, *_ = shaped_model
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="gpu", max_num_seqs=SEATS, num_blocks=64,
                                    swap_space=2**30, kv_cache_dtype=kv_cache_dtype))
    runner = engine.runner
    pools = runner.kv_cache.block_arrays()
    rng = np.random.default_rng(0)
    for pool in pools:  # random bytes, whatever the dtype
        pool.view(cupy.uint8).set(rng.integers(0, 256, pool.view(cupy.uint8).shape, np.uint8))
    src, dst, host = [3, 17, 40, 5], [60, 1, 22, 9], [0, 7, 2, 11]
    before = [pool[:, :, src].copy() for pool in pools]
    runner.swap(list(zip(src, host)), [])
    runner.swap([], list(zip(host, dst)))
    for pool, saved in zip(pools, before):
        assert cupy.array_equal(saved.view(cupy.uint8), pool[:, :, dst].view(cupy.uint8))


@pytest.fixture(scope="module")
def cpu_runs():
    return {}


ENGINE_CASES = [(shape, config) for shape in SHAPES for config in GPU_CONFIGS
                if shape != "llama_3.2_1b" or "keys" not in config]


# Parametrized over every config and skipped for the cases not in ENGINE_CASES, rather than
# parametrized over ENGINE_CASES (shaped_model indirectly): pytest then keeps each shape's tests
# together, and builds each model once.
@pytest.mark.parametrize("config", list(GPU_CONFIGS))
def test_gpu_engine_matches_cpu(shaped_model, config, cpu_runs):
    model_dir, vocab, shape = shaped_model
    if (shape, config) not in ENGINE_CASES:
        pytest.skip("another key scheme: the same kernels as rotate's, compared on the SmolLM2 shape")
    work = WORKLOADS[shape]
    tight = {"num_blocks": work["tight_blocks"]} if "preempt_" in config else {}
    check_gpu_config(model_dir, prompts_for(vocab, **work["prompts"]), config, cpu_runs, work["max_tokens"], **tight)


def test_gpu_speculation_matches_cpu(shaped_model):
    model_dir, vocab, shape = shaped_model
    if shape != "smollm2_135m":
        pytest.skip("compared on the SmolLM2 shape")
    check_speculation(model_dir, prompts_for(vocab, n=3))


def test_gpu_lora_matches_cpu(shaped_model, tmp_path):
    model_dir, vocab, shape = shaped_model
    if shape != "smollm2_135m":
        pytest.skip("compared on the SmolLM2 shape")
    check_lora(model_dir, prompts_for(vocab), tmp_path)


def test_gpu_prompt_logprobs_match_cpu(shaped_model):
    model_dir, vocab, shape = shaped_model
    if shape != "smollm2_135m":
        pytest.skip("compared on the SmolLM2 shape")
    check_prompt_logprobs(model_dir, prompts_for(vocab, n=2))


@pytest.fixture(scope="module", params=[64, 256])
def gemma3_model(request, tmp_path_factory):
    """The tiny Gemma 3 of tests/families.py at head dim 64 (the kernels' smallest) and 256
    (Gemma 3's own): GeGLU, its norms, sliding (12 keys) and global layers with their own RoPE.
    At 256 its query_pre_attn_scalar is Gemma's 256 too: the case's 24 would make scores ~3x
    sharper than any Gemma's, and an int8 pool's rounding would then pass the tolerance."""
    from tests import families
    edit = {"head_dim": request.param} | ({"query_pre_attn_scalar": 256} if request.param == 256 else {})
    return families.make_model("gemma3_text", tmp_path_factory.mktemp(f"gemma3-{request.param}"), edit=edit)


@pytest.mark.parametrize("config", ["default", "chunked_prefill", "int8"])
def test_gemma3_engine_matches_cpu(gemma3_model, config, cpu_runs):
    check_gpu_config(gemma3_model, prompts_for(512), config, cpu_runs)
