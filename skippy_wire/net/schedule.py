"""A generation's schedule on the wire, for :mod:`skippy_wire.net.driver` and its tests:
its arguments checked before anything is sent, its room in the stages' context, and the
messages that carry it (PrefillEmbd per chunk, PrefillFinalEmbd, DecodeEmbd per token)."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Set as AbstractSet

from ..wire.constants import I32_MAX
from ..wire.messages import StageStateHeader, StageWireMessage, WireMessageKind
from .arguments import int_argument

#: A generation needs a prompt of at least one token (what it says to an empty one).
EMPTY_PROMPT = "the prompt must have at least one token"


def check_generation(prompt, max_tokens: int, chunk_size: int, *, n_vocab: int | None = None,
                     **callbacks) -> tuple[list[int], int, int]:
    """The arguments of a generation, checked before anything is sent or computed (each of
    ``callbacks`` by name: None or callable): the prompt's token ids as a list (any sequence
    of ints: a tuple, numpy's; each below ``n_vocab`` when given), ``max_tokens`` and
    ``chunk_size`` as ints."""
    for name, callback in callbacks.items():
        if callback is not None and not callable(callback):  # it failed once the first step was out
            raise TypeError(f"{name} must be callable or None, not {type(callback).__name__}")
    # a set or a mapping has a length but no order a prompt could be read in
    try:
        len(prompt)  # (a 0-d numpy array has a __len__ that raises)
        sequence = not isinstance(prompt, (str, bytes, bytearray, memoryview, AbstractSet, Mapping))
    except TypeError:
        sequence = False
    if not sequence:
        raise TypeError(f"prompt must be a sequence of token ids, not {type(prompt).__name__}")
    ids = []
    for index, token in enumerate(prompt):
        try:
            if isinstance(token, bool):
                raise TypeError
            ids.append(operator.index(token))
        except TypeError:
            raise TypeError(f"prompt item {index} must be a token id (an int), not {token!r}") from None
        if not 0 <= ids[-1] <= I32_MAX:  # the wire's i32, and no id is negative
            raise ValueError(f"prompt item {index} is no token id: {ids[-1]}")
        if n_vocab is not None and ids[-1] >= n_vocab:
            raise ValueError(f"prompt item {index} is token {ids[-1]}, outside the model's vocabulary [0, {n_vocab})")
    if not ids:
        raise ValueError(EMPTY_PROMPT)
    return ids, int_argument("max_tokens", max_tokens, 0), int_argument("chunk_size", chunk_size, 1)


def context_room(prompt_tokens: int, max_tokens: int, ctx_size: int) -> int:
    """The tokens a generation of at most ``max_tokens`` after a prompt of ``prompt_tokens``
    can make in a context of ``ctx_size`` (the stages would fail it at the context's end; the
    last token is not fed back); ValueError when the prompt does not fit."""
    if prompt_tokens > ctx_size:
        raise ValueError(f"the prompt's {prompt_tokens} tokens do not fit the stages' context of {ctx_size} tokens")
    return min(max_tokens, ctx_size - prompt_tokens + 1)


def prefill_messages(prompt: list[int], chunk_size: int, request_id: int, session_id: int, sampling=None):
    """PrefillEmbd for every chunk but the last, PrefillFinalEmbd for the last."""
    if chunk_size < 1:
        raise ValueError("chunk size must be positive")
    starts = list(range(0, len(prompt), chunk_size))
    for start in starts:
        chunk = prompt[start:start + chunk_size]
        kind = WireMessageKind.PREFILL_FINAL_EMBD if start == starts[-1] else WireMessageKind.PREFILL_EMBD
        state = StageStateHeader.new(kind)
        state.prompt_token_count = len(prompt)
        state.current_token = chunk[-1]
        yield StageWireMessage(kind=kind, pos_start=start, token_count=len(chunk), state=state,
                               request_id=request_id, session_id=session_id, sampling=sampling,
                               tokens=list(chunk))


def decode_message(token: int, pos: int, step: int, prompt_len: int, request_id: int, session_id: int,
                   sampling=None):
    """The DecodeEmbd of generation step ``step``: ``token`` at position ``pos``."""
    state = StageStateHeader.new(WireMessageKind.DECODE_EMBD)
    state.prompt_token_count = prompt_len
    state.decode_step = step
    state.current_token = token
    return StageWireMessage(kind=WireMessageKind.DECODE_EMBD, pos_start=pos, token_count=1, state=state,
                            request_id=request_id, session_id=session_id, sampling=sampling, tokens=[token])


__all__ = ["EMPTY_PROMPT", "check_generation", "context_room", "prefill_messages", "decode_message"]
