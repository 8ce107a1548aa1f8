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

:meth:`TlsConfig.check` refuses, before anything starts, files that cannot work, the
certificate included when its peers would refuse it (an in-memory handshake verifies it
against the CA: expired, not yet valid, another CA's); a failed handshake is told in words
on both ends (:func:`tls_failure`).
"""

from __future__ import annotations

import ipaddress
import select
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Optional

from ..errors import SetupClosed, StageError, os_reason, special_file

#: Sent in the clear to a plain peer of a TLS stage, where it expects READY or a setup reply.
TLS_REQUIRED_NOTICE = b"STLS"
#: How long a TLS stage waits for a new peer's ClientHello before taking it for plain.
PLAIN_PEER_GRACE_SECONDS = 2.0
#: How long a stage that refused a peer's handshake keeps reading what the peer sends next,
#: so that its alert reaches the peer rather than being discarded by a reset (below).
ALERT_LINGER_SECONDS = 1.0
#: The first byte of a TLS handshake record.
TLS_HANDSHAKE_RECORD = 0x16
#: The record's major version byte (TLS 1.0-1.3 all write 3).
TLS_MAJOR_VERSION = 0x03
TLS_OPTIONS_TOGETHER = "--tls-cert, --tls-key and --tls-ca go together"
#: Why a key with a passphrase, even an empty one, is refused.
ENCRYPTED_KEY = "the key is encrypted (give it without a passphrase)"
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


def _ca_out_of_date(path: str) -> str:
    """Whether the one CA certificate of the PEM file ``path`` is outside its validity now, and
    since or until when ("" when it is not, or the file holds several: which of them signed
    the certificate is not known here): OpenSSL's "certificate has expired" does not say
    whether it is the CA's or the certificate it signed."""
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    probe.load_verify_locations(cafile=path)
    cas = probe.get_ca_certs()
    if len(cas) != 1:
        return ""
    ca, now = cas[0], time.time()
    name = ", ".join(f"{key}={value}" for rdn in ca["subject"] for key, value in rdn)
    if ssl.cert_time_to_seconds(ca["notAfter"]) < now:
        return f"the CA certificate {name} of --tls-ca expired on {' '.join(ca['notAfter'].split())}"
    if ssl.cert_time_to_seconds(ca["notBefore"]) > now:
        return f"the CA certificate {name} of --tls-ca is not valid before {' '.join(ca['notBefore'].split())}"
    return ""


def _not_a_file(option: str, path: str) -> None:
    """ValueError naming ``option`` when ``path`` exists but is a FIFO, a device or a socket:
    opening a FIFO waits for a writer for ever, /dev/zero never ends, and each file is read
    more than once (checked, then by every context).  A missing file or a directory is left
    to the reader, which names the reason."""
    why = special_file(path)
    if why is not None:
        raise ValueError(f"{option} {path}: {why}")


#: The verification error of a certificate whose (extended) key usage does not cover the
#: role it was checked in (X509_V_ERR_INVALID_PURPOSE): a stage's certificate may be fine for
#: the roles it does play (a serverAuth-only one on a last stage), so it is refused at
#: start-up for the roles the process plays only.
_INVALID_PURPOSE = 26
#: The verification errors another CA's certificate gives (OpenSSL's X509_V_ERR_
#: UNABLE_TO_GET_ISSUER_CERT, UNABLE_TO_DECRYPT_CERT_SIGNATURE, CERT_SIGNATURE_FAILURE (a CA
#: of the same name, another key), DEPTH_ZERO_SELF_SIGNED_CERT, SELF_SIGNED_CERT_IN_CHAIN,
#: UNABLE_TO_GET_ISSUER_CERT_LOCALLY, UNABLE_TO_VERIFY_LEAF_SIGNATURE).
_ANOTHER_CA = (2, 4, 7, 18, 19, 20, 21)
#: OpenSSL's X509_V_ERR_CERT_NOT_YET_VALID and X509_V_ERR_CERT_HAS_EXPIRED.
_OUT_OF_DATE = (9, 10)


def _no_passphrase() -> bytes:
    """The passphrase callback of every key load: an encrypted key is refused, never asked for
    at OpenSSL's prompt on the terminal (which waits without end)."""
    raise ValueError(ENCRYPTED_KEY)


def _verify_own(config: "TlsConfig") -> tuple:
    """Check ``config``'s certificate as its peers will, in memory before any connection:
    presented by a connecting side to a listener with its context, and by a listener to a
    connecting side.  The failure of each handshake (an ``ssl.SSLError``: a verification
    error, expired, not signed by the CA, unfit for the role, ...; or another, a key no
    cipher suite can use), or None."""
    try:
        server = config.server_context()
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        client.check_hostname, client.verify_mode = False, ssl.CERT_NONE
        client.load_cert_chain(config.cert, config.key, password=_no_passphrase)
        listener = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        listener.load_cert_chain(config.cert, config.key, password=_no_passphrase)
        verifier = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        verifier.check_hostname = False
        verifier.load_verify_locations(config.ca)
    except (ssl.SSLError, OSError):  # not the certificate's validity: loading the contexts will say what
        return None, None
    return _refusal(client, server), _refusal(verifier, listener)


def _unfit(refused) -> bool:
    return isinstance(refused, ssl.SSLCertVerificationError) and refused.verify_code == _INVALID_PURPOSE


def _refusal(client: ssl.SSLContext, server: ssl.SSLContext) -> "ssl.SSLError | None":
    """How an in-memory handshake between the two contexts fails, or None."""
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    pending = [client.wrap_bio(to_client, to_server, server_hostname=None),
               server.wrap_bio(to_server, to_client, server_side=True)]
    for _ in range(8):  # a TLS 1.2 or 1.3 handshake takes 2 or 3 flights
        for end in list(pending):
            try:
                end.do_handshake()
                pending.remove(end)
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLError as exc:
                return exc
        if not pending:
            break
    return None


def tls_failure(exc: ssl.SSLError) -> str:
    """What a failed handshake's ``exc`` means, in words (not OpenSSL's "[SSL: X] x
    (_ssl.c:N)"): the certificate verification error, the alert the peer sent about this
    side's certificate, a peer without a certificate, a peer that closed."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"the peer's certificate is refused: {exc.verify_message or exc.reason}"
    reason = exc.reason or ""
    if reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE":
        return "the peer presented no certificate (mutual TLS: it needs --tls-cert and --tls-key too)"
    if "_ALERT_" in reason:
        alert = reason.split("_ALERT_", 1)[1].replace("_", " ").lower()
        if _certificate_alert(reason):
            return f"the peer refused this side's certificate ({alert})"
        return f"the peer aborted the handshake ({alert})"
    if _closed(exc):
        return "the peer closed the connection during the handshake"
    return reason.replace("_", " ").lower() if reason else str(exc)


def _closed(exc: ssl.SSLError) -> bool:
    return isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError)) or exc.reason == "UNEXPECTED_EOF_WHILE_READING"


def _certificate_alert(reason: str) -> bool:
    return "_ALERT_" in reason and ("CERTIFICATE" in reason or "UNKNOWN_CA" in reason)


def refuses_certificate(exc: ssl.SSLError) -> bool:
    """Whether ``exc`` says a certificate was refused, by either side: a mismatch no wait mends."""
    reason = exc.reason or ""
    return isinstance(exc, ssl.SSLCertVerificationError) or reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE" \
        or _certificate_alert(reason)


def link_error(exc: BaseException):
    """``exc`` from a link's first read in words: a TLS failure (with TLS 1.3 a peer refuses
    this side's certificate after the handshake, at the first read), a socket's error without
    Python's "[Errno 104]"."""
    if isinstance(exc, ssl.SSLError):
        return tls_failure(exc)
    return os_reason(exc) if isinstance(exc, OSError) else exc


@dataclass(frozen=True)
class TlsConfig:
    """A certificate chain, its key and the CA every peer must be signed by (PEM paths)."""

    cert: str
    key: str
    ca: str

    @classmethod
    def from_options(cls, cert: Optional[str], key: Optional[str], ca: Optional[str]) -> Optional["TlsConfig"]:
        """None when no option is given (None); ValueError unless all three are, none empty
        (``"$CERT"`` with CERT unset must not turn mutual TLS off)."""
        given = [x for x in (cert, key, ca) if x is not None]
        if not given:
            return None
        if len(given) != 3:
            raise ValueError(TLS_OPTIONS_TOGETHER)
        for option, path in (("--tls-cert", cert), ("--tls-key", key), ("--tls-ca", ca)):
            if not path:
                raise ValueError(f"{option}: an empty path names no file")
            _not_a_file(option, path)
        return cls(cert, key, ca)

    def check(self, *, listens: bool = True, connects: bool = True) -> None:
        """Load the certificate, the key and the CA as a context will, before any connection:
        ValueError naming the option and the file at fault (a key that does not match the
        certificate, a file without a PEM certificate, a CA file without a CA certificate, a
        key or signature too weak for OpenSSL), and a certificate that its peers would refuse
        (expired, not yet valid, not signed by the CA, a key no cipher suite can use, unfit for
        a role the process plays: it ``listens`` (a stage), it ``connects`` (a driver, a stage
        with a downstream): :func:`_verify_own`)."""
        if not _certificates_in(self.cert)["x509"]:
            raise ValueError(f"--tls-cert {self.cert}: not a PEM certificate")
        probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        encrypted = []
        try:
            probe.load_cert_chain(self.cert, self.key, password=lambda: encrypted.append(True) or b"")
        except ssl.SSLError as exc:
            # NO_CERTIFICATE_ASSIGNED: a key of another type (EC) than the certificate's (RSA)
            if exc.reason in ("KEY_VALUES_MISMATCH", "NO_CERTIFICATE_ASSIGNED"):
                chain = _certificates_in(self.cert)["x509"] > 1  # only the first one is matched against it
                raise ValueError(f"--tls-key {self.key} does not match "
                                 + ("the first certificate of " if chain else "") + f"--tls-cert {self.cert}"
                                 + (" (the key's own certificate comes first, then its chain)" if chain else "")) \
                    from None
            if encrypted:
                raise ValueError(f"--tls-key {self.key}: {ENCRYPTED_KEY}") from None
            if exc.reason == "EE_KEY_TOO_SMALL":
                raise ValueError(f"--tls-cert {self.cert}: its key is too small for OpenSSL's security level "
                                 "(use RSA of 2048 bits or more, or an EC key)") from None
            if exc.reason == "CA_MD_TOO_WEAK":
                raise ValueError(f"--tls-cert {self.cert}: signed with a digest too weak for OpenSSL's security "
                                 "level (MD5 or SHA-1: sign it with SHA-256)") from None
            if exc.reason:
                raise ValueError(f"--tls-key {self.key} with --tls-cert {self.cert}: {tls_failure(exc)}") from None
            raise ValueError(f"--tls-key {self.key}: not a PEM private key") from None
        if encrypted:  # by an empty passphrase: loaded here, a prompt later
            raise ValueError(f"--tls-key {self.key}: {ENCRYPTED_KEY}")
        if not _certificates_in(self.ca)["x509_ca"]:
            raise ValueError(f"--tls-ca {self.ca}: no CA certificate in it")
        as_client, as_listener = _verify_own(self)
        refused = next((r for r in (as_client, as_listener) if r is not None and not _unfit(r)), None)
        if isinstance(refused, ssl.SSLCertVerificationError):
            ca_dates = _ca_out_of_date(self.ca) if refused.verify_code in _OUT_OF_DATE else ""
            raise ValueError(f"--tls-cert {self.cert} does not verify against --tls-ca {self.ca}: "
                             f"{refused.verify_message or refused.reason} "
                             + f"({ca_dates or 'a peer with the same --tls-ca would refuse it'})")
        if refused is not None:  # e.g. a DSA key: no TLS 1.2 or 1.3 cipher suite signs with it
            raise ValueError(f"--tls-cert {self.cert}: a TLS handshake with it fails: {tls_failure(refused)}"
                             + (" (use an RSA or EC key)" if refused.reason == "NO_SHARED_CIPHER" else ""))
        if _unfit(as_client) and _unfit(as_listener):
            raise ValueError(f"--tls-cert {self.cert} suits neither end of a stage link: its key usage allows "
                             "neither TLS server nor TLS client authentication")
        if listens and _unfit(as_listener):
            raise ValueError(f"--tls-cert {self.cert} cannot serve a stage link: its key usage does not allow TLS "
                             "server authentication (serverAuth), which every stage needs")
        if connects and _unfit(as_client):
            raise ValueError(f"--tls-cert {self.cert} cannot open a stage link: its key usage does not allow TLS "
                             "client authentication (clientAuth), which a driver and a stage with a downstream need")

    def _context(self, purpose) -> ssl.SSLContext:
        ctx = ssl.create_default_context(purpose, cafile=self.ca)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_cert_chain(self.cert, self.key, password=_no_passphrase)
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
    that leaves without a byte (a port check), or during the handshake -> SetupClosed, as on
    a plain stage; a failed handshake -> StageError saying why (:func:`tls_failure`).

    The handshake runs on a duplicate of ``sock``'s descriptor (wrapping a socket detaches
    it), so ``sock`` stays the connection's handle until the TLS socket replaces it: shutting
    ``sock`` down (a connection shed at the limit, the server stopping) ends a handshake that
    a peer stalls at once, not after ``timeout``.  ``sock`` is closed once the handshake is
    done."""
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
    duplicate = sock.dup()
    try:
        tls = context.wrap_socket(duplicate, server_side=True, do_handshake_on_connect=False)
    except BaseException:
        duplicate.close()
        raise
    try:
        _handshake(tls)
    except ssl.SSLError as exc:
        if isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError)) or exc.reason == "UNEXPECTED_EOF_WHILE_READING":
            raise SetupClosed() from None
        # Under TLS 1.3 the peer's handshake is over before ours, and it may write its first
        # message (a v17 Hello) next: into a closed socket, that write draws a reset, which
        # discards our alert unread ("the peer closed the connection" instead of "unknown ca").
        drain_before_close(sock, ALERT_LINGER_SECONDS)
        raise StageError(f"TLS handshake failed: {tls_failure(exc)}") from None
    sock.close()
    return tls


def drain_before_close(sock: socket.socket, seconds: float) -> None:
    """End this side's sending and read (and drop) what the peer still sends, until it closes
    or ``seconds`` pass: closed with unread bytes, the socket would send a reset, which discards
    at the peer's end what this side said last (a version notice, a TLS alert) before it is read."""
    deadline = time.monotonic() + seconds
    try:
        sock.shutdown(socket.SHUT_WR)
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(1 << 16):
                break
    except OSError:  # a timeout, or the peer gone
        pass


class HandshakeTimeout(TimeoutError):
    """The TLS handshake did not finish within its deadline (a peer may send a byte at a
    time and never stall): the text says how long it had."""


def _handshake(tls: ssl.SSLSocket) -> ssl.SSLSocket:
    try:
        tls.do_handshake()
    except TimeoutError:  # in words, not "_ssl.c:989: The handshake operation timed out"
        timeout = tls.gettimeout()
        tls.close()
        raise HandshakeTimeout(f"the TLS handshake did not finish within {timeout:g} s") from None
    except BaseException:
        tls.close()
        raise
    return tls


def starts_tls_handshake(head: bytes) -> bool:
    """Whether a connection's first bytes are a TLS handshake record's (a ClientHello)."""
    return head[:2] == bytes((TLS_HANDSHAKE_RECORD, TLS_MAJOR_VERSION))


def handshake_failure(who: str, exc: ssl.SSLError) -> str:
    """The one-line error of a failed client handshake with ``who``, asking after the CA where
    another CA (or a plain stage, which closes) may be the cause."""
    another_ca = exc.verify_code in _ANOTHER_CA if isinstance(exc, ssl.SSLCertVerificationError) \
        else "UNKNOWN_CA" in (exc.reason or "") or _closed(exc)
    return f"TLS handshake with {who} failed: {tls_failure(exc)}" + \
        (" (does it use mutual TLS with the same CA?)" if another_ca else "")


def connect_tls(sock: socket.socket, context: ssl.SSLContext, host: str) -> ssl.SSLSocket:
    """The client side: wrap and handshake (under ``sock``'s timeout)."""
    return _handshake(context.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False))


__all__ = ["PLAIN_EXPOSED_WARNING", "TLS_REQUIRED_NOTICE", "PLAIN_PEER_GRACE_SECONDS", "TLS_HANDSHAKE_RECORD",
           "TLS_CLIENT_ON_PLAIN_STAGE", "starts_tls_handshake", "handshake_failure",
           "TLS_OPTIONS_TOGETHER", "TlsConfig", "is_loopback", "accept_tls", "connect_tls", "tls_failure", "link_error",
           "drain_before_close"]
