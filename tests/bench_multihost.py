"""What tensor parallelism's all-reduces cost over TCP between two hosts, against shared
memory on one: a --tp 2 step of SmolLM2-135M does two all-reduces per layer (30 layers) of
a (tokens, 576) float32 array. Both ranks time that step's 60 all-reduces, alone, for a
decode of one sequence, 32 sequences and a 256-token prefill chunk: once with both ranks on
this host over shared memory (--mca btl sm,self), once with one rank in each of two network
namespaces joined by a veth pair, over TCP (tests/netns.py). Needs root for the namespaces.

    .venv/bin/python tests/bench_multihost.py            # the table, one row per step size
    .venv/bin/python tests/bench_multihost.py --steps 50
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netns import ROOT, TwoHosts  # noqa: E402

LAYERS, HIDDEN, ROWS = 30, 576, (1, 32, 256)


def worker(steps: int) -> None:
    """Under mpirun: every rank times `steps` steps of 2 x LAYERS all-reduces per row count;
    rank 0 prints the median step, in ms, as JSON."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    out = {}
    for rows in ROWS:
        x, y = np.ones((rows, HIDDEN), np.float32), np.empty((rows, HIDDEN), np.float32)
        times = []
        for _ in range(steps + 3):  # the first three warm the connections up
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(2 * LAYERS):
                comm.Allreduce(x, y)
            times.append(time.perf_counter() - start)
        out[rows] = 1e3 * float(np.median(times[3:]))
    if comm.Get_rank() == 0:
        print(json.dumps(out))


def measure(launcher: list[str], env: dict, steps: int) -> dict:
    proc = subprocess.run([*launcher, sys.executable, __file__, "--worker", "--steps", str(steps)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        sys.exit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.steps)
    mpirun = str(Path(sys.executable).parent / "mpirun")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    shared = measure([mpirun, "-n", "2", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
                      "--mca", "btl", "sm,self"], env, args.steps)
    hosts = TwoHosts()
    hosts.create()
    try:
        tcp = measure([*hosts.mpirun(mpirun), "-n", "2"], hosts.env(), args.steps)
    finally:
        hosts.close()
    print(f"2 x {LAYERS} all-reduces of (rows, {HIDDEN}) float32 per step, median of {args.steps} steps, ms")
    print("| rows | bytes each | shared memory, one host | TCP, two namespaces | ratio |")
    print("|---:|---:|---:|---:|---:|")
    for rows in ROWS:
        s, t = shared[str(rows)], tcp[str(rows)]
        print(f"| {rows} | {rows * HIDDEN * 4} | {s:.2f} | {t:.2f} | {t / s:.1f}x |")


if __name__ == "__main__":
    main()
