"""Two hosts on one machine, for the tests and the bench that run one mpirun across hosts: two
network namespaces joined by a veth pair (10.250.0.1/24 and 10.250.0.2/24), and a second pair
(10.251.0.0/24, created first) that stands for a network the job must not use, such as a
management network. mpirun runs in the first; its launch agent, tests/netns_ssh, starts its
daemon in the second, which also gets a /tmp, a /proc, process ids and a monotonic clock of
its own. Both share the rest of the filesystem (the checkout, the venv, weights/), the wall
clock and the CPUs. Needs root, ip and unshare."""
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUBNET, DECOY = "10.250.0.0/24", "10.251.0.0/24"
AGENT = ROOT / "tests" / "netns_ssh"


class Unavailable(Exception):
    """Namespaces cannot be made here: the reason."""


class TwoHosts:
    def __init__(self):
        tag = f"nh{os.getpid() % 100000}"
        self.a, self.b = f"{tag}a", f"{tag}b"  # namespace, hostname and interface names (at most 15 characters)

    def create(self) -> None:
        if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
            raise Unavailable("needs root, ip and unshare to make network namespaces")
        a, b = self.a, self.b
        commands = [["netns", "add", a], ["netns", "add", b]]
        for (name_a, name_b), subnet in (((a + "x", b + "x"), DECOY), ((a, b), SUBNET)):
            commands.append(["link", "add", name_a, "netns", a, "type", "veth", "peer", name_b, "netns", b])
            for i, (ns, name) in enumerate(((a, name_a), (b, name_b))):
                commands += [["-n", ns, "addr", "add", subnet.replace("0/24", f"{i + 1}/24"), "dev", name],
                             ["-n", ns, "link", "set", name, "up"]]
        commands += [["-n", a, "link", "set", "lo", "up"], ["-n", b, "link", "set", "lo", "up"]]
        for command in commands:
            proc = subprocess.run(["ip", *command], capture_output=True, text=True)
            if proc.returncode:
                self.close()
                raise Unavailable(f"ip {' '.join(command)}: {proc.stderr.strip()}")

    def mpirun(self, mpirun: str, *mca: str) -> list[str]:
        """mpirun on the first host, one slot on each, TCP between them on the veth only (its
        own flags replaced by mca where given)."""
        flags = mca or ("--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", SUBNET,
                        "--mca", "oob_tcp_if_include", SUBNET)
        return ["ip", "netns", "exec", self.a, "unshare", "--uts", "sh", "-c", f'hostname {self.a} && exec "$@"', "sh",
                mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
                "--host", f"{self.a}:1,{self.b}:1", "--mca", "plm_rsh_agent", str(AGENT), *flags]

    def env(self) -> dict:
        return dict(os.environ, NANO_APART=self.b, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")

    def sent(self, decoy: bool = False) -> int:
        """Bytes the first host has sent on the veth (or on the decoy network)."""
        name = self.a + ("x" if decoy else "")
        return int(subprocess.run(["ip", "netns", "exec", self.a, "cat", f"/sys/class/net/{name}/statistics/tx_bytes"],
                                  capture_output=True, text=True, check=True).stdout)

    def link(self, up: bool) -> None:
        """The veth's second end up, or down: the second host cut off (self.cut: when)."""
        self.cut = None if up else time.monotonic()
        subprocess.run(["ip", "-n", self.b, "link", "set", self.b, "up" if up else "down"], check=True)

    def pids(self, host: str) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def close(self) -> None:
        """End whatever a test left running in the namespaces (a daemon waiting for a cut-off
        host), then remove them."""
        for host in (self.a, self.b):
            for pid in self.pids(host):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:  # ended meanwhile
                    pass
            subprocess.run(["ip", "netns", "del", host], capture_output=True)


def python_ranks(hosts: TwoHosts) -> list[int]:
    """The Python processes (ranks) still running in either namespace."""
    return [p for h in (hosts.a, hosts.b) for p in hosts.pids(h) if _comm(p).startswith("python")]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:  # ended meanwhile
        return ""
