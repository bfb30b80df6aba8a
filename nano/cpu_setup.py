"""Process settings for the CPU path: OpenBLAS threads and kernels, glibc malloc thresholds.
OpenBLAS reads its variables when NumPy loads it, so nano/__init__.py calls configure()
before anything imports NumPy; a variable the user has set is left alone. (The OpenBLAS
part has no effect where NumPy was imported before nano.)"""
import ctypes
import os


def _cpu_flags() -> tuple[str, set[str]]:
    vendor, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "vendor_id":
                    vendor = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return vendor, flags


def configure() -> None:
    # Under mpirun each rank gets its share of this host's cores: with every core per rank,
    # tp=2 on the 2-core CPU ran a decode step in 1.3 s instead of 57 ms.
    if "OMPI_COMM_WORLD_LOCAL_SIZE" in os.environ:
        share = str(max(1, (os.cpu_count() or 1) // int(os.environ["OMPI_COMM_WORLD_LOCAL_SIZE"])))
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
            os.environ.setdefault(var, share)
    # On an AMD CPU with AVX-512, OpenBLAS picks its SkylakeX kernels; its Zen (AVX2) ones ran
    # the default model's LM head (32 x 576 x 49152, float32) in 14-17 ms instead of 23-34
    # on this project's 2-core AMD EPYC VM (OpenBLAS 0.3.31), and the layer GEMMs no slower.
    vendor, flags = _cpu_flags()
    if vendor == "AuthenticAMD" and "avx512f" in flags:
        os.environ.setdefault("OPENBLAS_CORETYPE", "Zen")
    _keep_freed_memory()


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def _keep_freed_memory() -> None:
    """A forward pass allocates and frees the same large temporaries (activations of
    hundreds of KB to MBs) at every op. By default glibc maps those with mmap or trims them
    off the heap when freed, so each new one is page-faulted in again: RMSNorm over 256
    tokens took 690 us with 265 page faults a call, 128 us with none once freed memory is
    kept; the example prompts' TTFT went from 395-696 to 317-351 ms. Arrays over 32 MiB
    (glibc's cap) are still mapped. Not glibc (macOS, musl): nothing to do."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 32 * 2**20)
        libc.mallopt(M_TRIM_THRESHOLD, 2**30)
    except (OSError, AttributeError):
        pass
