"""One error hierarchy for the whole package.

Upstream (Rust) reports ``std::io::Error`` with one of three kinds; each kind is a class
here, and ``str(error)`` is the exact upstream text (wire-format.md section 10).  Each
class also subclasses the builtin a Python caller would reach for first.
"""

from __future__ import annotations

EOF_MESSAGE = "failed to fill whole buffer"


class WireError(Exception):
    """Base class of every protocol error raised by skippy_wire."""

    #: The upstream ``io::ErrorKind`` name ("InvalidData", "InvalidInput", "UnexpectedEof").
    kind: str = "Other"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __eq__(self, other: object) -> bool:  # parity tests compare (class, text)
        return type(self) is type(other) and self.message == other.message  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), self.message))


class InvalidDataError(WireError, ValueError):
    """Malformed or out-of-contract bytes or values (upstream ``InvalidData``)."""

    kind = "InvalidData"


class InvalidInputError(WireError, ValueError):
    """A writer was handed a message it cannot represent (upstream ``InvalidInput``)."""

    kind = "InvalidInput"


class UnexpectedEofError(WireError, EOFError):
    """The input ended before the message did (upstream ``UnexpectedEof``)."""

    kind = "UnexpectedEof"

    def __init__(self, message: str = EOF_MESSAGE) -> None:
        super().__init__(message)


ERROR_CLASSES = {cls.kind: cls for cls in (InvalidDataError, InvalidInputError, UnexpectedEofError)}


def error_for_kind(kind: str, message: str) -> WireError:
    """Build the error class that stands for an upstream ``io::ErrorKind`` name."""
    return ERROR_CLASSES[kind](message)
