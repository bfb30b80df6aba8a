"""One mpirun across two hosts, stood in for by two network namespaces of this machine
(tests/netns.py): TCP on the veth the only way between them, the second host with its own
hostname, /tmp, /proc, process ids and a monotonic clock a day ahead. --tp 2, --dp 2 and
--disagg 1:1, one rank per host, give one process's greedy tokens on the default model; the
server answers under --tp 2; a cut link or a killed rank ends the job, mpirun included, naming
the host and rank. Skipped where namespaces cannot be made (no root, no ip)."""
import ctypes
import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest
from netns import DECOY, SUBNET, TwoHosts, Unavailable, python_ranks
from test_tp import ROOT, TIMEOUT, have_mpi, mpirun, rank_pid

from nano.telemetry import launcher, watchdog

PROMPTS = ["The capital of France is", "Write a haiku about the sea."]
TOKENS = ["--temperature", "0", "--max-tokens", "6", "--no-chat"]
STALL = 6  # --stall-timeout of the fault runs, seconds
# seconds from the cut to mpirun's return: the stall timeout, a heartbeat's period (at most 1 s),
# the server's grace for its clients' errors, the launcher's after MPI_Abort, and slack
ENDED = STALL + 1 + watchdog.GRACE + launcher.GRACE + 4
SILENT = f"has sent nothing for {STALL} s: stopped, wedged or cut off (--stall-timeout)"


@pytest.fixture(scope="module")
def hosts():
    """The two hosts, made once for the module and removed at its end, whatever happened."""
    if not have_mpi():
        pytest.skip("needs mpi4py and mpirun")
    two = TwoHosts()
    try:
        two.create()
    except Unavailable as e:
        pytest.skip(str(e))
    try:
        yield two
    finally:
        two.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The prompt file and the outputs' folder: under /tmp, which the second host cannot see,
    so only rank 0 may read or check them."""
    folder = tmp_path_factory.mktemp("multihost")
    (folder / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return folder


def run(args: list[str], launcher: list[str] = (), env: dict | None = None) -> subprocess.CompletedProcess:
    env = env or dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return subprocess.run([*launcher, sys.executable, "run.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def one_process(files):
    """--output records of one process on the default model: what every two-host run must give."""
    out = files / "one.jsonl"
    proc = run(["--prompt-file", str(files / "prompts.txt"), *TOKENS, "--output", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.parametrize("mode", [["--tp", "2"], ["--dp", "2"], ["--disagg", "1:1"]], ids=["tp2", "dp2", "disagg"])
def test_one_rank_per_host_gives_one_process_tokens(hosts, files, one_process, mode):
    """Each mode across the two hosts: one process's tokens; the traffic on the veth, none on
    the decoy network; TTFT and TPOT and the metrics' times on one clock, though the second
    host's is a day ahead (each rank moves a request's times onto its own as it arrives)."""
    name = mode[0].strip("-")
    out, summary, metrics = files / f"{name}.jsonl", files / f"{name}.json", files / f"{name}-m.jsonl"
    before, decoy = hosts.sent(), hosts.sent(decoy=True)
    proc = run(["--prompt-file", str(files / "prompts.txt"), *TOKENS, *mode, "--output", str(out),
                "--summary-json", str(summary), "--metrics-file", str(metrics)],
               hosts.mpirun(mpirun()), hosts.env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["token_ids"] for r in records] == [r["token_ids"] for r in one_process]
    if name == "dp":
        assert {r["replica"] for r in records} == {0, 1}
    sent = hosts.sent() - before
    tokens = sum(r["num_prompt_tokens"] + len(r["token_ids"]) for r in records)
    least = {"tp": 2 * 30 * 576 * 4 * tokens // 2,  # half of two all-reduces of a hidden row per layer and token
             "disagg": 30 * 3 * 64 * 2 * 4 * records[0]["num_prompt_tokens"] // 2,  # half a prompt's KV
             "dp": 1000}[name]  # a request and its result
    assert sent > least, (sent, least)
    assert hosts.sent(decoy=True) - decoy < 20000  # its own neighbour discovery at most
    s = json.loads(summary.read_text())
    assert 0 < s["ttft_p99_ms"] < 60000 and 0 <= s["tpot_p99_ms"] < 60000, s
    times = [json.loads(line)["time"] for line in metrics.read_text().splitlines() if '"time"' in line]
    assert times and max(times) - min(times) < 600, times


class InHost(threading.Thread):
    """fn() run on a thread inside a network namespace (setns moves only the calling thread),
    so that its sockets reach what listens on that host's loopback."""

    def __init__(self, host: str, fn):
        super().__init__(daemon=True)
        self.host, self.fn, self.result, self.error = host, fn, None, None

    def run(self):
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/var/run/netns/{self.host}", os.O_RDONLY)
        try:
            if libc.setns(fd, 0x40000000):  # CLONE_NEWNET
                raise OSError(ctypes.get_errno(), "setns")
            self.result = self.fn()
        except BaseException as e:  # handed to the test's thread
            self.error = e
        finally:
            os.close(fd)

    def get(self, timeout: float):
        self.join(timeout)
        assert not self.is_alive(), "the client is still waiting"
        if self.error:
            raise self.error
        return self.result


def error_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("error:")]


def reader(job: subprocess.Popen) -> list[str]:
    """job's stderr lines as they come, in a list that a thread fills."""
    lines = []
    threading.Thread(target=lambda: lines.extend(line.rstrip("\n") for line in job.stderr), daemon=True).start()
    return lines


def ended(hosts, job, lines, expected: set[str], within: float) -> None:
    """Within `within` seconds of the cut, the link still down: every expected error line said,
    no rank left on either host, mpirun returned, and nothing left on the far host (its daemon
    gone too), each launcher ended by its rank's watcher (nano/telemetry/launcher.py)."""
    while not (expected <= set(error_lines(lines)) and not python_ranks(hosts) and job.poll() is not None
               and not hosts.pids(hosts.b)):
        assert time.monotonic() < hosts.cut + within, (error_lines(lines), python_ranks(hosts), job.poll(),
                                                       hosts.pids(hosts.b), lines[-20:])
        time.sleep(0.2)
    assert job.returncode != 0 and "Traceback" not in "\n".join(lines), lines[-40:]


def test_serve_tp2_across_hosts_answers_and_a_cut_link_ends_it_naming_host_and_rank(hosts, one_process):
    """The server on the first host under --tp 2, rank 1 on the second: a completion is one
    process's; mpirun's daemon and the ranks talk over the veth. Then the veth is cut with a
    stream open: the stream ends with an error event naming rank 1 and its host, and within
    the stall timeout each side's rank says which rank on which host went silent, and ends."""
    pytest.importorskip("fastapi")
    from test_server import httpx
    port = 8000  # the first host's loopback is the test's own
    job = subprocess.Popen([*hosts.mpirun(mpirun()), sys.executable, "run.py", "--serve", "--tp", "2", "--port",
                            str(port), "--kv-cache-memory", "100MB", "--stall-timeout", str(STALL)],
                           cwd=ROOT, env=hosts.env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines, url = reader(job), f"http://127.0.0.1:{port}"
    started, cut = threading.Event(), threading.Event()

    def client():
        deadline = time.monotonic() + TIMEOUT
        while True:
            assert job.poll() is None and time.monotonic() < deadline, lines[-20:]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0}
        text = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        started.set()
        cut.wait(TIMEOUT)
        stream = []
        body = {"prompt": PROMPTS[1], "max_tokens": 4000, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    stream.append(line)
                    if len(stream) == 4:
                        hosts.link(False)
        except httpx.HTTPError:  # the server ends after the error event
            pass
        return text, stream

    try:
        thread = InHost(hosts.a, client)
        thread.start()
        assert started.wait(TIMEOUT), lines[-20:]
        # mpirun's daemon on the second host and rank 1 each hold a connection to the first
        # host's veth address: the launch (PMIx's out-of-band messages) and MPI's both go by it.
        ss = subprocess.run(["ip", "netns", "exec", hosts.b, "ss", "-tnpH", "state", "established"],
                            capture_output=True, text=True).stdout
        peers = {(m.group(2), m.group(1)) for m in re.finditer(r"\s(\S+):\d+\s+users:\(\(\"(\w+)\"", ss)}
        first = SUBNET.replace("0/24", "1")
        assert ("prted", first) in peers and ("python", first) in peers, ss
        assert not any(peer.startswith(DECOY[:-5]) for _, peer in peers), ss
        cut.set()
        text, stream = thread.get(TIMEOUT)
        assert text == one_process[0]["text"]
        message = f"rank 1 on {hosts.b} {SILENT}"
        assert any(message in line for line in stream if line.startswith("data: {")), stream[-3:]
        ended(hosts, job, lines, {f"error: {message}", f"error: rank 0 on {hosts.a} {SILENT}"}, ENDED)
    finally:
        hosts.link(True)
        if job.poll() is None:
            job.kill()


def test_a_killed_rank_on_the_other_host_ends_the_job_naming_host_and_rank(hosts, files):
    """kill -9 of rank 1 on the second host mid-run: mpirun ends the job at once with a notice
    naming the other host (and the rank, when the daemon's word comes first), and no rank is left."""
    metrics = files / "killed.jsonl"
    job = subprocess.Popen([*hosts.mpirun(mpirun()), sys.executable, "run.py", "--tp", "2", "--bench", "--num-seqs",
                            "2", "--input-len", "8", "--output-len", "4000", "--kv-cache-memory", "100MB",
                            "--stall-timeout", str(STALL), "--metrics-file", str(metrics)],
                           cwd=ROOT, env=hosts.env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines = reader(job)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
            assert job.poll() is None and time.monotonic() < deadline, lines[-20:]
            time.sleep(0.2)
        os.kill(rank_pid(job.pid, 1), 9)
        job.wait(timeout=STALL + 10)
        assert job.returncode != 0 and not python_ranks(hosts)
        notice = " ".join(lines)
        # Open MPI reports whichever it sees first: the daemon's word that the rank died, or rank 0's
        # TCP link to it closing (its "peer hung up" notice names the peer's host, not its rank).
        assert re.search(rf"rank 1 with PID \d+ on node {hosts.b} exited on signal 9|Peer host:\s+{hosts.b}",
                         notice), lines[-20:]
    finally:
        if job.poll() is None:
            job.kill()
