"""run.py --lab NAME | list | all [--lab-quick] [--lab-out DIR]: the lab's experiments; their
flags and the checks between them. The lab drives the other packages (it is imported by
run.py alone); the experiments (and matplotlib) load only for --lab."""
from pathlib import Path

from nano import default_model
from nano.errors import NanoError
from nano.sequence import FIELD_RULES

CHOICES = ("list", "all")
OUT = "lab"  # --lab-out's default (git-ignored; docs/lab holds the documented runs)
FLAGS = {"lab", "lab_quick", "lab_out", "model", "device", "seed"}  # what --lab reads


def add_arguments(p) -> None:
    lab = p.add_argument_group("the lab (nano/lab): one serving concept's claim measured per experiment")
    lab.add_argument("--lab", metavar="NAME", help="run experiment NAME (a table, NAME.png and NAME.json); "
                     "list: the experiments and their claims; all: every one. Takes --model, --device, --seed")
    lab.add_argument("--lab-quick", action="store_true", help="the CI size: a tiny random model, seconds each")
    lab.add_argument("--lab-out", default=OUT, help="folder for NAME.png and NAME.json")


def check_args(args, parser) -> None:
    """--lab sets each experiment's engine knobs and workload itself: any other flag given
    would be ignored, so it is refused (parser: run.py's, whose defaults tell what was given)."""
    if args.lab is None:
        if args.lab_quick or args.lab_out != OUT:
            raise NanoError("--lab-quick and --lab-out go with --lab NAME")
        return
    check_name(args.lab)
    defaults = vars(parser.parse_args([]))
    given = [k for k, v in vars(args).items() if k not in FLAGS and v != defaults[k]]
    if given:
        raise NanoError(f"--lab takes only --model, --device, --seed, --lab-quick and --lab-out: drop "
                        f"--{given[0].replace('_', '-')}")
    FIELD_RULES["seed"]("--seed", args.seed)
    check_out(args.lab_out)


def check_name(name: str) -> None:
    """A bad NAME is one line listing the good ones (before any model loads)."""
    from nano.lab.driver import list_experiments
    names = list(list_experiments())
    if name not in names and name not in CHOICES:
        raise NanoError(f"--lab {name!r} is not an experiment: choose from {', '.join(names)} (or list, all)")


def run_lab(args) -> int:
    """Exit status 0 when every experiment run held its claim's direction, 1 otherwise."""
    from nano.lab.driver import list_experiments, run_experiment, verdict
    from nano.lab.experiment import Size
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
