"""Stop strings in ``TextAssembler``: the incremental (KMP) matcher gives what the rules
stated over the whole text give (search it all, hold back every prefix), on random tokens
that split characters across tokens, and stays linear for long stop strings; the engine's
finish_reason for a text cut at a stop string."""

import random
import threading

import pytest
from test_http_front import FakeTokenizer as ApiTokenizer
from test_server import Chain, fake_reference

from skippy_wire.net.service import GenerationEngine, SamplingParams
from skippy_wire.net.text import TextAssembler


class FakeTokenizer:
    """Token id -> bytes, decoded as a byte-level vocabulary decodes: concatenated, with an
    incomplete UTF-8 sequence read as U+FFFD; ids in ``control`` render as nothing."""

    def __init__(self, pieces: list[bytes], control=()) -> None:
        self.pieces, self.control = pieces, set(control)

    def decode(self, ids, special: bool = True) -> str:
        data = b"".join(self.pieces[t] for t in ids if special or t not in self.control)
        return data.decode("utf-8", errors="replace")


def _under_indented(text: str, min_indent: int) -> list[int]:
    """Where a line after the first shows an indentation (spaces and tabs) under ``min_indent``:
    at the first character that is neither (a new line too), if the text has it yet."""
    found, start = [], text.find("\n") + 1
    while min_indent > 0 and start:
        end = start + len(text[start:]) - len(text[start:].lstrip(" \t"))
        if end < len(text) and end - start < min_indent:
            found.append(end)
        start = text.find("\n", start) + 1
    return found


def _judged(text: str, stops: list[str], final: bool, min_indent: int = 0) -> tuple[str, int, bool]:
    """The rules stated directly over a whole text: (the text kept, how much of it may be
    shown, whether it stopped).  The earliest stop string, or line indented under
    ``min_indent``, cuts; otherwise the longest end that begins a stop string is held back
    until the generation ends."""
    found = [text.index(stop) for stop in stops if stop in text] + _under_indented(text, min_indent)
    if found:
        return text[:min(found)], min(found), True
    held = 0 if final else max((k for stop in stops for k in range(1, len(stop))
                                if text[len(text) - k:] == stop[:k]), default=0)
    return text, len(text) - held, False


ALPHABET = "aab\né🙂"  # 'a' twice: repeats make stop strings overlap themselves and the text
INDENTED = "a \t\n é"  # lines indented by spaces and tabs, blank ones too


def _case(rng: random.Random, alphabet: str = ALPHABET):
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    data = text.encode()
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(0, len(data))))) if data else []
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])] if data else []
    ids, vocab = [], []
    for piece in pieces:  # split anywhere, multi-byte characters included
        if rng.random() < 0.1:
            ids.append(len(vocab))
            vocab.append(b"<ctl>")  # a control token: no text
        ids.append(len(vocab))
        vocab.append(piece)
    control = {i for i, p in enumerate(vocab) if p == b"<ctl>"}
    if rng.random() < 0.1:  # generation ends inside a character
        ids.append(len(vocab))
        vocab.append("é".encode()[:1])
    stops = []
    for _ in range(rng.randint(0, 4)):
        if text and rng.random() < 0.5:  # a piece of the text: it will be found
            a = rng.randrange(len(text))
            stops.append(text[a:a + rng.randint(1, 6)])
        else:
            stops.append("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6))))
    return FakeTokenizer(vocab, control), ids, stops


@pytest.mark.parametrize("alphabet", [ALPHABET, INDENTED])
@pytest.mark.parametrize("seed", range(20))
def test_matches_the_rules_over_the_whole_text_on_random_tokens_and_stops(seed, alphabet):
    rng = random.Random(seed)
    for _ in range(150):
        tokenizer, ids, stops = _case(rng, alphabet)
        min_indent = rng.randint(0, 3) if alphabet == INDENTED else 0
        rules = ([s for s in stops if s], min_indent)
        ours, shown, stopped = TextAssembler(tokenizer, stops, min_indent), "", False
        for n in range(1, len(ids) + 1):
            delta = ours.push(ids[n - 1])
            # an incomplete character at the end is decided later, the whole ones before it now
            text = tokenizer.decode(ids[:n], special=False).rstrip("\ufffd")
            kept, safe, stopped = _judged(text, rules[0], False, rules[1])
            assert shown + delta == kept[:max(safe, len(shown))], (ids, stops, min_indent)
            assert (ours.stopped, ours.text) == (stopped, kept), (ids, stops, min_indent)
            shown += delta
            if stopped:  # as the engine does: generation ends at a stop string
                break
        shown += ours.finish()
        if not stopped:  # the end decides what was held back
            kept, _, stopped = _judged(tokenizer.decode(ids, special=False), rules[0], True, rules[1])
        assert (shown, ours.stopped, ours.text) == (kept, stopped, kept), (ids, stops, min_indent)
        # a stop string is named where one cut the text, else the indentation did
        assert ours.under_indented == (stopped and not ours.stopping_word), (ids, stops, min_indent)
        if ours.stopping_word:
            assert ours.stopping_word in stops, (ids, stops)
            assert tokenizer.decode(ids, special=False).startswith(ours.stopping_word, len(kept)), (ids, stops)


def test_a_line_indented_less_than_min_indent_ends_the_text_before_its_first_character():
    # llama-server's n_indent: the first line is free; a later line that shows fewer spaces and
    # tabs ends the text, its indentation kept, and nothing of it is shown
    pieces = [b"def f():", b"\n    ", b"return 1", b"\n", b"\t\tx = 2", b"\n  y"]
    tokenizer = FakeTokenizer(pieces)
    enough = TextAssembler(tokenizer, min_indent=2)  # a tab counts as a space does
    shown = "".join(enough.push(t) for t in range(len(pieces))) + enough.finish()
    assert shown == enough.text == "def f():\n    return 1\n\t\tx = 2\n  y" and not enough.stopped
    code = TextAssembler(tokenizer, min_indent=4)
    shown = "".join(code.push(t) for t in range(5))
    assert code.stopped and code.under_indented and code.stopping_word == ""
    assert shown == code.text == "def f():\n    return 1\n\t\t"
    # a blank line is a line indented by nothing
    blank = TextAssembler(FakeTokenizer([b"x", b"\n    a\n", b"\n    b"]), min_indent=4)
    assert "".join(blank.push(t) for t in range(3)) == blank.text == "x\n    a\n" and blank.under_indented
    # a stop string before the line cuts first, and is named
    word = TextAssembler(tokenizer, stop="1\n", min_indent=4)
    assert "".join(word.push(t) for t in range(5)) == word.text == "def f():\n    return "
    assert word.stopping_word == "1\n" and not word.under_indented


def test_the_earliest_stop_string_wins_whichever_completes_first():
    # "bc" completes first (at the 3rd token) but "abcd" would begin earlier: the earliest
    # occurrence present when a push is judged wins, as a search of the whole text finds.
    tokenizer = FakeTokenizer([b"x", b"ab", b"c", b"d"])
    assembler = TextAssembler(tokenizer, ["abcd", "bc"])
    assert [assembler.push(t) for t in (0, 1, 2)] == ["x", "", "a"]
    assert assembler.stopped and assembler.text == "xa" and assembler.stopping_word == "bc"
    assert assembler.push(3) == "" and assembler.text == "xa"  # after a stop, pushes change nothing
    assert assembler.stopping_word == "bc"
    # both in one push: the one that begins first is the stopping word, whatever the order
    together = TextAssembler(FakeTokenizer([b"x", b"abcd"]), ["bc", "abcd"])
    assert together.push(0) + together.push(1) == "x" and together.text == "x"
    assert together.stopping_word == "abcd"


def test_a_60000_character_stop_string_over_thousands_of_tokens():
    # Testing every prefix would slice ~60,000 prefixes of up to 60,000 characters per token
    # (minutes over these pushes); the automaton advances over each new character once.
    tokenizer = FakeTokenizer([b"a", b"b", b"ab", b"c"])
    stop = "ab" * 30_000
    assembler = TextAssembler(tokenizer, [stop])
    shown = "".join(assembler.push(2) for _ in range(29_999)) + assembler.push(0)
    assert shown == "" and not assembler.stopped  # all of it could still become the stop string
    assert assembler.push(1) == "" and assembler.stopped and assembler.text == ""

    missed = TextAssembler(tokenizer, [stop, "c" * 60_000])
    shown = "".join(missed.push(2) for _ in range(29_999)) + missed.push(0)
    shown += missed.push(0)  # "aa" cannot continue "abab...": all but the last "a" is safe
    assert shown == "ab" * 29_999 + "a" and not missed.stopped
    shown += "".join(missed.push(3) for _ in range(5000)) + missed.finish()
    assert shown == missed.text == "ab" * 29_999 + "aa" + "c" * 5000 and not missed.stopped

    late = TextAssembler(tokenizer, ["a" * 59_999 + "b"])
    shown = "".join(late.push(0) for _ in range(70_000))
    assert shown == "a" * (70_000 - 59_999)
    assert late.push(1) == "" and late.stopped and late.text == "a" * (70_001 - 60_000)


def test_a_stop_string_before_an_incomplete_character_stops_at_once():
    # " " then the first byte of "€" in one token: the stop string was not looked for until a
    # later token completed the character (generation ran on, to max_tokens)
    tokenizer = FakeTokenizer([b"x", b" \xe2", b"\x82\xac"])
    assembler = TextAssembler(tokenizer, [" "])
    assert assembler.push(0) == "x"
    assert assembler.push(1) == "" and assembler.stopped and assembler.text == "x"
    shows = TextAssembler(tokenizer)  # and with no stop string, the whole characters show at once
    assert [shows.push(t) for t in (0, 1, 2)] + [shows.finish()] == ["x", " ", "\u20ac", ""]


class EndsInALeadByte(ApiTokenizer):
    """The fake pipeline's last token decodes as the first byte of a 3-byte character."""

    def __init__(self, last: int) -> None:
        super().__init__()
        self.last = last

    def decode(self, ids, special: bool = True) -> str:
        return b"".join(b"\xe2" if t == self.last else b"a" for t in ids).decode("utf-8", errors="replace")


def test_a_character_left_incomplete_as_generation_ends_is_no_stop_string():
    # "\ufffd" is decided only when the held-back rest is flushed.  The text was once cut
    # there with finish_reason "length"; then cut there with "stop", for a character the
    # model never wrote.  As llama-server (which looks for stop strings in whole characters
    # only): the text keeps its replacement character, and the limit ended it.
    prompt = [1, 2, 3]
    tokens = fake_reference(prompt, 3)
    chain = Chain([(0, 3), (3, 6)])
    engine = GenerationEngine(chain.entry, EndsInALeadByte(tokens[-1]), ctx_size=64, timeout=10, chunk_size=4)
    try:
        out = engine.generate(prompt, max_tokens=3, sampling=SamplingParams(temperature=0.0), stop=["\ufffd"],
                              on_text=lambda text, ids: None, cancelled=threading.Event())
    finally:
        engine.close()
        chain.close()
    assert (out.text, out.finish_reason, out.stop_type, out.stopping_word) == ("aa\ufffd", "length", "limit", "")


def test_one_stop_string_given_as_a_str_is_one_stop_string():
    """A str was read as its characters, each a stop string: "xyz" cut the text at its first x, y or z."""
    assembler = TextAssembler(FakeTokenizer([b"a y b ", b"xyz", b" c"]), stop="xyz")
    shown = "".join(assembler.push(t) for t in (0, 1, 2)) + assembler.finish()
    assert assembler.stopped and assembler.stopping_word == "xyz" and shown == assembler.text == "a y b "


class Pieces(ApiTokenizer):
    """The fake pipeline's tokens (``tokens``, in order) decode as ``pieces``, others as "a"."""

    def __init__(self, tokens: list[int], pieces: list[str]) -> None:
        super().__init__()
        self.text = dict(zip(tokens, pieces))

    def decode(self, ids, special: bool = True) -> str:
        return "".join(self.text.get(t, "a") for t in ids)


def _generated(pieces: list[str], **ends):
    prompt = [1, 2, 3]
    tokens = fake_reference(prompt, len(pieces))
    assert len(set(tokens)) == len(tokens)  # each token its own piece
    chain = Chain([(0, 3), (3, 6)])
    engine = GenerationEngine(chain.entry, Pieces(tokens, pieces), ctx_size=64, timeout=10, chunk_size=4)
    shown = []
    try:
        out = engine.generate(prompt, max_tokens=len(pieces), sampling=SamplingParams(temperature=0.0), stop=[],
                              on_text=lambda text, ids: shown.append(text), cancelled=threading.Event(), **ends)
    finally:
        engine.close()
        chain.close()
    return out, "".join(shown)


def test_a_line_indented_less_ends_a_generation_as_llama_servers_limit():
    pieces = ["if x:", "\n", "    y", "\n", "z", "\n", "w"]
    out, shown = _generated(pieces, min_indent=4)
    assert (out.text, shown, out.finish_reason, out.stop_type, out.stopping_word) == \
        ("if x:\n    y\n", "if x:\n    y\n", "length", "limit", "")
    assert out.completion_tokens == 5  # the step that showed "z" was the last
    whole, _ = _generated(pieces, min_indent=1)  # "z" is indented by 0: 1 stops it too
    assert whole.text == "if x:\n    y\n" and whole.completion_tokens == 5
    free, _ = _generated(pieces)
    assert (free.text, free.finish_reason, free.completion_tokens) == ("".join(pieces), "length", len(pieces))


def test_a_new_line_past_the_time_limit_ends_a_generation():
    # llama-server's t_max_predict_ms: the first new line once the limit has passed since the first token
    pieces = ["a", "b", "\n", "c", "\n", "d"]
    out, shown = _generated(pieces, line_time_limit_s=1e-9)
    assert (out.text, shown, out.finish_reason, out.stop_type, out.completion_tokens) == \
        ("ab\n", "ab\n", "length", "limit", 3)
    within, _ = _generated(pieces, line_time_limit_s=3600.0)
    assert within.text == "".join(pieces) and within.completion_tokens == len(pieces)
