"""The socket side of the wire (``skippy_wire.net.transport``): records off a socket through
the incremental decoders, whatever the segmentation; clean and unclean closes; READY;
addresses; the local TLS files checked before any connection (``skippy_wire.net.tls``)."""

from __future__ import annotations

import socket
import ssl
import struct
import subprocess
import threading
import time
import traceback

import pytest

from skippy_wire.errors import InvalidDataError, UnexpectedEofError
from skippy_wire.net.tls import TlsConfig, starts_tls_handshake
from skippy_wire.net.transport import HEAD_BYTES, Peer, PeerClosedError, SocketReader, parse_address
from skippy_wire.wire import frame
from skippy_wire.wire.constants import READY_BYTES
from skippy_wire.wire.replies import StageReply, StageReplyStats, StageReplyWindow, WireReplyKind
from skippy_wire.wire.messages import StageStateHeader, StageWireMessage, WireMessageKind as K


def _replies():
    return [StageReply(WireReplyKind.PREDICTED_TOKEN, t, [t], StageReplyWindow(), None, StageReplyStats(*range(27)))
            for t in (3, 1, 4)]


def _messages():
    return [StageWireMessage.configure_generation(1, 2, 7, None, None),
            StageWireMessage(K.PREFILL_EMBD, 0, 2, StageStateHeader.new(K.PREFILL_EMBD), 1, 2, tokens=[1, 2]),
            StageWireMessage.stop(1, 2)]


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    yield a, b
    a.close()
    b.close()


def test_pipelined_messages_in_one_segment_come_out_one_by_one_with_their_sizes(pair):
    a, b = pair
    encoded = [frame.write_stage_message(m) for m in _messages()]
    reader = SocketReader(b, frame.StageMessageDecoder(4))
    a.sendall(b"".join(encoded))
    a.shutdown(socket.SHUT_WR)
    got = []
    while (msg := reader.read()) is not None:
        got.append((msg.kind, reader.last_size))
    assert got == [(m.kind, len(e)) for m, e in zip(_messages(), encoded)]
    assert reader.count == sum(map(len, encoded)) and reader.buffered == 0


def test_whole_records_waiting_are_buffered_not_partial(pair):
    # A peer's reset with whole messages unread was logged "in the middle of a message": only
    # the bytes of a record begun and not complete are partial.
    a, b = pair
    encoded = [frame.write_stage_message(m) for m in _messages()]
    reader = SocketReader(b, frame.StageMessageDecoder(4))
    a.sendall(b"".join(encoded))
    assert reader.read() is not None
    assert reader.buffered == sum(map(len, encoded[1:])) and reader.partial == 0
    a.sendall(encoded[0][:5])
    assert reader.read() is not None and reader.read() is not None  # the whole ones, from the first receive
    assert reader.wait_readable(5)  # the five bytes arrive
    assert reader.partial == reader.buffered == 5


def test_a_record_split_across_segments(pair):
    a, b = pair
    data = frame.write_reply(_replies()[0])
    reader = SocketReader(b, frame.StageReplyDecoder())
    a.sendall(data[:5])
    assert reader.wait_readable(5) and reader.buffered == 5
    a.sendall(data[5:])
    assert reader.read().predicted == 3 and reader.last_size == len(data)


def test_close_in_the_middle_of_a_record_is_eof(pair):
    """The peer's close, also when read again: the reader kept the decoder's plain EOF, which
    a second read raised as a malformed record."""
    a, b = pair
    reader = SocketReader(b, frame.StageReplyDecoder())
    a.sendall(frame.write_reply(_replies()[0])[:-1])
    a.shutdown(socket.SHUT_WR)
    depths = []
    for _ in range(3):
        with pytest.raises(PeerClosedError) as caught:
            reader.read()
        depths.append(len(traceback.extract_tb(caught.value.__traceback__)))
    assert depths[1] == depths[2]  # each raise starts its own traceback (it grew by a frame a read)


def test_good_records_before_garbage_are_read_first(pair):
    a, b = pair
    good = b"".join(frame.write_reply(r) for r in _replies()[:2])
    reader = SocketReader(b, frame.StageReplyDecoder())
    a.sendall(good + struct.pack("<i", 9) + bytes(60))  # reply kind 9 does not exist
    assert [reader.read().predicted for _ in range(2)] == [3, 1]
    with pytest.raises(InvalidDataError, match="^unknown stage reply kind$"):
        reader.read()


def test_peer_reads_ready_then_replies_without_losing_bytes(pair, tmp_path):
    a, b = pair
    peer = Peer(b, capture_prefix=str(tmp_path / "hop"))
    replies = b"".join(frame.write_reply(r) for r in _replies())
    a.sendall(READY_BYTES + replies)  # READY and the replies in one segment
    peer.recv_ready()
    assert [peer.read().predicted for _ in range(3)] == [3, 1, 4]
    peer.send(b"xyz")
    assert a.recv(3) == b"xyz" and peer.sent == 3 and peer.received == 4 + len(replies)
    a.close()
    with pytest.raises(UnexpectedEofError):  # a clean close where a reply is due
        peer.read()
    peer.close()
    assert (tmp_path / "hop-replies.bin").read_bytes() == READY_BYTES + replies
    assert (tmp_path / "hop-messages.bin").read_bytes() == b"xyz"


def test_a_bad_ready_magic(pair):
    a, b = pair
    a.sendall(b"NOPE")
    with pytest.raises(InvalidDataError, match="^stage ready magic mismatch$"):
        Peer(b).recv_ready()


def _answer_each_request(sock, replies, delay_s):
    """A peer that answers each request byte with the next reply, ``delay_s`` later."""
    for reply in replies:
        if not sock.recv(1):
            return
        time.sleep(delay_s)
        sock.sendall(frame.write_reply(reply))


@pytest.mark.parametrize("poll_s", [0.0, 0.015, 0.2])
def test_a_polling_reader_finds_replies_near_their_expected_arrival(pair, poll_s):
    """Replies that take as long as the one before are found by polling (not by a wake-up
    from recv) when a window is set -- one wider than the wait polls all of it -- and never
    without one; either way every record is whole."""
    a, b = pair
    replies = [StageReply(WireReplyKind.PREDICTED_TOKEN, t, [t]) for t in range(6)]
    answering = threading.Thread(target=_answer_each_request, args=(b, replies, 0.04))
    answering.start()
    peer = Peer(a)
    peer.reader.poll_s = poll_s
    try:
        for reply in replies:
            a.sendall(b"?")
            assert peer.read() == reply
    finally:
        answering.join(10)
    if poll_s:
        assert peer.reader.polled_arrivals >= 2  # the first wait only sets the expectation
    else:
        assert peer.reader.polled_arrivals == 0


@pytest.mark.parametrize("text", ["[::1]:9000", "::1:0", "tcp://[fe80::1%eth0]:19000", "[::]:0"])
def test_ipv6_addresses_are_refused(text):
    """Listeners are IPv4: "[::1]:0" was accepted and then failed with "unknown error -9"."""
    with pytest.raises(ValueError, match=r"^IPv6 addresses are not supported: "):
        parse_address(text)
    assert parse_address("[127.0.0.1]:5") == ("127.0.0.1", 5) and parse_address(":7") == ("127.0.0.1", 7)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a certificate it signed with its key, and another (self-signed) key."""
    d = tmp_path_factory.mktemp("pki")

    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    for name in ("ca", "other"):
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
                "-keyout", f"{name}.key", "-out", f"{name}.pem")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=node", "-keyout", "node.key", "-out", "node.csr")
    openssl("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2",
            "-out", "node.pem")
    return d


@pytest.mark.parametrize("cert,key,ca,message", [
    ("node.pem", "other.key", "ca.pem", "--tls-key {key} does not match --tls-cert {cert}"),
    ("node.key", "node.key", "ca.pem", "--tls-cert {cert}: not a PEM certificate"),
    ("node.pem", "node.pem", "ca.pem", "--tls-key {key}: not a PEM private key"),
    ("node.pem", "node.key", "ca.key", "--tls-ca {ca}: no CA certificate in it"),
    ("node.pem", "node.key", "node.csr", "--tls-ca {ca}: no CA certificate in it"),
])
def test_tls_files_are_checked_before_any_connection(pki, cert, key, ca, message):
    """Each wrong file is named with its option (a mismatched key was a handshake failure
    blamed on stage 0; a key given as the certificate "[SSL] PEM lib (_ssl.c:3905)")."""
    cert, key, ca = (str(pki / name) for name in (cert, key, ca))
    with pytest.raises(ValueError) as caught:
        TlsConfig(cert, key, ca).check()
    assert str(caught.value) == message.format(cert=cert, key=key, ca=ca)
    TlsConfig(str(pki / "node.pem"), str(pki / "node.key"), str(pki / "ca.pem")).check()  # the right files load


def test_a_reader_keeps_the_connection_s_first_bytes_whatever_the_segmentation(pair):
    """Through the records' reader and through the v17 handshake's socket alike."""
    a, b = pair
    data = bytes(range(100))
    peer = Peer(b)
    handshake = peer.capturing_socket()
    for piece in (data[:3], data[3:20], data[20:70], data[70:]):
        a.sendall(piece)
        if len(piece) == 17:
            assert handshake.recv(len(piece)) == piece
        else:
            peer.reader.read_exact(len(piece))
    assert bytes(peer.reader.head) == data[:HEAD_BYTES] and peer.received == 100


def test_a_client_hello_is_told_from_the_stage_wire():
    """A plain stage that a mutual-TLS peer opens reads the ClientHello as nonsense (an
    unknown message kind, an absurd state version): the log names the TLS instead."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    hello = ssl.create_default_context().wrap_bio(incoming, outgoing, server_hostname="stage")
    with pytest.raises(ssl.SSLWantReadError):
        hello.do_handshake()
    assert starts_tls_handshake(outgoing.read())
    for plain in (READY_BYTES, frame.write_stage_message(_messages()[0]), b"\x16", b""):
        assert not starts_tls_handshake(plain)


def test_a_port_check_on_a_tls_stage_is_a_peer_that_left_not_a_plain_client():
    # (a topology's diagnosis connects and closes: that read as a stranger speaking plain TCP)
    from skippy_wire.errors import StageError
    from skippy_wire.net.tls import accept_tls
    from skippy_wire.wire.setup import SetupError

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    left, server = socket.socketpair()
    left.close()
    with pytest.raises(SetupError, match="stage peer closed during setup"):
        accept_tls(server, context, 1.0)
    server.close()
    plain, server = socket.socketpair()
    plain.sendall(b"\x0e\x00")  # a plain client's first bytes
    with pytest.raises(StageError, match="did not start a TLS handshake"):
        accept_tls(server, context, 1.0)
    plain.close()
    server.close()


@pytest.mark.parametrize("text,message", [
    ("127.0.0.1:\u0661\u0669\u0664\u0664\u0661", "the port of '127.0.0.1:\u0661\u0669\u0664\u0664\u0661' must be ASCII digits"),
    ("h:\u00b2", "the port of 'h:\u00b2' must be ASCII digits"),
    ("http://h:1", "only tcp:// may come before HOST:PORT, not 'http://h:1'"),
])
def test_a_port_in_other_digits_or_another_scheme_is_refused(text, message):
    """`--listen 127.0.0.1:<Arabic-Indic 19441>` listened on port 19441; `http://h:1` read as IPv6."""
    with pytest.raises(ValueError) as info:
        parse_address(text)
    assert str(info.value) == message
    assert parse_address("tcp://h:19000") == ("h", 19000)
