"""Stages on separate hosts: topology-driven stage processes and the namespace cluster.

The namespace tests need root, ``ip`` and ``tc``.  Where those are missing they FAIL with
the reason, unless SKIPPY_WIRE_NO_NETNS=1 says this machine cannot make namespaces (then
they skip with the reason).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from skippy_wire.errors import NetnsError
from skippy_wire.net import netns as netns_module
from skippy_wire.net.netns import NETNS_PREFIX, NO_NETNS_ENV, NetnsChain, list_netns, netns_unavailable, parse_rate
from skippy_wire.net.supervision import StageProcess, split_layers, stage_env
from skippy_wire.net.topology import build_topology
from skippy_wire.stage.models import model_shape, smollm2_path, write_tiny_llama_gguf
from skippy_wire.tools import cluster, run
from skippy_wire.tools.signals import exiting_on_signals
from process_helpers import default_sigint

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CLUSTER = [sys.executable, "-m", "skippy_wire", "cluster"]


@pytest.fixture(scope="module")
def model() -> Path:
    return smollm2_path()


@pytest.fixture(scope="module")
def netns():
    reason = netns_unavailable()
    if reason:
        if os.environ.get(NO_NETNS_ENV) == "1":
            pytest.skip(f"{NO_NETNS_ENV}=1: {reason}")
        pytest.fail(f"cannot make network namespaces: {reason} (set {NO_NETNS_ENV}=1 where that is expected)")


def _free_ports(n: int) -> list[int]:
    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(n)]
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_serve_and_run_from_one_topology_file(tmp_path, model, capsys):
    """``serve --topology F --stage K`` for every K, then ``run --topology F --check``."""
    n_layer, _ = model_shape(model)
    ports = _free_ports(3)
    topo = build_topology(model, split_layers(n_layer, 3), [f"127.0.0.1:{p}" for p in ports], threads=1,
                          ctx_size=256)
    path = topo.write(tmp_path / "topology.json")
    procs = []
    try:
        for k in range(3):
            procs.append(StageProcess(k, split_layers(n_layer, 3)[k], ["--topology", str(path), "--stage", str(k)],
                                      env=stage_env(), log_path=tmp_path / f"stage{k}.log"))
        for proc in procs:
            proc.wait_listening(120)
            assert proc.port == ports[proc.index]
        assert run.main(["--topology", str(path), "--max-tokens", "6", "--check", "--quiet"]) == 0
    finally:
        for proc in procs:
            proc.terminate()
    out = capsys.readouterr().err  # the summary, on stderr as llama-cli prints its timings
    assert f"the pipeline at 127.0.0.1:{ports[0]}" in out and "check: OK, 6 tokens identical" in out


# --------------------------------------------------------------------------------------
# namespace hosts
# --------------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _assert_nothing_left(run_id: str, pids: list[int]) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (any(_alive(p) for p in pids) or
                                           [n for n in list_netns() if run_id in n]):
        time.sleep(0.1)
    assert [n for n in list_netns() if run_id in n] == [], "namespaces left behind"
    assert [p for p in pids if _alive(p)] == [], "stage processes left behind"
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert "swdn" not in links and "swup" not in links, "a veth reached the root namespace"


def _run_id(text: str) -> str:
    m = re.search(rf"{NETNS_PREFIX}-([0-9a-f]+)-h0", text)
    assert m, text
    return m.group(1)


def _pids(text: str) -> list[int]:
    return [int(p) for p in re.findall(r"stage \d+: pid (\d+)", text)]


@pytest.mark.parametrize("hosts", [2, 3])
def test_cluster_tokens_equal_one_stage(netns, hosts):
    done = subprocess.run([*CLUSTER, "--hosts", str(hosts), "--max-tokens", "8", "--check"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "check: OK, 8 tokens identical to one in-process stage" in done.stderr
    assert f"summary: {hosts} namespace hosts" in done.stderr and "prefill:" in done.stderr
    assert "bulk transfer" in done.stderr and "bytes per token per hop" in done.stderr
    for hop in range(1, hosts):
        assert f"wire hop {hop} stage {hop - 1}->stage {hop}" in done.stderr
    pids = _pids(done.stderr)
    assert len(pids) == hosts
    # stage K listened on its own namespace's address from the generated topology file
    assert "listening on 10.77.0.2:19000" in done.stderr
    _assert_nothing_left(_run_id(done.stderr), pids)


def test_shaped_link_lowers_throughput(netns):
    with NetnsChain(2) as free:
        unshaped = free.measure(0, 1.0)
    with NetnsChain(2, parse_rate("5mbit")) as shaped_chain:
        shaped = shaped_chain.measure(0, 1.5)
        run_id = shaped_chain.run_id
    assert 2.5e6 < shaped < 6e6, shaped  # the link carries its rate, neither collapsed nor unshaped
    assert unshaped > 10 * shaped, (unshaped, shaped)
    _assert_nothing_left(run_id, [])


def _start_and_wait_generating(extra: list[str]):
    proc = subprocess.Popen([*CLUSTER, "--hosts", "2", "--delay-ms", "40", "--max-tokens", "200",
                             "--measure-seconds", "0", *extra], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=default_sigint)
    seen = []
    deadline = time.monotonic() + 120
    for line in proc.stderr:
        seen.append(line)
        if "generating:" in line or time.monotonic() > deadline:
            break
    assert any("generating:" in s for s in seen), "".join(seen)
    time.sleep(1.0)  # well into decode (each token crosses the 40 ms link twice)
    return proc, "".join(seen)


def test_killed_stage_ends_the_driver_with_one_line(netns):
    proc, seen = _start_and_wait_generating([])
    pids = _pids(seen)
    os.kill(pids[1], signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    errors = [line for line in err.splitlines() if line.startswith("skippy-wire: error:")]
    assert len(errors) == 1, err
    assert re.search(r"stage 1 at 10\.77\.\d+\.\d+:19000 \(layers \d+\.\.\d+\) was killed by SIGKILL; "
                     r"stage 0 at 10\.77\.0\.1:19000 closed the connection during DECODE_EMBD \(session \d+\)$", errors[0]), errors[0]
    _assert_nothing_left(_run_id(seen), pids)


def test_a_stopped_stage_is_named_before_the_driver_gives_up(netns):
    """Every stage waited as long as the driver, so all timed out together and the error
    named only stage 0's silence."""
    proc, seen = _start_and_wait_generating(["--timeout", "4"])
    pids = _pids(seen)
    os.kill(pids[1], signal.SIGSTOP)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if _alive(pids[1]):
            os.kill(pids[1], signal.SIGCONT)
    assert proc.returncode == 1, err
    errors = [line for line in err.splitlines() if line.startswith("skippy-wire: error:")]
    assert len(errors) == 1 and re.search(r"stage 1 at \S+ \(layers \d+\.\.\d+\) is stopped \(SIGSTOP", errors[0]), err
    _assert_nothing_left(_run_id(seen), pids)


def test_ctrl_c_removes_everything(netns):
    proc, seen = _start_and_wait_generating([])
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted; namespaces and stage processes removed" in err
    assert out.startswith("Once upon a time") and out.endswith("\n")  # the partial text ends its line
    _assert_nothing_left(_run_id(seen), _pids(seen))


def test_failure_at_startup_removes_everything(netns, tmp_path, model):
    """A stage that cannot load its model (tensor data cut off) still leaves nothing behind."""
    broken = tmp_path / "broken.gguf"
    data = model.read_bytes()
    broken.write_bytes(data[:len(data) // 2])  # the metadata (shape, vocabulary) stays readable
    done = subprocess.run([*CLUSTER, "--hosts", "2", "--measure-seconds", "0", "--model", str(broken),
                           "--max-tokens", "2", "x"], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("skippy-wire: error:")]
    assert len(errors) == 1, done.stderr
    assert re.search(r"cannot start the stages: stage \d cannot start: ModelError: GGUF is truncated", errors[0]), \
        errors[0]
    _assert_nothing_left(_run_id(done.stderr), [])


def test_unavailable_netns_is_a_one_line_error(tmp_path):
    """Without the tools the command says why in one line (no root needed)."""
    env = dict(os.environ, PATH=str(tmp_path))  # no `ip`, no `tc`
    done = subprocess.run([*CLUSTER, "--hosts", "2"], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env=env)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "skippy-wire: error: cannot make namespace hosts: the `ip` command (iproute2) is not installed"]


def test_topology_file_of_a_cluster_is_valid(model):
    """The file the cluster writes is a plain topology (validated, loadable by serve)."""
    n_layer, _ = model_shape(model)
    chain = NetnsChain(3)
    topo = build_topology(model, split_layers(n_layer, 3), [f"{chain.host_address(h)}:19000" for h in range(3)])
    assert [s.endpoint for s in topo.stages] == ["10.77.0.1:19000", "10.77.0.2:19000", "10.77.1.2:19000"]
    assert json.loads(json.dumps(topo.to_json()))["stages"][2]["layer_end"] == n_layer


def _namespaces_that_fail_to_come_up(monkeypatch, close) -> None:
    """``cluster``'s NetnsChain: hosts that fail to come up, whose removal runs ``close()``."""
    class Chain:
        run_id = "0"

        def __init__(self, hosts, rate_bits):
            pass

        def create(self):
            raise NetnsError("no namespaces here")

        def close(self):
            return close()

    monkeypatch.setattr(cluster, "NetnsChain", Chain)
    monkeypatch.setattr(cluster, "netns_unavailable", lambda: None)


@pytest.mark.parametrize("signum,stops", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, SystemExit)])
def test_a_signal_during_the_cleanup_waits_for_it_and_is_then_acted_on(tmp_path, monkeypatch, signum, stops):
    """Ctrl-C (SIGTERM) while a run's namespaces are removed: the removal finishes, then the
    command stops (it was: Ctrl-C ignored, so bench-cluster went on; SIGTERM cut the removal short)."""
    steps = []

    def close():  # the removal is signalled halfway through
        steps.append("removing")
        os.kill(os.getpid(), signum)
        time.sleep(0.2)
        steps.append("removed")
        return []

    _namespaces_that_fail_to_come_up(monkeypatch, close)
    opts = cluster.ClusterOptions(model=str(write_tiny_llama_gguf(tmp_path / "tiny.gguf")), measure_seconds=0)
    # Ctrl-C as a terminal delivers it, whatever this runner inherited (in the background: ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(stops) as caught, exiting_on_signals():
            cluster.run_cluster(opts)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert steps == ["removing", "removed"]
    assert not isinstance(caught.value, SystemExit) or caught.value.code == 128 + signum


def test_an_ip_command_runs_in_its_own_session():
    # in the command's process group, a terminal's Ctrl-C killed the `ip netns del` of a
    # cleanup that had deferred the signal: the namespace stayed
    done = netns_module._run([sys.executable, "-c", "import os; print(os.getsid(0))"])
    assert int(done.stdout) != os.getsid(0)


def test_a_ctrl_c_between_the_probe_s_add_and_del_leaves_no_probe(tmp_path, monkeypatch):
    made = []

    def fake_run(argv, *, check=True):
        name = tmp_path / argv[-1]
        if argv[2] == "add":
            name.touch()
            made.append(argv[-1])
            raise KeyboardInterrupt  # after the namespace was made, before the del
        name.unlink()
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(netns_module, "_run", fake_run)
    monkeypatch.setattr(netns_module, "NETNS_DIR", str(tmp_path))
    monkeypatch.setattr(netns_module.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns_module.shutil, "which", lambda tool: "/sbin/" + tool)
    with pytest.raises(KeyboardInterrupt):
        netns_unavailable()
    assert made and not list(tmp_path.iterdir())


def test_a_cleanup_that_leaves_a_namespace_does_not_say_it_removed_them(tmp_path, monkeypatch, capsys):
    def close():  # one cannot be removed, and a Ctrl-C came meanwhile
        os.kill(os.getpid(), signal.SIGINT)
        return ["ip netns del skw-0-h0: Device or resource busy"]

    _namespaces_that_fail_to_come_up(monkeypatch, close)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code = cluster.main(["-m", str(write_tiny_llama_gguf(tmp_path / "tiny.gguf")), "--measure-seconds", "0"])
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capsys.readouterr().err
    assert code == 130
    assert "cleanup problems (`ip netns del NAME` removes a namespace left): ip netns del skw-0-h0: " in err
    assert err.splitlines()[-1] == "[skippy-wire] interrupted; stage processes stopped, not all namespaces removed " \
                                   "(above)"


@pytest.mark.parametrize("rate, measured", [("8kbit", False), ("1mbit", True)])
def test_a_link_too_slow_to_drain_its_queue_is_not_measured(tmp_path, monkeypatch, rate, measured):
    # at 8kbit the bulk transfer left minutes of backlog in the queue: the stages then could
    # not connect over the link ("cannot connect to downstream ...: timed out")
    calls = []

    class Chain:
        run_id = "0"

        def __init__(self, hosts, rate_bits):
            pass

        def create(self):
            pass

        def name(self, host):
            return f"h{host}"

        def measure(self, link, seconds):
            calls.append(link)
            return 1e6

        def host_address(self, host):
            raise NetnsError("no further")

        def close(self):
            return []

    monkeypatch.setattr(cluster, "NetnsChain", Chain)
    monkeypatch.setattr(cluster, "netns_unavailable", lambda: None)
    said = []
    opts = cluster.ClusterOptions(model=str(write_tiny_llama_gguf(tmp_path / "tiny.gguf")), rate=rate)
    with pytest.raises(NetnsError, match="no further"):
        cluster.run_cluster(opts, progress=said.append)
    assert bool(calls) is measured
    assert any(line.startswith("link 0 not measured: at 8kbit its queue takes 262 s to drain") for line in said) \
        is not measured
