"""Checks for values that come from users (API arguments, CLI flags, JSONL prompt fields,
config.json entries), one function per kind of value: each returns the value or raises a one-line
NanoError, so that a mistake is reported where it is made, not as a NumPy error inside a step."""
import math
import numbers

from nano.errors import NanoError

INT32_MAX = 2**31 - 1  # the sampler packs top_k and output counts (up to max_tokens) as int32


def integer(name: str, value, low: int | None = None, high: int | None = None,
            optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    # bool is an int to Python, but `"max_tokens": true` is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not _within(value, low,
                                                                                         high):
        raise NanoError(f"{name} must be {_kind('an integer', low, high)}, got {_show(value)}")
    return int(value)


def number(name: str, value, low: float | None = None, high: float | None = None,
           open_low: bool = False, open_high: bool = False, optional: bool = False) -> float | None:
    """A finite real number within [low, high] (open_low / open_high: excluding that end)."""
    if value is None and optional:
        return None
    try:  # bool is a number to Python too, but never a temperature
        x = float(value) if isinstance(value, numbers.Real) and not isinstance(value,
                                                                               bool) else math.nan
    except OverflowError:  # an int beyond any float
        x = math.inf
    if not (math.isfinite(x) and _within(x, low, high) and not (open_low and x == low)
            and not (open_high and x == high)):
        kind = _kind("a number", low, high, "(" if open_low else "[", ")" if open_high else "]")
        raise NanoError(f"{name} must be {kind}, got {_show(value)}")
    return x


def flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise NanoError(f"{name} must be true or false, got {_show(value)}")
    return value


def choice(name: str, value, options: tuple[str, ...]) -> str:
    if value not in options:
        raise NanoError(f"{name} must be {', '.join(options[:-1])} or {options[-1]}, got "
                        f"{_show(value)}")
    return value


def text(name: str, value) -> str:
    """A string the tokenizer and the output files can take: valid Unicode (JSON's \\ud800
    escapes can make a lone surrogate, which has no UTF-8 encoding)."""
    if not isinstance(value, str):
        raise NanoError(f"{name} must be a string, got {_show(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise NanoError(f"{name} is not valid Unicode text (it holds a lone surrogate)") from None
    return value


def instance(name: str, value, types: type | tuple, kind: str):
    if not isinstance(value, types):
        raise NanoError(f"{name} must be {kind}, got {_show(value)}")
    return value


def token_ids(name: str, value, vocab_size: int) -> list[int]:
    """A list of token ids, each one a row of the embedding table."""
    if not isinstance(value, (list, tuple)):
        raise NanoError(f"{name} must be a string or a list of token ids, got {_show(value)}")
    for i, t in enumerate(value):
        integer(f"{name} token {i}", t, 0, vocab_size - 1)
    return [int(t) for t in value]


def _within(value, low, high) -> bool:
    return (low is None or value >= low) and (high is None or value <= high)


def _kind(kind: str, low, high, left: str = "[", right: str = "]") -> str:
    """What a value must be, in words: bounds are both given, a low one alone, or none."""
    if high is not None:
        return f"{kind} in {left}{low}, {high}{right}"
    if low is not None:
        return f"{kind} {'>' if left == '(' else '>='} {low}"
    return kind


def _show(value) -> str:
    """The offending value, short and on one line (repr escapes newlines)."""
    try:
        shown = repr(value)
    except ValueError:  # an int of over 4300 digits, which Python refuses to print
        return "an integer too long to print"
    return shown if len(shown) <= 40 else shown[:37] + "..."
