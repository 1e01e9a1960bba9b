"""Errors a user can act on: the CLI prints their message on one line and exits non-zero."""


class DilocoError(Exception):
    """A clear, expected failure (bad input, unreachable peer, port in use), not a bug."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be: the same orderly stop, its own exit code (143)."""
