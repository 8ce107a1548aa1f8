"""Every exception root of the package, in one place.

``SkippyError`` is the base of everything skippy_wire raises on purpose.  Below it, one root
per layer:

- wire: ``WireError``.  Upstream (Rust) reports ``std::io::Error`` with one of three kinds;
  each kind is a class here, and ``str(error)`` is the exact upstream text (wire-format.md
  section 10).  Each class also subclasses the builtin a Python caller would reach for first.
  ``ForwardingError`` wraps what upstream's forwarding reports through ``anyhow``.
- stage: ``StageRuntimeError`` (the runtime adapter and the native backend's statuses).
- net: ``StageError`` (a stage server could not serve a message) and ``PipelineError`` (a
  request through the pipeline failed).
- tools: ``ToolError`` (a command-line tool could not do what it was asked).
"""

from __future__ import annotations

import enum
import functools
import os
import stat
from typing import Optional

EOF_MESSAGE = "failed to fill whole buffer"


class SkippyError(Exception):
    """Base class of every error skippy_wire raises on purpose."""


class WireError(SkippyError):
    """Base class of every protocol error raised by skippy_wire."""

    #: The upstream ``io::ErrorKind`` name ("InvalidData", "InvalidInput", "UnexpectedEof").
    kind: str = "Other"
    #: What a writer had produced before it failed (upstream's partial output), else None.
    partial: Optional[bytes] = None

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
    """The input ended before the message did (upstream ``UnexpectedEof``).

    ``needed`` is the total byte count the reader knows the message needs (``None`` when it
    cannot tell yet).
    """

    kind = "UnexpectedEof"

    def __init__(self, message: str = EOF_MESSAGE, *, needed: Optional[int] = None) -> None:
        super().__init__(message)
        self.needed = needed


ERROR_CLASSES = {cls.kind: cls for cls in (InvalidDataError, InvalidInputError, UnexpectedEofError)}


def with_detail(exc: BaseException) -> str:
    """``str(exc)`` and, in parentheses, its ``detail``: what an exact upstream text leaves out."""
    detail = getattr(exc, "detail", None)
    return f"{exc} ({detail})" if detail else str(exc)


def error_for_kind(kind: str, message: str) -> WireError:
    """Build the error class that stands for an upstream ``io::ErrorKind`` name."""
    return ERROR_CLASSES[kind](message)


class ForwardingError(WireError):
    """A forwarding failure (upstream ``anyhow::Error``); ``cause`` is the wrapped error."""

    kind = "Other"

    def __init__(self, message: str, cause: Optional[BaseException] = None) -> None:
        super().__init__(message)
        self.cause = cause


# --- stage: the runtime adapter and the native backend (runtime.md sections 1.5, 3.2) --------


class SetupError(WireError):
    """A setup handshake (wire-v16-v17.md B.2) failed; ``str()`` is upstream's exact
    top-level text, ``detail`` what upstream adds beneath it."""

    kind = "Setup"

    def __init__(self, message: str, detail: Optional[str] = None) -> None:
        super().__init__(message)
        self.detail = detail


#: Upstream's text for a peer that closed the connection during the setup handshake.
SETUP_CLOSED_TEXT = "stage peer closed during setup"
#: What a stage logs of a downstream that never answered a new link (v15 and v16: READY; v17:
#: the setup); the driver's cause finder knows them as a neighbour's report, not a cause.
DOWNSTREAM_NO_READY = "did not send READY"
DOWNSTREAM_SETUP_UNANSWERED = "did not answer the stage setup"


class SetupClosed(SetupError):
    """The peer closed the connection during the setup handshake (upstream's text): a stage
    whose own downstream setup failed closes its upstream one, giving no reason on the wire."""

    def __init__(self, message: str = SETUP_CLOSED_TEXT, detail: Optional[str] = None) -> None:
        super().__init__(message, detail)


class SetupTimeout(SetupError):
    """The setup handshake ran past its deadline (upstream's text): a peer slow to answer, not one that refuses."""

    def __init__(self, message: str = "stage setup deadline expired", detail: Optional[str] = None) -> None:
        super().__init__(message, detail)


class Status(enum.IntEnum):
    """``enum skippy_status``.  ``str()`` gives the Rust ``Debug`` name used in error text."""

    OK = 0
    ERROR = 1
    INVALID_ARGUMENT = 2
    UNSUPPORTED = 3
    BUFFER_TOO_SMALL = 4
    IO_ERROR = 5
    MODEL_ERROR = 6
    RUNTIME_ERROR = 7

    def __str__(self) -> str:
        return "".join(part.capitalize() for part in self.name.split("_"))

    @classmethod
    def from_code(cls, code: int) -> "Status | int":
        try:
            return cls(code)
        except ValueError:
            return code


def format_status_error(status: "Status | int", message: Optional[str]) -> str:
    """Upstream ``format_skippy_error``: ``"{Status:?}: {message}"``, or ``"{Status:?}"``."""
    name = str(status) if isinstance(status, Status) else f"Status({status})"
    return f"{name}: {message}" if message else name


_FILE_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISSOCK, "a socket"))


def thread_start_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is ``Thread.start()``'s refusal (a process or memory limit: ``ulimit -u``,
    ``ulimit -v``): the machine's limit, to be said in one line as an OSError is, not a bug's."""
    return isinstance(exc, RuntimeError) and str(exc) == "can't start new thread"


def os_reason(exc: OSError) -> str:
    """An OSError's reason in words ("connection refused"), without Python's "[Errno 111]"."""
    if exc.strerror:
        return exc.strerror[0].lower() + exc.strerror[1:]
    return str(exc) or type(exc).__name__


def not_a_regular_file(mode: int) -> str:
    """What an error says of a file of ``mode`` (a FIFO, a device) that is read only as a
    regular file: "it is a FIFO, not a regular file"."""
    kind = next((f"it is {what}, " for test, what in _FILE_KINDS if test(mode)), "")
    return f"{kind}not a regular file"


def special_file(path) -> Optional[str]:
    """What an error says of ``path`` when it exists but is a FIFO, a device or a socket (opening
    a FIFO waits for a writer, /dev/zero never ends), as :func:`not_a_regular_file`; None for a
    regular file, a directory, or a path ``os.stat`` refuses (missing, holding a NUL): the open
    names those."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    return None if stat.S_ISREG(mode) or stat.S_ISDIR(mode) else not_a_regular_file(mode)


class StageRuntimeError(SkippyError, RuntimeError):
    """Base of every error the runtime adapter and the backend binding raise.

    ``status`` is the native ``Status`` when a native call failed, else ``None`` (an
    adapter-side check failed); ``message`` is the native message or the check's text.
    ``required`` is, with status ``BUFFER_TOO_SMALL``, the output size native reported as
    needed (an int, or one per request for a batch call), else ``None``.
    """

    def __init__(self, message: str, status: "Status | int | None" = None) -> None:
        self.status = status
        self.message = message
        self.required: "int | list[int] | None" = None
        super().__init__(message if status is None else format_status_error(status, message))

    def __reduce__(self):  # ``required`` travels too (set after construction)
        return (type(self), (self.message, self.status), self.__dict__)

    @classmethod
    def from_native(cls, status: int, message: Optional[str], required: "int | list[int] | None" = None) -> "StageRuntimeError":
        error = cls(message or "", Status.from_code(status))
        error.required = required
        return error


class ModelFileError(StageRuntimeError, ValueError):
    """A model file the stage layer cannot read: not a regular file or not a GGUF file,
    truncated or malformed metadata, a vocabulary of a kind it cannot tokenize."""


class ActivationFrameError(StageRuntimeError, ValueError):
    """An activation frame or descriptor is inconsistent (checked before any native call)."""


class SamplingConfigError(StageRuntimeError, ValueError):
    """A sampling configuration cannot be encoded into the native struct."""


class StageArgumentError(StageRuntimeError, ValueError):
    """An argument cannot be represented in the native call (the Rust types rule these out:
    a token id outside i32, a negative count or capacity)."""


class PartialBatchExecution(StageRuntimeError):
    """A batch that executed one request at a time and then failed part way through.

    Every request before ``executed`` already advanced its session natively (no rollback),
    so a caller that tracks positions has to account for them.  ``error`` (also
    ``__cause__``) is the failure that stopped the batch.
    """

    def __init__(self, executed: int, error: BaseException) -> None:
        self.executed = executed
        self.error = error
        super().__init__(f"batch executed {executed} request(s) before failing: {error}")
        self.__cause__ = error

    def __reduce__(self):
        return (type(self), (self.executed, self.error))


# --- net: stage servers and the driver ------------------------------------------------------


class StageError(SkippyError, RuntimeError):
    """A stage could not execute or forward a message; its connection is closed."""


class PipelineError(SkippyError, RuntimeError):
    """A request through the pipeline failed; the message says which stage and why."""


class PipelineMismatch(PipelineError):
    """Stage 0 speaks another state version, or requires mutual TLS this side lacks: a
    setting to change, which no wait mends (unlike a stage that is down)."""


class PipelineTimeout(PipelineError):
    """Stage 0 did not answer within the driver's timeout (a busy or stalled pipeline, not a refusal)."""


class PipelineClosed(PipelineError):
    """Stage 0 closed the connection while a request was out: a stage failed, or refused
    what was sent (before state version 17 no error reply can say so)."""

    #: It closed on a generation's first message carrying the driver's tokens, after READY
    #: and the ConfigureGeneration's Ack: what a later stage does when a driver connects to it.
    on_first_tokens = False


class StateVersionMismatch(StageError):
    """The peer of a connection speaks another stage state version (15, 16 or 17).

    ``peer`` is the peer's version (None when it could only be narrowed down, see
    ``peer_text``), ``own`` this side's; the message names both.  A peer that names this
    side's own version refused what this side sent as of another one."""

    def __init__(self, peer, own: int, *, peer_text: str | None = None, who: str = "peer",
                 me: str = "this stage") -> None:
        self.peer, self.own, self.who, self.me = peer, own, who, me
        self.peer_text = peer_text or f"state version {peer}"
        if peer == own:
            super().__init__(f"{who} refused what {me} sent as not of state version {own}, which both speak")
        else:
            super().__init__(f"{who} speaks {self.peer_text}, {me} speaks state version {own}")

    def __reduce__(self):
        return (functools.partial(type(self), peer_text=self.peer_text, who=self.who, me=self.me),
                (self.peer, self.own), self.__dict__)


class TlsRequired(StageError):
    """A plain peer reached a stage that requires mutual TLS (it said so in the clear)."""

    def __init__(self, who: str = "peer", me: str = "this side") -> None:
        self.who, self.me = who, me
        super().__init__(f"{who} requires mutual TLS; {me} speaks plain TCP (give --tls-cert, --tls-key and --tls-ca)")

    def __reduce__(self):
        return (type(self), (self.who, self.me), self.__dict__)


class TopologyError(PipelineError, ValueError):
    """A topology file is unreadable or describes no valid pipeline (one line: file, stage, rule)."""


class NetnsError(PipelineError):
    """A network-namespace cluster could not be set up (missing privilege, tool, or a failed command)."""


# --- tools ------------------------------------------------------------------------------------


class ToolError(SkippyError):
    """A command-line tool could not do what it was asked; the message is the one line shown."""


class DissectError(ToolError, ValueError):
    """A record could not be parsed; the message carries its index and byte offset."""


class Mismatch(ToolError):
    """One recorded expectation (a golden vector) that the implementation did not meet."""


__all__ = ["SkippyError", "WireError", "InvalidDataError", "InvalidInputError", "UnexpectedEofError", "ForwardingError",
           "SetupError", "SetupClosed", "SetupTimeout", "Status", "StageRuntimeError", "ModelFileError",
           "ActivationFrameError", "SamplingConfigError", "StageArgumentError", "PartialBatchExecution", "StageError",
           "PipelineError", "PipelineMismatch", "PipelineTimeout", "PipelineClosed", "StateVersionMismatch",
           "TlsRequired", "TopologyError", "NetnsError", "ToolError", "DissectError", "Mismatch", "EOF_MESSAGE",
           "ERROR_CLASSES", "with_detail", "error_for_kind", "format_status_error", "os_reason", "not_a_regular_file",
           "special_file"]
