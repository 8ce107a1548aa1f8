"""How the runtime adapter calls ``skippy_wire.stage._backend``: the compiled module, argument
conversion, input/output frames in their packed form, and the one BUFFER_TOO_SMALL retry.

The binding raises ``StageRuntimeError`` for every native status other than OK (with
BUFFER_TOO_SMALL it carries ``.required``, the output size native asked for) and returns
result objects with named fields; this module holds the policy upstream puts around it.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any, Callable, List, Optional, Sequence, Tuple, TypeVar

from ..errors import StageArgumentError, StageRuntimeError, Status
from . import _ggml
from ..wire.constants import wire_int
from .activation import I32_MAX, I32_MIN, U64_MAX, ActivationDesc, ActivationFrame, PackedFrame

# The compiled backend is imported here, at module top; it is missing only from a
# pure-Python install (SKIPPY_WIRE_PUREPYTHON=1), where the wire layer still works and
# opening a model raises the import error (see ``default_backend``).
try:
    BACKEND = _ggml.load_backend()  # checked against this CPU's instruction set
except ImportError as _missing:  # noqa: N816
    BACKEND = None
    BACKEND_IMPORT_ERROR: Optional[ImportError] = _missing
else:
    BACKEND_IMPORT_ERROR = None

#: Bound on BUFFER_TOO_SMALL retries.  Upstream recurses without a bound (it converges
#: after one retry because native reports the exact size before executing anything).
MAX_BUFFER_RETRIES = 8

Result = TypeVar("Result")


def default_backend() -> ModuleType:
    """The compiled backend; a ``StageRuntimeError`` when this install has none."""
    if BACKEND is None:
        raise StageRuntimeError(f"the stage backend skippy_wire.stage._backend is not built ({BACKEND_IMPORT_ERROR})")
    return BACKEND


def checked_add(count: int, delta: int) -> int:
    updated = count + delta
    if updated > U64_MAX:
        raise StageRuntimeError("session token count overflow")
    return updated


def _integer(value: Any, what: str) -> int:
    # not int(): a float or a numeric string is not silently truncated (nor a bool taken as 1)
    try:
        return wire_int(value)
    except TypeError:
        raise StageArgumentError(f"{what} must be an integer, not {type(value).__name__}") from None


def to_i32(value: Any, what: str) -> int:
    number = _integer(value, what)
    if not I32_MIN <= number <= I32_MAX:
        raise StageArgumentError(f"{what} {number} does not fit in i32")
    return number


def to_count(value: Any, what: str) -> int:
    number = _integer(value, what)
    if not 0 <= number <= U64_MAX:
        raise StageArgumentError(f"{what} {number} is not a valid unsigned count")
    return number


#: The largest bytes object Python makes (its size, less the object's own header).
_LARGEST_BUFFER = sys.maxsize - sys.getsizeof(b"")


def to_capacity(value: Any) -> int:
    """An output buffer size in bytes: an unsigned count no larger than a buffer can be."""
    number = to_count(value, "output capacity")
    if number > _LARGEST_BUFFER:
        raise StageArgumentError(f"output capacity {number} exceeds the largest buffer ({_LARGEST_BUFFER} bytes)")
    return number


def to_tokens(token_ids: Sequence[int]) -> List[int]:
    if isinstance(token_ids, (str, bytes, bytearray, memoryview)):  # their items would read as ids
        raise StageArgumentError(f"token ids must be a sequence of ints, not {type(token_ids).__name__}")
    return [to_i32(token, "token id") for token in token_ids]


def to_positions(positions: Optional[Sequence[int]]) -> Optional[List[int]]:
    return [to_i32(p, "position") for p in positions] if positions is not None and len(positions) else None


def raw_input(frame: "ActivationFrame | PackedFrame | None") -> Tuple[Optional[bytes], Optional[bytes]]:
    """Upstream ``raw_input_frame``: ``(desc bytes, payload)`` or ``(None, None)``."""
    if frame is None:
        return None, None
    if isinstance(frame, PackedFrame):
        return frame
    frame.validate_payload_len()
    return frame.desc.to_bytes(), bytes(frame.payload)


def output_frame(desc: bytes, payload: bytes, out_bytes: int) -> ActivationFrame:
    return ActivationFrame(ActivationDesc.from_bytes(desc), bytes(payload[:out_bytes]))


def _asks_for_more(required: Any, capacity: Any) -> bool:
    if isinstance(capacity, list):
        return required is not None and any(need > have for need, have in zip(required, capacity))
    return required is not None and required > capacity


def with_output_capacity(call: Callable[[Any], Result], capacity: "int | List[int]") -> Result:
    """Run ``call(capacity)`` and retry while native asks for a larger output buffer.

    ``capacity`` is one size, or a list of one per request (batches).  Native reports the
    required size before executing anything, so a retry is safe.  A BUFFER_TOO_SMALL whose
    required size is not larger is raised as it came.
    """
    for _ in range(MAX_BUFFER_RETRIES + 1):
        try:
            return call(capacity)
        except StageRuntimeError as error:
            if error.status != Status.BUFFER_TOO_SMALL or not _asks_for_more(error.required, capacity):
                raise
            capacity = list(error.required) if isinstance(capacity, list) else error.required
    if isinstance(capacity, list):
        raise StageRuntimeError(f"native kept reporting larger output buffers after {MAX_BUFFER_RETRIES} retries")
    raise StageRuntimeError(f"native kept reporting a larger output buffer after {MAX_BUFFER_RETRIES} retries")


def retry_with_required_capacity(fn: Callable[..., Result], *args: Any, **kw: Any) -> Result:
    """A direct binding call ``fn(*args, **kw)``; on BUFFER_TOO_SMALL once more with
    ``capacity=`` the output size native asked for (benchmarks and tests call the binding
    this way; the runtime adapter uses :func:`with_output_capacity`)."""
    try:
        return fn(*args, **kw)
    except StageRuntimeError as error:
        if error.status != Status.BUFFER_TOO_SMALL:
            raise
        return fn(*args, **{**kw, "capacity": error.required})


def memory_available() -> Optional[int]:
    """Bytes this process can still allocate, as a session's KV cache is checked against them
    (MemAvailable and the memory limits of its cgroups); None where that is not known or this
    install has no compiled backend."""
    return None if BACKEND is None else BACKEND.memory_available()


def check_sampling(raw: Optional[bytes]) -> None:
    """The StageRuntimeError (InvalidArgument) a step given the packed sampling config ``raw``
    would raise, raised now (a NaN temperature, say); None without a compiled backend."""
    if BACKEND is not None:
        BACKEND.check_sampling(raw)


__all__ = [
    "BACKEND", "MAX_BUFFER_RETRIES", "check_sampling", "checked_add", "default_backend", "memory_available",
    "output_frame", "raw_input", "retry_with_required_capacity", "to_capacity", "to_count", "to_i32", "to_positions",
    "to_tokens", "with_output_capacity",
]
