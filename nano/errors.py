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
