"""run.py --lab NAME | list | all [--lab-quick] [--lab-out DIR]: the lab's experiments."""
from pathlib import Path

from nano import default_model
from nano.errors import NanoError
from nano.lab.driver import list_experiments, run_experiment, verdict
from nano.lab.experiment import Size

CHOICES = ("list", "all")


def check_name(name: str) -> None:
    """A bad NAME is one line listing the good ones (before any model loads)."""
    names = list(list_experiments())
    if name not in names and name not in CHOICES:
        raise NanoError(f"--lab {name!r} is not an experiment: choose from {', '.join(names)} (or list, all)")


def run_lab(args) -> int:
    """Exit status 0 when every experiment run held its claim's direction, 1 otherwise."""
    found = list_experiments()
    if args.lab == "list":
        width = max(map(len, found))
        for name, exp in found.items():
            print(f"{name.ljust(width)}  {exp.claim}")
        return 0
    size = Size(quick=args.lab_quick, model=args.model, device=args.device,
                seed=0 if args.seed is None else args.seed)
    if not size.quick:
        default_model.ensure(size.model)  # fetched and converted on first use
    names = list(found) if args.lab == "all" else [args.lab]
    failed = []
    for name in names:
        rows = run_experiment(name, size, args.lab_out)
        if verdict(found[name], rows) is not None:
            failed.append(name)
    if failed:
        print(f"claim's direction not seen: {', '.join(failed)}")
    return 1 if failed else 0


def check_out(folder: str) -> None:
    """--lab-out: a folder that can be made (now, so a long run cannot fail at its end)."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NanoError(f"--lab-out {folder}: {e.strerror or e}") from None
