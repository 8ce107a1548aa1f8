"""Mutual TLS as an operator meets it: files that cannot work are refused at start-up with
one line naming the option and the reason, and a failed handshake says why on both ends
without holding the connection (``skippy_wire.net.tls``; certificates made with the
``openssl`` command)."""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time

import pytest

from skippy_wire.errors import PipelineMismatch, SetupClosed, StageError
from skippy_wire.net.driver import PipelineClient
from skippy_wire.net.server import StageServer
from skippy_wire.net.tls import TlsConfig, accept_tls, connect_tls, handshake_failure, link_error
from skippy_wire.tools import serve
from test_server import FakeBackend

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")

_CA_CONFIG = """[ca]
default_ca = c
[c]
database = index.txt
serial = serial
new_certs_dir = .
default_md = sha256
policy = p
copy_extensions = none
[p]
commonName = supplied
[v3ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
"""


def _openssl(*args, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _request(name: str, d, bits: int = 2048) -> None:
    _openssl("req", "-newkey", f"rsa:{bits}", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA and another one; certificates of the CA's: valid, expired, not yet valid, a
    1024-bit key; one of the other CA's; an EC key."""
    d = tmp_path_factory.mktemp("pki")
    for name in ("ca", "other-ca"):
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d)
    for name, ca, bits in (("node", "ca", 2048), ("weak", "ca", 1024), ("stranger", "other-ca", 2048)):
        _request(name, d, bits)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
                 "-CAcreateserial", "-days", "2", "-out", f"{name}.pem", cwd=d)
    (d / "ca.cnf").write_text(_CA_CONFIG)
    (d / "index.txt").write_text("")
    (d / "serial").write_text("1000\n")
    for name, start, end in (("expired", "20200101000000Z", "20200102000000Z"),
                             ("future", "20990101000000Z", "20990102000000Z")):
        _request(name, d)
        _openssl("ca", "-batch", "-config", "ca.cnf", "-cert", "ca.pem", "-keyfile", "ca.key", "-in",
                 f"{name}.csr", "-out", f"{name}.pem", "-startdate", start, "-enddate", end, "-notext", cwd=d)
    for name, extension in (("codesign", "extendedKeyUsage=codeSigning"), ("crlsign", "keyUsage=critical,cRLSign"),
                            ("serveronly", "extendedKeyUsage=serverAuth"),
                            ("clientonly", "extendedKeyUsage=clientAuth")):
        _request(name, d)
        (d / f"{name}.ext").write_text(extension + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "2", "-out", f"{name}.pem", "-extfile", f"{name}.ext", cwd=d)
    for name, start, end in (("old-ca", "20200101000000Z", "20200102000000Z"),
                             ("early-ca", "20990101000000Z", "20990102000000Z")):  # a leaf of theirs in date
        _request(name, d)
        _openssl("ca", "-batch", "-selfsign", "-config", "ca.cnf", "-keyfile", f"{name}.key", "-in", f"{name}.csr",
                 "-out", f"{name}.pem", "-startdate", start, "-enddate", end, "-extensions", "v3ca", "-notext", cwd=d)
        _request(f"{name}-leaf", d)
        _openssl("x509", "-req", "-in", f"{name}-leaf.csr", "-CA", f"{name}.pem", "-CAkey", f"{name}.key",
                 "-CAcreateserial", "-days", "2", "-out", f"{name}-leaf.pem", cwd=d)
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "ec.key", cwd=d)
    return d


def _config(pki, cert: str, key: str, ca: str = "ca.pem") -> TlsConfig:
    return TlsConfig(str(pki / cert), str(pki / key), str(pki / ca))


# --- files checked at start-up --------------------------------------------------------


@pytest.mark.parametrize("cert,ca,reason", [
    ("expired", "ca.pem", "certificate has expired"),
    ("future", "ca.pem", "certificate is not yet valid"),
    ("node", "other-ca.pem", "unable to get local issuer certificate"),
])
def test_a_certificate_its_peers_would_refuse_is_refused_at_start_up(pki, cert, ca, reason):
    """It used to start ("listening ... mutual TLS") and fail every connection, its peers
    blaming the CA: "failed: CERTIFICATE_VERIFY_FAILED (does it use mutual TLS with the same CA?)"."""
    config = _config(pki, f"{cert}.pem", f"{cert}.key", ca)
    with pytest.raises(ValueError) as caught:
        config.check()
    assert str(caught.value) == (f"--tls-cert {config.cert} does not verify against --tls-ca {config.ca}: {reason} "
                                 "(a peer with the same --tls-ca would refuse it)")


@pytest.mark.parametrize("ca, reason, dates", [
    ("old-ca", "certificate has expired", "expired on Jan 2 00:00:00 2020 GMT"),
    ("early-ca", "certificate is not yet valid", "is not valid before Jan 1 00:00:00 2099 GMT"),
])
def test_a_ca_out_of_its_dates_is_named_as_the_certificate_that_is(pki, ca, reason, dates):
    """OpenSSL's "certificate has expired" blamed --tls-cert when the CA had expired."""
    config = _config(pki, f"{ca}-leaf.pem", f"{ca}-leaf.key", f"{ca}.pem")
    with pytest.raises(ValueError) as caught:
        config.check()
    assert str(caught.value) == (f"--tls-cert {config.cert} does not verify against --tls-ca {config.ca}: {reason} "
                                 f"(the CA certificate commonName={ca} of --tls-ca {dates})")


def test_an_out_of_date_ca_in_a_bundle_is_not_blamed_for_a_certificate_another_ca_signed(pki, tmp_path):
    """A bundle of an expired CA and the valid CA that signed an expired certificate named the
    expired CA as the cause."""
    bundle = tmp_path / "bundle.pem"
    bundle.write_text((pki / "old-ca.pem").read_text() + (pki / "ca.pem").read_text())
    config = TlsConfig(str(pki / "expired.pem"), str(pki / "expired.key"), str(bundle))
    with pytest.raises(ValueError) as caught:
        config.check()
    assert str(caught.value).endswith("certificate has expired (a peer with the same --tls-ca would refuse it)")


def test_good_files_still_load(pki):
    _config(pki, "node.pem", "node.key").check()
    _config(pki, "stranger.pem", "stranger.key", "other-ca.pem").check()  # its own CA: fine
    _config(pki, "serveronly.pem", "serveronly.key").check(connects=False)  # a last stage's: it listens only
    _config(pki, "clientonly.pem", "clientonly.key").check(listens=False)  # a driver's of running stages


def test_a_certificate_unfit_for_a_role_the_process_plays_is_refused_at_start_up(pki, capsys):
    """A serverAuth-only certificate passed for a stage with a downstream, for run and api (whose
    driver connects), a clientAuth-only one for any stage: each then failed every link."""
    server_only, client_only = _config(pki, "serveronly.pem", "serveronly.key"), \
        _config(pki, "clientonly.pem", "clientonly.key")
    with pytest.raises(ValueError) as caught:
        server_only.check()
    assert str(caught.value) == (f"--tls-cert {server_only.cert} cannot open a stage link: its key usage does not "
                                 "allow TLS client authentication (clientAuth), which a driver and a stage with a "
                                 "downstream need")
    with pytest.raises(ValueError) as caught:
        client_only.check(connects=False)
    assert str(caught.value) == (f"--tls-cert {client_only.cert} cannot serve a stage link: its key usage does not "
                                 "allow TLS server authentication (serverAuth), which every stage needs")
    for config, downstream, why in ((server_only, ["--downstream", "127.0.0.1:9"], "cannot open a stage link"),
                                    (client_only, [], "cannot serve a stage link")):
        with pytest.raises(SystemExit) as info:
            serve.main(["-m", str(pki / "none.gguf"), "--layer-start", "0", "--layer-end", "1", *downstream,
                        *config.as_args()])
        assert info.value.code == 2
        last = capsys.readouterr().err.splitlines()[-1]
        assert last.startswith(f"skippy-wire: error: --tls-cert {config.cert} {why}: its key usage does not"), last


def test_a_key_no_cipher_suite_can_use_is_refused_at_start_up(pki, tmp_path):
    """A DSA certificate passed: every handshake then failed with "no shared cipher" at the stage
    and "(does it use mutual TLS with the same CA?)" at the driver, which used the same CA."""
    _openssl("genpkey", "-genparam", "-algorithm", "DSA", "-pkeyopt", "dsa_paramgen_bits:2048", "-out", "p.pem",
             cwd=tmp_path)
    _openssl("genpkey", "-paramfile", "p.pem", "-out", "dsa.key", cwd=tmp_path)
    _openssl("req", "-new", "-key", "dsa.key", "-subj", "/CN=dsa", "-out", "dsa.csr", cwd=tmp_path)
    _openssl("x509", "-req", "-in", "dsa.csr", "-CA", str(pki / "ca.pem"), "-CAkey", str(pki / "ca.key"),
             "-CAcreateserial", "-CAserial", "dsa.srl", "-days", "2", "-out", "dsa.pem", cwd=tmp_path)
    config = TlsConfig(str(tmp_path / "dsa.pem"), str(tmp_path / "dsa.key"), str(pki / "ca.pem"))
    with pytest.raises(ValueError) as caught:
        config.check()
    assert str(caught.value) == (f"--tls-cert {config.cert}: a TLS handshake with it fails: no shared cipher "
                                 "(use an RSA or EC key)")


@pytest.mark.parametrize("cert", ["codesign", "crlsign"])
def test_a_certificate_fit_for_neither_end_of_a_link_is_refused_at_start_up(pki, cert):
    # it started, then failed every handshake ("unsuitable certificate purpose")
    config = _config(pki, f"{cert}.pem", f"{cert}.key")
    with pytest.raises(ValueError) as caught:
        config.check()
    assert str(caught.value) == (f"--tls-cert {config.cert} suits neither end of a stage link: its key usage "
                                 "allows neither TLS server nor TLS client authentication")


def test_an_expired_certificate_is_a_usage_error_of_serve(pki, capsys):
    with pytest.raises(SystemExit) as info:
        serve.main(["-m", str(pki / "none.gguf"), "--layer-start", "0", "--layer-end", "1",
                    "--tls-cert", str(pki / "expired.pem"), "--tls-key", str(pki / "expired.key"),
                    "--tls-ca", str(pki / "ca.pem")])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.splitlines()[-1].startswith(f"skippy-wire: error: --tls-cert {pki / 'expired.pem'} does not verify "
                                           f"against --tls-ca {pki / 'ca.pem'}: certificate has expired")


def test_a_key_of_another_type_is_a_mismatch_not_a_non_key(pki):
    """An EC key with an RSA certificate: OpenSSL says NO_CERTIFICATE_ASSIGNED."""
    config = _config(pki, "node.pem", "ec.key")
    with pytest.raises(ValueError) as caught:
        config.check()
    assert str(caught.value) == f"--tls-key {config.key} does not match --tls-cert {config.cert}"


def test_a_chain_with_the_ca_first_says_the_key_s_certificate_comes_first(pki, tmp_path):
    # the key matches a certificate in the file: "does not match --tls-cert" sent the operator to the key
    bundle = tmp_path / "ca-then-node.pem"
    bundle.write_bytes((pki / "ca.pem").read_bytes() + (pki / "node.pem").read_bytes())
    config = TlsConfig(str(bundle), str(pki / "node.key"), str(pki / "ca.pem"))
    with pytest.raises(ValueError) as caught:
        config.check()
    assert str(caught.value) == (f"--tls-key {config.key} does not match the first certificate of --tls-cert "
                                 f"{bundle} (the key's own certificate comes first, then its chain)")
    ordered = tmp_path / "node-then-ca.pem"
    ordered.write_bytes((pki / "node.pem").read_bytes() + (pki / "ca.pem").read_bytes())
    TlsConfig(str(ordered), config.key, config.ca).check()  # the same files in that order load


def test_a_key_too_small_for_openssl_is_named_so_not_a_non_key(pki):
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        probe.load_cert_chain(str(pki / "weak.pem"), str(pki / "weak.key"))
    except ssl.SSLError:
        pass
    else:
        pytest.skip("this OpenSSL's security level takes 1024-bit RSA keys")
    config = _config(pki, "weak.pem", "weak.key")
    with pytest.raises(ValueError) as caught:
        config.check()
    assert str(caught.value) == (f"--tls-cert {config.cert}: its key is too small for OpenSSL's security level "
                                 "(use RSA of 2048 bits or more, or an EC key)")


def test_a_fifo_or_a_device_as_a_tls_file_is_refused_not_waited_on(pki, tmp_path):
    """``open()`` of a FIFO waits for a writer: ``serve --tls-ca FIFO`` hung before it said
    anything (OpenSSL's own open of it then held the interpreter: hence a subprocess)."""
    fifo = tmp_path / "ca.fifo"
    os.mkfifo(fifo)
    probe = ("import sys, types; from skippy_wire.tools.tls_options import tls_config\n"
             "try:\n"
             "    tls_config(types.SimpleNamespace(tls_cert=sys.argv[1], tls_key=sys.argv[2], tls_ca=sys.argv[3]), "
             "listens=True)\n"
             "except ValueError as exc:\n"
             "    print(exc)\n")
    try:
        done = subprocess.run([sys.executable, "-c", probe, str(pki / "node.pem"), str(pki / "node.key"), str(fifo)],
                              capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("tls_config still opening a FIFO after 20 s")
    assert done.stdout.strip() == f"--tls-ca {fifo}: it is a FIFO, not a regular file", done.stderr
    with pytest.raises(ValueError, match=r"^--tls-key /dev/zero: it is a character device, not a regular file$"):
        TlsConfig.from_options(str(pki / "node.pem"), "/dev/zero", str(pki / "ca.pem"))


@pytest.mark.parametrize("passphrase", ["secret", ""])
def test_an_encrypted_key_is_refused_and_never_asked_for(pki, tmp_path, passphrase):
    """A key under an empty passphrase loaded in the check, then every context made for a link
    sat at OpenSSL's "Enter PEM pass phrase:" on the terminal."""
    key = tmp_path / "node.enc.key"
    _openssl("pkcs8", "-topk8", "-in", str(pki / "node.key"), "-v2", "aes256", "-passout", f"pass:{passphrase}",
             "-out", str(key), cwd=tmp_path)
    config = TlsConfig(str(pki / "node.pem"), str(key), str(pki / "ca.pem"))
    with pytest.raises(ValueError, match=rf"^--tls-key {re.escape(str(key))}: the key is encrypted "):
        config.check()
    # a context made without the check: no terminal (its own session), refused at once, nothing prompted
    probe = ("import sys; from skippy_wire.net.tls import TlsConfig\n"
             "try:\n"
             "    TlsConfig(*sys.argv[1:4]).server_context()\n"
             "except ValueError as exc:\n"
             "    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", probe, str(pki / "node.pem"), str(key), str(pki / "ca.pem")],
                          capture_output=True, text=True, timeout=30, start_new_session=True)
    assert (done.stdout, done.stderr) == ("the key is encrypted (give it without a passphrase)\n", ""), done


def test_empty_tls_paths_are_refused_not_read_as_plain_tcp(pki):
    # an embedder's "$CERT" with CERT unset: plain TCP where mutual TLS was meant
    with pytest.raises(ValueError, match=r"^--tls-cert: an empty path names no file$"):
        TlsConfig.from_options("", "", "")
    with pytest.raises(ValueError, match=r"^--tls-ca: an empty path names no file$"):
        TlsConfig.from_options(str(pki / "node.pem"), str(pki / "node.key"), "")


# --- handshakes that fail -------------------------------------------------------------


def _accept_in_thread(server_sock, context, timeout: float):
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(accept_tls(server_sock, context, timeout))
        except BaseException as exc:  # noqa: BLE001 -- the test looks at it
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_a_client_without_a_certificate_is_told_apart_on_the_stage(pki):
    """The stage's line said "[SSL: PEER_DID_NOT_RETURN_A_CERTIFICATE] peer did not return a
    certificate (_ssl.c:1006)"."""
    bare = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    bare.check_hostname = False
    bare.maximum_version = ssl.TLSVersion.TLSv1_2  # the refusal then comes within the handshake
    assert _stage_error(pki, bare, ssl.SSLError) == (
        "TLS handshake failed: the peer presented no certificate (mutual TLS: it needs --tls-cert and --tls-key too)")


def _stage_error(pki, client_context: ssl.SSLContext, client_fails) -> str:
    """The StageError of a stage's handshake with a client of ``client_context`` whose own
    handshake fails with ``client_fails``."""
    stage, client = socket.socketpair()
    thread, outcome = _accept_in_thread(stage, _config(pki, "node.pem", "node.key").server_context(), 5.0)
    try:
        with pytest.raises(client_fails):
            client_context.wrap_socket(client, server_hostname="stage")
    finally:
        client.close()
    thread.join(5)
    stage.close()
    assert outcome and isinstance(outcome[0], StageError), outcome
    return str(outcome[0])


def test_a_handshake_stalled_by_the_peer_ends_when_the_stage_closes_the_connection(pki):
    """A stage at --max-connections sheds the quietest connection with ``shutdown()`` on its
    socket; wrapping for TLS detached that socket, so a peer that sent a ClientHello's first
    bytes and stalled kept its thread and descriptor for the whole --io-timeout."""
    stage, staller = socket.socketpair()
    thread, outcome = _accept_in_thread(stage, _config(pki, "node.pem", "node.key").server_context(), 30.0)
    staller.sendall(b"\x16\x03\x01\x00\x50")  # a record header, and nothing more
    time.sleep(0.3)
    started = time.monotonic()
    try:
        stage.shutdown(socket.SHUT_RDWR)  # what ServerStage._shed does
    except OSError:
        pass
    thread.join(5)
    staller.close()
    stage.close()
    assert outcome, "the handshake went on after its connection was shut down"
    assert time.monotonic() - started < 5
    assert isinstance(outcome[0], SetupClosed), outcome  # a peer that left, as on a plain stage


def test_a_stage_names_a_handshake_dripped_past_its_deadline(pki, caplog):
    """The handshake has one deadline (--io-timeout), however often the peer sends a byte:
    the stage's log says the handshake did not finish, not that the peer stalled."""
    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    server = StageServer(FakeBackend(0, 6), serve.stage_config(0, 0, 6, "raw-f32-v1", "fixed"), io_timeout=0.5,
                         tls=_config(pki, "node.pem", "node.key"))
    server.start()
    dripper = socket.create_connection(server.address)
    try:
        hello = b"\x16\x03\x01\x00\x50" + bytes(0x50)  # a record header and a body that never parses
        for byte in hello[:20]:  # a byte every 0.1 s: never quiet for --io-timeout, done in 2 s
            try:
                dripper.sendall(bytes([byte]))
            except OSError:  # the stage has closed the connection
                break
            time.sleep(0.1)
        assert _wait_for_text(caplog, "closing")
    finally:
        dripper.close()
        server.shutdown()
    assert "the TLS handshake did not finish within 0.5 s; closing" in caplog.text
    assert "stalled" not in caplog.text


def test_a_stage_logs_a_peer_it_refused_as_an_error(pki, caplog):
    # A peer that refused the stage's certificate left at once, the stage having read nothing of it: an
    # INFO line, lost under WARNING.
    caplog.set_level(logging.WARNING, logger="skippy_wire.net.server")
    server = StageServer(FakeBackend(0, 6), serve.stage_config(0, 0, 6, "raw-f32-v1", "fixed"),
                         tls=_config(pki, "node.pem", "node.key"))
    server.start()
    try:
        with pytest.raises(PipelineMismatch):
            PipelineClient(*server.address, timeout=5, tls=_config(pki, "stranger.pem", "stranger.key", "other-ca.pem"))
        assert _wait_for_text(caplog, "TLS handshake failed: the peer refused this side's certificate")
    finally:
        server.shutdown()
    assert all(record.levelno == logging.ERROR for record in caplog.records), caplog.text


def _wait_for_text(caplog, text: str, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while text not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)
    return text in caplog.text


def test_a_completed_handshake_leaves_no_descriptor_behind(pki):
    config = _config(pki, "node.pem", "node.key")
    server_context, client_context = config.server_context(), config.client_context()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        stage, client = socket.socketpair()
        thread, outcome = _accept_in_thread(stage, server_context, 5.0)
        tls_client = client_context.wrap_socket(client, server_hostname="stage")
        thread.join(5)
        assert isinstance(outcome[0], ssl.SSLSocket), outcome
        assert stage.fileno() == -1  # the TLS socket holds the connection now
        outcome[0].close()
        tls_client.close()
    assert len(os.listdir("/proc/self/fd")) <= before


def test_a_client_names_the_verification_failure_not_only_openssl_s_code():
    """The driver said "failed: CERTIFICATE_VERIFY_FAILED (...)" whether the stage's
    certificate had expired or came from another CA."""
    exc = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed")
    exc.reason, exc.verify_code, exc.verify_message = "CERTIFICATE_VERIFY_FAILED", 10, "certificate has expired"
    assert handshake_failure("stage 0 at h:1", exc) == (  # the CA is not what is wrong: no question after it
        "TLS handshake with stage 0 at h:1 failed: the peer's certificate is refused: certificate has expired")
    for code, words in ((20, "unable to get local issuer certificate"),
                        (7, "certificate signature failure")):  # a CA of the same name, another key
        exc.verify_code, exc.verify_message = code, words
        assert handshake_failure("stage 0 at h:1", exc) == (
            f"TLS handshake with stage 0 at h:1 failed: the peer's certificate is refused: {words} "
            "(does it use mutual TLS with the same CA?)")
    eof = ssl.SSLEOFError(8, "EOF occurred in violation of protocol")
    eof.reason = "UNEXPECTED_EOF_WHILE_READING"
    assert handshake_failure("stage 0 at h:1", eof) == (
        "TLS handshake with stage 0 at h:1 failed: the peer closed the connection during the handshake "
        "(does it use mutual TLS with the same CA?)")


def test_a_stage_refused_by_its_peer_says_whose_certificate(pki):
    """A peer trusting another CA aborts with an alert: the stage's line said
    "[SSL: TLSV1_ALERT_UNKNOWN_CA] tlsv1 alert unknown ca (_ssl.c:1006)"."""
    stranger = _config(pki, "stranger.pem", "stranger.key", "other-ca.pem").client_context()
    assert _stage_error(pki, stranger, ssl.SSLCertVerificationError) == (
        "TLS handshake failed: the peer refused this side's certificate (unknown ca)")


def test_a_handshake_the_peer_never_answers_times_out_in_words(pki):
    # a driver connecting to a peer that accepts and stays silent said
    # "_ssl.c:989: The handshake operation timed out"
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        sock = socket.create_connection(silent.getsockname()[:2], timeout=0.3)
        context = _config(pki, "node.pem", "node.key").client_context()
        with pytest.raises(TimeoutError) as err:
            connect_tls(sock, context, "127.0.0.1")
        assert str(err.value) == "the TLS handshake did not finish within 0.3 s"
    finally:
        silent.close()


def test_a_tls_downstream_silent_after_its_handshake_is_given_up_when_the_upstream_goes(pki):
    """Its TLS 1.3 session tickets made the socket readable with no READY in them: the wait
    stopped looking at the upstream and slept through the whole reply timeout."""
    from test_downstream_waits import ENDS_WITHIN_S, opening_downstream
    from test_hardening import _wait_for

    config = _config(pki, "node.pem", "node.key")
    silent = socket.create_server(("127.0.0.1", 0))
    held = []

    def handshake_then_nothing() -> None:
        conn, _ = silent.accept()
        held.append(accept_tls(conn, config.server_context(), 10.0))

    threading.Thread(target=handshake_then_nothing, daemon=True).start()
    server, upstream, driver_end, thread, outcome = opening_downstream(15, silent.getsockname()[:2], 60.0, tls=config)
    try:
        assert _wait_for(lambda: held, 10.0)  # the handshake is done: the stage waits for READY
        time.sleep(0.3)
        driver_end.close()
        thread.join(ENDS_WITHIN_S)
        assert not thread.is_alive()
        assert "while waiting for downstream" in str(outcome[0]) and "to send READY" in str(outcome[0]), outcome
    finally:
        for sock in (upstream, driver_end, silent, *held):
            sock.close()
        server.shutdown()


def test_a_driver_refused_by_stage_0_s_certificate_is_a_mismatch_no_wait_mends(pki):
    # `api --connect` took it for stages not up yet: it served 503 and 502 for good
    server = StageServer(FakeBackend(0, 6), serve.stage_config(0, 0, 6, "raw-f32-v1", "fixed"),
                         tls=_config(pki, "node.pem", "node.key"))
    server.start()
    try:
        with pytest.raises(PipelineMismatch, match="the peer's certificate is refused"):
            PipelineClient(*server.address, timeout=5, tls=_config(pki, "stranger.pem", "stranger.key", "other-ca.pem"))
        # stage 0 refusing the driver's: under TLS 1.3 it says so after the handshake, at the READY read
        with pytest.raises(PipelineMismatch, match="the peer refused this side's certificate"):
            PipelineClient(*server.address, timeout=5, tls=_config(pki, "stranger.pem", "stranger.key", "ca.pem"))
        with PipelineClient(*server.address, timeout=5, tls=_config(pki, "node.pem", "node.key")) as client:
            assert client.alive()
    finally:
        server.shutdown()


def test_a_peer_refused_after_its_handshake_reads_the_alert_even_when_it_writes_first(pki):
    """Under TLS 1.3 a v17 driver (or stage) writes its Hello after its side of the handshake;
    written after stage 0 had refused its certificate and closed, the write drew a reset that
    discarded the alert: "the peer closed the connection" (and `api` waited for good), where
    the alert says "unknown ca", a mismatch no wait mends."""
    server = StageServer(FakeBackend(0, 6), serve.stage_config(0, 0, 6, "raw-f32-v1", "fixed"),
                         tls=_config(pki, "node.pem", "node.key"))
    server.start()
    try:
        context = _config(pki, "stranger.pem", "stranger.key", "ca.pem").client_context()
        sock = socket.create_connection(server.address, timeout=5)
        with context.wrap_socket(sock, server_hostname=server.address[0]) as tls:
            time.sleep(0.3)  # stage 0 has refused the certificate by now
            tls.sendall(b"hello")
            with pytest.raises(ssl.SSLError, match="UNKNOWN_CA"):
                tls.recv(1)
    finally:
        server.shutdown()


def test_a_link_s_socket_error_is_said_in_words():
    # "downstream H:P did not send READY: [Errno 104] Connection reset by peer"
    assert link_error(ConnectionResetError(104, "Connection reset by peer")) == "connection reset by peer"
