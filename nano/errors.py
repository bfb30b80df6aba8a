import json
from contextlib import contextmanager


class NanoError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


@contextmanager
def writing(path):
    """Writing a file the user named: a failure (a full disk, a folder gone) is theirs to fix,
    not a bug, so it is one line too."""
    try:
        yield
    except OSError as e:
        raise NanoError(f"cannot write {path}: {e.strerror}") from None


def read_json(path):
    """Reading a JSON file the user gave (a model's config, its tokenizer's): unreadable or
    not JSON is one line."""
    try:
        return json.loads(path.read_bytes())
    except OSError as e:
        raise NanoError(f"cannot read {path}: {e.strerror}") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise NanoError(f"{path} is not valid JSON ({e})") from None
