"""Stage hosts as Linux network namespaces joined by shaped veth links (needs root).

:class:`NetnsChain` makes one namespace per host, ``<prefix>-<run>-hK`` (``run`` is a
random suffix, so parallel runs never collide), and joins host K to host K+1 with a veth
pair created directly inside the two namespaces (nothing is ever attached to the root
namespace, so no traffic can leave).  Link K carries 10.77.K.0/24: host K is 10.77.K.1,
host K+1 is 10.77.K.2.  Only neighbours talk (stage K forwards to stage K+1), so no routes
are needed.  Each veth end gets a ``tbf`` root qdisc when a rate is given (both
directions); sized by :func:`tbf_args` so a link carries its rate.  ``netem`` is not
assumed: link delay is added by the stages themselves (``serve --link-delay-ms``).

:func:`netns_socket` creates a socket inside a namespace from this process (``setns`` on
the calling thread only, then back), so the driver and :func:`measure_link` need no child
process.  :meth:`NetnsChain.close` kills what was started in the namespaces and deletes
them (a namespace's veths go with it); it is idempotent and safe after a partial setup.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from fractions import Fraction

from ..errors import NetnsError

NETNS_DIR = "/run/netns"
NETNS_PREFIX = "skw"
#: The private range links are numbered from (10.77.K.0/24 for link K).
SUBNET_PREFIX = "10.77"
LINK_DOWN = "swdn"  # a host's veth toward host K+1
LINK_UP = "swup"  # a host's veth toward host K-1
CLONE_NEWNET = 0x40000000
MEASURE_CHUNK = 1 << 16
#: Seconds a bulk transfer waits, past its own, for the link's queue to drain: a slower
#: link (:func:`queue_drain_s`) is not measured, its backlog would hold the stages' links.
MEASURE_DRAIN_S = 30
COMMAND_TIMEOUT = 20.0
#: The opt-out that lets namespace tests skip where namespaces cannot be made.
NO_NETNS_ENV = "SKIPPY_WIRE_NO_NETNS"

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bps": 8, "kbps": 8 * 10**3,
               "mbps": 8 * 10**6, "gbps": 8 * 10**9}
_UNLIMITED = ("none", "unlimited", "inf")  # (a rate of 0 would carry nothing: refused, not read as these)
#: The fastest shaped link: tc keeps a tbf's sizes in 32 bits, and its 100 ms queue
#: (:func:`tbf_args`) outgrows them past about 343 gbit.
MAX_RATE_BITS = 300 * 10**9


def parse_rate(text: str | None) -> int | None:
    """``"100mbit"`` -> 100_000_000 (bits/s); ``"unlimited"``/None -> None."""
    if text is None or str(text).strip().lower() in _UNLIMITED:
        return None
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in _RATE_UNITS:
        raise ValueError(f"rate must look like 100mbit, 20mbit, 1gbit or unlimited, not {text!r}")
    bits = int(Fraction(m.group(1)) * _RATE_UNITS[m.group(2)])  # exact: a float made 2.01mbit 2009999 bits
    if bits < 8000:
        raise ValueError(f"rate {text!r} is below 8kbit")
    if bits > MAX_RATE_BITS:
        raise ValueError(f"rate {text!r} is above {format_rate(MAX_RATE_BITS)} (tc's limit; unlimited shapes none)")
    return bits


def format_rate(bits: int | None) -> str:
    """``100_000_000`` -> ``"100mbit"``, in the largest unit that names it exactly
    (:func:`parse_rate` reads it back as ``bits``: ``1.5mbit`` is ``1500kbit``)."""
    if bits is None:
        return "unlimited"
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits >= scale and bits % scale == 0:
            return f"{bits // scale}{unit}"
    return f"{bits}bit"


def tbf_args(rate_bits: int) -> list[str]:
    """``tc ... tbf`` parameters that carry ``rate_bits``.

    The bucket holds 4 ms at the rate (at least 16 KiB, so a 64 KiB GSO segment is split
    rather than dropped and a timer tick never starves the link) and the queue 100 ms (at
    least 256 KiB): TCP then fills the link instead of collapsing on tail drops.
    """
    burst, limit = _tbf_sizes(rate_bits)
    return ["rate", f"{rate_bits}bit", "burst", str(burst), "limit", str(limit)]


def _tbf_sizes(rate_bits: int) -> tuple[int, int]:
    rate_bytes = rate_bits / 8
    burst = max(int(rate_bytes * 0.004), 16 * 1024)
    return burst, max(int(rate_bytes * 0.1), 256 * 1024, 4 * burst)


def queue_drain_s(rate_bits: int | None) -> float:
    """Seconds a link's full ``tbf`` queue takes to drain (0 for an unlimited link)."""
    return 0.0 if rate_bits is None else _tbf_sizes(rate_bits)[1] * 8 / rate_bits


def _run(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
    try:
        # its own session: a terminal's Ctrl-C, sent to the whole foreground group, killed an
        # `ip netns del` of the cleanup that the command had deferred the signal for
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, timeout=COMMAND_TIMEOUT, start_new_session=True)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"`{' '.join(argv)}` failed: {exc}") from None
    if check and done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise NetnsError(f"`{' '.join(argv)}` failed: {reason}")
    return done


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here (None when they can)."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the `{tool}` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN); run as root"
    name = f"{NETNS_PREFIX}-probe-{secrets.token_hex(4)}"
    try:
        done = _run(["ip", "netns", "add", name], check=False)
        if done.returncode != 0:
            return f"cannot create a network namespace: {done.stderr.strip() or done.returncode}"
        return None
    finally:  # also after a Ctrl-C between the two, which left the probe behind
        if os.path.exists(os.path.join(NETNS_DIR, name)):
            _run(["ip", "netns", "del", name], check=False)


_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise NetnsError(f"setns failed: {os.strerror(err)}")


@contextlib.contextmanager
def in_netns(name: str):
    """Run the body with the calling thread in namespace ``name`` (sockets made there stay there)."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY)
    except OSError as exc:
        os.close(own)
        raise NetnsError(f"no network namespace {name}: {exc.strerror}") from None
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(target)
        os.close(own)


def netns_socket(name: str, *args) -> socket.socket:
    """A socket created inside namespace ``name``."""
    with in_netns(name):
        return socket.socket(*args)


def measure_link(src_ns: str, dst_ns: str, dst_host: str, seconds: float = 1.5) -> float:
    """Bulk TCP from ``src_ns`` to ``dst_host`` in ``dst_ns`` for ``seconds``; bits/s received."""
    with in_netns(dst_ns):
        listener = socket.create_server((dst_host, 0))
    port = listener.getsockname()[1]
    sender = netns_socket(src_ns, socket.AF_INET, socket.SOCK_STREAM)
    got = {"bytes": 0, "first": None, "last": None}

    def receive() -> None:
        conn, _ = listener.accept()
        conn.settimeout(seconds + MEASURE_DRAIN_S)
        with conn:
            buf = bytearray(MEASURE_CHUNK)
            while True:
                n = conn.recv_into(buf)
                if not n:
                    break
                now = time.perf_counter()
                if got["first"] is None:
                    got["first"] = now
                else:  # the first chunk only starts the clock
                    got["bytes"] += n
                got["last"] = now

    thread = threading.Thread(target=receive, name="measure-recv", daemon=True)
    thread.start()
    try:
        listener.settimeout(10)
        sender.settimeout(seconds + MEASURE_DRAIN_S)
        sender.connect((dst_host, port))
        block = b"\0" * MEASURE_CHUNK
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            sender.sendall(block)
        sender.shutdown(socket.SHUT_WR)
        thread.join(seconds + MEASURE_DRAIN_S)
    except OSError as exc:
        raise NetnsError(f"bulk transfer {src_ns} -> {dst_host} failed: {exc}") from None
    finally:
        sender.close()
        listener.close()
    if not got["bytes"] or got["last"] <= got["first"]:
        raise NetnsError(f"bulk transfer {src_ns} -> {dst_host} carried nothing")
    return got["bytes"] * 8 / (got["last"] - got["first"])


@dataclass
class NetnsChain:
    """``hosts`` namespaces in a chain of veth links, each shaped to ``rate_bits`` (None: unshaped)."""

    hosts: int
    rate_bits: int | None = None
    run_id: str = field(default_factory=lambda: secrets.token_hex(4))
    namespaces: list[str] = field(default_factory=list)  # made so far
    processes: list = field(default_factory=list)  # Popen-likes with terminate()/kill()

    def name(self, host: int) -> str:
        return f"{NETNS_PREFIX}-{self.run_id}-h{host}"

    @staticmethod
    def link_address(link: int, side: int) -> str:
        """Address of ``side`` (1: host K, 2: host K+1) on link K."""
        return f"{SUBNET_PREFIX}.{link}.{side}"

    def host_address(self, host: int) -> str:
        """The address host K's stage is reached at (its end of the link from its upstream)."""
        if self.hosts == 1:
            return "127.0.0.1"
        return self.link_address(0, 1) if host == 0 else self.link_address(host - 1, 2)

    def exec_prefix(self, host: int) -> list[str]:
        return ["ip", "netns", "exec", self.name(host)]

    def create(self) -> "NetnsChain":
        if self.hosts < 1:
            raise NetnsError("need at least one host")
        for host in range(self.hosts):
            name = self.name(host)
            self.namespaces.append(name)
            _run(["ip", "netns", "add", name])
            _run(["ip", "-n", name, "link", "set", "lo", "up"])
        for link in range(self.hosts - 1):
            a, b = self.name(link), self.name(link + 1)
            _run(["ip", "link", "add", LINK_DOWN, "netns", a, "type", "veth", "peer", "name", LINK_UP, "netns", b])
            for ns, dev, side in ((a, LINK_DOWN, 1), (b, LINK_UP, 2)):
                _run(["ip", "-n", ns, "addr", "add", f"{self.link_address(link, side)}/24", "dev", dev])
                _run(["ip", "-n", ns, "link", "set", dev, "up"])
                if self.rate_bits is not None:
                    _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                          *tbf_args(self.rate_bits)])
        return self

    def measure(self, link: int = 0, seconds: float = 1.5) -> float:
        """Bulk-transfer throughput (bits/s) from host ``link`` to host ``link + 1``."""
        return measure_link(self.name(link), self.name(link + 1), self.link_address(link, 2), seconds)

    def spawn(self, popen) -> None:
        """Track a process started in a namespace so :meth:`close` ends it."""
        self.processes.append(popen)

    def close(self) -> list[str]:
        """End every tracked process, delete every namespace; returns the problems (if any)."""
        problems = []
        for proc in self.processes:
            try:
                proc.terminate()
            except Exception as exc:  # noqa: BLE001 -- keep cleaning up
                problems.append(f"terminate: {exc}")
        self.processes.clear()
        for name in reversed(self.namespaces):
            if os.path.exists(os.path.join(NETNS_DIR, name)):
                done = _run(["ip", "netns", "del", name], check=False)
                if done.returncode != 0:
                    problems.append(f"ip netns del {name}: {done.stderr.strip()}")
        self.namespaces.clear()
        return problems

    def __enter__(self) -> "NetnsChain":
        return self.create()

    def __exit__(self, *exc) -> None:
        self.close()


def list_netns(prefix: str = NETNS_PREFIX) -> list[str]:
    """Names in ``ip netns list`` that start with ``prefix``."""
    done = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.startswith(prefix)]


__all__ = ["NETNS_PREFIX", "NO_NETNS_ENV", "SUBNET_PREFIX", "MEASURE_DRAIN_S", "parse_rate", "format_rate", "tbf_args",
           "queue_drain_s", "netns_unavailable", "in_netns", "netns_socket", "measure_link", "NetnsChain", "list_netns"]
