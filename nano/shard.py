"""What every tensor-parallel rank loads (load_shard: LLMEngine on rank 0, fleet/worker.Worker
on the others). Loading runs on every rank in step: its failures are shared
(Group.together), and the ranks agree on one number of blocks, since rank 0 schedules for
all of them."""
from dataclasses import dataclass
from pathlib import Path

from nano import kv_cache, ops, parallel
from nano.invariant import BATCH_INVARIANT
from nano.config import EngineConfig, ModelConfig, max_model_len
from nano.device import Device, gpu_of, host_memory, select_device
from nano.errors import NanoError
from nano.runner import ModelRunner
from nano.tokenizer import Tokenizer
from nano.tp import load_model, partition
from nano.weights import open_model


@dataclass
class Shard:
    """One rank's part of the engine, loaded: its slice of the model on its device, and its
    KV pool (in the runner), which holds only its KV heads."""
    model_dir: Path
    model_config: ModelConfig
    tokenizer: Tokenizer | None      # rank 0's alone
    max_model_len: int
    device: Device
    runner: ModelRunner
    num_blocks: int                  # the same on every rank
    num_swap_blocks: int
    kv_bytes_per_token: int          # this rank's
    weight_bytes: int                # this rank's


def load_shard(config: EngineConfig, group: parallel.Group) -> Shard:
    """This rank's weights on its device and its KV pool, sized from what is left."""
    with group.together():  # a rank failing here fails them all, before any collective
        config.validate()
        group.require(config.tp)
        folder = open_model(config.model, tokenizer=group.rank == 0)
        cfg, context = folder.config, max_model_len(config, folder.config)
        part = partition(cfg, group.rank, group.world)  # this rank's heads and columns
        kind = select_device(config.device)
        # The batch-invariant ops (invariant.BATCH_INVARIANT) are NumPy's.
        if config.batch_invariant and kind == "gpu":
            raise NanoError("--batch-invariant is CPU-only")
        device = Device(kind, gpu_of(group.rank) if kind == "gpu" else 0,
                        config.element_dtype(cfg, kind))
        if config.key_scheme == "rotate" and cfg.head_dim & (cfg.head_dim - 1):
            raise NanoError(f"--kv-int8-keys rotate needs a power-of-two head dim, the model's is "
                            f"{cfg.head_dim} (give --kv-int8-keys token)")
        # Unless told, an int8 pool on the CPU runs the batch-invariant ops: its promise (the
        # same tokens whatever the batch) holds only with them (docs/int8-kv.md).
        default = kind == "cpu" and config.kv_cache_dtype == "int8"
        invariant = default if config.batch_invariant is None else config.batch_invariant
        model = load_model(folder.reader, cfg, part, device.put, context, group.all_reduce,
                           op_set(kind, invariant))

    per_token = kv_cache.bytes_per_token(cfg, part.num_kv_heads, config.kv_cache_dtype,
                                         device.itemsize)
    block_bytes = per_token * config.block_size
    # Free memory measured once every rank has loaded its weights (the together block above).
    memory = kv_cache.pool_memory(config, device.kind, device.free_memory(), group.rank,
                                  group.world)
    num_blocks = group.min(kv_cache.pool_blocks(config, memory, per_token))
    if num_blocks < 1:  # agreed, so every rank raises it
        raise parallel.SharedError(f"KV cache memory holds no block of {block_bytes} bytes")
    num_swap_blocks = group.min(config.swap_space // block_bytes)
    with group.together():
        _check_memory(device, num_blocks * block_bytes, num_swap_blocks * block_bytes)
    runner = ModelRunner(model, device, num_blocks, num_swap_blocks, config.block_size,
                         config.kv_cache_dtype, config.key_scheme, group.broadcast,
                         # MPI all-reduces run on the host: a TP step cannot be captured
                         cuda_graphs=not config.enforce_eager and group.world == 1,
                         max_num_seqs=config.max_num_seqs, max_model_len=context)
    return Shard(folder.path, cfg, folder.tokenizer, context, device, runner, num_blocks,
                 num_swap_blocks, per_token, model.nbytes)


def op_set(kind: str, invariant: bool) -> ops.OpSet:
    """The ops a shard runs, chosen once: the CUDA kernels on a GPU (nano/kernels.py needs
    CuPy: imported only then), else the NumPy references or their batch-invariant set."""
    if kind == "gpu":
        from nano import kernels
        return kernels.CUDA
    return BATCH_INVARIANT if invariant else ops.REFERENCE


def _check_memory(device: Device, kv_bytes: int, swap_bytes: int) -> None:
    """Refuse a KV pool or swap space the machine cannot hold, before allocating it: the pool
    is written as it fills, so it must fit in what is free now; swap space is only touched
    under preemption, so it must fit in the machine's memory."""
    free = device.free_memory()
    if kv_bytes > free:
        where = "GPU" if device.kind == "gpu" else "host"
        raise NanoError(f"a KV cache of {kv_bytes / 1e9:.2f} GB does not fit: {free / 1e9:.2f} GB "
                        f"of "
                        f"{where} memory is available (give a smaller --kv-cache-memory or "
                        f"--num-blocks)")
    _, total = host_memory()
    if swap_bytes > total:
        raise NanoError(f"swap space of {swap_bytes / 1e9:.2f} GB does not fit: this machine has "
                        f"{total / 1e9:.2f} GB of memory (give a smaller --swap-space)")
