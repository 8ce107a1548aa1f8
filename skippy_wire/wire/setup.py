"""State version 17: the per-connection setup handshake (wire-v16-v17.md B.2-B.4).

Every v17 connection starts with four packets (``SETUP_MAGIC``, generation 12, a u32
length and a compact UTF-8 JSON body): Hello (C -> S), Offer (S -> C, a fresh random
agreement generation), accept (C -> S, the generation echoed) and ready (S -> C, the same).

* :func:`client_setup` runs the connecting side and returns the installed agreement;
* :func:`server_setup` runs the listening side and returns ``(role, agreement)``.

Both take any socket (``recv``/``sendall``; polled in 100 ms slices under one absolute
deadline and a cancellation callable, its timeout cleared afterwards) or a binary stream
(``read``/``write``; no polling).  Errors are :class:`SetupError` with upstream's exact
top-level text; ``detail`` holds our explanation.  A peer that speaks v15/v16 starts with
READY (``59 44 52 53``) or a stage message: the text stays "incompatible stage setup
protocol" (pinned by the vectors) and ``detail`` names both versions.
"""

from __future__ import annotations

import dataclasses
import enum
import socket
import struct
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from .constants import READY_BYTES, wrapped_i32
from ..errors import InvalidDataError, SetupClosed, SetupError, SetupTimeout
from .activation_frame import STAGE_STATE_VERSION_V16, STAGE_STATE_VERSION_V17
from .agreement import (
    U32_MAX,
    ActivationAgreement,
    ActivationProfile,
    Dynamic,
    Fixed,
    JsonShapeError,
    TOKENS,
    dumps,
    generation_from_json,
    json_string,
    json_struct,
    json_uint,
    parse_json,
)
from .protocol import kernels

SETUP_MAGIC = 0x53545053
STAGE_PROTOCOL_GENERATION = 12
MAX_STAGE_SETUP_MESSAGE_BYTES = 65_536
SETUP_HEADER_BYTES = 12
POLL_SLICE_SECONDS = 0.1
DEFAULT_SETUP_TIMEOUT_SECONDS = 30.0


class SetupRole(str, enum.Enum):
    ACTIVATION = "Activation"
    TOKENS_AND_CONTROL = "TokensAndControl"
    PREDICTION_RETURN = "PredictionReturn"


@dataclass
class StagePeer:
    stage_id: str
    stage_index: int


@dataclass
class StageSetupConfig:
    """The identity subset of a stage configuration that setup uses."""

    run_id: str
    topology_id: str
    model_id: str
    stage_id: str
    stage_index: int
    layer_start: int
    layer_end: int
    upstream: Optional[StagePeer] = None
    downstream: Optional[StagePeer] = None


@dataclass
class PlanStage:
    stage_id: str
    stage_index: int
    layer_start: int
    layer_end: int


@dataclass
class Peer:
    run: str
    topology: str
    model: str
    stage: str
    index: int
    layer_start: int
    layer_end: int

    @classmethod
    def of(cls, config: StageSetupConfig) -> "Peer":
        return cls(config.run_id, config.topology_id, config.model_id, config.stage_id, config.stage_index,
                   config.layer_start, config.layer_end)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj) -> "Peer":
        v = json_struct(obj, _PEER_FIELDS, strict=True)
        return cls(*(json_string(v[f]) for f in _PEER_FIELDS[:4]), *(json_uint(v[f], U32_MAX) for f in _PEER_FIELDS[4:]))


_PEER_FIELDS = ("run", "topology", "model", "stage", "index", "layer_start", "layer_end")


def _role(obj) -> SetupRole:
    # a unit variant is "Name" or, as serde_json also reads it, {"Name": null}
    if isinstance(obj, dict) and len(obj) == 1 and not getattr(obj, "duplicates", ()):
        (obj, value), = obj.items()
        if value is not None:
            raise JsonShapeError(f"invalid type: {value!r}, expected unit")
    try:
        return SetupRole(json_string(obj))
    except ValueError:
        raise JsonShapeError(f"unknown variant {obj!r}") from None


def _nullable(obj, parse):
    return None if obj is None else parse(obj)


@dataclass
class Hello:
    role: SetupRole
    sender: Optional[Peer] = None
    target: Optional[tuple] = None
    output: Optional[ActivationProfile] = None

    def to_json(self) -> dict:
        return {"role": self.role.value, "sender": None if self.sender is None else self.sender.to_json(),
                "target": None if self.target is None else list(self.target),
                "output": None if self.output is None else self.output.to_json()}

    @classmethod
    def from_json(cls, obj) -> "Hello":
        names = ("role", "sender", "target", "output")
        v = json_struct(obj, names, strict=True, optional=names[1:])
        target = v["target"]
        if target is not None:
            if not isinstance(target, list) or len(target) != 2:
                raise JsonShapeError("target is [stage_id, stage_index]")
            target = (json_string(target[0]), json_uint(target[1], U32_MAX))
        return cls(_role(v["role"]), _nullable(v["sender"], Peer.from_json), target,
                   _nullable(v["output"], ActivationProfile.from_json))


@dataclass
class Offer:
    role: SetupRole
    receiver: Optional[Peer]
    agreement: ActivationAgreement

    def to_json(self) -> dict:
        return {"role": self.role.value, "receiver": None if self.receiver is None else self.receiver.to_json(),
                "agreement": self.agreement.to_json()}

    @classmethod
    def from_json(cls, obj) -> "Offer":
        v = json_struct(obj, ("role", "receiver", "agreement"), strict=True, optional=("receiver",))
        return cls(_role(v["role"]), _nullable(v["receiver"], Peer.from_json), ActivationAgreement.from_json(v["agreement"]))


# --- transport ------------------------------------------------------------------------------
class _Transport:
    """One deadline and one cancellation flag for the whole handshake (B.2)."""

    def __init__(self, stream, deadline: float, cancelled: Optional[Callable[[], bool]]) -> None:
        self.stream = stream
        self.deadline = deadline
        self.cancelled = cancelled or (lambda: False)
        self.sock = stream if hasattr(stream, "recv") and hasattr(stream, "settimeout") else None
        self.partial = bytearray()  # what the current read has received so far

    def _gate(self) -> float:
        if self.cancelled():
            raise SetupError("stage setup cancelled")
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise SetupTimeout()
        return remaining

    def clear_timeout(self) -> None:
        """Clear the socket's timeout, whether setup succeeded or failed (B.2): the link then
        blocks as upstream's does, whatever timeout the caller had set before."""
        if self.sock is not None:
            try:
                self.sock.settimeout(None)
            except OSError:
                pass

    def read(self, n: int) -> bytes:
        buf = self.partial = bytearray()
        while len(buf) < n:
            remaining = self._gate()
            if self.sock is None:
                chunk = self.stream.read(n - len(buf))
            else:
                self.sock.settimeout(min(POLL_SLICE_SECONDS, remaining))
                try:
                    chunk = self.sock.recv(min(n - len(buf), 1 << 16))
                except (socket.timeout, BlockingIOError, InterruptedError):
                    continue
            if not chunk:
                raise SetupClosed()
            buf += chunk
        return bytes(buf)

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while len(view):
            remaining = self._gate()
            if self.sock is None:
                sent = self.stream.write(view)
                sent = len(view) if sent is None else sent
                flush = getattr(self.stream, "flush", None)
                if flush is not None:
                    flush()
            else:
                self.sock.settimeout(min(POLL_SLICE_SECONDS, remaining))
                try:
                    sent = self.sock.send(view)
                except (socket.timeout, BlockingIOError, InterruptedError):
                    continue  # other socket errors propagate with their system text (B.2)
            if not sent:
                raise SetupClosed()
            view = view[sent:]


def encode_packet(body) -> bytes:
    """A setup packet of a JSON-shaped value; over 64 KiB -> "stage setup message exceeds limit"."""
    raw = dumps(body)
    if len(raw) > MAX_STAGE_SETUP_MESSAGE_BYTES:
        raise SetupError("stage setup message exceeds limit")
    return struct.pack("<III", SETUP_MAGIC, STAGE_PROTOCOL_GENERATION, len(raw)) + raw


def _incompatible(header: bytes) -> SetupError:
    if header[:4] == READY_BYTES:
        detail = (f"the peer sent READY, which state versions 15 and {STAGE_STATE_VERSION_V16} use; "
                  f"this side speaks state version {STAGE_STATE_VERSION_V17} (setup handshake)")
    elif len(header) >= 12 and struct.unpack_from("<i", header, 0)[0] in range(1, 24):
        detail = (f"the peer sent what looks like a stage message without a setup handshake (state version "
                  f"15 or {STAGE_STATE_VERSION_V16}); this side speaks state version {STAGE_STATE_VERSION_V17}")
    else:
        magic, generation = struct.unpack_from("<II", header, 0)
        detail = (f"magic {magic:#010x} generation {generation}, expected {SETUP_MAGIC:#010x} generation "
                  f"{STAGE_PROTOCOL_GENERATION} (state version {STAGE_STATE_VERSION_V17})")
    return SetupError("incompatible stage setup protocol", detail)


def _read_packet(t: _Transport) -> bytes:
    try:
        header = t.read(SETUP_HEADER_BYTES)
    except SetupError as error:
        if bytes(t.partial[:4]) == READY_BYTES[:len(t.partial[:4])] and len(t.partial) >= 4:
            error.detail = _incompatible(bytes(t.partial[:4]) + bytes(8)).detail
        raise
    magic, generation, length = struct.unpack("<III", header)
    if magic != SETUP_MAGIC or generation != STAGE_PROTOCOL_GENERATION:
        raise _incompatible(header)
    if length > MAX_STAGE_SETUP_MESSAGE_BYTES:
        raise SetupError("stage setup message exceeds limit")
    return t.read(length)


def _decode(body: bytes, parse):
    try:
        return parse(parse_json(body))
    except JsonShapeError as exc:
        raise SetupError("decode stage setup", f"decode stage setup: {exc}") from None


def _validated(agreement: ActivationAgreement, impl: Optional[str]) -> None:
    try:
        kernels(impl).validate_agreement(agreement)
    except InvalidDataError as exc:
        raise SetupError(exc.message) from None


def _deadline(deadline: Optional[float], timeout: Optional[float]) -> float:
    if deadline is not None:
        return deadline
    return time.monotonic() + (DEFAULT_SETUP_TIMEOUT_SECONDS if timeout is None else timeout)


# --- the connecting side (B.4.1) ------------------------------------------------------------
def client_setup(stream, role, config: Optional[StageSetupConfig] = None, output: Optional[ActivationProfile] = None,
                 *, timeout: Optional[float] = None, deadline: Optional[float] = None,
                 cancelled: Optional[Callable[[], bool]] = None, impl: Optional[str] = None,
                 model_id: Optional[str] = None) -> ActivationAgreement:
    """Run the connecting side on ``stream``; returns the agreement to install.

    ``deadline`` is absolute (``time.monotonic()``), else ``timeout`` seconds from now.
    ``model_id``, without ``config`` (a driver that knows its model but not the run): the
    model id the peer must report."""
    role = SetupRole(role)
    t = _Transport(stream, _deadline(deadline, timeout), cancelled)
    try:
        return _client(t, role, config, output, impl, model_id)
    finally:
        t.clear_timeout()


def _client(t: _Transport, role: SetupRole, config, output, impl, model_id) -> ActivationAgreement:
    downstream = None if config is None else config.downstream
    hello = Hello(role, None if config is None else Peer.of(config),
                  None if downstream is None else (downstream.stage_id, downstream.stage_index), output)
    t.write(encode_packet(hello.to_json()))
    offer = _decode(_read_packet(t), Offer.from_json)
    if offer.role != role:
        raise SetupError("setup role confirmation mismatch")
    agreement = offer.agreement
    _validated(agreement, impl)
    expected = [] if output is None else [output]
    if output is not None and len(agreement.profiles) == 1:
        offered = agreement.profiles[0]
        if offered.max_tokens > output.max_tokens or offered.max_sequences > output.max_sequences:
            raise SetupError("peer widened the offered count limits")
        expected = [dataclasses.replace(output, max_tokens=offered.max_tokens, max_sequences=offered.max_sequences)]
    # structural equality of the values (B.4.1 step 5), whatever containers the caller's
    # profile uses (a list of dimensions, a bytearray identity): compare the JSON forms
    if [p.to_json() for p in agreement.profiles] != [p.to_json() for p in expected]:
        raise SetupError("peer changed the offered output contract")
    if config is not None:
        receiver = offer.receiver
        if receiver is None:
            raise SetupError("stage peer identity absent")
        if downstream is None:
            raise SetupError("downstream identity absent")
        _check_relationship("admitted downstream relationship mismatch", [
            ("run", receiver.run, config.run_id), ("topology", receiver.topology, config.topology_id),
            ("model id", receiver.model, config.model_id), ("downstream stage", receiver.stage, downstream.stage_id),
            ("downstream stage index", receiver.index, downstream.stage_index),
            ("downstream layer_start", receiver.layer_start, config.layer_end)])
    elif model_id is not None:
        if offer.receiver is None:
            raise SetupError("stage peer identity absent")
        _check_relationship("admitted downstream relationship mismatch", [("model id", offer.receiver.model, model_id)])
    t.write(encode_packet(list(agreement.generation)))
    ready = _decode(_read_packet(t), generation_from_json)
    if ready != bytes(agreement.generation):
        raise SetupError("setup confirmation generation mismatch")
    return agreement


def _check_relationship(text: str, checks: list[tuple[str, Any, Any]]) -> None:
    """SetupError ``text`` (the upstream wording) when a peer's ``(name, theirs, ours)``
    differ; the detail names each difference, for the operator reading the log."""
    differences = [f"{name} {theirs!r}, here {ours!r}" for name, theirs, ours in checks if theirs != ours]
    if differences:
        raise SetupError(text, "; ".join(differences))


# --- the listening side (B.4.2-B.4.3) -------------------------------------------------------
def server_setup(stream, config: Optional[StageSetupConfig] = None, input_profile: Optional[ActivationProfile] = None,
                 *, topology: Optional[Sequence[PlanStage]] = None, recording: bool = False,
                 prepare: Optional[Callable[[], None]] = None, timeout: Optional[float] = None,
                 deadline: Optional[float] = None, cancelled: Optional[Callable[[], bool]] = None,
                 impl: Optional[str] = None) -> tuple:
    """Run the listening side on ``stream``; returns ``(role, agreement)`` (installed
    before ready is sent: install it on the connection at once)."""
    t = _Transport(stream, _deadline(deadline, timeout), cancelled)
    try:
        return _server(t, config, input_profile, topology, recording, prepare, impl)
    finally:
        t.clear_timeout()


def _activation_output(hello: Hello, config, input_profile, topology, recording) -> ActivationProfile:
    if config is None:
        raise SetupError("activation role on a return listener")
    sender, output = hello.sender, hello.output
    if sender is None:
        raise SetupError("activation sender identity missing")
    if output is None:
        raise SetupError("activation output contract missing")
    _check_relationship("admitted upstream relationship mismatch", [
        ("run", sender.run, config.run_id), ("topology", sender.topology, config.topology_id),
        ("model id", sender.model, config.model_id), ("target", hello.target, (config.stage_id, config.stage_index)),
        ("upstream stage index", sender.index, config.stage_index - 1),
        ("upstream layer_end", sender.layer_end, config.layer_start),
        # the sender's u32s compared as i32, as upstream casts them (2^31 and above wrap)
        ("output producer_stage_index", output.producer_stage_index, wrapped_i32(sender.index)),
        ("output layer_start", output.layer_start, wrapped_i32(sender.layer_start)),
        ("output layer_end", output.layer_end, wrapped_i32(sender.layer_end))])
    up = config.upstream
    if up is not None and (up.stage_id != sender.stage or up.stage_index != sender.index):
        raise SetupError("upstream identity differs from configured peer")
    if topology is not None:
        entry = next((e for e in topology if e.stage_index == sender.index), None)
        if entry is None:
            raise SetupError("upstream stage absent from plan")
        if (entry.stage_id, entry.layer_start, entry.layer_end) != (sender.stage, sender.layer_start, sender.layer_end):
            raise SetupError("upstream identity differs from plan")
    if recording:
        return output
    if input_profile is None:
        raise SetupError("receiver has no input boundary")
    narrowed = dataclasses.replace(output, max_tokens=min(output.max_tokens, input_profile.max_tokens),
                                   max_sequences=min(output.max_sequences, input_profile.max_sequences))
    check_input_compatibility(narrowed, input_profile)
    return narrowed


def _dimension_admits(required, offered) -> bool:
    if isinstance(required, Dynamic):
        if isinstance(offered, Fixed):
            return required.min <= offered.value <= required.max
        return isinstance(offered, Dynamic) and offered.min >= required.min and offered.max <= required.max
    return required == offered if required is not TOKENS else offered is TOKENS


def check_input_compatibility(offered: ActivationProfile, required: ActivationProfile) -> None:
    """B.4.3: may a receiver with input profile ``required`` admit ``offered``?"""
    if offered.max_tokens > required.max_tokens or offered.max_sequences > required.max_sequences:
        raise SetupError("offered activation counts exceed receiver limits")
    if bytes(offered.frontier_identity) != bytes(required.frontier_identity):
        raise SetupError("activation frontier identity mismatch")
    for need in required.parts:
        # the first offered part of that identity (an offer repeating one fails validation later)
        got = next((p for p in offered.parts if bytes(p.identity) == bytes(need.identity)), None)
        if got is None:
            if need.optional:
                continue
            raise SetupError("required input binding missing from setup")
        if (got.ggml_type, got.rank, got.token_axis) != (need.ggml_type, need.rank, need.token_axis) or (
                got.optional and not need.optional):
            raise SetupError("input binding type, rank, token axis or presence mismatch")
        if not all(_dimension_admits(r, o) for r, o in zip(need.dimensions, got.dimensions)):
            raise SetupError("input dimension or dynamic bounds mismatch")
    known = {bytes(p.identity) for p in required.parts}
    if any(not p.optional and bytes(p.identity) not in known for p in offered.parts):
        raise SetupError("unrecognized required activation binding")


def _server(t: _Transport, config, input_profile, topology, recording, prepare, impl) -> tuple:
    hello = _decode(_read_packet(t), Hello.from_json)
    profiles = []
    if hello.role is SetupRole.ACTIVATION:
        profiles = [_activation_output(hello, config, input_profile, topology, recording)]
    elif hello.role is SetupRole.TOKENS_AND_CONTROL:
        if config is None or hello.output is not None:
            raise SetupError("token/control ingress requires a stage and no activation table")
    elif hello.output is not None:
        raise SetupError("return connection cannot admit activations")
    agreement = ActivationAgreement(uuid.uuid4().bytes, profiles)
    _validated(agreement, impl)
    offer = Offer(hello.role, None if config is None else Peer.of(config), agreement)
    t.write(encode_packet(offer.to_json()))
    accept = _decode(_read_packet(t), generation_from_json)
    if accept != agreement.generation:
        raise SetupError("setup acceptance generation mismatch")
    if prepare is not None:
        prepare()
    t.write(encode_packet(list(agreement.generation)))
    return hello.role, agreement


__all__ = [
    "SETUP_MAGIC", "STAGE_PROTOCOL_GENERATION", "MAX_STAGE_SETUP_MESSAGE_BYTES", "SetupError", "SetupRole",
    "StagePeer", "StageSetupConfig", "PlanStage", "Peer", "Hello", "Offer", "encode_packet", "client_setup",
    "server_setup", "check_input_compatibility",
]
