"""run.py's --policy and --drop-late: the policy class an engine takes (LLMEngine(config,
policy=...)). run.py hands the benchmarks the same classes by name (policies())."""
import functools

from nano import checks
from nano.deadline.policy import Deadline
from nano.errors import NanoError
from nano.policy import FCFS

POLICIES = ("fcfs", "deadline")


def add_arguments(p) -> None:
    s = p.add_argument_group("scheduling policy (nano/deadline)")
    s.add_argument("--policy", default="fcfs", help="fcfs | deadline (by slack to the latency targets)")
    s.add_argument("--drop-late", action="store_true", help="deadline: reject requests that can no longer make their TTFT")


def policy_factory(name: str, drop_late: bool = False):
    """The policy --policy NAME names; with --drop-late the deadline policy rejects the
    requests that can no longer make their TTFT instead of admitting them behind the rest."""
    checks.choice("--policy", name, POLICIES)
    checks.flag("drop_late", drop_late)
    if drop_late and name != "deadline":
        raise NanoError("--drop-late needs --policy deadline")
    return functools.partial(Deadline, drop_late=drop_late) if name == "deadline" else FCFS


def policies(drop_late: bool = False) -> dict:
    """Every policy by name, for the modes that compare them (--bench --request-rate,
    --policy-compare); --drop-late applies to the deadline policy."""
    return {name: policy_factory(name, drop_late and name == "deadline") for name in POLICIES}
