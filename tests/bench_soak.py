"""A soak of the HTTP server as a busy deployment sees it: concurrent streaming clients, some
prompts near the context limit, for minutes. Reports failed requests, the pauses between a
stream's tokens (every running stream waits for the whole step) and the time to first token.

    python tests/bench_soak.py [--minutes 8] [--clients 16] [--long-share 0.1] [--json out.json]
        [-- extra run.py flags, e.g. --max-num-batched-tokens 2048 --stall-timeout 300]

The server is `run.py --serve --device cpu --max-model-len 2048 --kv-cache-memory 600MB` in a
subprocess; each client loops: a prompt of random token ids (a --long-share of them 1,750 to
2,047 tokens, the rest 16 to 256), 16 to 128 tokens streamed back, EOS ignored. A request
fails when its status is not 200 or its stream ends without `[DONE]`; a client stops at its
first refused connection (the server has ended).
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
from test_server import free_port, httpx, wait_healthy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SERVER = ["--serve", "--device", "cpu", "--max-model-len", "2048", "--kv-cache-memory", "600MB"]


def client(url: str, model: str, seed: int, until: float, long_share: float, results: list) -> None:
    rng = np.random.default_rng(seed)
    with httpx.Client(timeout=600) as http:
        while time.monotonic() < until:
            long = rng.random() < long_share
            prompt = rng.integers(100, 40000, int(rng.integers(1750, 2048) if long else rng.integers(16, 257)))
            body = {"model": model, "prompt": prompt.tolist(), "max_tokens": int(rng.integers(16, 129)),
                    "stream": True, "ignore_eos": True, "temperature": 0}
            start, arrivals, status, done = time.monotonic(), [], None, False
            try:
                with http.stream("POST", url + "/v1/completions", json=body) as r:
                    status = r.status_code
                    for line in r.iter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: ") and '"text"' in line:
                            arrivals.append(time.monotonic())
            except httpx.HTTPError as e:
                status = status or type(e).__name__
            results.append({"long": bool(long), "status": status, "done": done, "start": start,
                            "arrivals": arrivals})
            if status == "ConnectError":  # no server any more: the soak is over for this client
                return


def summarize(results: list, wall: float) -> dict:
    ok = [r for r in results if r["status"] == 200 and r["done"]]
    gaps = np.concatenate([np.diff(r["arrivals"]) for r in ok if len(r["arrivals"]) > 1] or [np.zeros(0)])
    ttft = np.array([r["arrivals"][0] - r["start"] for r in ok if r["arrivals"]])

    def pct(a, q):
        return round(float(np.percentile(a, q)), 3) if len(a) else None
    return {"requests": len(results), "ok": len(ok), "failed": len(results) - len(ok),
            "failures": sorted({str(r["status"]) + ("" if r["done"] else " no [DONE]") for r in results
                                if r not in ok}),
            "long_prompts": sum(r["long"] for r in results), "wall_s": round(wall, 1),
            "gap_s": {"p50": pct(gaps, 50), "p99": pct(gaps, 99), "max": pct(gaps, 100)},
            "ttft_s": {"p50": pct(ttft, 50), "p99": pct(ttft, 99), "max": pct(ttft, 100)}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--minutes", type=float, default=8)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--long-share", type=float, default=0.1)
    p.add_argument("--json", help="also write the summary here")
    p.add_argument("extra", nargs="*", help="more run.py flags (after --)")
    args = p.parse_args()
    port = free_port()
    log = tempfile.TemporaryFile("w+")  # not a pipe: a server whose log nobody reads would block on it
    job = subprocess.Popen([sys.executable, "run.py", *SERVER, "--port", str(port), "--log-level", "warning",
                            *args.extra], cwd=ROOT, stderr=log, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    url = wait_healthy(job, port, 300)
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    results, start = [], time.monotonic()
    until = start + 60 * args.minutes
    threads = [threading.Thread(target=client, args=(url, model, i, until, args.long_share, results))
               for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    summary = summarize(results, time.monotonic() - start)
    summary["server_exit"] = job.poll()  # None: still serving at the end, as it should be
    job.send_signal(signal.SIGINT)
    job.wait(timeout=120)
    log.seek(0)
    summary["server_errors"] = [line for line in log.read().splitlines() if line.startswith("error:")]
    summary["flags"] = [*SERVER, *args.extra]
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
