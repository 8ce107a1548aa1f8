"""The arguments a library caller gives the pipeline's functions (``launch_pipeline``,
``PipelineClient``), checked in the caller's words before anything starts: a TypeError for
the wrong type, a ValueError for a value out of range, naming the argument."""

from __future__ import annotations

import numbers

from ..wire.activation_frame import PROTOCOL_VERSIONS
from ..wire.constants import MAX_WAIT_S, wire_int
from ..wire.protocol import protocol_version


def int_argument(name: str, value, least: int, most: int | None = None) -> int:
    """``value`` of the argument ``name``: an integer (a bool is none; numpy's are) from ``least``
    (to ``most``), as an int."""
    try:
        value = wire_int(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, not {type(value).__name__}") from None
    if value < least or (most is not None and value > most):
        bound = f"at least {least}" if most is None else f"from {least} to {most}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def seconds_argument(name: str, value, *, zero: bool = False) -> float:
    """``value`` of the argument ``name``: a number of seconds above 0 (``zero``: from 0), at
    most :data:`MAX_WAIT_S`, as a float (numpy's numbers are numbers; anything else, a bool or
    a string, is a TypeError)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    if not ((0 <= value if zero else 0 < value) and value <= MAX_WAIT_S):  # NaN fails every test
        bound = f"from 0 to {MAX_WAIT_S}" if zero else f"above 0 and at most {MAX_WAIT_S}"
        raise ValueError(f"{name} must be a number of seconds {bound}, got {value!r}")
    return float(value)


def instance_argument(name: str, value, kind: type) -> None:
    """``value`` of the argument ``name``: None or a ``kind`` (a TypeError, not an
    AttributeError once it is used)."""
    if value is not None and not isinstance(value, kind):
        raise TypeError(f"{name} must be a {kind.__name__} or None, not {type(value).__name__}")


def protocol_argument(name: str, value) -> int:
    """``value`` of the argument ``name``: a state version this package speaks, as an int."""
    try:
        return protocol_version(value)
    except ValueError:
        raise ValueError(f"{name} must be one of {', '.join(map(str, PROTOCOL_VERSIONS))}, got {value!r}") from None


def server_arguments(host, port, protocol, io_timeout, idle_timeout, reply_timeout, poll_s, link_delay) -> tuple:
    """A :class:`~skippy_wire.net.server.StageServer`'s arguments, checked before it binds (each
    had failed only once a peer connected, with a traceback in its log): ``protocol``, the
    three timeouts, ``poll_s`` and ``link_delay``, as an int and floats (a numpy float is one
    to the check, not to ``settimeout``)."""
    if not isinstance(host, str):  # "" binds every interface
        raise TypeError(f"host must be a host name or address (a str), not {type(host).__name__}")
    int_argument("port", port, 0, 65535)
    return (protocol_argument("protocol", protocol), seconds_argument("io_timeout", io_timeout),
            None if idle_timeout is None else seconds_argument("idle_timeout", idle_timeout),
            seconds_argument("reply_timeout", reply_timeout), seconds_argument("poll_s", poll_s, zero=True),
            seconds_argument("link_delay", link_delay, zero=True))


__all__ = ["int_argument", "seconds_argument", "instance_argument", "protocol_argument", "server_arguments"]
