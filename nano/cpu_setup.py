"""Process settings for the CPU path: OpenBLAS threads and kernels, glibc malloc thresholds.
OpenBLAS reads its variables when NumPy loads it, so nano/__init__.py calls configure()
before anything imports NumPy; a variable the user has set is left alone. (The OpenBLAS
part has no effect where NumPy was imported before nano.) BlasThreads then follows the
cores other processes and threads leave free, step by step."""
import ctypes
import os
import time

USER_THREADS = "OPENBLAS_NUM_THREADS" in os.environ  # the user's own choice: kept as it is
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def _cpu_info() -> dict[str, str]:
    """The first CPU's fields in /proc/cpuinfo ("vendor_id", "cpu family", "flags", ...)."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n", 1)[0]
    except OSError:
        return {}
    return {key.strip(): value.strip() for key, _,
            value in (line.partition(":") for line in first.splitlines())}


def configure() -> None:
    # Under mpirun each rank gets its share of this host's cores: ranks that each start a
    # thread per core fight over them (docs/perf_notes.md, CPU section).
    if "OMPI_COMM_WORLD_LOCAL_SIZE" in os.environ:
        share = str(max(1, (os.cpu_count() or 1) // int(os.environ["OMPI_COMM_WORLD_LOCAL_SIZE"])))
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
            os.environ.setdefault(var, share)
    # Zen 4 (AMD family 25) runs a 512-bit operation as two 256-bit halves: there OpenBLAS's Zen
    # (AVX2) kernels beat the SkylakeX (AVX-512) ones it picks; not on Zen 5 (docs/perf_notes.md).
    cpu = _cpu_info()
    zen4 = cpu.get("vendor_id") == "AuthenticAMD" and cpu.get("cpu family") == "25"
    if zen4 and "avx512f" in cpu.get("flags", "").split():
        os.environ.setdefault("OPENBLAS_CORETYPE", "Zen")
    # A forward pass allocates and frees the same large temporaries at every op, which glibc by
    # default maps or trims off the heap, each new one page-faulted in again: keep them (arrays
    # over 32 MiB, glibc's cap, are still mapped; docs/perf_notes.md). Not glibc: nothing to do.
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 32 * 2**20)
        libc.mallopt(M_TRIM_THRESHOLD, 2**30)
    except (OSError, AttributeError):
        pass


class BlasThreads:
    """BLAS threads for the cores the steps can have now, since each GEMM's join waits for a
    thread that another process, or another thread of this one (a server's event loop, its
    grammar compiles), descheduled (docs/perf_notes.md#blas-threads-beside-a-busy-process).
    Nothing is changed where the user set OPENBLAS_NUM_THREADS, or without threadpoolctl or
    /proc."""

    CHECK = 0.5  # seconds between measurements

    def __init__(self, read=None):
        # -> (seconds, idle core-seconds of our cores, the stepping thread's CPU seconds) | None
        self.read = read or _usage
        self.last = self.read()
        try:
            from threadpoolctl import ThreadpoolController
            self.controller = ThreadpoolController().select(user_api="blas")
        except ImportError:  # not installed (a GPU machine has cores to spare)
            self.controller = None
        # At most what BLAS started with: a thread per core, or an MPI rank's share of them.
        self.cores = 1 if USER_THREADS or not self.controller or self.last is None else \
            min(lib.num_threads for lib in self.controller.lib_controllers)
        self.threads = self.cores

    def choose(self) -> None:
        if self.cores == 1:
            return
        now = self.read()
        wall = now[0] - self.last[0]
        if wall < self.CHECK:
            return
        # The steps' own cores: the stepping thread's, and as much again for each BLAS thread
        # beside it (they share its GEMMs); the rest of the process counts as any other load.
        usable = ((now[1] - self.last[1]) + (now[2] - self.last[2]) * self.threads) / wall
        self.last = now
        threads = min(max(int(usable + 0.25), 1), self.cores)
        if threads != self.threads:
            self.controller.limit(limits=threads)
            self.threads = threads


def _usage() -> tuple[float, float, float] | None:
    """(now, idle seconds summed over this process's cores, the calling thread's CPU seconds),
    from /proc/stat (clock ticks of 1/100 s); None where there is no /proc."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    cores = os.sched_getaffinity(0)
    idle = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            idle += int(fields[3]) + int(fields[4])  # idle, iowait
    return time.monotonic(), idle / os.sysconf("SC_CLK_TCK"), time.thread_time()
