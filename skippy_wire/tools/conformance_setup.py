"""Conformance of the v17 setup handshake: ``setup_client`` / ``setup_server`` cases run
over a loopback socket pair against the scripted peer the case describes."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
from typing import Optional

from ..errors import Mismatch
from ..wire.agreement import ActivationAgreement, ActivationProfile
from ..wire.setup import PlanStage, SetupError, StagePeer, StageSetupConfig, client_setup, server_setup
from .vector_cases import hex_diff

_JOIN_SECONDS = 10.0
#: The longest deadline a case may give its setup (the vectors give 0 or 2,000 ms).
MAX_DEADLINE_MS = 60_000
#: What a server case's scripted client does after its hello, and the setups a server case runs.
_CLIENT_STEPS = ("close", "wait", "raw", "echo_spaced", "wrong_generation", "echo")
_SERVER_MODES = ("server_setup", "recording_setup")


def config_from_case(d: Optional[dict]) -> Optional[StageSetupConfig]:
    if d is None:
        return None
    peer = lambda p: None if p is None else StagePeer(p["stage_id"], p["stage_index"])  # noqa: E731
    return StageSetupConfig(d["run_id"], d["topology_id"], d["model_id"], d["stage_id"], d["stage_index"],
                            d["layer_start"], d["layer_end"], peer(d.get("upstream")), peer(d.get("downstream")))


def _recv_exact(sock: socket.socket, n: int) -> Optional[bytes]:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _recv_packet(sock: socket.socket) -> Optional[bytes]:
    header = _recv_exact(sock, 12)
    if header is None:
        return None
    body = _recv_exact(sock, struct.unpack_from("<I", header, 8)[0])
    return None if body is None else header + body


def _drain(sock: socket.socket, sink: bytearray) -> None:
    while True:
        chunk = sock.recv(1 << 16)
        if not chunk:
            return
        sink += chunk


def _packet(body: bytes) -> bytes:
    return struct.pack("<III", 0x53545053, 12, len(body)) + body


def _outcome(fn):
    try:
        return ("ok", fn())
    except SetupError as exc:
        return ("err", str(exc))


def _check_result(got: tuple, want: dict) -> None:
    if want["ok"]:
        if got[0] != "ok":
            raise Mismatch(f"setup failed with {got[1]!r}, expected success")
    elif got[0] == "ok":
        raise Mismatch(f"setup succeeded, expected {want['error']['message']!r}")
    elif got[1] != want["error"]["message"]:
        raise Mismatch(f"setup: {got[1]!r}, expected {want['error']['message']!r}")


def _run(case: dict, ours, script) -> tuple:
    wait_ms = case["deadline_ms"]
    if isinstance(wait_ms, bool) or not isinstance(wait_ms, (int, float)) or not 0 <= wait_ms <= MAX_DEADLINE_MS:
        raise Mismatch(f"deadline_ms {wait_ms!r}: a case waits 0 to {MAX_DEADLINE_MS} ms")  # (1e12 ran without end)
    a, b = socket.socketpair()
    seen = bytearray()
    state: dict = {}

    def peer() -> None:
        try:
            script(b, seen, state)
            _drain(b, seen)
        except OSError:
            pass
        except Exception as exc:  # noqa: BLE001 -- a script the case wrote badly: reported as the case's, not a
            state["peer_error"] = exc  # thread's traceback, and the side under test is not left waiting its deadline
            with contextlib.suppress(OSError):  # (closed already, if the case's wait for this thread ran out)
                b.shutdown(socket.SHUT_RDWR)

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    cancelled = bool(case["cancelled"])
    deadline = time.monotonic() + wait_ms / 1000.0
    try:
        got = _outcome(lambda: ours(a, deadline, lambda: cancelled))
    finally:
        a.close()
    thread.join(_JOIN_SECONDS)
    b.close()
    if "peer_error" in state:
        raise state["peer_error"]
    return got, bytes(seen), state


def run_client_case(case: dict, impl: str) -> None:
    s = case["server_script"]

    def script(sock, seen, state):
        first = _recv_packet(sock)
        if first is None:
            return
        seen += first
        if s["offer_hex"] is None:
            _drain(sock, seen)
            return
        sock.sendall(bytes.fromhex(s["offer_hex"]))
        if s["ready_hex"] is not None:
            second = _recv_packet(sock)
            if second is None:
                return
            seen += second
            sock.sendall(bytes.fromhex(s["ready_hex"]))
        sock.shutdown(socket.SHUT_WR)

    output = None if case["output"] is None else ActivationProfile.from_json(case["output"])
    got, sent, _ = _run(case, lambda sock, deadline, cancelled: client_setup(
        sock, case["role"], config_from_case(case["config"]), output, deadline=deadline, cancelled=cancelled,
        impl=impl), script)
    _check_result(got, case["result"])
    if sent.hex() != case["client_sent_hex"]:
        raise Mismatch(hex_diff("client_sent_hex", sent.hex(), case["client_sent_hex"]))
    want = case["established"]
    if (want is None) != (got[0] != "ok") or want is not None and got[1] != ActivationAgreement.from_json(want):
        raise Mismatch("established agreement differs")


def run_server_case(case: dict, impl: str) -> None:
    s = case["client_script"]
    for name, value, known in (("client_script.then", s["then"], _CLIENT_STEPS), ("mode", case["mode"], _SERVER_MODES)):
        if value not in known:  # a misspelt one ran as the last branch (echo, server_setup)
            raise Mismatch(f"unknown {name} {value!r} ({', '.join(known)})")

    def script(sock, seen, state):
        sock.sendall(bytes.fromhex(s["hello_hex"]))
        then = s["then"]
        if then == "close":
            sock.shutdown(socket.SHUT_WR)
            return
        if then == "wait":
            return
        offer = _recv_packet(sock)
        if offer is None:
            return
        seen += offer
        generation = json.loads(offer[12:])["agreement"]["generation"]
        state["generation"] = generation
        if then == "raw":
            sock.sendall(bytes.fromhex(s["raw_hex"]))
        elif then == "echo_spaced":
            sock.sendall(_packet(("[ " + ", ".join(map(str, generation)) + " ]").encode()))
        else:
            if then == "wrong_generation":
                generation = generation[:-1] + [(generation[-1] + 1) % 256]
            sock.sendall(_packet(json.dumps(generation, separators=(",", ":")).encode()))
        sock.shutdown(socket.SHUT_WR)

    topology = case["topology"]
    plan = None if topology is None else [PlanStage(e["stage_id"], e["stage_index"], e["layer_start"], e["layer_end"])
                                          for e in topology]
    input_profile = None if case["input"] is None else ActivationProfile.from_json(case["input"])
    got, sent, state = _run(case, lambda sock, deadline, cancelled: server_setup(
        sock, config_from_case(case["config"]), input_profile, topology=plan,
        recording=case["mode"] == "recording_setup", deadline=deadline, cancelled=cancelled, impl=impl), script)
    _check_result(got, case["result"])
    if got[0] == "ok" and got[1][0].value != case["result"]["role"]:
        raise Mismatch(f"role {got[1][0].value}, expected {case['result']['role']}")
    gen = json.dumps(state.get("generation"), separators=(",", ":"))
    expected = b""
    for p in case["server_packets"]:
        body = p["body_template"].replace("@GEN@", gen).encode("utf-8")
        expected += bytes.fromhex(p["header_prefix_hex"]) + struct.pack("<I", len(body)) + body
    if sent != expected:
        raise Mismatch(hex_diff("server packets", sent.hex(), expected.hex()))
    want = case["established_profiles"]
    if (want is None) != (got[0] != "ok"):
        raise Mismatch("established differs")
    if want is not None and got[1][1].profiles != [ActivationProfile.from_json(p) for p in want]:
        raise Mismatch("established profiles differ")


def run_case(case: dict, impl: str) -> None:
    if case["group"] == "setup_client":
        run_client_case(case, impl)
    elif case["group"] == "setup_server":
        run_server_case(case, impl)
    else:
        raise Mismatch(f"unknown setup group {case['group']!r}")
