"""JSON values from clients and from the model, read as JSON defines them and bounded in depth.
Python's json also takes NaN, Infinity and -Infinity, and turns 1e999 into an infinity; no
other JSON parser does either, so a tool call's arguments holding them are refused. A value
nested deeper than limits.JSON_DEPTH levels is refused too: the chat template and
copy.deepcopy walk such values by recursion, which a deep enough one would exhaust."""
import json
import math

from nano.server.limits import JSON_DEPTH

TOO_DEEP = f"nests deeper than {JSON_DEPTH} levels"


def check_depth(value) -> None:
    """A ValueError if value's arrays and objects nest deeper than JSON_DEPTH; walked without recursion."""
    todo = [(value, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, (dict, list)):
            if level > JSON_DEPTH:
                raise ValueError(TOO_DEEP)
            todo.extend((v, level + 1) for v in (item.values() if isinstance(item, dict) else item))


def loads(text: str):
    """text's JSON value, strictly (no NaN, no infinities) and at most JSON_DEPTH levels deep;
    a ValueError saying what is wrong otherwise."""
    try:
        value = json.loads(text, parse_constant=_not_json, parse_float=_finite)
    except RecursionError:  # deeper than Python's own stack allows: deeper than JSON_DEPTH too
        raise ValueError(TOO_DEEP) from None
    check_depth(value)
    return value


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"{text:.40} is beyond any finite number")
    return number
