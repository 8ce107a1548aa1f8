"""Broken or hostile model files: one clear refusal when the model is read (never a crash
at the first token, an abort, gigabytes of memory, or a traceback), from the backend and
from the metadata readers the commands use before it."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from backend_helpers import N_EMBD, N_VOCAB, rewritten_gguf, tiny_path  # noqa: F401  (fixture)

from skippy_wire.errors import StageRuntimeError, Status
from skippy_wire.stage import _backend as B
from skippy_wire.stage import models
from skippy_wire.tools import cli

V = gguf.GGUFValueType
EPS = "llama.attention.layer_norm_rms_epsilon"


@pytest.mark.parametrize("change, status, text", [
    # weights ggml-cpu has no product for: the first token crashed (I32) or aborted (F64)
    ({"tensors": {"blk.0.attn_q.weight": np.zeros((N_EMBD, N_EMBD), np.int32)}}, Status.UNSUPPORTED,
     "tensor blk.0.attn_q.weight is of type i32, which the CPU backend cannot multiply"),
    ({"tensors": {"token_embd.weight": np.zeros((N_VOCAB, N_EMBD), np.float64)}}, Status.UNSUPPORTED,
     "tensor token_embd.weight is of type f64, which the CPU backend cannot multiply"),
    # rms_norm aborts on an epsilon that is not a finite number >= 0
    ({"kv": {EPS: (float("nan"), V.FLOAT32)}}, Status.MODEL_ERROR, f"invalid {EPS} nan"),
    ({"kv": {EPS: (-1.0, V.FLOAT32)}}, Status.MODEL_ERROR, f"invalid {EPS} -1"),
    # 2^30 layers: gigabytes of per-layer bookkeeping, then std::bad_alloc aborted the process
    ({"kv": {"llama.block_count": (1 << 30, V.UINT32)}}, Status.MODEL_ERROR,
     "llama.block_count 1073741824: the file holds 39 tensors, fewer than its layers need"),
    # a vocabulary shorter than the embedding: token ids the tokenizer cannot decode
    ({"kv": {"tokenizer.ggml.tokens": ([f"t{i}" for i in range(10)], V.ARRAY)}}, Status.MODEL_ERROR,
     f"the vocabulary lists 10 tokens, token_embd.weight has {N_VOCAB} rows"),
])
def test_a_broken_model_is_refused_when_it_is_opened(tiny_path, tmp_path, change, status, text):
    path = rewritten_gguf(tiny_path, tmp_path / "broken.gguf", **change)
    with pytest.raises(StageRuntimeError) as error:
        B.Model(path, n_threads=1)
    assert error.value.status == status and text in error.value.message


@pytest.mark.parametrize("kv, text", [
    ({"tokenizer.ggml.token_type": ([1] * 10, V.ARRAY)}, "tokenizer.ggml.token_type has 10 entries for 256 tokens"),
    ({"tokenizer.ggml.model": ("bert", V.STRING)}, "tokenizer model 'bert' is not supported"),
    ({"tokenizer.ggml.bos_token_id": ("one", V.STRING)}, "invalid GGUF metadata tokenizer.ggml.bos_token_id = one"),
    ({"tokenizer.ggml.model": ("gpt2", V.STRING), "tokenizer.ggml.merges": (["ab"], V.ARRAY)},
     "a tokenizer.ggml.merges entry is not two pieces separated by a space"),
])
def test_tokenizer_metadata_a_model_cannot_use_is_a_value_error(tiny_path, tmp_path, kv, text):
    # (were NotImplementedError, TypeError or an IndexError at the first decoded token: tracebacks)
    path = rewritten_gguf(tiny_path, tmp_path / "tokenizer.gguf", kv=kv)
    with pytest.raises(ValueError, match=text):
        models.Tokenizer.from_gguf(path)


@pytest.mark.parametrize("value, vtype", [([4, 4], V.ARRAY), (1 << 31, V.UINT64), ("4", V.STRING)])
def test_a_block_count_that_is_no_count_is_a_value_error(tiny_path, tmp_path, value, vtype):
    path = rewritten_gguf(tiny_path, tmp_path / "shape.gguf", kv={"llama.block_count": (value, vtype)})
    with pytest.raises(ValueError, match=r"invalid GGUF metadata llama\.block_count = "):
        models.model_shape(path)


def test_the_command_line_says_so_in_one_line(tiny_path, tmp_path, capsys):
    path = rewritten_gguf(tiny_path, tmp_path / "bert.gguf", kv={"tokenizer.ggml.model": ("bert", V.STRING)})
    assert cli.main(["run", "-m", path, "-n", "1", "--stages", "1", "Hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("skippy-wire: error: ") and "tokenizer model 'bert' is not supported" in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_a_chat_template_that_does_not_compile_is_named_not_taken_for_none(tiny_path, tmp_path, capsys):
    path = rewritten_gguf(tiny_path, tmp_path / "template.gguf",
                          kv={"tokenizer.chat_template": ("{% for %}", V.STRING)})
    assert cli.main(["run", "-m", path, "-n", "1", "--stages", "1", "Hi"]) == 0
    err = capsys.readouterr().err
    assert "the chat template does not compile: " in err and ": the prompt goes as is" in err
    assert "has no chat template" not in err


@pytest.mark.parametrize("damage, reason", [
    (lambda data: data[:2], "failed to read magic"),
    (lambda data: b"GGUG" + data[4:], "invalid magic characters: 'GGUG', expected 'GGUF'"),
    (lambda data: data[:4] + (9).to_bytes(4, "little") + data[8:], "only supports up to version 3"),
])
def test_a_file_ggml_cannot_read_says_why(tiny_path, tmp_path, damage, reason):
    path = tmp_path / "damaged.gguf"
    path.write_bytes(damage(Path(tiny_path).read_bytes()))
    with pytest.raises(StageRuntimeError) as error:
        B.Model(str(path), n_threads=1)
    assert error.value.status == Status.MODEL_ERROR
    assert f"'{path}' is not a readable GGUF file: " in error.value.message and reason in error.value.message


def test_a_system_prompt_with_a_template_that_does_not_compile_names_the_failure(tiny_path, tmp_path, capsys):
    path = rewritten_gguf(tiny_path, tmp_path / "template.gguf",
                          kv={"tokenizer.chat_template": ("{% for %}", V.STRING)})
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", "-m", path, "-n", "1", "--stages", "1", "-sys", "Be brief.", "Hi"])
    assert exit_.value.code == 2
    assert "error: -sys/--system-prompt: the chat template does not compile: " in \
        capsys.readouterr().err
