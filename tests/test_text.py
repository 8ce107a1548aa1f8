"""Incremental detokenisation (``TextAssembler``, behind ``run`` and the API) on the real
SmolLM2 vocabulary: the pieces add up to the whole decode, whatever the text."""

import pytest

from skippy_wire.net.text import TextAssembler
from skippy_wire.stage.models import Tokenizer, smollm2_path

TEXTS = [
    "Once upon a time, in a small village by the sea, there lived a baker.",
    "Émile a vu 3 élèves à l'école — naïve café crème, 東京 ist groß, 🙂👍🏽 done.",
    "code: def f(x):\n    return x ** 2  # ü\n\n\tend",
]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_gguf(smollm2_path())


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_add_up_to_the_whole_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    assembler = TextAssembler(tokenizer)
    pieces = [assembler.push(t) for t in ids] + [assembler.finish()]
    assert "".join(pieces) == tokenizer.decode(ids) == assembler.text
    assert all("\ufffd" not in p for p in pieces)  # split characters wait for their last byte
    # Decoding stays incremental: the buffered tail never grows with the text.
    assert len(assembler.tokens) - assembler._decoded_tokens <= 4


@pytest.mark.parametrize("text", TEXTS)
def test_stop_strings_cut_and_hold_back(tokenizer, text):
    ids = tokenizer.encode(text)
    whole = tokenizer.decode(ids)
    stop = whole[len(whole) // 2: len(whole) // 2 + 3]
    assembler = TextAssembler(tokenizer, [stop])
    shown = ""
    for t in ids:
        shown += assembler.push(t)
        assert stop not in shown and not (assembler.stopped and shown != whole[: whole.index(stop)])
        if assembler.stopped:
            break
    shown += assembler.finish()
    assert assembler.stopped and shown == whole[: whole.index(stop)] == assembler.text


def test_generated_control_tokens_show_no_text(tokenizer):
    # llama.cpp renders a generated control token as nothing (llama-server, llama-cli without
    # --special): a model that emits <|im_start|> mid-answer must not print the marker.
    start = tokenizer.encode("<|im_start|>")
    assert len(start) == 1
    ids = tokenizer.encode("Paris") + start + tokenizer.encode("assistant\nLyon")
    assembler = TextAssembler(tokenizer)
    shown = "".join(assembler.push(t) for t in ids) + assembler.finish()
    assert shown == assembler.text == "Parisassistant\nLyon"
    assert tokenizer.decode(ids, special=False) == shown
    assert tokenizer.decode(ids) == "Paris<|im_start|>assistant\nLyon"  # the default keeps them


def test_a_character_cut_short_at_the_end_is_no_stop_string(tokenizer):
    """A generation cut by max_tokens in the middle of a character ends in U+FFFD, which a
    stop string of "\ufffd" matched: finish_reason "stop" for text the model never wrote."""
    ids = tokenizer.encode("東京は")
    cut = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    assembler = TextAssembler(tokenizer, ["\ufffd"])
    shown = "".join(assembler.push(t) for t in ids[:cut]) + assembler.finish()
    assert not assembler.stopped
    assert shown == assembler.text == tokenizer.decode(ids[:cut])  # shown as the decode shows it
