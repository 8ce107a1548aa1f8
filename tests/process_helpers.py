"""Helpers for tests that start the CLI as a child process."""

from __future__ import annotations

import signal


def default_sigint() -> None:
    """``preexec_fn`` for a child that a test stops with Ctrl-C: a runner started in the
    background (``cmd &``) ignores SIGINT, the child would inherit that, and Python only
    turns SIGINT into KeyboardInterrupt when it starts with the default disposition."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
