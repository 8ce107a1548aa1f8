"""A plain-text progress bar for long checks (``verify-exhaustive``)."""

from __future__ import annotations

import sys
import time


class Progress:
    """A plain-text progress bar on stderr ("\\r" redraws on a terminal, lines otherwise)."""

    def __init__(self, total: int, stream=None, width: int = 30) -> None:
        self.total, self.stream, self.width = total, stream or sys.stderr, width
        try:
            self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        except (OSError, ValueError):  # a closed stream: no bar
            self.stream, self.tty = None, False
        self.t0 = time.monotonic()
        self.last_line = -1.0

    def update(self, done: int, mismatches: int) -> None:
        now = time.monotonic()
        frac = done / self.total if self.total else 1.0
        if not self.tty and done < self.total and now - self.last_line < 10.0:
            return
        self.last_line = now
        rate = done / (now - self.t0) if now > self.t0 else 0.0
        filled = int(self.width * frac)
        bar = "#" * filled + "." * (self.width - filled)
        eta_s = f"{(self.total - done) / rate:5.0f}s" if rate > 0 else "--"
        line = (f"[{bar}] {100 * frac:5.1f}% {done:>10}/{self.total} {rate / 1e6:6.1f} M/s eta {eta_s} "
                f"mismatches {mismatches}")
        self._write(("\r" + line) if self.tty else (line + "\n"))

    def close(self) -> None:
        if self.tty:
            self._write("\n")

    def _write(self, text: str) -> None:
        """Show ``text``; a stderr that is closed (``2>&-``) or fails ends the bar, not the check."""
        if self.stream is None:
            return
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # ValueError: a closed file object
            self.stream = None


__all__ = ["Progress"]
