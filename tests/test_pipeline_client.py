"""PipelineClient as a library user drives it: ``alive()`` beside a running request, a reply
wait that times out, a connection stage 0 closed while idle, arguments refused before the
connection is made, and stages launched on 127.0.0.1 reached as "localhost".  In-process
fake stages (test_server's Chain) and hand-made stage 0s, no model."""

from __future__ import annotations

import os
import socket
import threading
from types import SimpleNamespace

import pytest
from test_server import PROMPT, Chain, fake_reference

from skippy_wire.errors import PipelineError
from skippy_wire.net.driver import STOP_CONTEXT_FULL, PipelineClient
from skippy_wire.net.schedule import prefill_messages
from skippy_wire.wire.constants import READY_BYTES
from skippy_wire.wire.frame import write_reply
from skippy_wire.wire.replies import StageReply, StageReplyStats, StageReplyWindow, WireReplyKind

ACK = write_reply(StageReply(WireReplyKind.ACK, 0, [], StageReplyWindow(), None, StageReplyStats()))


@pytest.fixture
def chain():
    made = Chain([(0, 3), (3, 6)])
    yield made
    made.close()


def test_alive_while_a_request_runs_is_true_and_leaves_the_request_alone(chain):
    """``alive()`` read a byte of the reply in flight: False on a healthy connection, and the
    request failed with "unknown stage reply kind"."""
    answers = []
    with PipelineClient(*chain.entry, timeout=10) as client:
        arrived = threading.Event()

        def on_token(token: int) -> None:  # runs while the next step is in flight
            arrived.wait(0.05)  # its reply has arrived by now
            answers.append(client.alive())

        result = client.generate(PROMPT, max_tokens=6, chunk_size=4, on_token=on_token)
        assert result.tokens == fake_reference(PROMPT, 6)
        assert answers == [True] * 6 and client.alive()


def test_a_reply_that_does_not_come_is_waited_for_once():
    """After the timeout the driver read the missing reply again, for a whole timeout more
    (an error after 2 minutes with the default 60 s)."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def ready_ack_then_silence() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(READY_BYTES)
            conn.recv(1 << 16)  # ConfigureGeneration
            conn.sendall(ACK)
            done.wait(10)

    threading.Thread(target=ready_ack_then_silence, daemon=True).start()
    try:
        with PipelineClient(*listener.getsockname()[:2], timeout=0.3) as client:
            waits = []
            receive = client.receive
            client.receive = lambda what: waits.append(what) or receive(what)
            with pytest.raises(PipelineError, match="no answer to PREFILL_FINAL_EMBD .* within 0.3 s"):
                client.generate([1, 2, 3], max_tokens=2)
            assert waits == ["ConfigureGeneration", "PREFILL_FINAL_EMBD (session 1)"]
            assert not client.alive()
    finally:
        done.set()
        listener.close()


def test_a_connection_closed_while_idle_is_opened_again(chain):
    """A stage's --idle-timeout closed it, and the next request failed as if a stage had failed."""
    with PipelineClient(*chain.entry, timeout=10) as client:
        first = client.generate(PROMPT, max_tokens=3, chunk_size=4)
        client._peer.sock.shutdown(socket.SHUT_RDWR)  # as when stage 0 closes it: the next read sees EOF
        sent = client.sent_bytes
        again = client.generate(PROMPT, max_tokens=3, chunk_size=4)
        assert again.tokens == first.tokens == fake_reference(PROMPT, 3)
        assert client.sent_bytes >= sent + again.sent_bytes  # the counts go on from the old connection's


def test_a_connection_opened_again_knows_the_pipeline_now_on_the_address(chain, monkeypatch):
    """A pipeline started anew on the address is another one: the client kept the old one's
    context (a request over the new one's refused as too long, or run past its end) and named
    the old one's stages when one failed."""
    from skippy_wire.net import supervision

    monkeypatch.setitem(supervision._LAUNCHED, chain.entry, SimpleNamespace(ctx_size=512, log_marks=lambda: None))
    with PipelineClient(*chain.entry, timeout=10) as client:
        client.generate(PROMPT, max_tokens=2, chunk_size=4)
        assert client.ctx_size == 512
        restarted = SimpleNamespace(ctx_size=len(PROMPT) + 2, log_marks=lambda: None)
        monkeypatch.setitem(supervision._LAUNCHED, chain.entry, restarted)
        client._peer.sock.shutdown(socket.SHUT_RDWR)
        result = client.generate(PROMPT, max_tokens=5, chunk_size=4)
        assert client._stages is restarted and client.ctx_size == len(PROMPT) + 2
        # and a larger one takes a prompt the old one could not hold (it was refused beforehand)
        monkeypatch.setitem(supervision._LAUNCHED, chain.entry, SimpleNamespace(ctx_size=512, log_marks=lambda: None))
        client._peer.sock.shutdown(socket.SHUT_RDWR)
        longer = PROMPT * 2
        assert len(longer) > len(PROMPT) + 2 and client.generate(longer, max_tokens=2, chunk_size=4).tokens
    with PipelineClient(*chain.entry, timeout=10, ctx_size=len(PROMPT) + 2) as told:
        expected = told.generate(PROMPT, max_tokens=5, chunk_size=4)
    assert result.tokens == expected.tokens and result.stop_reason == expected.stop_reason == STOP_CONTEXT_FULL


def test_a_connection_closed_while_capturing_is_not_opened_again(chain, tmp_path):
    """A new connection would start the capture files over."""
    with PipelineClient(*chain.entry, timeout=10, capture=tmp_path / "hop0") as client:
        client.generate(PROMPT, max_tokens=2, chunk_size=4)
        client._peer.sock.shutdown(socket.SHUT_RDWR)
        with pytest.raises(PipelineError):
            client.generate(PROMPT, max_tokens=2, chunk_size=4)
    assert (tmp_path / "hop0-replies.bin").read_bytes().startswith(READY_BYTES)


@pytest.mark.parametrize("arguments, error, text", [
    ({"host": None}, TypeError, "host must be a host name or address (a str), not None"),
    ({"protocol": 99}, ValueError, "protocol must be one of 15, 16, 17, got 99"),
    ({"protocol": "15"}, ValueError, "protocol must be one of 15, 16, 17, got '15'"),
    ({"poll_s": "x"}, TypeError, "poll_s must be a number of seconds, not str"),
    ({"timeout": "5"}, TypeError, "timeout must be a number of seconds, not str"),  # a ValueError
    ({"poll_s": -1}, ValueError, "poll_s must be a number of seconds from 0 to 1000000, got -1"),
    # raw AttributeErrors once used ('str' object has no attribute 'client_context')
    ({"tls": "x"}, TypeError, "tls must be a TlsConfig or None, not str"),
    ({"identity": "x"}, TypeError, "identity must be a StageSetupConfig or None, not str"),
    ({"stages": "x"}, TypeError, "stages must be a StageCluster or None, not str")])
def test_arguments_are_refused_before_the_connection_is_made(arguments, error, text):
    """They failed once connected (leaving the socket open), mid-request, or not at all."""
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        with pytest.raises(error) as caught:
            PipelineClient(**{"host": "127.0.0.1", "port": listener.getsockname()[1], **arguments})
        assert str(caught.value) == text
        listener.settimeout(0.2)
        with pytest.raises(socket.timeout):
            listener.accept()  # no connection was made
    finally:
        listener.close()


def _open_sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # the listing's own descriptor, closed since
            pass
    return count


def test_a_capture_file_that_cannot_be_made_leaves_no_socket_open(tmp_path):
    """The connection was made first and left open when the capture file failed."""
    listener = socket.create_server(("127.0.0.1", 0))  # the kernel completes the connect; nobody accepts
    try:
        before = _open_sockets()
        with pytest.raises(FileNotFoundError):
            PipelineClient(*listener.getsockname()[:2], capture=tmp_path / "missing" / "hop0")
        assert _open_sockets() == before
    finally:
        listener.close()


def test_stages_launched_on_127_0_0_1_are_known_when_reached_as_localhost(chain, monkeypatch):
    """Which stage failed and why was looked up by the host as spelled: through "localhost"
    an error said only "a stage failed; the stages' logs say which and why"."""
    from skippy_wire.net import supervision

    launched = SimpleNamespace(ctx_size=12)  # what launch_pipeline notes for its stage 0's address
    monkeypatch.setitem(supervision._LAUNCHED, chain.entry, launched)
    with PipelineClient("localhost", chain.entry[1], timeout=10) as client:
        assert client._stages is launched and client.ctx_size == 12


def test_a_request_that_is_no_message_is_a_type_error(chain):
    with PipelineClient(*chain.entry, timeout=10) as client:  # an AttributeError from the writer
        with pytest.raises(TypeError, match="^request expects a StageWireMessage, not NoneType$"):
            client.request(None)
        assert client.generate(PROMPT, max_tokens=2, chunk_size=4).tokens == fake_reference(PROMPT, 2)


@pytest.mark.parametrize("arguments, error, text", [
    ({"sampling": {}}, TypeError, "sampling must be a SamplingConfig or None, not dict"),  # the runtime's ValueError
    ({"threads": "x"}, TypeError, "threads must be an int or None, not str")])  # a ValueError, the model read first
def test_generate_local_checks_its_arguments_as_generate_does(arguments, error, text):
    from skippy_wire.net.driver import generate_local

    with pytest.raises(error) as caught:
        generate_local("no-such-model.gguf", [1, 2], **arguments)
    assert str(caught.value) == text


@pytest.mark.parametrize("ctx_size, error, text", [(0, ValueError, "ctx_size must be from 1 to 16777216, got 0"),
                                                   (1.5, TypeError, "ctx_size must be an int, not float")])
def test_generate_local_refuses_a_context_in_its_own_words(ctx_size, error, text):
    """The runtime's words named arguments the caller never gave ("ctx_size, lane_count and
    n_batch must be positive (0, 1, 512)"); refused before the model is opened."""
    from skippy_wire.net.driver import generate_local

    with pytest.raises(error) as caught:
        generate_local("no-such-model.gguf", [1, 2], ctx_size=ctx_size)
    assert str(caught.value) == text


def test_a_context_given_bounds_the_generation(chain):
    with PipelineClient(*chain.entry, timeout=10, ctx_size=10) as client:
        result = client.generate(PROMPT, max_tokens=8, chunk_size=4)  # 7 prompt tokens: room for 4
        assert (result.stop_reason, result.tokens) == ("context_full", fake_reference(PROMPT, 4))
        assert client.generate(PROMPT, max_tokens=4, chunk_size=4).stop_reason == "max_tokens"
    with pytest.raises(ValueError, match="^ctx_size must be from 1 to 16777216, got 0$"):
        PipelineClient(*chain.entry, ctx_size=0)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from skippy_wire.stage.models import write_tiny_llama_gguf

    return write_tiny_llama_gguf(tmp_path_factory.mktemp("local") / "tiny.gguf")


def test_generate_local_is_bounded_by_its_context_as_a_client_is(tiny_model):
    """The reference of `run --check` failed at the context's end (StageRuntimeError "context
    full") and computed a prompt too long for it, where a PipelineClient with the same
    ctx_size stops with context_full and refuses the prompt before sending it."""
    from skippy_wire.net.driver import generate_local

    full = generate_local(tiny_model, [1, 2], ctx_size=8, max_tokens=20)
    assert full.stop_reason == "context_full" and len(full.tokens) == 8 - 2 + 1  # the last is not fed back
    assert generate_local(tiny_model, [1, 2], ctx_size=8, max_tokens=3).stop_reason == "max_tokens"
    with pytest.raises(ValueError, match="^the prompt's 9 tokens do not fit the stages' context of 8 tokens$"):
        generate_local(tiny_model, list(range(1, 10)), ctx_size=8)


def test_a_callback_s_own_pipeline_error_leaves_the_client_usable(chain):
    """Only a failed send or wait closes the client: a PipelineError raised by on_token (a
    callback that drives another pipeline) closed it as if this link had failed."""
    def fails(token: int) -> None:
        raise PipelineError("another pipeline failed")

    with PipelineClient(*chain.entry, timeout=10) as client:
        with pytest.raises(PipelineError, match="^another pipeline failed$"):
            client.generate(PROMPT, max_tokens=3, chunk_size=4, on_token=fails)
        assert client.alive()
        assert client.generate(PROMPT, max_tokens=3, chunk_size=4).tokens == fake_reference(PROMPT, 3)


def test_a_request_from_inside_its_own_callback_is_named_so(chain):
    """It said "carrying another thread's request", on the one thread there was."""
    with PipelineClient(*chain.entry, timeout=10) as client:
        def nested(token: int) -> None:
            client.generate(PROMPT, max_tokens=1)

        with pytest.raises(PipelineError, match=r"carrying its own request \(called from that request's callback\)"):
            client.generate(PROMPT, max_tokens=3, chunk_size=4, on_token=nested)
        assert client.generate(PROMPT, max_tokens=3, chunk_size=4).tokens == fake_reference(PROMPT, 3)


def test_numpy_integers_are_taken_where_ints_are(chain):
    """np.int64 counts and ports were refused ("must be an int, not int64"; the port "must be a
    TCP port from 1 to 65535, got np.int64(...)"), where a prompt of numpy ids is taken."""
    import numpy as np

    with PipelineClient(chain.entry[0], np.int64(chain.entry[1]), timeout=np.float32(10), ctx_size=np.int32(64),
                        poll_s=np.float32(0)) as client:
        assert type(client.timeout) is float and type(client.ctx_size) is int
        assert client.generate(PROMPT, max_tokens=np.int64(3), chunk_size=np.int16(4)).tokens \
            == fake_reference(PROMPT, 3)


def test_a_send_that_stalls_closes_the_client():
    """A request whose message stalled half written (a stage that stops reading) left the
    client open: the next message would follow the half-written one on the link.  (Its error
    said "no answer to ...", as if the message had gone.)"""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the send stalls soon
    done = threading.Event()

    def ready_then_read_nothing() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(READY_BYTES)
            done.wait(10)

    threading.Thread(target=ready_then_read_nothing, daemon=True).start()
    try:
        with PipelineClient(*listener.getsockname()[:2], timeout=0.3) as client:
            client._peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            big = next(prefill_messages(list(range(1, 1 << 18)), 1 << 18, 1, 1))  # one 1 MiB chunk
            with pytest.raises(PipelineError, match=r"read nothing of PREFILL_FINAL_EMBD \(session 1\) for 0.3 s$"):
                client.request(big)
            assert not client.alive()
    finally:
        done.set()
        listener.close()


def test_numpy_counts_are_computed_with_as_python_ints(chain):
    """`chunk_size=np.int8(100)` overflowed at the second chunk (200 is no int8), and an int16
    chunk dropped prompt tokens silently: the counts are Python ints once checked."""
    import numpy as np

    prompt = [1 + i % 90 for i in range(250)]
    with PipelineClient(*chain.entry, timeout=10) as client:
        narrow = client.generate(prompt, max_tokens=np.int8(3), chunk_size=np.int8(100))
        assert narrow.tokens == client.generate(prompt, max_tokens=3, chunk_size=100).tokens
        assert narrow.prefill_messages == 3
