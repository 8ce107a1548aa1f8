"""Stage replies and their statistics (wire-format.md section 11.2-11.3).

Plain Python classes shared by both framing implementations, like the messages of
:mod:`skippy_wire.wire.messages`; field names are the upstream (Rust) names.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, make_dataclass
from typing import Optional, Sequence

from ..errors import InvalidInputError
from .constants import I32_MAX, I32_MIN, I64_MAX, I64_MIN, STAGE_REPLY_STATS_COUNT
from .messages import fields_equal, first_out_of_range


class WireReplyKind(enum.IntEnum):
    ACK = 1
    PREDICTED_TOKEN = 2
    PREDICTED_TOKENS = 3


#: The 27 statistics in wire order (section 11.2).
STATS_FIELDS = (
    "kv_lookup_hits", "kv_lookup_misses", "kv_lookup_errors", "kv_imported_pages",
    "kv_imported_tokens", "kv_recorded_pages", "kv_recorded_bytes", "kv_hit_stage_mask",
    "kv_record_stage_mask", "verify_window_compute_us", "verify_window_forward_write_us",
    "verify_window_downstream_wait_us", "verify_window_total_us", "verify_window_stage_count",
    "verify_window_request_count", "verify_window_token_count", "verify_window_max_tokens",
    "prefill_edge_write_us_max", "prefill_edge_wait_us_max", "prefill_edge_total_us_max",
    "prefill_edge_stage_index", "prefill_edge_activation_bytes_max",
    "prefill_edge_observation_count", "prefill_compute_us_at_slowest_rate",
    "prefill_compute_stage_index", "prefill_compute_token_count_at_slowest_rate",
    "prefill_compute_observation_count",
)
assert len(STATS_FIELDS) == STAGE_REPLY_STATS_COUNT
#: The kv_* and verify_window_* counters (summed, OR-ed or maxed by ``merge``).
_COUNTER_FIELDS = STATS_FIELDS[:17]


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


# The dataclass's fields are STATS_FIELDS, all i64 defaulting to 0 (one list of the names).
@dataclass
class StageReplyStats(make_dataclass("StageReplyStatsFields", [(name, int, 0) for name in STATS_FIELDS])):
    """The 27 i64 reply statistics, in wire order (section 11.2), with section 11.3 methods."""

    FIELDS = STATS_FIELDS

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


@dataclass
class StageReplyWindow:
    window_id: int = 0


@dataclass
class NativeMtpDraft:
    """A native MTP draft carried by a reply: draft token ids and the proposal cost."""

    token_ids: list = field(default_factory=list)
    proposal_compute_us: int = 0

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


def reply_out_of_range_error(reply: StageReply) -> InvalidInputError:
    checks = [("kind", reply.kind, I32_MIN, I32_MAX), ("predicted", reply.predicted, I32_MIN, I32_MAX)]
    checks += [("predicted_tokens", t, I32_MIN, I32_MAX) for t in reply.predicted_tokens]
    checks.append(("window.window_id", reply.window.window_id, I32_MIN, I32_MAX))
    if reply.native_mtp_draft is not None:
        checks += [("native_mtp_draft.token_ids", t, I32_MIN, I32_MAX) for t in reply.native_mtp_draft.token_ids]
        checks.append(("native_mtp_draft.proposal_compute_us", reply.native_mtp_draft.proposal_compute_us, I64_MIN, I64_MAX))
    checks += [(f"stats.{n}", getattr(reply.stats, n), I64_MIN, I64_MAX) for n in STATS_FIELDS]
    return first_out_of_range(checks, "reply")


__all__ = ["NativeMtpDraft", "STATS_FIELDS", "StageReply", "StageReplyStats", "StageReplyWindow", "WireReplyKind",
           "reply_out_of_range_error"]
