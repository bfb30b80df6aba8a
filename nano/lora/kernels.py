"""The GPU's LoRA product: cuda/lora.cu's wrapper, with nano/ops.py's add_lora's arguments.
The core's GPU op set (kernels.CUDA) has none; AdapterPool.op_set puts this one in a GPU
engine's set when adapters are attached. Only a GPU run imports this module; it allocates
through kernels.py's array module (CuPy), as kernels.py's own wrappers do."""
import numpy as np

from nano import kernels
from nano.kernels import LORA_ROWS


def add_lora(y, x, lora, batch):
    """cuda/lora.cu, in place on y: shrink then expand, each as BGMV over the decode rows and
    SGMV over the prefill chunks (grid y sized for the longest possible chunk)."""
    a, b, scales = lora
    t = kernels.element_type(y=y, x=x, a=a, b=b)
    kernels.check_dtype(np.float32, scales=scales)
    kernels.check_dtype(np.int32, lora_slots=batch.lora_slots, cu_seqlens_q=batch.cu_seqlens_q)
    (slots, r, k), (tokens, n), d = a.shape, y.shape, batch.num_decodes
    if x.shape != (tokens, k) or b.shape != (slots, n, r) or not y.flags.c_contiguous:
        raise ValueError(f"add_lora: x {x.shape}, y {y.shape}, A {a.shape}, B {b.shape} do not "
                         f"match (y contiguous)")
    xp = kernels.cupy
    v, x = xp.empty((tokens, r), np.float32), xp.ascontiguousarray(x)  # v: (T, R)
    for name, inputs, widths in (("lora_shrink", (x, a, scales, v), (k, r)),
                                 ("lora_expand", (v, b, scales, y), (r, n))):
        for rows, grid_y, grid_z in ((1, 1, d), (LORA_ROWS, -(-(tokens - d) // LORA_ROWS),
                                                 batch.cu_seqlens_q.size - 1)):
            if grid_y > 0 and grid_z > 0:
                kernels.kernel("lora.cu", f"{name}<{t}, {rows}>")(
                    (-(-widths[1] // 8), grid_y, grid_z), (256,),
                    (*inputs, batch.lora_slots, batch.cu_seqlens_q, np.int32(d),
                     *map(np.int32, widths)))
    return y
