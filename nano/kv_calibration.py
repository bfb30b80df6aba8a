"""Per-channel key pre-scales for the int8 "channel" key scheme (kv_cache.py), measured at
load: run the model once over a short shipped English text into a scratch full-precision
cache, and take each channel's largest |K| per (layer, KV head).

  a[layer, head, c] = max(amax[c], amax[c + d/2]) / max over channels
  s = max(sqrt(a), MIN_SCALE)
Why a RoPE pair shares one scale, and why the square root: docs/int8-kv.md. Under tensor
parallelism every rank keeps its own KV heads' scales.
"""
import numpy as np

from nano.corpus import CALIBRATION_TOPICS, english_text
from nano.kv_cache import KVCache
from nano.model import ForwardBatch
from nano.plan import StepSizes, pack_step, unpack_step

CALIBRATION_TOKENS = 512
MIN_SCALE = 2.0 ** -6


def calibration_tokens(tokenizer) -> np.ndarray:
    """(CALIBRATION_TOKENS,) int32 ids of the calibration text."""
    text = "\n\n".join(english_text(t) for t in CALIBRATION_TOPICS)
    return np.asarray(tokenizer.encode(text)[:CALIBRATION_TOKENS], np.int32)


def key_channel_scales(model, device, token_ids: np.ndarray, block_size: int) -> np.ndarray:
    """(num_layers, nkv, d) float32 pre-scales for this rank's KV heads, from one prefill of
    token_ids (int32, every rank the same) into a scratch cache of the device's dtype."""
    cfg, n = model.cfg, len(token_ids)
    blocks = -(-n // block_size)
    scratch = KVCache(device.xp, cfg.num_layers, blocks, model.num_kv_heads, block_size, cfg.head_dim,
                      device.dtype, "auto")
    positions, sizes = np.arange(n), StepSizes(tokens=n, seqs=1, max_blocks=blocks, logits=1)
    packed = pack_step(sizes, blocks_to_swap_out=(), blocks_to_swap_in=(), input_ids=token_ids, positions=positions,
                       slot_mapping=positions, context_lens=[n], block_tables=np.arange(blocks), cu_seqlens_q=[0, n],
                       logits_indices=[n - 1])  # one prefill of the whole text into blocks 0, 1, ...
    model.forward(ForwardBatch.from_step(unpack_step(device.xp.asarray(packed), sizes), 0), scratch)
    keys = device.to_host(scratch.data[:, 0]).astype(np.float32)    # (L, blocks, nkv, bs, d)
    amax = np.abs(keys).max(axis=(1, 3))                            # (L, nkv, d); unused slots are 0
    half = cfg.head_dim // 2
    pair = np.maximum(amax[..., :half], amax[..., half:])
    amax = np.concatenate([pair, pair], axis=-1)
    top = amax.max(axis=-1, keepdims=True)
    return np.maximum(np.sqrt(amax / np.where(top > 0, top, 1)), MIN_SCALE).astype(np.float32)
