"""run.py's --speculative-config: vLLM's JSON, checked before any model loads, and the
proposer it asks for attached to every engine the command line builds (nano/speculative)."""
from nano.errors import NanoError
from nano.speculative import SpeculativeConfig, parse


def add_arguments(p) -> None:
    s = p.add_argument_group("speculative decoding (nano/speculative)")
    s.add_argument("--speculative-config", metavar="JSON",
                   help="vLLM's: e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                        "\"prompt_lookup_max\": 4}' (n-gram prompt lookup: each decoding sequence gets up to "
                        "k draft tokens a step, checked in the same forward pass); every engine gets it")


def check_args(args) -> SpeculativeConfig | None:
    """The config, parsed and checked (a NanoError, one line, before the model loads); kept
    as args.speculative, None when off."""
    try:
        args.speculative = parse(args.speculative_config)
    except NanoError as e:  # each message names the flag
        raise NanoError(str(e) if str(e).startswith("--speculative-config") else f"--speculative-config: {e}") from None
    if args.speculative and args.capacity:
        raise NanoError("--capacity runs no requests: drop --speculative-config")
    return args.speculative
