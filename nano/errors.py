class NanoError(Exception):
    """A user-facing error: printed as one line, exit code 2."""
