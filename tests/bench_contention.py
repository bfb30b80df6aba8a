"""CPU decode speed on a quiet machine and beside one busy process, side by side.

    python tests/bench_contention.py [--hf-python PATH]

For batch 1 and 32 (64 prompt tokens, 32 generated, greedy, the default model): nano as it
runs by default (BLAS threads chosen by measured contention, nano/cpu_setup.py), nano with
OPENBLAS_NUM_THREADS fixed to every core, and, given a Python that has torch and
transformers (--hf-python; not a dependency), Hugging Face `generate` on as many threads.
Each figure is measured quiet, then with one busy process (a pure-Python loop, as any other
program on a laptop) running beside it. docs/results.md's contention table comes from here.
"""
import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORES = len(os.sched_getaffinity(0))
HF_GENERATE = """
import sys, time, torch
from transformers import AutoModelForCausalLM
torch.set_num_threads(int(sys.argv[2]))
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
batch, new = int(sys.argv[3]), int(sys.argv[4])
ids = torch.randint(10, 40000, (batch, 64), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    model.generate(ids[:, :8], max_new_tokens=4, do_sample=False)  # warm-up
    start, cpu = time.perf_counter(), time.process_time()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                   do_sample=False)
print(f"bench: {batch * new / (time.perf_counter() - start):.1f} output tokens/s, "
      f"{batch * new / (time.process_time() - cpu):.1f} per CPU-second")
"""


def tokens_per_second(cmd: list[str], env: dict) -> float:
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    found = re.search(r"bench: ([\d.]+) output tokens/s", out.stdout)
    if not found:
        raise SystemExit(f"no figure from {' '.join(cmd)}:\n{out.stderr[-2000:]}")
    return float(found.group(1))


def nano_command(batch: int, output_len: int) -> list[str]:
    """run.py --bench as a user runs it: 64 prompt tokens, greedy, all sequences in one batch."""
    return [sys.executable, "run.py", "--bench", "--device", "cpu", "--num-seqs", str(batch), "--max-num-seqs",
            str(batch), "--input-len", "64:64", "--output-len", f"{output_len}:{output_len}", "--temperature", "0"]


def hf_command(hf_python: str, batch: int, output_len: int) -> list[str]:
    """Hugging Face generate on the same workload, on a thread per core."""
    model = str(ROOT / "weights" / "SmolLM2-135M-Instruct")
    return [hf_python, "-c", HF_GENERATE, model, str(CORES), str(batch), str(output_len)]


def user_env() -> dict:
    """This environment without BLAS thread settings: nano chooses its own (nano/cpu_setup.py)."""
    return {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}


def runs(batch: int, hf_python: str | None) -> dict:
    nano, base = nano_command(batch, 32), user_env()
    out = {"nano (threads by contention)": (nano, base),
           f"nano (OPENBLAS_NUM_THREADS={CORES})": (nano, dict(base, OPENBLAS_NUM_THREADS=str(CORES)))}
    if hf_python:
        out[f"transformers generate ({CORES} threads)"] = (hf_command(hf_python, batch, 32), base)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf-python", help="a Python with torch and transformers")
    args = p.parse_args()
    rows = []
    for batch in (1, 32):
        for name, (cmd, env) in runs(batch, args.hf_python).items():
            quiet = tokens_per_second(cmd, env)
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                loaded = tokens_per_second(cmd, env)
            finally:
                busy.kill()
            rows.append(f"| {name} | {batch} | {quiet:.1f} | {loaded:.1f} | {100 * loaded / quiet:.0f}% |")
            print(rows[-1], flush=True)
    print(f"\n{CORES} cores; output tokens/s\n\n| engine | batch | quiet | one busy process | kept |\n"
          "|---|---|---|---|---|\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
