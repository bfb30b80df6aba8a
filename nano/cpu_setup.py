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
    # Under mpirun each rank gets its share of this host's cores: ranks that each start a
    # thread per core fight over them (docs/perf_notes.md, CPU section).
    if "OMPI_COMM_WORLD_LOCAL_SIZE" in os.environ:
        share = str(max(1, (os.cpu_count() or 1) // int(os.environ["OMPI_COMM_WORLD_LOCAL_SIZE"])))
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
            os.environ.setdefault(var, share)
    # On an AMD CPU with AVX-512, OpenBLAS picks its SkylakeX kernels; its Zen (AVX2) ones are
    # faster for the model's GEMMs there (measured in docs/perf_notes.md).
    vendor, flags = _cpu_flags()
    if vendor == "AuthenticAMD" and "avx512f" in flags:
        os.environ.setdefault("OPENBLAS_CORETYPE", "Zen")
    _keep_freed_memory()


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def _keep_freed_memory() -> None:
    """A forward pass allocates and frees the same large temporaries (activations of
    hundreds of KB to MBs) at every op. By default glibc maps those with mmap or trims them
    off the heap when freed, so each new one is page-faulted in again (the cost is in
    docs/perf_notes.md). Arrays over 32 MiB (glibc's cap) are still mapped. Not glibc
    (macOS, musl): nothing to do."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 32 * 2**20)
        libc.mallopt(M_TRIM_THRESHOLD, 2**30)
    except (OSError, AttributeError):
        pass
