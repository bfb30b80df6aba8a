"""run.py's --policy and --drop-late: the policy class an engine takes (LLMEngine(config,
policy=...)), also for the benchmarks and the lab, which name their policies the same way."""
import functools

from nano import checks
from nano.deadline.policy import Deadline
from nano.errors import NanoError
from nano.policy import FCFS

POLICIES = ("fcfs", "deadline")


def policy_factory(name: str, drop_late: bool = False):
    """The policy --policy NAME names; with --drop-late the deadline policy rejects the
    requests that can no longer make their TTFT instead of admitting them behind the rest."""
    checks.choice("--policy", name, POLICIES)
    checks.flag("drop_late", drop_late)
    if drop_late and name != "deadline":
        raise NanoError("--drop-late needs --policy deadline")
    return functools.partial(Deadline, drop_late=drop_late) if name == "deadline" else FCFS
