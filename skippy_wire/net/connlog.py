"""What a stage logs about its connections: one line per event, bounded in rate and size.

A peer decides how often a stage logs (every connection, every malformed message is a
line) and part of what it logs (an error names what the peer sent: a JSON key, a string,
a 4000-digit number).  Every line about a connection therefore goes through a
:class:`ConnectionLog`:

* text that came from an error is cut to :data:`MAX_PEER_TEXT` characters, and
  characters that are not printable (a newline, an escape sequence) are escaped, so a
  peer can neither forge log lines nor make one line huge;
* each level has a token bucket: :data:`LOG_BURST` lines at once (many clients connecting
  together), then :data:`LOG_RATE` a second; lines beyond it are counted, and the next
  line logged says how many were dropped.  A peer reconnecting in a loop thus cannot fill
  the disk quickly, and its flood of one level never silences another.
* an unexpected error (a bug) is logged with its traceback the first time only.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

#: Lines a stage may log at one level at once.
LOG_BURST = 100
#: Lines a second a stage may log at one level once the burst is spent.
LOG_RATE = 5.0
#: Characters of one piece of text a peer caused (an error message) in one line.
MAX_PEER_TEXT = 300


def peer_text(value, limit: int = MAX_PEER_TEXT) -> str:
    """``str(value)`` cut to ``limit`` characters, every unprintable character escaped."""
    text = str(value)
    cut = len(text) - limit
    if cut > 0:
        text = text[:limit]
    if not text.isprintable():
        text = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
    return text + (f"... ({cut} more characters)" if cut > 0 else "")


class LogBudget:
    """A token bucket per level: :data:`LOG_BURST` lines at once, then :data:`LOG_RATE` a
    second (see the module doc)."""

    def __init__(self, burst: int = LOG_BURST, rate: float = LOG_RATE) -> None:
        self.burst, self.rate = burst, rate
        self.dropped = 0  # lines not logged, all levels, since the start
        self._lock = threading.Lock()
        self._buckets: dict[int, tuple[float, float]] = {}  # level -> (tokens, when)
        self._held: dict[int, int] = {}  # level -> lines dropped since the last one logged

    def admit(self, level: int) -> int | None:
        """None when a line of ``level`` is over the budget, else the lines dropped before it."""
        with self._lock:
            now = time.monotonic()
            tokens, when = self._buckets.get(level, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - when) * self.rate)
            if tokens < 1.0:
                self._buckets[level] = (tokens, now)
                self._held[level] = self._held.get(level, 0) + 1
                self.dropped += 1
                return None
            self._buckets[level] = (tokens - 1.0, now)
            return self._held.pop(level, 0)


def _held_note(held: int) -> str:
    return f" [{held} earlier lines at this level not logged: log rate limit]"


class RateLimitedRecords(logging.Filter):
    """The same budget for a logger whose lines a peer causes but this package does not
    write (uvicorn's "Invalid HTTP request received." for every malformed request)."""

    def __init__(self, burst: int = LOG_BURST, rate: float = LOG_RATE) -> None:
        super().__init__()
        self.budget = LogBudget(burst, rate)

    def filter(self, record: logging.LogRecord) -> bool:
        held = self.budget.admit(record.levelno)
        if held is None:
            return False
        if held:
            record.msg, record.args = record.getMessage() + _held_note(held), ()
        return True


class ConnectionLog:
    """Rate-limited, sanitised lines on ``logger`` (see the module doc)."""

    def __init__(self, logger: logging.Logger, burst: int = LOG_BURST, rate: float = LOG_RATE) -> None:
        self.logger = logger
        self.budget = LogBudget(burst, rate)
        self._traced = False

    @property
    def dropped(self) -> int:
        """Lines not logged, all levels, since the start."""
        return self.budget.dropped

    def log(self, level: int, fmt: str, *args, exc_info: bool = False) -> None:
        if not self.logger.isEnabledFor(level):
            return
        held = self.budget.admit(level)
        if held is None:
            return
        line = fmt % tuple(peer_text(a) if isinstance(a, (str, BaseException)) else a for a in args)
        if held:
            line += _held_note(held)
        self.logger.log(level, "%s", line, exc_info=exc_info)

    def info(self, fmt: str, *args) -> None:
        self.log(logging.INFO, fmt, *args)

    def warning(self, fmt: str, *args) -> None:
        self.log(logging.WARNING, fmt, *args)

    def error(self, fmt: str, *args) -> None:
        self.log(logging.ERROR, fmt, *args)

    def unexpected(self, fmt: str, *args) -> None:
        """An error that is a bug here: its traceback the first time, one line after."""
        traced, self._traced = self._traced, True
        self.log(logging.ERROR, fmt, *args, exc_info=not traced)


class ShedAwareLog:
    """The lines of connection ``name`` (each starting with it): once the stage has shed the
    connection to make room (``shed()``), what its thread meets next (the end of its stream,
    a reset: the stage's doing, not the peer's) is one INFO line saying so instead."""

    def __init__(self, clog: ConnectionLog, name: str, shed: Callable[[], bool]) -> None:
        self.clog, self.name, self.shed = clog, name, shed

    def _line(self, method: str, fmt: str, *args) -> None:
        if self.shed():
            self.clog.info("%s: closed by this stage to make room (max-connections)", self.name)
        else:
            getattr(self.clog, method)(fmt, *args)

    def info(self, fmt: str, *args) -> None:
        self._line("info", fmt, *args)

    def warning(self, fmt: str, *args) -> None:
        self._line("warning", fmt, *args)

    def error(self, fmt: str, *args) -> None:
        self._line("error", fmt, *args)

    def unexpected(self, fmt: str, *args) -> None:
        self._line("unexpected", fmt, *args)


__all__ = ["LOG_BURST", "LOG_RATE", "MAX_PEER_TEXT", "peer_text", "LogBudget", "RateLimitedRecords", "ConnectionLog",
           "ShedAwareLog"]
