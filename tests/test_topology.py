"""Topology files: validation before anything starts, one-line errors (no root, no model)."""

from __future__ import annotations

import copy
import json
import socket
import threading

import pytest

from skippy_wire.errors import TopologyError
from skippy_wire.net.netns import format_rate, parse_rate, tbf_args
from skippy_wire.net import topology, transport
from skippy_wire.net.topology import PROBE_SETTLE_S, build_topology, load_topology, parse_topology
from skippy_wire.stage.models import TINY_CONTEXT, model_shape, smollm2_path, write_tiny_llama_gguf
from skippy_wire.tools import api, serve

N_LAYER, N_EMBD = 30, 576


def shape(path):
    return N_LAYER, N_EMBD


GOOD = {
    "topology_id": "t",
    "model_path": "/models/m.gguf",
    "ctx_size": 1024,
    "stages": [
        {"endpoint": "10.77.0.1:19000", "layer_start": 0, "layer_end": 10},
        {"endpoint": "tcp://10.77.0.2:19000", "layer_start": 10, "layer_end": 20, "threads": 2},
        {"stage_id": "last", "endpoint": "10.77.1.2:19000", "bind_addr": "0.0.0.0:19000",
         "layer_start": 20, "layer_end": 30},
    ],
}


def test_good_topology_fields_and_downstreams():
    t = parse_topology(GOOD, shape=shape)
    assert [(s.layer_start, s.layer_end) for s in t.stages] == [(0, 10), (10, 20), (20, 30)]
    assert t.entry == ("10.77.0.1", 19000)
    assert t.downstream(0) == ("10.77.0.2", 19000)
    assert t.downstream(1) == ("10.77.1.2", 19000)
    assert t.downstream(2) is None
    assert t.stages[2].listen == ("0.0.0.0", 19000) and t.stages[2].stage_id == "last"
    assert t.stages[0].stage_id == "stage-0" and t.stages[1].threads == 2 and t.stages[0].threads is None
    assert t.stages[0].activation_codec == "raw-f32-v1" and t.stages[0].activation_codec_policy == "fixed"
    assert (t.ctx_size, t.n_layer, t.n_embd) == (1024, N_LAYER, N_EMBD)
    # what a file says survives writing it and reading it back
    again = parse_topology(json.loads(json.dumps(t.to_json())), shape=shape)
    assert again == t


def _with(mutate):
    data = copy.deepcopy(GOOD)
    mutate(data)
    return data


def _set(i, key, value):
    def mutate(d):
        if value is None:
            d["stages"][i].pop(key)
        else:
            d["stages"][i][key] = value
    return mutate


def _all_codec(codec, policy):
    def mutate(d):
        for s in d["stages"]:
            s["activation_codec"], s["activation_codec_policy"] = codec, policy
    return mutate


CASES = [
    ("gap", _set(1, "layer_start", 11), "stage 1: layers 11..20 leaves a gap after stage 0's 0..10"),
    ("overlap", _set(1, "layer_start", 9), "stage 1: layers 9..20 overlaps stage 0's 0..10"),
    ("not from 0", _set(0, "layer_start", 1), "stage 0 starts at layer 1, not 0"),
    ("short", _set(2, "layer_end", 29), "the last stage ends at layer 29, but m.gguf has 30 layers"),
    ("past the end", _set(2, "layer_end", 31), "the last stage ends at layer 31, but m.gguf has 30 layers"),
    ("empty range", _set(1, "layer_end", 10), "stage 1: layer range 10..10 is empty (layer_end is exclusive)"),
    ("duplicate endpoint", _set(2, "endpoint", "10.77.0.2:19000"),
     "stage 2: endpoint 10.77.0.2:19000 is already used by stage 1"),
    ("duplicate id", _set(1, "stage_id", "last"), "stage 2: stage_id 'last' is already used by stage 1"),
    ("policy needs raw", _all_codec("bf16-rne-v1", "auto-lossless-v1"),
     "stage 0: activation_codec_policy auto-lossless-v1 requires activation_codec raw-f32-v1, not bf16-rne-v1"),
    ("codecs differ", _set(1, "activation_codec", "f16-rne-v1"),
     "stage 1: codec f16-rne-v1/fixed differs from stage 0's raw-f32-v1/fixed"),
    ("unknown codec", _set(0, "activation_codec", "zstd"), "stage 0: unknown activation codec 'zstd'"),
    ("unknown policy", _set(0, "activation_codec_policy", "auto"), "stage 0: unknown activation codec policy 'auto'"),
    ("bad address", _set(0, "endpoint", "10.77.0.1"), "stage 0: endpoint: address must be HOST:PORT"),
    ("bad port", _set(0, "endpoint", "h:70000"), "stage 0: endpoint port 70000 is out of range 1..65535"),
    ("missing endpoint", _set(0, "endpoint", None), "stage 0: endpoint is missing"),
    ("missing layer", _set(1, "layer_end", None), "stage 1: layer_end is missing"),
    ("string layer", _set(1, "layer_end", "20"), "stage 1: layer_end must be an integer, not '20'"),
    ("zero threads", _set(1, "threads", 0), "stage 1: threads must be -1 (the default) or >= 1, not 0"),
    ("negative threads", _set(1, "threads", -2), "stage 1: threads must be -1 (the default) or >= 1, not -2"),
    ("unknown stage key", _set(0, "layers", [0, 10]), "stage 0: unknown key 'layers'"),
    ("unknown key", lambda d: d.update(extra=1), "unknown key 'extra'"),
    ("no stages", lambda d: d.update(stages=[]), "stages must be a non-empty list"),
    ("no model", lambda d: d.pop("model_path"), "model_path (or a packaged model_id) is missing"),
    ("unknown model id", lambda d: (d.pop("model_path"), d.update(model_id="llama-70b")),
     "model_id 'llama-70b' is not a packaged model"),
]


@pytest.mark.parametrize("name,mutate,message", CASES, ids=[c[0] for c in CASES])
def test_invalid_topology_is_one_line(name, mutate, message):
    with pytest.raises(TopologyError) as info:
        parse_topology(_with(mutate), name="f.json", shape=shape)
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith("f.json: ")
    assert message in text


def test_codecs_go_by_short_name_as_on_the_command_line():
    """A stage may say ``f16`` where the next says ``f16-rne-v1``: the same codec, stored by
    its identity (what ``serve`` is given)."""
    mixed = _with(_all_codec("f16", "fixed"))
    mixed["stages"][1]["activation_codec"] = "f16-rne-v1"
    t = parse_topology(mixed, shape=shape)
    assert {(s.activation_codec, s.activation_codec_policy) for s in t.stages} == {("f16-rne-v1", "fixed")}
    t = parse_topology(_with(_all_codec("raw-f32", "auto-lossless")), shape=shape)
    assert {(s.activation_codec, s.activation_codec_policy) for s in t.stages} == {("raw-f32-v1", "auto-lossless-v1")}


def test_a_model_that_cannot_be_read_is_the_model_s_failure_not_the_file_s(tmp_path):
    """As ``-m`` gives it (exit 1, the model's path and the reason), not a usage error with
    "cannot read the model: [Errno 2] ..." naming the file."""
    missing = tmp_path / "no-such.gguf"
    with pytest.raises(FileNotFoundError) as error:
        parse_topology(_with(lambda d: d.update(model_path=str(missing))), name="t.json")
    assert not isinstance(error.value, TopologyError) and error.value.filename == str(missing)
    text = tmp_path / "text.gguf"
    text.write_text("hello\n")
    with pytest.raises(ValueError) as error:
        parse_topology(_with(lambda d: d.update(model_path=str(text))), name="t.json")
    assert not isinstance(error.value, TopologyError) and str(error.value) == f"{text} is not a GGUF file"


def test_threads_minus_one_is_the_default_as_on_the_command_line():
    t = parse_topology(_with(_set(1, "threads", -1)), shape=shape)
    assert t.stages[1].threads is None and "threads" not in t.stages[1].to_json()


def test_load_topology_file_errors(tmp_path):
    with pytest.raises(TopologyError) as error:
        load_topology(tmp_path / "missing.json", shape=shape)
    assert str(error.value) == f"{tmp_path / 'missing.json'}: cannot read the topology: no such file or directory"
    with pytest.raises(TopologyError) as error:
        load_topology(tmp_path, shape=shape)
    assert str(error.value) == f"{tmp_path}: cannot read the topology: is a directory"
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TopologyError, match=r"bad\.json: not JSON"):
        load_topology(bad, shape=shape)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(GOOD))
    assert load_topology(good, shape=shape).stages[1].endpoint == "tcp://10.77.0.2:19000"
    assert load_topology(good, model="/other.gguf", shape=shape).model_path.name == "other.gguf"


def test_build_topology_validates():
    t = build_topology("/m.gguf", [(0, 15), (15, 30)], ["10.77.0.1:19000", "10.77.0.2:19000"],
                       codec="s8-row-f32-rne-v1", threads=1, ctx_size=600, shape=shape)
    assert t.downstream(0) == ("10.77.0.2", 19000) and t.stages[1].activation_codec == "s8-row-f32-rne-v1"
    with pytest.raises(TopologyError, match="overlaps"):
        build_topology("/m.gguf", [(0, 16), (15, 30)], ["a:1", "b:1"], shape=shape)
    # a third endpoint was dropped without a word, a missing bind address an IndexError
    with pytest.raises(TopologyError, match="^topology: 2 layer ranges but 3 endpoints$"):
        build_topology("/m.gguf", [(0, 15), (15, 30)], ["a:1", "b:1", "c:1"], shape=shape)
    with pytest.raises(TopologyError, match="^topology: 2 layer ranges but 1 bind_addrs$"):
        build_topology("/m.gguf", [(0, 15), (15, 30)], ["a:1", "b:1"], bind_addrs=["0.0.0.0:1"], shape=shape)
    # stage -1 was stage 0's downstream, stage 5 of 2 the last's
    for index in (-1, 2, 5):
        with pytest.raises(TopologyError, match=f"no stage {index} \\(it has 2\\)"):
            t.downstream(index)


def _serve_usage_error(capsys, args) -> str:
    """``serve ARGS`` is a usage error: status 2, argparse's usage block, one error line."""
    with pytest.raises(SystemExit) as info:
        serve.main(args)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("usage: skippy-wire serve"), err
    errors = [line for line in err.splitlines() if line.startswith("skippy-wire: error: ")]
    assert len(errors) == 1, err
    return errors[0]


def test_serve_rejects_a_bad_topology_before_starting(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_with(_set(1, "layer_start", 11))))
    assert "leaves a gap" in _serve_usage_error(capsys, ["--topology", str(path), "--stage", "0"])
    # --stage is required with --topology
    assert "--topology and --stage go together" in _serve_usage_error(capsys, ["--topology", str(path)])


def test_serve_stage_out_of_range_names_the_file(tmp_path, capsys):
    n_layer, _ = model_shape(smollm2_path())
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"model_id": "smollm2-135m", "topology_id": "one", "stages": [
        {"endpoint": "127.0.0.1:1", "layer_start": 0, "layer_end": n_layer}]}))
    assert _serve_usage_error(capsys, ["--topology", str(path), "--stage", "3"]) == \
        f"skippy-wire: error: {path}: no stage 3 (it has 1)"


def test_serve_topology_threads_out_of_range_names_file_and_stage(tmp_path, capsys):
    n_layer, _ = model_shape(smollm2_path())
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"model_id": "smollm2-135m", "stages": [
        {"endpoint": "127.0.0.1:1", "layer_start": 0, "layer_end": 1},
        {"endpoint": "127.0.0.1:2", "layer_start": 1, "layer_end": n_layer, "threads": 513}]}))
    for stage in ("1", "0"):  # the file is checked as a whole: stage 0 does not start either
        assert _serve_usage_error(capsys, ["--topology", str(path), "--stage", stage]) == \
            f"skippy-wire: error: {path}: stage 1: threads 513 is not between 1 and 512"


def test_non_utf8_topology_names_the_file(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(TopologyError, match=r"t\.json: not valid UTF-8$"):
        load_topology(path, shape=shape)
    assert _serve_usage_error(capsys, ["--topology", str(path), "--stage", "0"]) == \
        f"skippy-wire: error: {path}: not valid UTF-8"


def test_utf8_topology_reads_whatever_the_locale(tmp_path, monkeypatch):
    """JSON is UTF-8: a stage_id outside ASCII reads under an ASCII locale too."""
    import locale

    monkeypatch.setattr(locale, "getpreferredencoding", lambda do_setlocale=True: "ascii")
    monkeypatch.setattr(locale, "getencoding", lambda: "ascii", raising=False)
    path = tmp_path / "t.json"
    path.write_bytes(json.dumps(_with(_set(0, "stage_id", "étage")), ensure_ascii=False).encode())
    assert load_topology(path, shape=shape).stages[0].stage_id == "étage"


NULLS = [
    ("ctx_size", lambda d: d.update(ctx_size=None), "f.json: ctx_size must be an integer, not null"),
    ("threads", _set(0, "threads", "null"), "stage 0: threads must be an integer, not null"),
    ("layer_end", _set(1, "layer_end", "null"), "stage 1: layer_end must be an integer, not null"),
    ("bind_addr", _set(0, "bind_addr", "null"), 'stage 0: bind_addr must be a "HOST:PORT" string, not null'),
    ("codec", _set(0, "activation_codec", "null"), "stage 0: activation_codec must be a name string, not null"),
    ("model_id", lambda d: d.update(model_id=None), "f.json: model_id must be a non-empty string, not null"),
    # JSON's spelling of a boolean too, not Python's (False)
    ("false", _set(0, "threads", "false"), "stage 0: threads must be an integer, not false"),
    ("true", _set(0, "activation_codec", "true"), "stage 0: activation_codec must be a name string, not true"),
]


@pytest.mark.parametrize("name,mutate,message", NULLS, ids=[c[0] for c in NULLS])
def test_null_is_not_missing(name, mutate, message):
    """``"key": null`` names the key's type; "missing" is only for a key that is absent."""
    data = json.loads(json.dumps(_with(mutate)).replace('"null"', "null").replace('"false"', "false")
                      .replace('"true"', "true"))
    with pytest.raises(TopologyError) as info:
        parse_topology(data, name="f.json", shape=shape)
    assert message in str(info.value) and "missing" not in str(info.value)


def test_two_names_of_one_address_are_a_duplicate():
    """localhost:P and 127.0.0.1:P are one listener: stage 0 would forward to itself."""
    data = _with(lambda d: (d["stages"][0].update(endpoint="localhost:19101"),
                            d["stages"][1].update(endpoint="127.0.0.1:19101")))
    with pytest.raises(TopologyError) as info:
        parse_topology(data, name="f.json", shape=shape)
    assert str(info.value) == ("f.json: stage 1: endpoint 127.0.0.1:19101 is already used by stage 0 "
                               "(as localhost:19101)")



def test_each_host_binds_its_own_addresses():
    # behind NAT every host binds 0.0.0.0:19000: a bind_addr is its own host's (this was
    # "bind_addr 0.0.0.0:19000 is already used by stage 0")
    data = _with(lambda d: [s.update(bind_addr="0.0.0.0:19000") for s in d["stages"]])
    assert [s.listen for s in parse_topology(data, shape=shape).stages] == [("0.0.0.0", 19000)] * 3
    # on one host (one endpoint address) a wildcard takes the port from every address
    one_host = _with(lambda d: (d["stages"][0].update(endpoint="10.77.0.1:19000", bind_addr="0.0.0.0:19000"),
                                d["stages"][1].update(endpoint="10.77.0.1:19001", bind_addr="127.0.0.1:19000")))
    with pytest.raises(TopologyError, match="stage 1: bind_addr 127.0.0.1:19000 is already used by stage 0 "
                                            r"\(as 0.0.0.0:19000\)"):
        parse_topology(one_host, shape=shape)
    # however the wildcard is spelled ("0" and "0x0" bind to every address too)
    for wildcard in ("0", "0x0", "0.0"):
        spelled = _with(lambda d: (d["stages"][0].update(endpoint="10.77.0.1:19000", bind_addr=f"{wildcard}:19000"),
                                   d["stages"][1].update(endpoint="10.77.0.1:19001", bind_addr="127.0.0.1:19000")))
        with pytest.raises(TopologyError, match=f"stage 1: bind_addr 127.0.0.1:19000 is already used by stage 0 "
                                                rf"\(as {wildcard}:19000\)"):
            parse_topology(spelled, shape=shape)

def test_hosts_are_resolved_only_where_ports_meet(monkeypatch):
    """Distinct ports cost no lookup; an unresolvable host is compared as written."""
    from skippy_wire.net import topology

    looked_up = []

    def getaddrinfo(host, *args, **kwargs):
        looked_up.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(topology.socket, "getaddrinfo", getaddrinfo)
    ports = _with(lambda d: [s.update(endpoint=f"h{i}.example:{19001 + i}") for i, s in enumerate(d["stages"])])
    assert parse_topology(ports, shape=shape).stages[2].endpoint == "h2.example:19003"
    assert looked_up == []
    names = _with(lambda d: [s.update(endpoint=f"h{i}.example:19000") for i, s in enumerate(d["stages"])])
    assert parse_topology(names, shape=shape).downstream(0) == ("h1.example", 19000)
    assert sorted(set(looked_up)) == ["h0.example", "h1.example", "h2.example"]
    with pytest.raises(TopologyError, match="stage 1: endpoint h0.example:19000 is already used by stage 0"):
        parse_topology(dict(names, stages=[names["stages"][0], *names["stages"]]), shape=shape)


def test_rates_and_tbf_sizing():
    assert parse_rate("100mbit") == 100_000_000 and parse_rate("2MBIT") == 2_000_000
    assert parse_rate("1gbit") == 10**9 and parse_rate("unlimited") is None and parse_rate(None) is None
    assert format_rate(parse_rate("20mbit")) == "20mbit" and format_rate(None) == "unlimited"
    # exact, in the largest unit that names it: read back, the same rate ("%g" cut 12345678bit to 12.3457mbit)
    for text, name in (("1.5mbit", "1500kbit"), ("0.1gbit", "100mbit"), ("12345678bit", "12345678bit"),
                       ("2.01mbit", "2010kbit"), ("4.1mbit", "4100kbit")):  # (a float made 2009999bit)
        assert format_rate(parse_rate(text)) == name and parse_rate(name) == parse_rate(text)
    for bad in ("fast", "10 parsecs", "1bit"):
        with pytest.raises(ValueError):
            parse_rate(bad)
    for rate in (2_000_000, 100_000_000, 10**9):
        args = dict(zip(tbf_args(rate)[::2], tbf_args(rate)[1::2]))
        assert args["rate"] == f"{rate}bit"
        # a bucket that holds a whole 64 KiB GSO segment's worth of MTU packets and a queue of >= 100 ms
        assert int(args["burst"]) >= 16 * 1024 and int(args["burst"]) >= rate / 8 * 0.004
        assert int(args["limit"]) >= rate / 8 * 0.1 and int(args["limit"]) >= 4 * int(args["burst"])


def test_link_delay_sleeps_before_each_send(monkeypatch):
    """``serve --link-delay-ms``: a Peer with send_delay sleeps before every send, none without."""
    calls = []
    monkeypatch.setattr(transport.time, "sleep", lambda s: calls.append(s))
    a, b = socket.socketpair()
    with a, b:
        delayed, plain = transport.Peer(a), transport.Peer(b)
        delayed.send_delay = 0.04
        delayed.send(b"xy")
        plain.send(b"z")
        assert calls == [0.04]
        assert b.recv(2) == b"xy" and a.recv(1) == b"z"
    args = serve.build_parser().parse_args(["--topology", "t.json", "--stage", "1", "--link-delay-ms", "20"])
    assert args.link_delay_ms == 20.0


def test_a_failed_request_names_the_first_stage_that_takes_no_connection():
    listening = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    gone = socket.create_server(("127.0.0.1", 0))
    gone_port = gone.getsockname()[1]
    gone.close()  # nothing listens there now: a stage that ended
    try:
        ports = [s.getsockname()[1] for s in listening]
        endpoints = [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{gone_port}", f"127.0.0.1:{ports[1]}"]
        topology = build_topology("/models/m.gguf", [(0, 10), (10, 20), (20, 30)], endpoints, shape=shape)
        assert topology.unreachable_stage() == (f"stage 1 at 127.0.0.1:{gone_port} (layers 10..20) refuses "
                                                "connections (it is not running)")
        every = build_topology("/models/m.gguf", [(0, 15), (15, 30)], endpoints[::2], shape=shape)
        assert every.unreachable_stage() is None
    finally:
        for s in listening:
            s.close()


def test_a_stage_whose_listener_closes_just_after_the_failure_is_still_named():
    """A killed stage's connections close before its listener: the driver's first probe,
    right after the failure it saw, could still connect, and it named no stage (one run in
    six)."""
    dying = socket.create_server(("127.0.0.1", 0))
    port = dying.getsockname()[1]
    threading.Timer(PROBE_SETTLE_S / 3, dying.close).start()  # after the first probe, before the second
    topology = build_topology("/models/m.gguf", [(0, 30)], [f"127.0.0.1:{port}"], shape=shape)
    assert topology.unreachable_stage() == (f"stage 0 at 127.0.0.1:{port} (layers 0..30) refuses connections (it "
                                            "is not running)")


def test_a_stage_on_a_network_the_driver_has_no_route_to_is_not_blamed(monkeypatch):
    """A driver that reaches only stage 0's front address named stage 1 "cannot be reached
    (Network is unreachable)" for any failure, wherever it was."""
    import errno

    from skippy_wire.net import topology as topology_module

    def connect(address, timeout):
        host, _ = address
        if host == "10.99.1.2":  # a back-end network only stage 0 reaches
            raise OSError(errno.ENETUNREACH, "Network is unreachable")
        if host == "10.99.2.2":
            raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
        return socket.socket()

    monkeypatch.setattr(topology_module.socket, "create_connection", connect)
    endpoints = ["10.99.0.1:19000", "10.99.1.2:19000", "10.99.2.2:19000"]
    topology = build_topology("/models/m.gguf", [(0, 10), (10, 20), (20, 30)], endpoints, shape=shape)
    assert topology.unreachable_stage() == "stage 2 at 10.99.2.2:19000 (layers 20..30) refuses connections (it is " \
                                           "not running)"
    only_back_end = build_topology("/models/m.gguf", [(0, 15), (15, 30)], endpoints[:2], shape=shape)
    assert only_back_end.unreachable_stage() is None


def test_serve_takes_the_v17_model_id_from_the_topology(tmp_path):
    # The stage's v17 identity took the model file's stem, so a host keeping the model under
    # another name (--model, as the file allows) was refused by its neighbour ("model ... mismatch").
    n_layer, _ = model_shape(smollm2_path())
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"model_id": "smollm2-135m", "stages": [
        {"endpoint": "127.0.0.1:1", "layer_start": 0, "layer_end": n_layer}]}))
    parser = serve.build_parser()
    for extra, model_id in (([], "smollm2-135m"), (["--model-id", "mine"], "mine")):
        args = parser.parse_args(["--topology", str(path), "--stage", "0", "--model", str(smollm2_path()), *extra])
        serve._check_args(parser, args)
        assert args.model_id == model_id


def test_serve_takes_the_v17_topology_id_and_plan_from_the_topology(tmp_path, capsys):
    """Stages started from a file announced the id "skippy-wire" whatever the file's, so
    stages of two files were never told apart, and their upstreams went unchecked."""
    n_layer, _ = model_shape(smollm2_path())
    half = n_layer // 2
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"topology_id": "two-hosts", "model_path": str(smollm2_path()), "stages": [
        {"endpoint": "127.0.0.1:1", "layer_start": 0, "layer_end": half},
        {"endpoint": "127.0.0.1:2", "layer_start": half, "layer_end": n_layer}]}))
    parser = serve.build_parser()
    args = parser.parse_args(["--topology", str(path), "--stage", "1", "--protocol", "17"])
    serve._check_args(parser, args)
    assert (args.topology_id, args.plan) == ("two-hosts", f"0-{half},{half}-{n_layer}")
    # a plan given beside the file that does not give this stage its layers is refused
    args = parser.parse_args(["--topology", str(path), "--stage", "1", "--protocol", "17", "--plan", f"0-{n_layer}"])
    with pytest.raises(SystemExit):
        serve._check_args(parser, args)
    assert f"--plan 0-{n_layer} does not give stage 1 its layers {half}-{n_layer}" in capsys.readouterr().err


# --- an operator's malformed files: one line naming the file, never a hang or a traceback ---


def _load_in_thread(path, timeout: float = 5.0):
    """``load_topology(path)`` on a thread: its error, or AssertionError if it hangs."""
    import threading

    outcome: list = []

    def load() -> None:
        try:
            outcome.append(load_topology(path, shape=shape))
        except Exception as exc:  # noqa: BLE001 -- the test looks at it
            outcome.append(exc)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(timeout)
    assert outcome, f"load_topology({path}) still reading after {timeout} s"
    return outcome[0]


def test_a_fifo_is_refused_at_once_not_waited_on(tmp_path):
    import os

    fifo = tmp_path / "t.json"
    os.mkfifo(fifo)
    try:
        error = _load_in_thread(fifo)
    finally:  # a reader blocked in open() (as the old code was) gets a writer and goes
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass
    assert isinstance(error, TopologyError)
    assert str(error) == f"{fifo}: cannot read the topology: it is a FIFO, not a regular file"


def test_a_device_is_refused_not_read(tmp_path):
    """/dev/zero would fill memory (8 GB in 20 s); /dev/null is a device too."""
    error = _load_in_thread("/dev/null")
    assert isinstance(error, TopologyError)
    assert str(error) == "/dev/null: cannot read the topology: it is a character device, not a regular file"


def test_a_huge_file_is_refused_unread(tmp_path):
    from skippy_wire.net.topology import MAX_TOPOLOGY_BYTES

    path = tmp_path / "t.json"
    path.write_text(json.dumps(GOOD) + " " * MAX_TOPOLOGY_BYTES)
    with pytest.raises(TopologyError) as info:
        load_topology(path, shape=shape)
    assert str(info.value) == f"{path}: larger than 1 MiB: not a topology file"
    path.write_text(json.dumps(GOOD) + " " * (MAX_TOPOLOGY_BYTES - len(json.dumps(GOOD))))
    assert len(load_topology(path, shape=shape).stages) == 3  # up to the limit, it reads


def test_a_key_given_twice_is_an_error_not_the_last_one(tmp_path):
    path = tmp_path / "t.json"
    text = json.dumps(GOOD)
    path.write_text(text.replace('"layer_end": 10', '"layer_end": 10, "layer_end": 12', 1))
    with pytest.raises(TopologyError) as info:
        load_topology(path, shape=shape)
    assert str(info.value) == (f"{path}: key 'layer_end' appears twice in one object "
                               "(JSON would keep the last silently)")


def test_odd_json_values_are_one_line_errors_for_an_operator(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(GOOD).replace('"ctx_size": 1024', '"ctx_size": ' + "9" * 5000))
    with pytest.raises(TopologyError) as info:  # not "use sys.set_int_max_str_digits()"
        load_topology(path, shape=shape)
    assert str(info.value) == f"{path}: a number with 5000 digits (at most 100)"
    path.write_text(json.dumps(GOOD).replace('"topology_id": "t"', '"topology_id": "\\ud800"'))
    with pytest.raises(TopologyError, match=r"t\.json: a string holds an unpaired UTF-16 surrogate"):
        load_topology(path, shape=shape)


ADDRESSES = [
    ("NUL", "bad\x00host:19000", "endpoint host 'bad\\x00host' is not an IPv4 address or a host name"),
    ("newline", "bad\nhost:19000", "endpoint host 'bad\\nhost' is not an IPv4 address or a host name"),
    ("space", "bad host:19000", "endpoint host 'bad host' is not an IPv4 address or a host name"),
    ("slash", "10.0.0.1/24:19000", "endpoint host '10.0.0.1/24' is not an IPv4 address or a host name"),
    ("long label", "a" * 64 + ".example:19000", "is not a valid host name (an empty label, or one over 63"),
    ("empty label", "a..b:19000", "is not a valid host name (an empty label"),
    ("scheme", "http://h:19000", "endpoint: only tcp:// may come before HOST:PORT, not 'http://h:19000'"),
    ("other digits", "h:\u0661\u0662\u0663", "endpoint: the port of 'h:\u0661\u0662\u0663' must be ASCII digits"),
    ("superscript", "h:\u00b2", "endpoint: the port of 'h:\u00b2' must be ASCII digits"),
    # accepted as host names, they failed only when something connected
    ("octet over 255", "999.1.1.1:19000", "endpoint host '999.1.1.1' is not a valid IPv4 address (four numbers"),
    ("five numbers", "10.1.2.3.4:19000", "endpoint host '10.1.2.3.4' is not a valid IPv4 address"),
    # refused later in the words of serve's options, naming neither the file nor the stage
    ("wildcard", "0.0.0.0:19000", "endpoint host '0.0.0.0' is every address of a machine, none to connect to"),
    ("wildcard, dot", "0.0.0.0.:19000", "endpoint host '0.0.0.0.' is every address of a machine"),
    ("wildcard, short", "0:19000", "endpoint host '0' is every address of a machine"),
    ("wildcard, hex", "0x0:19000", "endpoint host '0x0' is every address of a machine"),
]


@pytest.mark.parametrize("name,endpoint,message", ADDRESSES, ids=[a[0] for a in ADDRESSES])
def test_an_address_with_odd_characters_is_the_file_s_error(name, endpoint, message):
    """They used to pass, then fail where the stage listened or connected: a traceback (NUL),
    an error line split in two (newline), "text is not valid UTF-8" (a long label), port 123
    read from Arabic-Indic digits."""
    with pytest.raises(TopologyError) as info:
        parse_topology(_with(_set(0, "endpoint", endpoint)), name="f.json", shape=shape)
    text = str(info.value)
    assert text.startswith("f.json: stage 0: ") and "\n" not in text and message in text, text


def test_host_names_that_resolve_stay_valid():
    for endpoint in ("node-1.cluster.local:19000", "tcp://10.77.0.1:19000", "h\u00f4st.example:19000",
                     "stage_0:19000", "localhost.:19000", "255.255.255.254:19000", "1a.2.3.4:19000",
                     "10.1.2:19000", "127.1:19000", "2130706433:19000"):  # the C library's short forms
        stage = parse_topology(_with(_set(0, "endpoint", endpoint)), name="f.json", shape=shape).stages[0]
        assert stage.address == (endpoint.removeprefix("tcp://").rsplit(":", 1)[0], 19000) == stage.listen
    # a stage may listen on every address, as long as its endpoint says where it is reached
    stage = parse_topology(_with(_set(0, "bind_addr", "0.0.0.0:19000")), name="f.json", shape=shape).stages[0]
    assert stage.listen == ("0.0.0.0", 19000) and stage.address[0] != "0.0.0.0"


def test_a_quoted_value_is_clipped_to_keep_the_line_short():
    with pytest.raises(TopologyError) as info:
        parse_topology(_with(_set(1, "layer_end", list(range(10000)))), name="f.json", shape=shape)
    assert len(str(info.value)) < 160 and str(info.value).endswith("...")


def test_a_nul_in_model_path_is_the_file_s_error():
    with pytest.raises(TopologyError, match=r"^f\.json: model_path contains a NUL character$"):
        parse_topology(_with(lambda d: d.update(model_path="/m\x00.gguf")), name="f.json", shape=shape)


BOUNDS = [
    ("threads", _set(1, "threads", 513), "stage 1: threads 513 is not between 1 and 512"),
    ("ctx_size", lambda d: d.update(ctx_size=2**24 + 1), "ctx_size 16777217 is not between 0 and 16777216"),
]


@pytest.mark.parametrize("name,mutate,message", BOUNDS, ids=[b[0] for b in BOUNDS])
def test_serve_s_bounds_are_the_file_s_so_every_command_refuses_alike(name, mutate, message):
    with pytest.raises(TopologyError) as info:
        parse_topology(_with(mutate), name="f.json", shape=shape)
    assert str(info.value) == f"f.json: {message}"


@pytest.mark.parametrize("command", ["serve", "run", "api"])
def test_serve_run_and_api_refuse_one_file_alike(tmp_path, command):
    """``run --topology`` and ``api --topology`` took a ctx_size or threads that ``serve
    --topology`` refuses for the same file (``api`` then served; hence a subprocess)."""
    import subprocess
    import sys

    n_layer, _ = model_shape(smollm2_path())
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"model_id": "smollm2-135m", "ctx_size": 2**24 + 1, "stages": [
        {"endpoint": "127.0.0.1:1", "layer_start": 0, "layer_end": n_layer}]}))
    args = [sys.executable, "-m", "skippy_wire", command, "--topology", str(path)]
    args += ["--stage", "0"] if command == "serve" else ["--listen", "127.0.0.1:0"] if command == "api" else []
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{command} --topology took the file and ran")
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == \
        f"skippy-wire: error: {path}: ctx_size 16777217 is not between 0 and 16777216"


def test_ctx_size_0_is_the_model_s_training_context_as_serve_s_c_0(tmp_path, monkeypatch):
    """`serve -c 0` is the training context, but a file saying ctx_size 0 was refused
    ("ctx_size must be >= 1, not 0")."""
    model = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    n_layer, _ = model_shape(model)
    data = {"model_path": str(model), "ctx_size": 0,
            "stages": [{"endpoint": "127.0.0.1:1", "layer_start": 0, "layer_end": n_layer}]}
    assert parse_topology(data, name="f.json").ctx_size == TINY_CONTEXT
    monkeypatch.setattr(topology, "training_context", lambda path: None)
    with pytest.raises(TopologyError) as info:
        parse_topology(data, name="f.json")
    assert str(info.value) == ("f.json: ctx_size 0 asks for the training context of tiny.gguf, which it does not "
                               "record; give ctx_size")


def test_api_refuses_a_file_s_ctx_size_under_its_own_c_bound(tmp_path, capsys):
    """`api -c 8` is a usage error (16 at least), but a topology file's ctx_size 8 was taken:
    the API served with a context no request fits in."""
    n_layer, _ = model_shape(smollm2_path())
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"model_id": "smollm2-135m", "ctx_size": 8, "stages": [
        {"endpoint": "127.0.0.1:1", "layer_start": 0, "layer_end": n_layer}]}))
    parser = api.build_parser()
    with pytest.raises(SystemExit) as stopped:
        api._check_args(parser, parser.parse_args(["--topology", str(path)]))
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == \
        f"skippy-wire: error: {path}: ctx_size 8 is under the least --ctx-size skippy-wire api takes (16)"


def test_a_byte_order_mark_is_skipped(tmp_path):
    """Windows editors write one; RFC 8259 lets a parser ignore it (it was "not JSON:
    Unexpected UTF-8 BOM (decode using utf-8-sig)")."""
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(GOOD), encoding="utf-8")
    marked = tmp_path / "marked.json"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert load_topology(marked, shape=shape).stages == load_topology(plain, shape=shape).stages
