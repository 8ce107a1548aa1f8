"""What each wire field accepts, and which field a value the wire cannot carry is.

Both framing implementations (the Cython ``_frame``/``_frame_gen`` and the reference
``_reference``) convert fields with :func:`.constants.wire_int`, :func:`wire_bool` and :func:`wire_f32`
and refuse the same containers (:data:`NOT_INT_LISTS`); when a value does not fit, both raise
:func:`out_of_range_error`, which walks the message's fields in wire order and names the
first that does not fit (wire-format.md, "Python API").
"""

from __future__ import annotations

import numbers
import operator
from typing import Any, Collection, Iterable, Iterator, Sized

import numpy as np

from ..errors import InvalidInputError
from .constants import (I32_MAX, I32_MIN, MAX_STAGE_LOGIT_BIAS, NOT_BYTES_LIKE_TEXT, U32_MAX, U64_MAX, ActivationCodec,
                        CodecPolicy, wire_int)
from .messages import (DISCARD_STALE_WINDOWS, SAMPLING_WIRE_ORDER, SamplingConfig, StageStateHeader, StageWireMessage,
                       WireMessageKind, cut_repr)

#: The message kinds a writer of each state version emits: those its readers take (23 from 16 on).
MESSAGE_KINDS = {15: frozenset(WireMessageKind)}
MESSAGE_KINDS[16] = MESSAGE_KINDS[17] = MESSAGE_KINDS[15] | {DISCARD_STALE_WINDOWS}

#: The wire ids a message's ``state.activation_codec`` may hold (those its readers take).
ACTIVATION_CODEC_IDS = frozenset(ActivationCodec)

#: The state header's i32 fields, in wire order.
I32_STATE_FIELDS = ("version", "seq_id", "phase", "flags", "checkpoint_generation", "prompt_token_count",
                    "decode_step", "current_token", "source_stage_index", "activation_codec")

#: Python's and numpy's booleans: a wire boolean (``ignore_eos``) only, never a wire
#: integer or f32 (``kind=True`` is a mistake, not 1).
BOOL_TYPES = (bool, np.bool_)
#: Sequences whose items are ints but which are no list of tokens (nor a logit-bias pair):
#: text and raw bytes (``memoryview(b"AB")`` is no [65, 66]).
NOT_INT_LISTS = (str, bytes, bytearray, memoryview)


def holds_objects(buf: Any) -> bool:
    """Whether ``buf`` is a numpy array of Python objects, whose buffer holds their addresses
    (no payload's bytes: refused by every writer and reader of both twins)."""
    return isinstance(buf, np.ndarray) and buf.dtype.hasobject


def bytes_like_view(buf: Any) -> memoryview:
    """``memoryview(buf)``; an object without the buffer protocol is the TypeError every
    entry point of both twins raises for it (``a bytes-like object is required, not 'list'``)."""
    try:
        return memoryview(buf)
    except TypeError:
        raise TypeError(NOT_BYTES_LIKE_TEXT.format(type(buf).__name__)) from None


def flat_bytes(view: memoryview) -> memoryview:
    """A C-contiguous view as its bytes, one dimension of format ``B``: ``cast("B")``, which
    refuses a shape holding a zero, so an empty view of any shape is empty bytes, writable
    when it was."""
    if view.format == "B" and view.ndim == 1:
        return view
    if not view.nbytes:
        return memoryview(b"" if view.readonly else bytearray())
    return view.cast("B")


def byte_array(buf: Any, refusal: str) -> np.ndarray | None:
    """A numpy array given as a payload's or a reader's bytes, as its flat uint8 view (the
    same memory), or None for any other object.  memoryview() cannot take some dtypes that
    numpy exports without a format (ml_dtypes' bfloat16, what ``bf16_view`` gives), which the
    compiled twin reads as bytes; an array of Python objects, whose buffer holds their
    addresses, or a non-contiguous one is refused: InvalidInputError(``refusal``)."""
    if not isinstance(buf, np.ndarray):
        return None
    if holds_objects(buf) or not buf.flags.c_contiguous:
        raise InvalidInputError(refusal)
    return np.asarray(buf).reshape(-1).view(np.uint8)


def wire_bool(value: Any) -> int:
    """A wire boolean as 0 or 1: a bool (Python's or numpy's) or an integer 0 or 1;
    anything else (``"no"``, ``None``, 2, 1.0) is a TypeError."""
    if isinstance(value, BOOL_TYPES):
        return 1 if value else 0
    try:
        number = operator.index(value)
    except TypeError:
        number = None
    if number not in (0, 1):
        raise TypeError(f"not a wire boolean: {cut_repr(value)}")
    return number


def wire_f32(value: Any) -> float:
    """A value for an f32 field, unchanged: anything ``struct.pack("<f")`` takes but a
    bool (TypeError).  A finite value beyond f32::MAX is kept (it is written as
    infinity, IEEE round to nearest, as upstream's ``as f32``)."""
    if isinstance(value, BOOL_TYPES):
        raise TypeError(f"a bool is not a wire f32: {cut_repr(value)}")
    return value



def check_known_kind(kind: Any, known: Collection[int], what: str) -> None:
    """A writer refuses a ``kind`` that is not in ``known``, the kinds its readers take: upstream's
    kinds are enums its writers cannot step outside, but a Python caller could write bytes every
    reader refuses.  A kind of the wrong type is left to the kernel, which names it."""
    _refuse_unknown(kind, known, f"kind value {cut_repr(kind)} is no {what} kind")


def _refuse_unknown(value: Any, known: Collection[int], text: str) -> None:
    """InvalidInputError(``text``) when the integer ``value`` is not in ``known``; a value of
    the wrong type is left to the kernel, which names it."""
    try:
        number = wire_int(value)
    except TypeError:
        return
    if number not in known:
        raise InvalidInputError(text)


def check_writable(msg: StageWireMessage, version: int = 15) -> None:
    """Refuse up front what a writer of state ``version`` would write silently wrong: a kind or
    an activation codec its readers refuse, and a sampling block's string lists that are no lists of strings (a
    bare ``str`` would be written one character per entry, and an iterator without a length
    is used up by measuring it)."""
    check_known_kind(msg.kind, MESSAGE_KINDS[version], f"state version {version} stage message")
    codec = getattr(msg.state, "activation_codec", None)  # an enum upstream, as the kind
    _refuse_unknown(codec, ACTIVATION_CODEC_IDS,
                    f"state.activation_codec value {cut_repr(codec)} is no stage activation codec")
    sampling = msg.sampling
    if sampling is not None:
        for name in ("dry_sequence_breakers", "samplers"):
            value = getattr(sampling, name, None)
            if isinstance(value, (str, bytes)):
                raise InvalidInputError(f"sampling.{name} must be a list of strings, not a single string")
            if isinstance(value, Iterator) or (value is not None and not isinstance(value, Sized)):
                raise InvalidInputError(f"sampling.{name} must be a list of strings, not {type(value).__name__}")


def first_out_of_range(checks: Iterable[tuple[str, Any, int, int]], what: str) -> InvalidInputError:
    """The error naming the first ``(name, value, lo, hi)`` whose value is not an integer in
    [lo, hi]; a generic one about ``what`` when every value fits.  A check whose value is a
    ``str`` is a finished error text (a field of the wrong kind, found while listing)."""
    try:
        for check in checks:
            if isinstance(check, str):
                return InvalidInputError(check)
            name, value, lo, hi = check
            try:
                fits = lo <= wire_int(value) <= hi
            except TypeError:
                fits = False
            if not fits:
                return InvalidInputError(f"{name} value {cut_repr(value)} does not fit its wire type")
    except Exception as error:  # listing the fields failed: say where, never mask it with another
        return InvalidInputError(f"{what} field does not fit its wire type ({type(error).__name__}: {error})")
    return InvalidInputError(f"{what} field does not fit its wire type")


def type_name(value: Any) -> str:
    """A value's type as an error names it."""
    return type(value).__name__


def int_list_checks(name: str, values: Any, lo: int = I32_MIN, hi: int = I32_MAX):
    """The checks of a list of wire integers (a text when ``values`` is not a list at all:
    text, raw bytes, an iterator without a length)."""
    if isinstance(values, NOT_INT_LISTS) or not isinstance(values, Iterable) or not isinstance(values, Sized):
        yield f"{name} must be a sequence of ints, not {type_name(values)}"
        return
    for value in values:
        yield name, value, lo, hi


def int_list(name: str, values: Any) -> list:
    """``values`` as a list, once a writer would take it as a list of wire integers (raw
    bytes, an iterator without a length, ``None``: the InvalidInputError naming ``name``)."""
    problem = next(int_list_checks(name, values), None)
    if isinstance(problem, str):
        raise InvalidInputError(problem)
    return list(values)


def _sampling_checks(s: Any):
    if not isinstance(s, SamplingConfig):
        yield f"sampling must be a SamplingConfig or None, not {type_name(s)}"
        return
    for name, code in SAMPLING_WIRE_ORDER:
        value = getattr(s, name)
        if code == "I":
            yield f"sampling.{name}", value, 0, U32_MAX
        elif code == "i":
            yield f"sampling.{name}", value, I32_MIN, I32_MAX
        elif code == "f" and (isinstance(value, BOOL_TYPES) or not isinstance(value, numbers.Real)):
            yield f"sampling.{name} value {cut_repr(value)} is not a number"
        elif code == "B" and not _fits(wire_bool, value):
            yield f"sampling.{name} value {cut_repr(value)} is not a bool"
        elif code == "L":
            if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
                yield f"sampling.logit_bias must be a list of (token_id, bias) pairs, not {type_name(value)}"
                return
            for pair in list(value)[:MAX_STAGE_LOGIT_BIAS]:
                if isinstance(pair, NOT_INT_LISTS) or not isinstance(pair, Iterable) or len(list(pair)) != 2:
                    yield f"sampling.logit_bias entry {cut_repr(pair)} is not a (token_id, bias) pair"
                    return
                token, bias = pair
                yield "sampling.logit_bias token_id", token, I32_MIN, I32_MAX
                if isinstance(bias, BOOL_TYPES) or not isinstance(bias, numbers.Real):
                    yield f"sampling.logit_bias bias {cut_repr(bias)} is not a number"
        elif code == "S":  # read more than once (sized, then written): no iterator
            if isinstance(value, (str, bytes)) or not isinstance(value, Iterable) or not isinstance(value, Sized):
                yield f"sampling.{name} must be a list of strings, not {type_name(value)}"
                return
            for item in value:
                if not isinstance(item, str):
                    yield f"sampling.{name} entry {cut_repr(item)} is not a string"
                elif not _utf8(item):
                    yield f"sampling.{name} entry {cut_repr(item)} is not UTF-8 text (a lone surrogate)"


def _fits(convert, value: Any) -> bool:
    """Whether ``convert(value)`` takes the value (a TypeError says it does not)."""
    try:
        convert(value)
    except TypeError:
        return False
    return True


def _utf8(text: str) -> bool:
    """Whether ``text`` has a UTF-8 form (an unpaired surrogate has none)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _message_checks(msg: Any):
    yield "kind", msg.kind, I32_MIN, I32_MAX
    yield "pos_start", msg.pos_start, I32_MIN, I32_MAX
    yield "token_count", msg.token_count, I32_MIN, I32_MAX
    if not isinstance(msg.state, StageStateHeader):
        yield f"state must be a StageStateHeader, not {type_name(msg.state)}"
    for n in I32_STATE_FIELDS:
        yield f"state.{n}", getattr(msg.state, n), I32_MIN, I32_MAX
    yield "request_id", msg.request_id, 0, U64_MAX
    yield "session_id", msg.session_id, 0, U64_MAX
    if msg.sampling is not None:
        yield from _sampling_checks(msg.sampling)
    metadata = msg.chat_sampling_metadata
    if metadata is not None and not isinstance(metadata, str):
        yield f"chat_sampling_metadata must be a str or None, not {type_name(metadata)}"
    elif metadata is not None and not _utf8(metadata):
        yield "chat_sampling_metadata is not UTF-8 text (a lone surrogate)"
    yield from int_list_checks("tokens", msg.tokens)
    yield from int_list_checks("positions", msg.positions)


def out_of_range_error(msg: StageWireMessage) -> InvalidInputError:
    """Name the first field of ``msg`` the wire cannot represent (both implementations raise
    this when a value does not fit its wire integer type, or is of the wrong kind)."""
    return first_out_of_range(_message_checks(msg), "message")


def check_admission(expected_codec, policy) -> None:
    """A reader kernel's admission arguments (v15 8.2), checked alike by both implementations
    before any byte is read: ``policy`` a CodecPolicy id, ``expected_codec`` None or an
    ActivationCodec id; else the enum's own ValueError.  (The public readers map theirs
    through ``frame.reader_expectation`` first.)"""
    CodecPolicy(policy)
    if expected_codec is not None:
        ActivationCodec(expected_codec)


__all__ = ["BOOL_TYPES", "NOT_INT_LISTS", "bytes_like_view", "check_admission", "wire_bool", "wire_f32",
           "first_out_of_range", "int_list", "int_list_checks", "out_of_range_error", "type_name"]
