"""The package as an embedder sees it: ``sw.__all__``, docstrings, the documented module
paths, one-line errors for the usual mistakes, pickling, and the type information."""

import ast
import copy
import importlib
import inspect
import io
import pickle
import re
import socket

import numpy as np
import pytest
from conftest import REPO

import skippy_wire as sw
from skippy_wire.wire.protocol import ProtocolVersionError

W = sw.WireMessageKind


def test_all_lists_every_public_reexport_and_each_exists():
    assert len(set(sw.__all__)) == len(sw.__all__)
    assert all(hasattr(sw, name) for name in sw.__all__)


@pytest.mark.parametrize("name", [n for n in sw.__all__ if callable(getattr(sw, n))])
def test_every_public_callable_has_its_own_docstring(name):
    obj = getattr(sw, name)
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    assert doc and not doc.startswith(f"{obj.__name__}("), f"{name} has no docstring of its own"


def test_forwarding_needs_no_name_from_below_the_package():
    # the README lists forwarding as public: its frame type and its error were not re-exported
    incoming = _message()
    out = sw.forwarded_stage_message(sw.StageConfig(stage_index=1, layer_start=0, layer_end=4), incoming,
                                     sw.ActivationFrameV1.f32([1e40, -1e40] + [0.5] * 6, 1), 8)
    assert out.activation_f32().tolist() == [np.inf, -np.inf] + [0.5] * 6  # beyond f32: infinities, as writers do
    short = sw.ActivationFrameV1(sw.ActivationDescV1(dtype=sw.ActivationDType.F16, token_count=1), b"")
    with pytest.raises(sw.ForwardingError, match="unsupported activation dtype conversion: F16 to f32$"):
        sw.forwarded_stage_message(sw.StageConfig(stage_index=1), incoming, short, 8)


def test_errors_names_its_public_classes_and_helpers():
    from skippy_wire import errors
    classes = {n for n, v in vars(errors).items() if inspect.isclass(v) and issubclass(v, BaseException)}
    assert classes <= set(errors.__all__) and all(hasattr(errors, n) for n in errors.__all__)
    assert not {"enum", "functools", "stat", "Optional"} & set(errors.__all__)


def test_a_decoder_s_repr_says_where_its_stream_stands():
    decoder = sw.StageMessageDecoder(8)
    data = sw.write_stage_message(_message())
    decoder.feed(data + data[:5])
    assert repr(decoder) == f"<StageMessageDecoder received={len(data) + 5} consumed={len(data)} buffered=5>"
    with pytest.raises(sw.InvalidDataError):
        decoder.feed(b"\xff" * 200)
    assert repr(decoder).startswith("<StageMessageDecoder received=") and "error=InvalidDataError(" in repr(decoder)


def test_modules_named_in_the_wire_format_page_exist():
    text = (REPO / "docs" / "wire-format.md").read_text(encoding="utf-8")
    named = sorted(set(re.findall(r"`(skippy_wire(?:\.[A-Za-z_0-9]+)+)", text)))
    assert len(named) >= 5, named  # the page names its modules (a changed spelling would find none)
    for dotted in named:
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
            break


def _message():
    state = sw.StageStateHeader.new(W.PREFILL_EMBD)
    state.source_stage_index = 0
    payload = np.arange(8, dtype=np.float32).tobytes()
    return sw.StageWireMessage(W.PREFILL_EMBD, 0, 1, state, 1, 2, tokens=[7], activation=payload)


MESSAGE_MISTAKES = [
    (dict(state=None), "state must be a StageStateHeader, not NoneType"),
    (dict(tokens=None), "tokens must be a sequence of ints, not NoneType"),
    (dict(tokens="ab"), "tokens must be a sequence of ints, not str"),
    (dict(sampling={}), "sampling must be a SamplingConfig or None, not dict"),
    (dict(sampling=sw.SamplingConfig(temperature="hot")), "sampling.temperature value 'hot' is not a number"),
    (dict(sampling=sw.SamplingConfig(samplers=None)), "sampling.samplers must be a list of strings, not NoneType"),
    (dict(sampling=sw.SamplingConfig(samplers="top_k")), "sampling.samplers must be a list of strings, not a single string"),
    (dict(sampling=sw.SamplingConfig(samplers=[1])), "sampling.samplers entry 1 is not a string"),
    (dict(sampling=sw.SamplingConfig(logit_bias={1: 2.0})),
     "sampling.logit_bias must be a list of (token_id, bias) pairs, not dict"),
    (dict(sampling=sw.SamplingConfig(logit_bias=[(1,)])), "sampling.logit_bias entry (1,) is not a (token_id, bias) pair"),
    (dict(chat_sampling_metadata=b"{}"), "chat_sampling_metadata must be a str or None, not bytes"),
]


@pytest.mark.parametrize("change, text", MESSAGE_MISTAKES)
def test_a_field_of_the_wrong_kind_is_one_invalid_input_error_naming_it(impl, change, text):
    msg = _message()
    for name, value in change.items():
        setattr(msg, name, value)
    with pytest.raises(sw.InvalidInputError) as info:
        sw.write_stage_message(msg, impl=impl)
    assert str(info.value) == text


REPLY_MISTAKES = [
    (dict(predicted_tokens=None), "predicted_tokens must be a sequence of ints, not NoneType"),
    (dict(window=3), "window must be a StageReplyWindow, not int"),
    (dict(stats=None), "stats must be a StageReplyStats, not NoneType"),
    (dict(native_mtp_draft=sw.NativeMtpDraft(None)), "native_mtp_draft.token_ids must be a sequence of ints, not NoneType"),
]


@pytest.mark.parametrize("change, text", REPLY_MISTAKES)
def test_a_reply_field_of_the_wrong_kind_is_named(impl, change, text):
    with pytest.raises(sw.InvalidInputError) as info:
        sw.write_reply(sw.StageReply(**change), impl=impl)
    assert str(info.value) == text


@pytest.mark.parametrize("tokens", [b"\x05\x06", None, iter([5, 6])])
def test_the_reply_helpers_refuse_what_write_reply_refuses_as_a_token_list(impl, tokens):
    """The send_reply_* helpers made a list of whatever they were given first: raw bytes were
    written as token ids 5 and 6, an iterator was taken, None was a bare TypeError."""
    text = f"predicted_tokens must be a sequence of ints, not {type(tokens).__name__}"
    for send in (lambda out: sw.send_reply_predicted_tokens_with_stats(out, tokens, impl=impl),
                 lambda out: sw.send_reply_predicted_with_tokens_and_stats(out, 9, tokens, impl=impl)):
        out = io.BytesIO()
        with pytest.raises(sw.InvalidInputError, match=f"^{re.escape(text)}$"):
            send(out)
        assert out.getvalue() == b""


@pytest.mark.parametrize("stream", [None, "out", socket.socket])
def test_a_writer_s_stream_without_write_is_a_type_error_before_anything_is_written(impl, stream):
    """``send_reply_ack(None)`` or a plain socket was a bare AttributeError from inside the package."""
    target = stream() if stream is socket.socket else stream
    try:
        for call in (lambda: sw.send_reply_ack(target, impl=impl), lambda: sw.send_ready(target),
                     lambda: sw.write_stage_message_to(target, sw.StageWireMessage.stop(), impl=impl)):
            with pytest.raises(TypeError, match=f"^stream must be a binary stream with a write method, not "
                                                f"{type(target).__name__}$"):
                call()
    finally:
        if stream is socket.socket:
            target.close()


def test_not_a_message_or_an_int_is_a_clear_type_error(impl):
    data = sw.write_stage_message(sw.StageWireMessage.stop(), impl=impl)
    cases = [
        (lambda: sw.write_stage_message(None, impl=impl), "write_stage_message expects a StageWireMessage, not NoneType"),
        (lambda: sw.write_stage_message_to(io.BytesIO(), {}, impl=impl), "expects a StageWireMessage, not dict"),
        (lambda: sw.write_reply(None, impl=impl), "write_reply expects a StageReply, not NoneType"),
        (lambda: sw.read_stage_message(data, None, impl=impl), "n_embd must be an int, not NoneType"),
        (lambda: sw.read_stage_message(io.BytesIO(data), "8", impl=impl), "n_embd must be an int, not str"),
        (lambda: sw.read_stage_message_from_buffer(data, 8, offset=None, impl=impl), "offset must be an int, not NoneType"),
        (lambda: sw.StageMessageDecoder(8, max_message_bytes="10", impl=impl), "max_message_bytes must be an int, not str"),
        (lambda: sw.F32(1.5), "F32 takes a binary32 bit pattern"),
        (lambda: sw.forwarded_stage_message(sw.StageConfig(), None, None, 4, impl=impl),
         "incoming must be a StageWireMessage, not NoneType"),
        (lambda: sw.forwarded_stage_message(sw.StageConfig(), _message(), b"", 4, impl=impl),
         "output must be an ActivationFrameV1, not bytes"),
        (lambda: sw.forwarded_stage_message({}, _message(), sw.ActivationFrameV1.f32([0.0] * 8, 1), 8, impl=impl),
         "config must be a StageConfig, not dict"),
        # the fields it reads: a raw AttributeError or TypeError deep inside, and a bool taken as 1
        (lambda: sw.forwarded_stage_message(sw.StageConfig(), sw.StageWireMessage(kind=2, token_count=1, state=None),
                                            sw.ActivationFrameV1.f32([0.0] * 8, 1), 8, impl=impl),
         "incoming.state must be a StageStateHeader, not NoneType"),
        (lambda: sw.forwarded_stage_message(sw.StageConfig(), _message(), sw.ActivationFrameV1(None, b""), 8, impl=impl),
         "output.desc must be an ActivationDescV1, not NoneType"),
        (lambda: sw.forwarded_stage_message(sw.StageConfig(), _message(), sw.ActivationFrameV1.f32([0.0] * 8, 1), True,
                                            impl=impl), "activation_width must be an int, not bool"),
    ]
    # numpy's integers are integers there too
    frame = sw.ActivationFrameV1.f32([0.0] * 8, 1)
    assert sw.forwarded_stage_message(sw.StageConfig(), _message(), frame, np.int64(8), impl=impl) == \
        sw.forwarded_stage_message(sw.StageConfig(), _message(), frame, 8, impl=impl)
    for call, text in cases:
        with pytest.raises(TypeError, match=re.escape(text)):
            call()


def test_a_read_message_and_the_wire_errors_pickle_and_deepcopy(impl):
    msg = sw.read_stage_message(sw.write_stage_message(_message(), impl=impl), 8, impl=impl)
    assert isinstance(msg.activation, memoryview)
    for back in (pickle.loads(pickle.dumps(msg)), copy.deepcopy(msg)):
        assert back == msg
        assert isinstance(back.activation, memoryview) and back.activation.readonly
        assert back.activation_f32().tolist() == list(range(8))
        assert "_memoryviews" not in vars(back)
    error = ProtocolVersionError(16, 15)
    for back in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
        assert (type(back), str(back), back.received, back.expected) == (ProtocolVersionError, str(error), 16, 15)


def _error_examples():
    from skippy_wire import errors as e

    return [e.SkippyError("x"), e.WireError("x"), e.InvalidDataError("bad"), e.InvalidInputError("bad"),
            e.UnexpectedEofError(needed=12), e.ForwardingError("wrapped", e.InvalidDataError("inner")),
            e.SetupError("setup failed", "because"), e.SetupClosed(detail="why"), e.SetupTimeout(),
            e.StageRuntimeError.from_native(4, "too small", 1234), e.ActivationFrameError("frame"),
            e.ModelFileError("m.gguf is not a GGUF file"),
            e.SamplingConfigError("sampling", e.Status.INVALID_ARGUMENT), e.StageArgumentError("token"),
            e.PartialBatchExecution(3, e.StageRuntimeError("boom")), e.StageError("stage"), e.PipelineError("p"),
            e.PipelineMismatch("m"), e.PipelineTimeout("t"), e.PipelineClosed("c"),
            e.StateVersionMismatch(16, 15, who="downstream 1.2.3.4:5", me="stage 2"),
            e.StateVersionMismatch(None, 17, peer_text="state version 15 or 16"),
            e.TlsRequired("stage 1", "the driver"), e.TopologyError("t"), e.NetnsError("n"), e.ToolError("tool"),
            e.DissectError("record 3"), e.Mismatch("case 1")]


def test_every_error_class_pickles_and_copies_with_its_text_and_fields():
    # Embedders send errors across processes (a worker pool that cannot unpickle one breaks).
    from skippy_wire import errors

    examples = _error_examples()
    classes = {cls for cls in vars(errors).values() if inspect.isclass(cls) and issubclass(cls, BaseException)}
    assert {type(error) for error in examples} == classes  # a new class needs an example here
    for error in examples:
        for back in (pickle.loads(pickle.dumps(error)), copy.deepcopy(error)):
            assert type(back) is type(error) and str(back) == str(error) and back.args == error.args
            assert {k: repr(v) for k, v in vars(back).items()} == {k: repr(v) for k, v in vars(error).items()}


def test_type_checkers_see_every_public_name_re_exported_and_no_module_getattr():
    # The lazy names are spelled out under TYPE_CHECKING as `X as X` (a bare import is not a
    # re-export under mypy --strict), and the module __getattr__ is hidden from type checkers,
    # which would otherwise type every name, misspelt ones too, as Any.
    tree = ast.parse((REPO / "skippy_wire" / "__init__.py").read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING")
    seen = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and all(a.asname == a.name for a in node.names)
        seen["." * node.level + (node.module or "")] = tuple(a.name for a in node.names)
    assert seen == sw._PUBLIC
    assert [f.name for f in block.orelse if isinstance(f, ast.FunctionDef)] == ["__getattr__"]
    assert not [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "__getattr__"]


def test_dataclass_fields_are_spelled_in_the_class_for_type_checkers():
    # A make_dataclass base is invisible to mypy: SamplingConfig(temperature=0.7) would not check.
    from skippy_wire.wire.messages import SAMPLING_WIRE_ORDER
    from skippy_wire.wire.replies import STATS_FIELDS

    assert list(sw.SamplingConfig.__annotations__) == [name for name, _ in SAMPLING_WIRE_ORDER]
    assert list(sw.StageReplyStats.__annotations__) == ["FIELDS", *STATS_FIELDS]
    assert sw.StageReplyStats.FIELDS == STATS_FIELDS


def _stub_parameters(path, name):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    node = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name][-1]
    a = node.args
    return [x.arg for x in a.posonlyargs + a.args], [x.arg for x in a.kwonlyargs]


@pytest.mark.parametrize("module, stub", [("skippy_wire.wire._codec", "_codec.pyi"),
                                          ("skippy_wire.wire._frame", "_frame.pyi"),
                                          ("skippy_wire.wire._frame_gen", "_frame_gen.pyi")])
def test_kernel_stubs_match_the_compiled_signatures(module, stub):
    if sw.IMPLEMENTATION != "cython":
        pytest.skip("the compiled kernels are not loaded under SKIPPY_WIRE_IMPL=python")
    mod = importlib.import_module(module)
    path = REPO / "skippy_wire" / "wire" / stub
    names = [n.name for n in ast.parse(path.read_text(encoding="utf-8")).body if isinstance(n, ast.FunctionDef)]
    defined = {n for n, f in vars(mod).items() if not n.startswith("_") and getattr(f, "__module__", None) == module
               and callable(f) and not isinstance(f, type)}
    assert defined <= set(names), defined - set(names)
    for name in set(names):
        params = inspect.signature(getattr(mod, name)).parameters.values()
        runtime = ([p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)],
                   [p.name for p in params if p.kind == p.KEYWORD_ONLY])
        assert runtime == _stub_parameters(path, name), name


def test_the_codec_stub_declares_every_public_constant():
    """STATE_FLAGS_RANGE (the text of a state_flags error) was missing from _codec.pyi."""
    if sw.IMPLEMENTATION != "cython":
        pytest.skip("the compiled kernels are not loaded under SKIPPY_WIRE_IMPL=python")
    mod = importlib.import_module("skippy_wire.wire._codec")
    tree = ast.parse((REPO / "skippy_wire" / "wire" / "_codec.pyi").read_text(encoding="utf-8"))
    declared = {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign)}
    public = {n for n, v in vars(mod).items() if n.isupper() and not n.startswith("_") and isinstance(v, (int, str))}
    assert "STATE_FLAGS_RANGE" in public and public <= declared, public - declared


def test_the_backend_stub_declares_every_public_attribute_of_its_classes():
    from skippy_wire.stage import _backend

    tree = ast.parse((REPO / "skippy_wire" / "stage" / "_backend.pyi").read_text(encoding="utf-8"))
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef) and hasattr(_backend, node.name)]
    assert {c.name for c in classes} >= {"Model", "Session"}
    for node in classes:
        declared = ({n.target.id for n in node.body if isinstance(n, ast.AnnAssign)}
                    | {n.name for n in node.body if isinstance(n, ast.FunctionDef)})
        compiled = {name for name in dir(getattr(_backend, node.name)) if not name.startswith("_")}
        assert compiled <= declared | set(dir(Exception)), node.name


@pytest.mark.parametrize("compiled, twin", [
    ("skippy_wire.wire._codec", "skippy_wire.wire._reference.codec"),
    ("skippy_wire.wire._frame", "skippy_wire.wire._reference.frame"),
    ("skippy_wire.wire._frame_gen", "skippy_wire.wire._reference.frame_gen"),
])
def test_the_twins_name_their_parameters_alike(compiled, twin):
    # A caller passing a keyword to one implementation must not get a TypeError from the other.
    if sw.IMPLEMENTATION != "cython":
        pytest.skip("the compiled kernels are not loaded under SKIPPY_WIRE_IMPL=python")
    cmod, tmod = importlib.import_module(compiled), importlib.import_module(twin)
    shared = [n for n in dir(cmod) if not n.startswith("_") and callable(getattr(cmod, n))
              and not isinstance(getattr(cmod, n), type) and callable(getattr(tmod, n, None))]
    assert shared
    for name in shared:
        ours, theirs = (list(inspect.signature(getattr(m, name)).parameters) for m in (cmod, tmod))
        assert ours == theirs, name
