"""Stage replies and their statistics (wire-format.md section 11.2-11.3).

Plain Python classes shared by both framing implementations, like the messages of
:mod:`skippy_wire.wire.messages`; field names are the upstream (Rust) names.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import ClassVar, Optional, Sequence

from ..errors import InvalidInputError
from .constants import I32_MAX, I32_MIN, I64_MAX, I64_MIN, STAGE_REPLY_STATS_COUNT
from .messages import fields_equal, short_repr
from .field_checks import first_out_of_range, int_list_checks


class WireReplyKind(enum.IntEnum):
    """A reply's leading i32 (section 11.2): Ack, one predicted token, or a token list."""

    ACK = 1
    PREDICTED_TOKEN = 2
    PREDICTED_TOKENS = 3


def _sat(v: int) -> int:
    return I64_MAX if v > I64_MAX else (I64_MIN if v < I64_MIN else v)


def _better_compute(c_us: int, c_tok: int, cur_us: int, cur_tok: int) -> bool:
    if c_us <= 0 or c_tok <= 0:
        return False
    if cur_us <= 0 or cur_tok <= 0:
        return True
    if c_tok != cur_tok:
        return c_tok > cur_tok  # a larger chunk is the better calibration sample
    return c_us * cur_tok > cur_us * c_tok


@dataclass
class StageReplyStats:
    """The 27 i64 reply statistics, in wire order (section 11.2), with section 11.3 methods."""

    #: The field names in wire order (``STATS_FIELDS``).
    FIELDS: ClassVar[tuple[str, ...]]

    kv_lookup_hits: int = 0
    kv_lookup_misses: int = 0
    kv_lookup_errors: int = 0
    kv_imported_pages: int = 0
    kv_imported_tokens: int = 0
    kv_recorded_pages: int = 0
    kv_recorded_bytes: int = 0
    kv_hit_stage_mask: int = 0
    kv_record_stage_mask: int = 0
    verify_window_compute_us: int = 0
    verify_window_forward_write_us: int = 0
    verify_window_downstream_wait_us: int = 0
    verify_window_total_us: int = 0
    verify_window_stage_count: int = 0
    verify_window_request_count: int = 0
    verify_window_token_count: int = 0
    verify_window_max_tokens: int = 0
    prefill_edge_write_us_max: int = 0
    prefill_edge_wait_us_max: int = 0
    prefill_edge_total_us_max: int = 0
    prefill_edge_stage_index: int = 0
    prefill_edge_activation_bytes_max: int = 0
    prefill_edge_observation_count: int = 0
    prefill_compute_us_at_slowest_rate: int = 0
    prefill_compute_stage_index: int = 0
    prefill_compute_token_count_at_slowest_rate: int = 0
    prefill_compute_observation_count: int = 0

    __repr__ = short_repr

    def as_tuple(self) -> tuple:
        d = self.__dict__
        return tuple(d[name] for name in STATS_FIELDS)

    @classmethod
    def from_tuple(cls, values: Sequence[int]) -> "StageReplyStats":
        return cls(*values)

    def observe_prefill_edge_transport(self, stage_index: int, write_us: int, wait_us: int, activation_bytes: int) -> None:
        write_us = max(write_us, 0)
        wait_us = max(wait_us, 0)
        total = _sat(write_us + wait_us)
        self.prefill_edge_write_us_max = max(self.prefill_edge_write_us_max, write_us)
        self.prefill_edge_wait_us_max = max(self.prefill_edge_wait_us_max, wait_us)
        if total > self.prefill_edge_total_us_max:
            self.prefill_edge_total_us_max = total
            self.prefill_edge_stage_index = stage_index
            self.prefill_edge_activation_bytes_max = min(activation_bytes, I64_MAX)
        self.prefill_edge_observation_count = _sat(self.prefill_edge_observation_count + 1)

    def observe_prefill_compute(self, stage_index: int, compute_us: int, token_count: int) -> None:
        compute_us = max(compute_us, 0)
        tokens = max(1, min(token_count, I64_MAX))
        if _better_compute(compute_us, tokens, self.prefill_compute_us_at_slowest_rate,
                           self.prefill_compute_token_count_at_slowest_rate):
            self.prefill_compute_us_at_slowest_rate = compute_us
            self.prefill_compute_stage_index = stage_index
            self.prefill_compute_token_count_at_slowest_rate = tokens
        self.prefill_compute_observation_count = _sat(self.prefill_compute_observation_count + 1)

    def merge(self, other: "StageReplyStats") -> None:
        for name in _COUNTER_FIELDS:
            if name in ("kv_hit_stage_mask", "kv_record_stage_mask"):
                setattr(self, name, getattr(self, name) | getattr(other, name))
            elif name == "verify_window_max_tokens":
                self.verify_window_max_tokens = max(self.verify_window_max_tokens, other.verify_window_max_tokens)
            else:
                setattr(self, name, _sat(getattr(self, name) + getattr(other, name)))
        self.prefill_edge_write_us_max = max(self.prefill_edge_write_us_max, other.prefill_edge_write_us_max)
        self.prefill_edge_wait_us_max = max(self.prefill_edge_wait_us_max, other.prefill_edge_wait_us_max)
        if other.prefill_edge_total_us_max > self.prefill_edge_total_us_max:
            self.prefill_edge_total_us_max = other.prefill_edge_total_us_max
            self.prefill_edge_stage_index = other.prefill_edge_stage_index
            self.prefill_edge_activation_bytes_max = other.prefill_edge_activation_bytes_max
        self.prefill_edge_observation_count = _sat(
            self.prefill_edge_observation_count + other.prefill_edge_observation_count
        )
        if _better_compute(other.prefill_compute_us_at_slowest_rate, other.prefill_compute_token_count_at_slowest_rate,
                           self.prefill_compute_us_at_slowest_rate, self.prefill_compute_token_count_at_slowest_rate):
            self.prefill_compute_us_at_slowest_rate = other.prefill_compute_us_at_slowest_rate
            self.prefill_compute_stage_index = other.prefill_compute_stage_index
            self.prefill_compute_token_count_at_slowest_rate = other.prefill_compute_token_count_at_slowest_rate
        self.prefill_compute_observation_count = _sat(
            self.prefill_compute_observation_count + other.prefill_compute_observation_count
        )

    def is_empty(self) -> bool:
        return (
            all(getattr(self, name) == 0 for name in _COUNTER_FIELDS)
            and self.prefill_edge_observation_count == 0
            and self.prefill_compute_observation_count == 0
        )


#: The 27 statistics in wire order (section 11.2): the dataclass's fields.
STATS_FIELDS = StageReplyStats.FIELDS = tuple(f.name for f in fields(StageReplyStats))
assert len(STATS_FIELDS) == STAGE_REPLY_STATS_COUNT
#: The kv_* and verify_window_* counters (summed, OR-ed or maxed by ``merge``).
_COUNTER_FIELDS = STATS_FIELDS[:17]


@dataclass
class StageReplyWindow:
    """The verify window a reply answers (``window_id``, an i32; 0 when none)."""

    window_id: int = 0

    __repr__ = short_repr


@dataclass
class NativeMtpDraft:
    """A native MTP draft carried by a reply: draft token ids and the proposal cost."""

    token_ids: list = field(default_factory=list)
    proposal_compute_us: int = 0

    __repr__ = short_repr  # a reply's repr showed a 262,144-token draft whole

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NativeMtpDraft):
            return NotImplemented
        return list(self.token_ids) == list(other.token_ids) and self.proposal_compute_us == other.proposal_compute_us


@dataclass
class StageReply:
    """A stage reply (section 11.2)."""

    kind: WireReplyKind = WireReplyKind.ACK
    predicted: int = 0
    predicted_tokens: list = field(default_factory=list)
    window: StageReplyWindow = field(default_factory=StageReplyWindow)
    native_mtp_draft: Optional[NativeMtpDraft] = None
    stats: StageReplyStats = field(default_factory=StageReplyStats)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StageReply):
            return NotImplemented
        return fields_equal(self, other, as_list=("predicted_tokens",))

    __hash__ = None  # type: ignore[assignment]
    __repr__ = short_repr


def _reply_checks(reply: StageReply):
    yield "kind", reply.kind, I32_MIN, I32_MAX
    yield "predicted", reply.predicted, I32_MIN, I32_MAX
    yield from int_list_checks("predicted_tokens", reply.predicted_tokens)
    if not isinstance(reply.window, StageReplyWindow):
        yield f"window must be a StageReplyWindow, not {type(reply.window).__name__}"
        return
    yield "window.window_id", reply.window.window_id, I32_MIN, I32_MAX
    draft = reply.native_mtp_draft
    if draft is not None:
        if not isinstance(draft, NativeMtpDraft):
            yield f"native_mtp_draft must be a NativeMtpDraft or None, not {type(draft).__name__}"
            return
        yield from int_list_checks("native_mtp_draft.token_ids", draft.token_ids)
        yield "native_mtp_draft.proposal_compute_us", draft.proposal_compute_us, I64_MIN, I64_MAX
    if not isinstance(reply.stats, StageReplyStats):
        yield f"stats must be a StageReplyStats, not {type(reply.stats).__name__}"
        return
    for n in STATS_FIELDS:
        yield f"stats.{n}", getattr(reply.stats, n), I64_MIN, I64_MAX


def reply_out_of_range_error(reply: StageReply) -> InvalidInputError:
    """Name the first field of ``reply`` the wire cannot represent (both implementations
    raise this when a value does not fit its wire type, or is of the wrong kind)."""
    return first_out_of_range(_reply_checks(reply), "reply")


__all__ = ["NativeMtpDraft", "STATS_FIELDS", "StageReply", "StageReplyStats", "StageReplyWindow", "WireReplyKind",
           "reply_out_of_range_error"]
