"""What one grammar may ask of the compiler, checked before llguidance sees it. llguidance
compiles recursively (once per Lark rule, per `$ref`, per nesting level), so a grammar past
these bounds could take a long time or overflow the stack of the thread that compiles it;
over a bound is a one-line NanoError naming the field and the bound. The compile thread's
stack (pool.STACK_BYTES) is sized so that the deepest grammar within the bounds compiles
(tests/test_structured_bounds.py compiles one at each bound in a child process)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from nano.errors import NanoError


@dataclass(frozen=True)
class GrammarLimits:
    """The bounds on one grammar; the defaults leave room for any schema a client generates
    from its types (OpenAI's structured outputs allow 5,000 properties, 10 levels of nesting
    and 1,000 enum values)."""
    grammar_bytes: int = 128 * 1024   # a schema's JSON text, a regex, a Lark grammar, all choices together
    json_depth: int = 64              # objects and arrays inside each other in a JSON schema
    refs: int = 1024                  # `$ref`s in a JSON schema
    rules: int = 2048                 # rule definitions in a Lark grammar
    choices: int = 4096               # strings in a choice


# A Lark rule or terminal definition: a name at the start of a line, then ":" (not "::=", GBNF's)
_RULE = re.compile(r"^\s*[?!]?[A-Za-z_][A-Za-z0-9_.]*(\{[^}]*\})?(\.-?\d+)?\s*(:(?!:=)|::=)", re.MULTILINE)


def check(kind: str, value, name: str, limits: GrammarLimits) -> None:
    """Raise a NanoError naming `name` if the grammar of `kind` (grammar_source's kinds) is
    past one of the limits; cheap, and iterative, whatever the input's nesting."""
    if kind == "choice":
        if len(value) > limits.choices:
            raise NanoError(f"{name}: {len(value)} choices, more than this server's {limits.choices}")
        size = sum(len(c.encode()) for c in value)
    elif kind == "json":
        text = value if isinstance(value, str) else None
        if text is not None:
            _check_bytes(name, len(text.encode()), limits)
            try:
                value = json.loads(text)
            except (ValueError, RecursionError):
                raise NanoError(f"{name}: not a JSON schema (its text is not JSON)") from None
        depth, refs = _json_shape(value, limits.json_depth)
        if depth > limits.json_depth:
            raise NanoError(f"{name}: nested deeper than this server's {limits.json_depth} levels")
        if refs > limits.refs:
            raise NanoError(f"{name}: {refs} $refs, more than this server's {limits.refs}")
        size = len(text.encode()) if text is not None else len(json.dumps(value).encode())
    elif kind in ("regex", "grammar"):
        size = len(value.encode())
        if kind == "grammar" and size <= limits.grammar_bytes:
            rules = len(_RULE.findall(value))
            if rules > limits.rules:
                raise NanoError(f"{name}: {rules} rules, more than this server's {limits.rules}")
    else:
        return
    _check_bytes(name, size, limits)


def _check_bytes(name: str, size: int, limits: GrammarLimits) -> None:
    if size > limits.grammar_bytes:
        raise NanoError(f"{name}: {size} bytes, more than this server's {limits.grammar_bytes}")


def _json_shape(value, most: int) -> tuple[int, int]:
    """(the nesting depth of objects and arrays, the count of `$ref` keys), walked with a stack
    and given up past `most` levels."""
    depth, refs, stack = 0, 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        depth = max(depth, level)
        if depth > most:
            return depth, refs
        if isinstance(node, dict):
            refs += "$ref" in node
            stack += [(v, level + 1) for v in node.values()]
        else:
            stack += [(v, level + 1) for v in node]
    return depth, refs
