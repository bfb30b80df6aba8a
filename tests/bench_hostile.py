"""The HTTP server against hostile and unlucky clients: what their requests cost the others.

    python tests/bench_hostile.py [--minutes 3] [--clients 64] [--json out.json] [-- run.py flags]

Two parts, on `run.py --serve --device cpu` (the default model) in a subprocess:

1. Isolation: one unconstrained stream's gaps between tokens, first alone (its p99), then while
   hostile requests arrive at once (8 slow-to-build regexes, a 3,000-rule grammar, a 3,000-deep
   $ref chain, a self-referencing schema, 10,000 bad_words with n 128, one 3.9 MB bad word, 6
   choices of 4,096 strings, and empty or 500-deep fields). Reports its largest gap against
   the quiet p99, each hostile request's status, and /health and /metrics answer times.
2. The controls' cost per step and sequence at the server's limits (128 bad words, 1,024
   logit_bias entries), timed on this process's CPU without a server.
3. Load: --clients clients for --minutes, a quarter sending hostile requests, a quarter
   dropping their streams after a few tokens, half ordinary (streams, and chat with a small
   JSON schema). Reports 5xx answers, ordinary requests that did not get their whole result,
   whether the server lived, its memory (proportional set size, with its engine's process: at
   the start, its largest, at the end, and at each minute), and /health answer times.
"""
import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
from bench_soak import SERVER  # noqa: E402
from test_server import free_port, httpx, wait_healthy  # noqa: E402
from test_server_grammar_limits import ref_chain, rule_chain  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "rank"],
          "properties": {"city": {"type": "string", "maxLength": 12}, "rank": {"type": "integer", "maximum": 99}}}


def hostile_bodies() -> list[tuple[str, str, dict]]:
    """(what, route, body) for each hostile request of the isolation part; the load part picks from them."""
    chat = {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 16}
    words = [f"w{i}" for i in range(10_000)]
    choices = [f"choice number {i:05d} of many" for i in range(4096)]
    nested = "[" * 500 + "]" * 500
    return [
        *[("slow regex", "/v1/completions", {"prompt": "a", "max_tokens": 8, "structured_outputs": {
            "regex": "(a{1000}){1000}"}})] * 8,
        ("3,000 rules", "/v1/completions", {"prompt": "a", "structured_outputs": {"grammar": rule_chain(3000)}}),
        ("3,000-deep $ref", "/v1/chat/completions", {**chat, "response_format": {"type": "json_schema", "json_schema": {
            "name": "deep", "schema": ref_chain(3000)}}}),
        ("$ref #", "/v1/chat/completions", {**chat, "response_format": {"type": "json_schema", "json_schema": {
            "name": "self", "schema": {"$ref": "#"}}}}),
        ("10k bad_words, n 128", "/v1/completions", {"prompt": "a", "n": 128, "max_tokens": 4, "bad_words": words}),
        ("3.9 MB bad word", "/v1/completions", {"prompt": "a", "max_tokens": 4, "bad_words": ["x" * 3_900_000]}),
        *[("4,096 choices", "/v1/completions", {"prompt": "Pick:", "max_tokens": 12, "structured_outputs": {
            "choice": choices}})] * 6,
        ("empty regex", "/v1/completions", {"prompt": "a", "structured_outputs": {"regex": ""}}),
        ("empty choice", "/v1/completions", {"prompt": "a", "structured_outputs": {"choice": []}}),
        ("500-deep arguments", "/v1/chat/completions", {"messages": [
            {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "f", "arguments": nested}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}], "max_tokens": 4}),
    ]


def stream_gaps(url: str, model: str, tokens: int) -> list[float]:
    """One unconstrained stream of `tokens` tokens: the seconds between its chunks."""
    body = {"model": model, "prompt": "Count: 1, 2, 3,", "max_tokens": tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    arrivals = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
    return np.diff(arrivals).tolist()


class Poller(threading.Thread):
    """Times GET /health and /metrics every `every` seconds until stopped."""

    def __init__(self, url: str, every: float = 0.25):
        super().__init__(daemon=True)
        self.url, self.every, self.times, self.failed = url, every, {"/health": [], "/metrics": []}, 0
        self.done = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=30) as http:
            while not self.done.is_set():
                for path, times in self.times.items():
                    start = time.monotonic()
                    try:
                        ok = http.get(self.url + path).status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    times.append(time.monotonic() - start)
                    self.failed += not ok
                self.done.wait(self.every)

    def summary(self) -> dict:
        self.done.set()
        self.join()
        return {path: {"n": len(t), "p50_ms": round(1000 * float(np.median(t)), 1),
                       "max_ms": round(1000 * max(t), 1)} for path, t in self.times.items()} | {"failed": self.failed}


def isolation(url: str, model: str) -> dict:
    quiet = stream_gaps(url, model, 200)
    poller = Poller(url)
    poller.start()
    statuses = {}
    # The bodies made and one client opened before the burst: a client per request would load
    # the system's CA certificates for each (httpx's SSL context, ~0.1 s of CPU), and on 2 cores
    # this process's work would be charged to the server.
    bodies, http = hostile_bodies(), httpx.Client(timeout=600)

    def send(what, route, body):
        try:
            r = http.post(url + route, json={"model": model, **body})
            why = r.json()["error"]["message"][:100] if r.status_code != 200 else ""
            statuses.setdefault(what, []).append(f"{r.status_code} {why}".strip())
        except httpx.HTTPError as e:
            statuses.setdefault(what, []).append(type(e).__name__)
    gaps = []
    measured = threading.Thread(target=lambda: gaps.extend(stream_gaps(url, model, 200)))
    measured.start()
    time.sleep(1.0)  # the stream is under way when the hostile requests arrive
    senders = [threading.Thread(target=send, args=b) for b in bodies]
    for t in senders:
        t.start()
    for t in senders + [measured]:
        t.join()
    http.close()
    p99 = float(np.percentile(quiet, 99))
    return {"quiet_gap_p99_ms": round(1000 * p99, 1), "loaded_gap_max_ms": round(1000 * max(gaps), 1),
            "loaded_gap_p99_ms": round(1000 * float(np.percentile(gaps, 99)), 1),
            "max_over_quiet_p99": round(max(gaps) / p99, 2), "hostile_statuses": statuses, "polls": poller.summary()}


def controls_cost() -> dict:
    """Microseconds a step spends on one sequence's controls (Controls.edits), at the limits."""
    from nano import weights
    from nano.controls import Controls, bad_words_ids
    from nano.sequence import SamplingParams, Sequence
    from nano.server.limits import Limits
    from nano.tokenizer import Tokenizer
    limits, rng = Limits(), np.random.default_rng(0)
    tokenizer = Tokenizer(weights.WEIGHTS_DIR / weights.DEFAULT_MODEL)
    words = bad_words_ids(tokenizer, ["".join(chr(97 + c) for c in rng.integers(0, 26, 8)) + " word"
                                      for _ in range(limits.bad_words)])
    bias = {int(t): 1.0 for t in rng.choice(49152, limits.logit_bias, replace=False)}
    cases = {"one bad word": Controls(bad_words_ids=[[5]]), f"{limits.bad_words} bad words": Controls(bad_words_ids=words),
             f"{limits.logit_bias} logit_bias": Controls(logit_bias=bias),
             "both, and three penalties": Controls(1.1, 0.5, 0.5, bias, 0, (), words)}
    out = {}
    for name, controls in cases.items():
        seq = Sequence(0, "", list(range(200)), SamplingParams(), 0.0, 0)
        seq.token_ids += rng.integers(0, 49152, 300).tolist()  # 300 output tokens so far
        start = time.perf_counter()
        for _ in range(2000):
            controls.edits(seq)
        out[name] = round((time.perf_counter() - start) / 2000 * 1e6, 1)
    return out


def rss_mb(pid: int) -> float:
    """The server's memory: its process's and its children's (the engine's process, forked from
    it) proportional set sizes, so that the pages they share (the weights) count once."""
    pids = [pid] + [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    total = 0
    for p in pids:
        for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                total += int(line.split()[1])
    return total / 1024


def load_client(url: str, model: str, kind: str, seed: int, until: float, out: list) -> None:
    rng, hostile = random.Random(seed), hostile_bodies()
    with httpx.Client(timeout=600) as http:
        while time.monotonic() < until:
            record = {"kind": kind, "status": None, "whole": False}
            try:
                if kind == "hostile":
                    what, route, body = rng.choice(hostile)
                    record["what"] = what
                    record["status"] = http.post(url + route, json={"model": model, **body}).status_code
                    record["whole"] = True
                elif kind == "dropping":
                    body = {"model": model, "prompt": "Tell me a story.", "max_tokens": 200, "stream": True,
                            "ignore_eos": True}
                    with http.stream("POST", url + "/v1/completions", json=body) as r:
                        record["status"] = r.status_code
                        for i, _ in enumerate(r.iter_lines()):
                            if i >= rng.randint(2, 12):
                                break  # the client goes away mid-stream
                    record["whole"] = True
                elif rng.random() < 0.5:
                    body = {"model": model, "prompt": "The city of", "max_tokens": rng.randint(8, 48),
                            "stream": True, "temperature": 0.7, "seed": seed}
                    with http.stream("POST", url + "/v1/completions", json=body) as r:
                        record["status"] = r.status_code
                        record["whole"] = any(line == "data: [DONE]" for line in r.iter_lines())
                else:
                    body = {"model": model, "messages": [{"role": "user", "content": "A city and its rank, in JSON."}],
                            "max_tokens": 48, "response_format": {"type": "json_schema", "json_schema": {
                                "name": "city", "schema": SCHEMA}}}
                    r = http.post(url + "/v1/chat/completions", json=body)
                    record["status"] = r.status_code
                    choice = r.json()["choices"][0] if r.status_code == 200 else None
                    record["whole"] = choice is not None and choice["finish_reason"] in ("stop", "length")
            except httpx.HTTPError as e:
                record["status"] = record["status"] or type(e).__name__
            out.append(record)


def load(url: str, model: str, pid: int, clients: int, minutes: float) -> dict:
    kinds = ["hostile"] * (clients // 4) + ["dropping"] * (clients // 4)
    kinds += ["ordinary"] * (clients - len(kinds))
    out, until = [], time.monotonic() + 60 * minutes
    poller = Poller(url, every=1.0)
    poller.start()
    rss = [(0.0, rss_mb(pid))]
    threads = [threading.Thread(target=load_client, args=(url, model, k, i, until, out)) for i, k in enumerate(kinds)]
    start = time.monotonic()
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        time.sleep(5)
        rss.append((round(time.monotonic() - start), round(rss_mb(pid), 1)))
    ordinary = [r for r in out if r["kind"] == "ordinary"]
    return {"requests": len(out), "by_kind": {k: sum(r["kind"] == k for r in out) for k in set(kinds)},
            "5xx": sum(isinstance(r["status"], int) and r["status"] >= 500 for r in out),
            "ordinary_lost": sum(not (r["status"] == 200 and r["whole"]) for r in ordinary),
            "hostile_statuses": sorted({(r["what"], r["status"]) for r in out if r["kind"] == "hostile"}),
            "memory_mb": {"start": rss[0][1], "max": max(m for _, m in rss), "end": rss[-1][1],
                       "each_minute": [m for t, m in rss if t % 60 < 5][1:]},
            "polls": poller.summary()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--minutes", type=float, default=3)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--json", help="also write the summary here")
    p.add_argument("--skip-load", action="store_true", help="the isolation part only")
    p.add_argument("extra", nargs="*", help="more run.py flags (after --)")
    args = p.parse_args()
    port = free_port()
    log = tempfile.TemporaryFile("w+")  # not a pipe: a server whose log nobody reads would block on it
    flags = [*SERVER, "--max-queued-requests", "512", *args.extra]
    job = subprocess.Popen([sys.executable, "run.py", *flags, "--port", str(port), "--log-level", "warning"],
                           cwd=ROOT, stderr=log, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    url = wait_healthy(job, port, 300)
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    summary = {"flags": flags, "isolation": isolation(url, model), "controls_us_per_step": controls_cost()}
    print(json.dumps(summary, indent=1), flush=True)
    if not args.skip_load:
        summary["load"] = load(url, model, job.pid, args.clients, args.minutes)
    summary["server_alive_at_end"] = job.poll() is None
    job.send_signal(signal.SIGINT)
    job.wait(timeout=120)
    log.seek(0)
    summary["server_log_errors"] = [line for line in log.read().splitlines() if " ERROR " in line]
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
