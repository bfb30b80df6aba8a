"""The deadline policy against FCFS on the simulated clock, with a CPU-shaped step and noise.

    python tests/bench_deadline_noise.py [--jitter SIGMA] [--seeds N] [--requests N] [WORKLOAD ...]

nano/bench/slo_matrix.py's matrix (`run.py --bench --policy-compare`) on a tiny random model,
every step priced like the default model's on a 2-core CPU (simulated.CPU_STEP) and
multiplied by a seeded lognormal factor (--jitter; 0: exact). FCFS and deadline of one run draw the same noise
stream. A real clock's run-to-run spread hides whether a policy decision costs requests;
here the same run replays exactly, so a decision can be changed and its effect counted.
Prints each run's SLO-met counts, then the totals and the runs where deadline is behind.
"""
import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from reference import make_random_model  # noqa: E402  (tests/reference.py)

from nano.bench import simulated, slo_matrix  # noqa: E402
from nano.config import EngineConfig  # noqa: E402
from nano.deadline.cli import policy_factory  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("workloads", nargs="*", help=f"of {', '.join(slo_matrix.WORKLOADS)} (default: all)")
    p.add_argument("--jitter", type=float, default=0.2, help="sigma of each step's lognormal time factor")
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--requests", type=int, default=24)
    args = p.parse_args()
    if set(args.workloads) - set(slo_matrix.WORKLOADS):
        p.error(f"workloads are {', '.join(slo_matrix.WORKLOADS)}")
    model = str(make_random_model(Path(tempfile.mkdtemp())))
    fcfs_engines = 0  # the noise seed: a run's deadline engine shares its FCFS engine's (made just before)

    def make_engine(policy: str):
        nonlocal fcfs_engines
        fcfs_engines += policy == "fcfs"  # run_matrix's calibration makes FCFS engines too
        return simulated.simulated_engine(EngineConfig(model=model, device="cpu"), simulated.CPU_STEP,
                                          args.jitter, seed=fcfs_engines, policy=policy_factory(policy))

    results = slo_matrix.run_matrix(make_engine, 512, args.requests, range(args.seeds),
                                    workloads=tuple(args.workloads or slo_matrix.WORKLOADS))
    behind, totals = [], {"fcfs": 0, "deadline": 0}
    for (name, load, seed, policy), outcome in sorted(results.items()):
        totals[policy] += outcome.met
        if policy == "fcfs":
            deadline = results[name, load, seed, "deadline"]
            print(f"{name:8s} {load:6s} seed {seed}: FCFS {outcome.met:3d}  deadline {deadline.met:3d} of {outcome.total}")
            if deadline.met < outcome.met:
                behind.append(f"{name} {load} seed {seed} ({outcome.met} -> {deadline.met})")
    print(f"SLO met over {len(results) // 2} runs: FCFS {totals['fcfs']}, deadline {totals['deadline']}; "
          f"deadline behind in {len(behind)}: {', '.join(behind) or 'none'}")


if __name__ == "__main__":
    main()
