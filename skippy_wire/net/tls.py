"""Mutual TLS for stage links and the driver link (stdlib :mod:`ssl`), off by default.

Both ends present a certificate and verify the other's against one private CA
(``--tls-cert`` / ``--tls-key`` / ``--tls-ca``): a stage's listener requires and verifies
client certificates, its downstream connection and the driver verify the server's.  Any
certificate signed by that CA is trusted (host names are not checked: the CA is the trust
boundary, see docs/security.md).  Plain TCP stays byte-compatible with upstream.

A TLS stage reached by a plain peer: a TLS client speaks first (ClientHello, a record
starting with byte 0x16), so a peer that sends anything else, or nothing within
``PLAIN_PEER_GRACE_SECONDS`` (a plain v15/v16 client waiting for READY), is sent
:data:`TLS_REQUIRED_NOTICE` in the clear and closed; this package's plain client turns
the notice into a one-line error.
"""

from __future__ import annotations

import ipaddress
import select
import socket
import ssl
from dataclasses import dataclass
from typing import Optional

from ..errors import SetupClosed, StageError

#: Sent in the clear to a plain peer of a TLS stage, where it expects READY or a setup reply.
TLS_REQUIRED_NOTICE = b"STLS"
#: How long a TLS stage waits for a new peer's ClientHello before taking it for plain.
PLAIN_PEER_GRACE_SECONDS = 2.0
#: The first byte of a TLS handshake record.
TLS_HANDSHAKE_RECORD = 0x16
#: The record's major version byte (TLS 1.0-1.3 all write 3).
TLS_MAJOR_VERSION = 0x03
TLS_OPTIONS_TOGETHER = "--tls-cert, --tls-key and --tls-ca go together"
#: Logged by a plain stage whose peer opened with a TLS handshake.
TLS_CLIENT_ON_PLAIN_STAGE = ("the peer started a TLS handshake (a mutual-TLS client; this stage speaks plain TCP: "
                             "give it --tls-cert, --tls-key and --tls-ca too)")
#: Logged by a plain stage bound beyond loopback (host, port).
PLAIN_EXPOSED_WARNING = ("listening on %s:%d, beyond loopback: the stage data plane is unauthenticated plain TCP "
                         "(anyone who can reach this port can drive the stage); use --tls-cert/--tls-key/--tls-ca "
                         "or a VPN (docs/security.md)")


def is_loopback(host: str) -> bool:
    """Whether a bind address only accepts this machine's connections."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _certificates_in(path: str) -> dict:
    """How many certificates (``x509``) and CA certificates (``x509_ca``) a PEM file holds
    (none for a file that is not PEM)."""
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        probe.load_verify_locations(cafile=path)
    except ssl.SSLError:
        pass
    return probe.cert_store_stats()


@dataclass(frozen=True)
class TlsConfig:
    """A certificate chain, its key and the CA every peer must be signed by (PEM paths)."""

    cert: str
    key: str
    ca: str

    @classmethod
    def from_options(cls, cert: Optional[str], key: Optional[str], ca: Optional[str]) -> Optional["TlsConfig"]:
        """None when no option is given; ValueError unless all three are."""
        given = [x for x in (cert, key, ca) if x]
        if not given:
            return None
        if len(given) != 3:
            raise ValueError(TLS_OPTIONS_TOGETHER)
        return cls(cert, key, ca)

    def check(self) -> None:
        """Load the certificate, the key and the CA as a context will, before any connection:
        ValueError naming the option and the file at fault (a key that does not match the
        certificate, a file without a PEM certificate, a CA file without a CA certificate)."""
        if not _certificates_in(self.cert)["x509"]:
            raise ValueError(f"--tls-cert {self.cert}: not a PEM certificate")
        probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        encrypted = []
        try:
            probe.load_cert_chain(self.cert, self.key, password=lambda: encrypted.append(True) or b"")
        except ssl.SSLError as exc:
            if exc.reason == "KEY_VALUES_MISMATCH":
                raise ValueError(f"--tls-key {self.key} does not match --tls-cert {self.cert}") from None
            if encrypted:
                raise ValueError(f"--tls-key {self.key}: the key is encrypted (give it without a passphrase)") \
                    from None
            raise ValueError(f"--tls-key {self.key}: not a PEM private key") from None
        if not _certificates_in(self.ca)["x509_ca"]:
            raise ValueError(f"--tls-ca {self.ca}: no CA certificate in it")

    def _context(self, purpose) -> ssl.SSLContext:
        ctx = ssl.create_default_context(purpose, cafile=self.ca)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_cert_chain(self.cert, self.key)
        return ctx

    def server_context(self) -> ssl.SSLContext:
        """A listener's context: requires and verifies client certificates."""
        return self._context(ssl.Purpose.CLIENT_AUTH)

    def client_context(self) -> ssl.SSLContext:
        """A connecting side's context: presents the certificate, verifies the server's."""
        return self._context(ssl.Purpose.SERVER_AUTH)

    def as_args(self) -> list[str]:
        """The ``serve`` options that carry this configuration."""
        return ["--tls-cert", self.cert, "--tls-key", self.key, "--tls-ca", self.ca]


def accept_tls(sock: socket.socket, context: ssl.SSLContext, timeout: float) -> ssl.SSLSocket:
    """The server side of a new connection: check that the peer starts a TLS handshake,
    then complete it (within ``timeout``).  A plain peer -> the notice, then StageError; one
    that leaves without a byte (a port check) -> SetupClosed, as on a plain stage."""
    first = None
    if select.select([sock], [], [], PLAIN_PEER_GRACE_SECONDS)[0]:
        sock.settimeout(timeout)
        first = sock.recv(1, socket.MSG_PEEK)
        if not first:
            raise SetupClosed()
    if not first or first[0] != TLS_HANDSHAKE_RECORD:
        try:
            sock.settimeout(1.0)
            sock.sendall(TLS_REQUIRED_NOTICE)
        except OSError:
            pass
        raise StageError("the peer did not start a TLS handshake (a plain client; this stage requires TLS)")
    sock.settimeout(timeout)
    return _handshake(context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False))


def _handshake(tls: ssl.SSLSocket) -> ssl.SSLSocket:
    try:
        tls.do_handshake()
    except BaseException:
        tls.close()
        raise
    return tls


def starts_tls_handshake(head: bytes) -> bool:
    """Whether a connection's first bytes are a TLS handshake record's (a ClientHello)."""
    return head[:2] == bytes((TLS_HANDSHAKE_RECORD, TLS_MAJOR_VERSION))


def handshake_failure(who: str, exc: ssl.SSLError) -> str:
    """The one-line error of a failed client handshake with ``who``."""
    return f"TLS handshake with {who} failed: {exc.reason or exc} (does it use mutual TLS with the same CA?)"


def connect_tls(sock: socket.socket, context: ssl.SSLContext, host: str) -> ssl.SSLSocket:
    """The client side: wrap and handshake (under ``sock``'s timeout)."""
    return _handshake(context.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False))


__all__ = ["PLAIN_EXPOSED_WARNING", "TLS_REQUIRED_NOTICE", "PLAIN_PEER_GRACE_SECONDS", "TLS_HANDSHAKE_RECORD",
           "TLS_CLIENT_ON_PLAIN_STAGE", "starts_tls_handshake", "handshake_failure",
           "TLS_OPTIONS_TOGETHER", "TlsConfig", "is_loopback", "accept_tls", "connect_tls"]
