"""Setup bodies are read as upstream's serde_json reads them (wire-v16-v17.md B.2-B.3), and the
listener's input compatibility picks parts as upstream does (B.4.3).

* ``-0`` is a float to serde_json: no integer field accepts it ("decode stage setup").
* A unit variant may also be written ``{"Activation": null}``.
* A repeated key is refused only where a struct reads that field (or it tags an enum);
  fields a profile or part ignores, and anything inside them, are skipped unseen.
* An offer repeating a part identity is matched on its first part of that identity, so the
  agreement's own validation reports it ("invalid activation part profile").
"""

from __future__ import annotations

import io
import json
import struct

import pytest

from conftest import IMPLS
from skippy_wire.wire.agreement import (TOKENS, ActivationPartProfile, ActivationProfile, Fixed, JsonShapeError,
                                        dimension_from_json, parse_json)
from skippy_wire.wire.setup import (Hello, Offer, SetupError, SetupRole, StageSetupConfig, check_input_compatibility,
                                    server_setup)

IDENTITY = b"\x01" * 32
OTHER = b"\x02" * 32
FRONTIER = b"\x03" * 32


def _part(identity=IDENTITY, ggml_type=0) -> ActivationPartProfile:
    return ActivationPartProfile(identity, ggml_type, 2, 1, False, (Fixed(4), TOKENS, Fixed(1), Fixed(1)))


def _profile(parts) -> ActivationProfile:
    return ActivationProfile(1, 0, 0, 4, FRONTIER, 32, 8, list(parts))


def _hello(**output_fields) -> str:
    output = _profile([_part()]).to_json()
    output.update(output_fields)
    return json.dumps({"role": "Activation", "sender": {"run": "r", "topology": "p", "model": "m", "stage": "s0",
                                                        "index": 0, "layer_start": 0, "layer_end": 4},
                       "target": ["s1", 1], "output": output}, separators=(",", ":"))


def _parse_hello(text: str) -> Hello:
    return Hello.from_json(parse_json(text.encode()))


def _packet(text: str) -> bytes:
    body = text.encode()
    return struct.pack("<III", 0x53545053, 12, len(body)) + body


class _Stream(io.RawIOBase):
    """The listener's side of a scripted peer: reads ``incoming``, collects what is written."""

    def __init__(self, incoming: bytes) -> None:
        self.incoming, self.sent = io.BytesIO(incoming), bytearray()

    def read(self, n: int = -1) -> bytes:
        data = self.incoming.read(n)
        if not data and self.sent:  # echo the offered generation as the accept
            offer = json.loads(self.sent[12:].decode())
            self.incoming, self.sent = io.BytesIO(_packet(json.dumps(offer["agreement"]["generation"]))), bytearray()
            data = self.incoming.read(n)
        return data

    def write(self, b) -> int:
        self.sent += bytes(b)
        return len(b)


def _serve(hello: str, impl: str, **kw):
    config = StageSetupConfig("r", "p", "m", "s1", 1, 4, 8)
    stream = _Stream(_packet(hello))
    return server_setup(stream, config, _profile([_part()]), timeout=5, impl=impl, **kw)


def test_baseline_hello_parses():
    hello = _parse_hello(_hello())
    assert hello.role is SetupRole.ACTIVATION and hello.output == _profile([_part()])


@pytest.mark.parametrize("field", ['"index":0', '"layer_start":0', '"producer_stage_index":0', '"ggml_type":0'])
def test_negative_zero_is_not_an_integer(field):
    text = _hello()
    assert field in text
    with pytest.raises(JsonShapeError):
        _parse_hello(text.replace(field, field[:-1] + "-0"))


def test_negative_zero_in_generation_is_refused():
    with pytest.raises(JsonShapeError):
        Offer.from_json(parse_json(b'{"role":"Activation","receiver":null,"agreement":{"generation":'
                                   b'[-0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15],"profiles":[]}}'))


@pytest.mark.parametrize("impl", IMPLS)
def test_negative_zero_fails_the_handshake(impl):
    with pytest.raises(SetupError) as err:
        _serve(_hello().replace('"index":0', '"index":-0'), impl)
    assert str(err.value) == "decode stage setup"


def test_negative_zero_inside_an_ignored_field_is_skipped():
    assert _parse_hello(_hello(extra=[-0, {"a": -0}])).output == _profile([_part()])


def test_an_integer_past_u64_is_skipped_where_ignored_and_refused_where_read():
    # 5000 digits: Python's int() refuses it outright ("Exceeds the limit (4300 digits)"),
    # which the log then quoted; serde_json scans an ignored number and reads a huge one as an f64
    for digits in ("1" * 30, "9" * 5000, "-" + "9" * 5000):
        assert _parse_hello(_hello(extra=[int(digits[:4]), {"a": 0}]).replace(digits[:4], digits, 1)).output \
            == _profile([_part()])
        with pytest.raises(JsonShapeError) as err:
            _parse_hello(_hello().replace('"index":0', f'"index":{digits}'))
        assert str(err.value).endswith(", expected an integer in 0..=4294967295"), err.value


def test_unit_variant_as_a_map():
    hello = _parse_hello(_hello().replace('"role":"Activation"', '"role":{"Activation":null}'))
    assert hello.role is SetupRole.ACTIVATION
    for bad in ('{"Activation":{}}', '{"Activation":0}', '{"Nope":null}', '{"Activation":null,"Activation":null}'):
        with pytest.raises(JsonShapeError):
            _parse_hello(_hello().replace('"role":"Activation"', f'"role":{bad}'))


def test_repeated_ignored_fields_are_accepted():
    text = _hello().replace('"max_tokens"', '"zz":1,"zz":{"a":1,"a":2},"max_tokens"')
    assert _parse_hello(text).output == _profile([_part()])


@pytest.mark.parametrize("impl", IMPLS)
def test_repeated_ignored_fields_pass_the_handshake(impl):
    role, agreement = _serve(_hello().replace('"max_tokens"', '"zz":1,"zz":2,"max_tokens"'), impl)
    assert role is SetupRole.ACTIVATION and len(agreement.profiles) == 1


@pytest.mark.parametrize("text", [
    '{"role":"Activation","role":"Activation","sender":null,"target":null,"output":null}',
    _hello().replace('"max_tokens":32', '"max_tokens":32,"max_tokens":32'),
    _hello().replace('"rank":2', '"rank":2,"rank":2'),
    _hello().replace('"run":"r"', '"run":"r","run":"r"'),
])
def test_repeated_read_fields_are_refused(text):
    with pytest.raises(JsonShapeError):
        _parse_hello(text)


def test_repeated_enum_tag_is_refused():
    assert dimension_from_json(parse_json(b'{"Fixed":4}')) == Fixed(4)
    for body in (b'{"Fixed":4,"Fixed":4}', b'{"Dynamic":{"min":1,"min":1,"max":2}}'):
        with pytest.raises(JsonShapeError):
            dimension_from_json(parse_json(body))


def test_compatibility_takes_the_first_part_of_an_identity():
    offered = _profile([_part(), _part(ggml_type=1)])
    check_input_compatibility(offered, _profile([_part()]))  # the repeat is validation's to report
    with pytest.raises(SetupError) as err:
        check_input_compatibility(_profile([_part(ggml_type=1), _part()]), _profile([_part()]))
    assert str(err.value) == "input binding type, rank, token axis or presence mismatch"


@pytest.mark.parametrize("impl", IMPLS)
def test_repeated_offered_identity_is_an_invalid_profile(impl):
    parts = [_part().to_json(), _part(ggml_type=1).to_json()]
    with pytest.raises(SetupError) as err:
        _serve(_hello(parts=parts), impl)
    assert str(err.value) == "invalid activation part profile"


def test_other_part_identities_still_match_by_identity():
    offered = _profile([_part(OTHER), _part()])
    required = _profile([_part(), ActivationPartProfile(OTHER, 0, 2, 1, True, (Fixed(4), TOKENS, Fixed(1), Fixed(1)))])
    check_input_compatibility(offered, required)  # admitted: each required part found by its identity
    with pytest.raises(SetupError, match="^input binding type, rank, token axis or presence mismatch$"):
        check_input_compatibility(_profile([_part(OTHER, ggml_type=1), _part()]), required)  # it is OTHER's read


def test_an_ignored_value_may_nest_deeper_than_pythons_parser_recurses():
    # serde_json skips an ignored value however deep it nests; the body's 64 KiB bound them
    deep = "[" * 5000 + '{"a":[1,2.5e3,"x\\u00e9",true,null,{}]}' + "]" * 5000
    text = _hello().replace('"max_tokens"', f'"zz":{deep},"max_tokens"')
    assert _parse_hello(text).output == _profile([_part()])
    # skipped, but still JSON: every fault inside it is refused
    for fault in ("[1,]", "[1 2]", '{"a" 1}', "{1:2}", "[01]", "[tru]", '["\x01"]', "[1}", "{,}", "[\"a\\x\"]"):
        with pytest.raises(JsonShapeError):
            _parse_hello(text.replace('{"a":[1,2.5e3,"x\\u00e9",true,null,{}]}', fault))
    with pytest.raises(JsonShapeError):  # unbalanced
        _parse_hello(_hello().replace('"max_tokens"', f'"zz":{deep[:-1]},"max_tokens"'))
    with pytest.raises(JsonShapeError):  # as deep where a field is read
        _parse_hello(_hello().replace('"target":["s1",1]', f'"target":{deep}'))


@pytest.mark.parametrize("impl", IMPLS)
def test_a_deep_ignored_value_passes_the_handshake(impl):
    deep = "[" * 3000 + "]" * 3000
    role, agreement = _serve(_hello().replace('"max_tokens"', f'"zz":{deep},"max_tokens"'), impl)
    assert role is SetupRole.ACTIVATION and len(agreement.profiles) == 1


def test_a_lone_surrogate_fails_only_where_a_struct_reads_it():
    # serde_json skips an ignored value's escapes unchecked, and refuses a lone surrogate in
    # a string it reads: a field's value or a key of a struct's object
    ignored = '"zz":["\\ud800",{"\\udc00":"x"}],"max_tokens"'
    assert _parse_hello(_hello().replace('"max_tokens"', ignored)).output == _profile([_part()])
    for read in (_hello().replace('"run":"r"', '"run":"r\\ud800"'),  # a field's value
                 _hello().replace('"max_tokens"', '"\\ud800":1,"max_tokens"'),  # an unknown key of a profile
                 _hello().replace('"target":["s1",1]', '"target":["\\udfff",1]')):
        with pytest.raises(JsonShapeError, match="lone surrogate"):
            _parse_hello(read)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_lone_surrogate_in_an_ignored_value_passes_the_handshake(impl):
    role, agreement = _serve(_hello().replace('"max_tokens"', '"zz":"\\ud800","max_tokens"'), impl)
    assert role is SetupRole.ACTIVATION and len(agreement.profiles) == 1
