"""Loading LoRA adapters while the server streams: the gaps between a stream's tokens while
POST /v1/load_lora_adapter reads folders, against the same requests for folders that do not
exist (the route's work without the read), and the time one folder takes to read alone.

    python tests/bench_lora_load.py [--streams 4] [--loads 8] [--rank 16]

The default model on the CPU, served by run.py --serve --enable-lora in its own process with
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; --streams greedy streams of the base model run while
nothing is sent for 2 s, then --loads requests for missing folders (404s), then --loads adapters of --rank on all seven
projections (random PEFT folders of the model's shape), are sent one after another. Prints a
markdown table: for each phase, the streams' median and longest gap between chunks (a chunk a
decode step) and its wall time."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import nano  # noqa: E402, F401  (first: nano's BLAS settings, before anything loads NumPy)
import numpy as np  # noqa: E402

from nano.config import ModelConfig  # noqa: E402
from nano.lora import LoRARequest, read_adapter  # noqa: E402
from nano.weights import resolve_model  # noqa: E402
from test_lora_pool import make_adapter  # noqa: E402
from test_server import free_port, httpx, wait_healthy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--loads", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    args = p.parse_args()
    cfg = ModelConfig.from_hf(json.loads((resolve_model(None) / "config.json").read_text()))
    port = free_port()
    env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
    server = subprocess.Popen([sys.executable, "run.py", "--serve", "--port", str(port), "--device", "cpu",
                               "--kv-cache-memory", "300MB", "--enable-lora", "--max-lora-rank", str(args.rank)],
                              cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = wait_healthy(server, port, 300)
        with tempfile.TemporaryDirectory() as tmp:
            folders = [make_adapter(Path(tmp) / f"a{i}", seed=i, r=args.rank, alpha=2 * args.rank, cfg=cfg)
                       for i in range(args.loads)]
            started = time.perf_counter()
            read_adapter(LoRARequest("probe", 1, str(folders[0])), cfg, args.rank)
            read_ms = 1000 * (time.perf_counter() - started)
            times = [[] for _ in range(args.streams)]
            threads = [threading.Thread(target=stream, args=(url, i, t)) for i, t in enumerate(times)]
            for t in threads:
                t.start()
            while min(map(len, times)) < 10:  # every stream past its prefill
                time.sleep(0.05)
            phases, client = {}, httpx.Client(timeout=60)  # one client: a new one costs ~50 ms of this process
            missing = [f"{tmp}/none{i}" for i in range(args.loads)]
            for phase, paths, status in (("no requests (2 s)", [], None), ("missing folders (404)", missing, 404),
                                         ("adapters read and loaded", list(map(str, folders)), 200)):
                start = time.perf_counter()
                for i, path in enumerate(paths):
                    r = client.post(url + "/v1/load_lora_adapter", json={"lora_name": f"{phase[0]}{i}",
                                                                          "lora_path": path})
                    assert r.status_code == status, r.text
                if not paths:
                    time.sleep(2.0)
                phases[phase] = (start, time.perf_counter())
                time.sleep(1.0)  # steps between the phases
            for t in threads:
                t.join()
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"read one folder alone (rank {args.rank}, all 7 projections): {read_ms:.0f} ms\n")
    print(f"| phase ({args.loads} requests each) | wall | gap between chunks: median | longest |")
    print("|---|---|---|---|")
    for phase, (start, end) in phases.items():
        gaps = [b - a for t in times for a, b in zip(t, t[1:]) if b >= start and a <= end]
        print(f"| {phase} | {1000 * (end - start):.0f} ms | {1000 * np.median(gaps):.0f} ms | "
              f"{1000 * max(gaps):.0f} ms |")


def stream(url: str, index: int, times: list[float]) -> None:
    """One greedy stream of the base model; the arrival time of each chunk into times."""
    body = {"prompt": f"Story {index}: once upon a time", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())


if __name__ == "__main__":
    main()
