"""Topology files: which stage runs which layers where, checked before anything starts.

A topology file is JSON shaped after upstream's stage configuration (``topology_id``,
``model_id``, per stage ``stage_id``, ``endpoint``, ``bind_addr``, ``layer_start``,
``layer_end``, codec and policy)::

    {
      "topology_id": "two-hosts",
      "model_id": "smollm2-135m",
      "model_path": "/models/SmolLM2-135M-Instruct.Q4_1.gguf",
      "ctx_size": 1024,
      "stages": [
        {"stage_id": "stage-0", "endpoint": "10.77.0.1:19000", "layer_start": 0, "layer_end": 15},
        {"stage_id": "stage-1", "endpoint": "10.77.0.2:19000", "layer_start": 15, "layer_end": 30,
         "activation_codec": "raw-f32-v1", "activation_codec_policy": "fixed", "threads": 1}
      ]
    }

``stages`` is ordered: stage K forwards to stage K+1, whose ``endpoint`` (``HOST:PORT``,
optionally ``tcp://``) is where stage K reaches it; a stage listens on ``bind_addr``
(default: its ``endpoint``).  Ranges are half-open.  ``model_path`` locates the GGUF; without
it, ``model_id`` must name a packaged model (:data:`PACKAGED_MODELS`).  Optional per stage:
``stage_id`` (default ``stage-K``), ``activation_codec`` (default ``raw-f32-v1``),
``activation_codec_policy`` (default ``fixed``), ``threads`` (default, or -1: ``default_threads()``);
codecs and policies go by their identities or the command line's short names (``f16``,
``auto-lossless``).  A stage's codec and policy describe what it *sends*; the receiver reads with the sender's,
so every stage of a file must agree on them.  An optional key given as ``null`` is an error
(its type is named), not its default.

:func:`load_topology` validates everything (a regular file of at most
:data:`MAX_TOPOLOGY_BYTES`, no key twice in one object, ranges contiguous from 0 to the
model's ``n_layer``, host names and ports that can be names and ports, no duplicate
addresses, names that resolve to one address included, codec/policy compatible,
``ctx_size`` and ``threads`` within ``serve``'s bounds) and raises
:class:`skippy_wire.errors.TopologyError` with one line naming the file and the stage; a model
that cannot be read is the model's failure, not the file's: its ``OSError``, or a
``ValueError`` naming the model, as a ``--model`` that cannot be read gives.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import TopologyError, not_a_regular_file, os_reason
from ..stage.models import model_shape, smollm2_path, training_context
from ..stage.threads import DEFAULT_THREADS, MAX_THREADS
from ..wire.constants import MAX_CTX_SIZE, named_codec_setting
from ..wire.forwarding import DEFAULT_CTX_SIZE
from .supervision import layer_chain_problem
from .transport import BadHost, ipv4_addresses, is_wildcard, parse_address

#: Model identities a file may name without a ``model_path``.
PACKAGED_MODELS: dict[str, Callable[[], Path]] = {"smollm2-135m": smollm2_path}
DEFAULT_CODEC = "raw-f32-v1"
DEFAULT_POLICY = "fixed"
#: Seconds a failed request's probe waits for each stage to take a connection.
PROBE_TIMEOUT_S = 1.0
#: When every stage takes a connection, the probes run once more after this long: a killed
#: stage's connections close (the failure the driver saw) before its listener does.
PROBE_SETTLE_S = 0.25
#: The largest topology file read (a real one is a few KiB): a device such as /dev/zero, or a
#: file of that size, is refused instead of filling memory.
MAX_TOPOLOGY_BYTES = 1 << 20
#: The most digits a number of a file may have (Python refuses to convert more than 4300,
#: with advice meant for programmers).
MAX_NUMBER_DIGITS = 100
#: The longest value an error quotes (a key or a value of the wrong type, as the file spells it).
MAX_QUOTED_CHARS = 80

_TOP_KEYS = {"topology_id", "model_id", "model_path", "ctx_size", "stages"}
_STAGE_KEYS = {"stage_id", "endpoint", "bind_addr", "layer_start", "layer_end", "activation_codec",
               "activation_codec_policy", "threads"}


@dataclass(frozen=True)
class TopologyStage:
    """One stage of a topology (``index`` = its position in ``stages``)."""

    index: int
    stage_id: str
    endpoint: str
    bind_addr: str
    layer_start: int
    layer_end: int
    activation_codec: str = DEFAULT_CODEC
    activation_codec_policy: str = DEFAULT_POLICY
    threads: int | None = None

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` where upstream reaches this stage."""
        return parse_address(self.endpoint)

    @property
    def listen(self) -> tuple[str, int]:
        return parse_address(self.bind_addr)

    def to_json(self) -> dict:
        out = {"stage_id": self.stage_id, "endpoint": self.endpoint, "layer_start": self.layer_start,
               "layer_end": self.layer_end, "activation_codec": self.activation_codec,
               "activation_codec_policy": self.activation_codec_policy}
        if self.bind_addr != self.endpoint:
            out["bind_addr"] = self.bind_addr
        if self.threads is not None:
            out["threads"] = self.threads
        return out


@dataclass(frozen=True)
class Topology:
    """A validated topology: the model and its stages, stage 0 first."""

    model_path: Path
    stages: tuple[TopologyStage, ...]
    n_layer: int
    n_embd: int
    topology_id: str = "topology"
    model_id: str | None = None
    ctx_size: int = DEFAULT_CTX_SIZE
    #: Where it came from (the file), for errors; not part of the topology itself.
    name: str = field(default="topology", compare=False)

    @property
    def entry(self) -> tuple[str, int]:
        """Stage 0's address (what a driver connects to)."""
        return self.stages[0].address

    def stage(self, index: int) -> TopologyStage:
        if not 0 <= index < len(self.stages):
            raise TopologyError(f"{self.name}: no stage {index} (it has {len(self.stages)})")
        return self.stages[index]

    def downstream(self, index: int) -> tuple[str, int] | None:
        """Where stage ``index`` forwards to (None on the last stage)."""
        self.stage(index)  # -1 gave stage 0's address, 5 of 2 stages None
        return self.stages[index + 1].address if index + 1 < len(self.stages) else None

    def to_json(self) -> dict:
        out: dict[str, Any] = {"topology_id": self.topology_id, "model_path": str(self.model_path),
                               "ctx_size": self.ctx_size, "stages": [s.to_json() for s in self.stages]}
        if self.model_id:
            out["model_id"] = self.model_id
        return out

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    def unreachable_stage(self, timeout: float = PROBE_TIMEOUT_S) -> str | None:
        """The first stage whose endpoint takes no TCP connection from this host now, in
        words naming it, its address and layers; None when every one does.  A driver's
        account of a failed request: the wire has no error reply, so a stage that ended shows
        only as a close.  A stage on a network this host has no route to (a back-end network
        only its neighbours reach) is passed over: that says nothing of the stage."""
        for settle in (0.0, PROBE_SETTLE_S):
            time.sleep(settle)
            for stage in self.stages:
                why = _refusal(stage.address, timeout)
                if why is not None:
                    host, port = stage.address
                    return f"stage {stage.index} at {host}:{port} (layers {stage.layer_start}..{stage.layer_end}) {why}"
        return None


def _refusal(address: tuple[str, int], timeout: float) -> str | None:
    """How ``address`` refused a TCP connection from this host, in words; None when it took
    one, or when this host has no route to its network (which says nothing of the stage)."""
    try:
        socket.create_connection(address, timeout).close()
    except ConnectionRefusedError:
        return "refuses connections (it is not running)"
    except (socket.timeout, TimeoutError):
        return f"accepted no connection from this host within {timeout:g} s"
    except OSError as exc:
        return None if exc.errno == errno.ENETUNREACH else f"cannot be reached from this host ({os_reason(exc)})"
    return None


#: The topologies whose stages this process drives, by stage 0's address.
_DRIVEN: dict[tuple[str, int], Topology] = {}


def drive_topology(topology: Topology) -> None:
    """Note that this process drives ``topology``'s stages: a driver connected to its stage 0
    then names a stage that no longer takes connections when a request fails."""
    _DRIVEN[topology.entry] = topology


def driven_topology(host: str, port: int) -> Topology | None:
    """The topology :func:`drive_topology` noted for stage 0 at ``host:port``."""
    return _DRIVEN.get((host, int(port)))


def _shown(value) -> str:
    """A JSON value in an error: ``null``, ``true`` and ``false`` as the file spells them, else
    its repr (clipped: the error stays one short line whatever the file holds)."""
    text = json.dumps(value) if value is None or isinstance(value, bool) else repr(value)
    return text if len(text) <= MAX_QUOTED_CHARS else text[:MAX_QUOTED_CHARS - 3] + "..."


def _int(where: str, obj: dict, key: str, *, minimum: int = 0, default=None) -> int:
    if key not in obj and default is None:
        raise TopologyError(f"{where}: {key} is missing")
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TopologyError(f"{where}: {key} must be an integer, not {_shown(value)}")
    if value < minimum:
        raise TopologyError(f"{where}: {key} must be >= {minimum}, not {value}")
    return value


def _address(where: str, key: str, text) -> str:
    if not isinstance(text, str):
        raise TopologyError(f"{where}: {key} must be a \"HOST:PORT\" string, not {_shown(text)}")
    try:
        host, port = parse_address(text)
    except BadHost as exc:
        raise TopologyError(f"{where}: {key} {exc}") from None
    except ValueError as exc:
        raise TopologyError(f"{where}: {key}: {exc}") from None
    if not 0 < port < 65536:
        raise TopologyError(f"{where}: {key} port {port} is out of range 1..65535")
    if key == "endpoint" and is_wildcard(host):
        raise TopologyError(f"{where}: endpoint host {_shown(host)} is every address of a machine, none to connect "
                            "to: give the address the stage is reached at (its bind_addr may be 0.0.0.0)")
    return text


def _model(name: str, data: dict, model_override) -> tuple[Path, str | None]:
    model_id = data.get("model_id")
    if "model_id" in data and (not isinstance(model_id, str) or not model_id):
        raise TopologyError(f"{name}: model_id must be a non-empty string, not {_shown(model_id)}")
    if model_override is not None:
        return Path(model_override), model_id
    if "model_path" in data:
        if not isinstance(data["model_path"], str) or not data["model_path"]:
            raise TopologyError(f"{name}: model_path must be a path string")
        if "\0" in data["model_path"]:
            raise TopologyError(f"{name}: model_path contains a NUL character")
        return Path(data["model_path"]), model_id
    if model_id is None:
        raise TopologyError(f"{name}: model_path (or a packaged model_id) is missing")
    resolve = PACKAGED_MODELS.get(str(model_id).lower())
    if resolve is None:
        raise TopologyError(f"{name}: model_id {model_id!r} is not a packaged model "
                            f"({', '.join(sorted(PACKAGED_MODELS))}); give model_path")
    try:
        return resolve(), model_id
    except FileNotFoundError as exc:
        raise TopologyError(f"{name}: {exc}") from None


def _stage(name: str, index: int, raw) -> TopologyStage:
    where = f"{name}: stage {index}"
    if not isinstance(raw, dict):
        raise TopologyError(f"{where}: must be an object")
    unknown = sorted(set(raw) - _STAGE_KEYS)
    if unknown:
        raise TopologyError(f"{where}: unknown key {_shown(unknown[0])}")
    if "endpoint" not in raw:
        raise TopologyError(f"{where}: endpoint is missing")
    endpoint = _address(where, "endpoint", raw["endpoint"])
    bind_addr = _address(where, "bind_addr", raw.get("bind_addr", endpoint))
    start = _int(where, raw, "layer_start")
    end = _int(where, raw, "layer_end")
    if end <= start:
        raise TopologyError(f"{where}: layer range {start}..{end} is empty (layer_end is exclusive)")
    codec = raw.get("activation_codec", DEFAULT_CODEC)
    policy = raw.get("activation_codec_policy", DEFAULT_POLICY)
    for key, value in (("activation_codec", codec), ("activation_codec_policy", policy)):
        if not isinstance(value, str):
            raise TopologyError(f"{where}: {key} must be a name string, not {_shown(value)}")
    try:
        codec, policy = named_codec_setting(codec, policy, ("activation_codec", "activation_codec_policy"))
    except ValueError as exc:
        raise TopologyError(f"{where}: {exc}") from None
    threads = None
    if "threads" in raw:
        threads = _int(where, raw, "threads", minimum=-(2**63))
        if threads != DEFAULT_THREADS and threads < 1:
            raise TopologyError(f"{where}: threads must be {DEFAULT_THREADS} (the default) or >= 1, not {threads}")
        if threads > MAX_THREADS:  # serve's bound, so that run and api refuse what serve refuses
            raise TopologyError(f"{where}: threads {threads} is not between 1 and {MAX_THREADS}")
        threads = None if threads == DEFAULT_THREADS else threads
    stage_id = raw.get("stage_id", f"stage-{index}")
    if not isinstance(stage_id, str) or not stage_id:
        raise TopologyError(f"{where}: stage_id must be a non-empty string")
    return TopologyStage(index, stage_id, endpoint, bind_addr, start, end, codec.identity(), policy.serde_name,
                         threads)


def _resolve(host: str, cache: dict[str, frozenset[str]]) -> frozenset[str]:
    """The IP addresses ``host`` names (once per host): two spellings of one address are one
    listener, and a stage whose downstream is itself floods itself with connections."""
    if host not in cache:
        cache[host] = ipv4_addresses(host)
    return cache[host]


def _check_addresses(name: str, stages: list[TopologyStage]) -> None:
    """No two stages on one address: no two endpoints, and no two listening addresses on
    one host (stages whose endpoints name one address), where a wildcard ``bind_addr``
    takes its port on all of them.  A ``bind_addr`` is its own host's: two hosts may both
    bind 0.0.0.0:19000.  Only hosts that share a port with another stage are resolved: a
    file of distinct ports costs no lookup."""
    listening = [[(key, *parse_address(getattr(s, key)))
                  for key in (("endpoint", "bind_addr") if s.bind_addr != s.endpoint else ("endpoint",))]
                 for s in stages]  # each stage's (key, host, port); the endpoint first
    ports: dict[int, set[int]] = {}
    for s, addresses in zip(stages, listening):
        for _, _, port in addresses:
            ports.setdefault(port, set()).add(s.index)
    cache: dict[str, frozenset[str]] = {}

    def hosts(host: str, port: int) -> frozenset[str]:
        return _resolve(host, cache) if len(ports[port]) > 1 else frozenset([host])

    for index, s in enumerate(stages):
        for key, host, port in listening[index]:
            for t, theirs in zip(stages[:index], listening):
                if port not in {other_port for _, _, other_port in theirs}:
                    continue
                one_host = bool(hosts(*listening[index][0][1:]) & hosts(*theirs[0][1:]))
                for other_key, other_host, other_port in theirs:
                    if other_port != port or (not one_host and "bind_addr" in (key, other_key)):
                        continue
                    if hosts(host, port) & hosts(other_host, port) or (
                            one_host and (is_wildcard(host) or is_wildcard(other_host))):
                        same = "" if (other_host, other_port) == (host, port) else f" (as {getattr(t, other_key)})"
                        raise TopologyError(f"{name}: stage {s.index}: {key} {host}:{port} is already used by "
                                            f"stage {t.index}{same}")


def parse_topology(data, *, name: str = "topology", model: str | Path | None = None,
                   shape: Callable[[Path], tuple[int, int]] = model_shape) -> Topology:
    """Validate a decoded topology document; ``model`` overrides its model path."""
    if not isinstance(data, dict):
        raise TopologyError(f"{name}: the document must be a JSON object")
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise TopologyError(f"{name}: unknown key {_shown(unknown[0])}")
    raw_stages = data.get("stages")
    if not isinstance(raw_stages, list) or not raw_stages:
        raise TopologyError(f"{name}: stages must be a non-empty list")
    stages = [_stage(name, i, raw) for i, raw in enumerate(raw_stages)]
    _check_addresses(name, stages)
    ids: dict[str, int] = {}
    for s in stages:
        if s.stage_id in ids:
            raise TopologyError(f"{name}: stage {s.index}: stage_id {s.stage_id!r} is already used by "
                                f"stage {ids[s.stage_id]}")
        ids[s.stage_id] = s.index
    ranges = [(s.layer_start, s.layer_end) for s in stages]
    problem = layer_chain_problem(ranges)  # before the model is read; its end once it is
    if problem:
        raise TopologyError(f"{name}: {problem}")
    first = stages[0]
    for s in stages[1:]:
        if (s.activation_codec, s.activation_codec_policy) != (first.activation_codec,
                                                               first.activation_codec_policy):
            raise TopologyError(f"{name}: stage {s.index}: codec {s.activation_codec}/"
                                f"{s.activation_codec_policy} differs from stage 0's "
                                f"{first.activation_codec}/{first.activation_codec_policy}")
    ctx_size = _int(name, data, "ctx_size", minimum=0, default=DEFAULT_CTX_SIZE)  # 0: as `serve -c 0`
    if ctx_size > MAX_CTX_SIZE:
        raise TopologyError(f"{name}: ctx_size {ctx_size} is not between 0 and {MAX_CTX_SIZE}")
    topology_id = data.get("topology_id", "topology")
    if not isinstance(topology_id, str) or not topology_id:
        raise TopologyError(f"{name}: topology_id must be a non-empty string")
    model_path, model_id = _model(name, data, model)
    try:
        n_layer, n_embd = shape(model_path)
    except ValueError as exc:  # a broken model is no fault of the file: as for `-m`, it names the model
        text = " ".join(str(exc).split())
        raise ValueError(text if str(model_path) in text else f"{model_path}: {text}") from None
    # an OSError (a missing model) goes on as it is: the model's path and the reason
    problem = layer_chain_problem(ranges, n_layer, model_path.name)
    if problem:
        raise TopologyError(f"{name}: {problem}")
    if ctx_size == 0:
        ctx_size = training_context(model_path) or 0
        if not 1 <= ctx_size <= MAX_CTX_SIZE:
            raise TopologyError(f"{name}: ctx_size 0 asks for the training context of {model_path.name}, which "
                                + (f"is {ctx_size} tokens, over the stages' limit of {MAX_CTX_SIZE}" if ctx_size
                                   else "it does not record") + "; give ctx_size")
    return Topology(model_path, tuple(stages), n_layer, n_embd, topology_id, model_id, ctx_size, name)


class _Refused(ValueError):
    """Valid JSON that no topology file holds (the parser's own errors are "not JSON")."""


def _json_int(text: str) -> int:
    if len(text) > MAX_NUMBER_DIGITS:
        raise _Refused(f"a number with {len(text.lstrip('-'))} digits (at most {MAX_NUMBER_DIGITS})")
    return int(text)


def _json_object(pairs: list) -> dict:
    """An object of the file; a key given twice is an error (JSON would keep the last)."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _Refused(f"key {_shown(key)} appears twice in one object (JSON would keep the last silently)")
        out[key] = value
    return out


def _read_topology_bytes(path: Path) -> bytes:
    """The file's bytes, at most :data:`MAX_TOPOLOGY_BYTES`: OSError (a directory as
    IsADirectoryError), or TopologyError for a FIFO or a device (reading one would wait for a
    writer for ever, or never end) and for a file over the limit."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))  # a FIFO opens at once
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(mode):
            raise TopologyError(f"{path}: cannot read the topology: {not_a_regular_file(mode)}")
        with os.fdopen(fd, "rb", closefd=False) as stream:
            data = stream.read(MAX_TOPOLOGY_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_TOPOLOGY_BYTES:
        raise TopologyError(f"{path}: larger than {MAX_TOPOLOGY_BYTES >> 20} MiB: not a topology file")
    return data


def load_topology(path: str | Path, *, model: str | Path | None = None,
                  shape: Callable[[Path], tuple[int, int]] = model_shape) -> Topology:
    """Read and validate a topology file (see the module docstring)."""
    path = Path(path)
    try:
        raw = _read_topology_bytes(path)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise TopologyError(f"{path}: cannot read the topology: {reason[:1].lower()}{reason[1:]}") from None
    try:
        # JSON is UTF-8 (RFC 8259), whatever the locale; a byte order mark, which RFC 8259
        # lets a parser ignore (Windows editors write one), is skipped
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise TopologyError(f"{path}: not valid UTF-8") from None
    try:
        data = json.loads(text, parse_int=_json_int, object_pairs_hook=_json_object)
    except _Refused as exc:
        raise TopologyError(f"{path}: {exc}") from None
    except ValueError as exc:
        raise TopologyError(f"{path}: not JSON: {exc}") from None
    except RecursionError:
        raise TopologyError(f"{path}: not JSON: nested too deeply") from None
    try:  # "\ud800" is JSON, but no character: it would fail wherever the string is used
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise TopologyError(f"{path}: not JSON: nested too deeply") from None
    except UnicodeEncodeError:
        raise TopologyError(f"{path}: a string holds an unpaired UTF-16 surrogate (an escape "
                            f"\\ud800..\\udfff without its pair)") from None
    return parse_topology(data, name=str(path), model=model, shape=shape)


def build_topology(model_path: str | Path, layers: list[tuple[int, int]], endpoints: list[str], *,
                   codec: str = DEFAULT_CODEC, policy: str = DEFAULT_POLICY, threads: int | None = None,
                   ctx_size: int = DEFAULT_CTX_SIZE, topology_id: str = "topology",
                   bind_addrs: list[str] | None = None,
                   shape: Callable[[Path], tuple[int, int]] = model_shape) -> Topology:
    """A validated topology from parts (what ``skippy-wire cluster`` writes): one endpoint
    (and one bind address, if any) per range of ``layers``."""
    for name, given in (("endpoints", endpoints), ("bind_addrs", bind_addrs)):
        if given is not None and len(given) != len(layers):  # zip() dropped the extra ones
            raise TopologyError(f"{topology_id}: {len(layers)} layer ranges but {len(given)} {name}")
    stages = []
    for i, ((start, end), endpoint) in enumerate(zip(layers, endpoints)):
        raw = {"stage_id": f"stage-{i}", "endpoint": endpoint, "layer_start": start, "layer_end": end,
               "activation_codec": codec, "activation_codec_policy": policy}
        if bind_addrs:
            raw["bind_addr"] = bind_addrs[i]
        if threads is not None:
            raw["threads"] = threads
        stages.append(raw)
    return parse_topology({"topology_id": topology_id, "model_path": str(model_path), "ctx_size": ctx_size,
                           "stages": stages}, name=topology_id, shape=shape)


__all__ = ["PACKAGED_MODELS", "PROBE_TIMEOUT_S", "PROBE_SETTLE_S", "TopologyStage", "Topology", "parse_topology", "load_topology",
           "build_topology", "drive_topology", "driven_topology"]
