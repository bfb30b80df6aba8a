import json
import os
import stat


class NanoError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def read_file(path, limit: int) -> bytes:
    """A whole model file, which must be a regular file (or a link to one: a FIFO would block,
    a device never end) of at most `limit` bytes. Opened non-blocking: a FIFO's open waits."""
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            data = f.read(limit + 1) if stat.S_ISREG(os.fstat(f.fileno()).st_mode) else None
    except OSError as e:
        raise NanoError(f"cannot read {path}: {e.strerror}") from None
    if data is None or len(data) > limit:
        raise NanoError(f"{path} must be a regular file of at most {limit >> 20} MiB")
    return data


def read_json(path, limit: int = 16 << 20):
    """A model's JSON file (real ones are at most a few MB): unreadable, too large or not JSON is
    one line."""
    try:
        return json.loads(read_file(path, limit))
    except (ValueError, RecursionError) as e:  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise NanoError(f"{path} is not valid JSON ({e})") from None
