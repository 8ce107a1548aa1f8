"""Stop strings in ``TextAssembler``: the incremental (KMP) matcher behaves exactly as the
straightforward one it replaced (search the whole text, hold back every prefix), on random
tokens that split characters across tokens, and stays linear for long stop strings."""

import random

import pytest

from skippy_wire.net.service import TextAssembler


class FakeTokenizer:
    """Token id -> bytes, decoded as a byte-level vocabulary decodes: concatenated, with an
    incomplete UTF-8 sequence read as U+FFFD; ids in ``control`` render as nothing."""

    def __init__(self, pieces: list[bytes], control=()) -> None:
        self.pieces, self.control = pieces, set(control)

    def decode(self, ids, special: bool = True) -> str:
        data = b"".join(self.pieces[t] for t in ids if special or t not in self.control)
        return data.decode("utf-8", errors="replace")


class ReferenceAssembler:
    """The quadratic original: find every stop string in the whole text per push, and hold
    back the longest suffix that is a proper prefix of a stop string by testing each one."""

    def __init__(self, tokenizer, stop=()) -> None:
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.tokens, self.text, self.shown, self.stopped = [], "", 0, False
        self._decoded, self._decoded_tokens = "", 0

    def _decode(self):
        return self._decoded + self.tokenizer.decode(self.tokens[self._decoded_tokens:], special=False)

    def push(self, token):
        self.tokens.append(token)
        text = self._decode()
        if text.endswith("\ufffd"):
            return ""
        self._decoded, self._decoded_tokens = text, len(self.tokens)
        return self._advance(text, final=False)

    def finish(self):
        return "" if self.stopped else self._advance(self._decode(), final=True)

    def _advance(self, text, *, final):
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            text = text[:cut]
            safe = len(text)
        elif final:
            safe = len(text)
        else:
            hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            safe = len(text) - hold
        self.text = text
        delta = text[self.shown:safe] if safe > self.shown else ""
        self.shown = max(self.shown, safe)
        return delta


ALPHABET = "aab\né🙂"  # 'a' twice: repeats make stop strings overlap themselves and the text


def _case(rng: random.Random):
    text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 40)))
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
            stops.append("".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 6))))
    return FakeTokenizer(vocab, control), ids, stops


@pytest.mark.parametrize("seed", range(20))
def test_matches_the_reference_on_random_tokens_and_stops(seed):
    rng = random.Random(seed)
    for _ in range(150):
        tokenizer, ids, stops = _case(rng)
        ours, ref = TextAssembler(tokenizer, stops), ReferenceAssembler(tokenizer, stops)
        for t in ids:
            assert ours.push(t) == ref.push(t), (ids, stops)
            assert (ours.stopped, ours.text, ours.shown) == (ref.stopped, ref.text, ref.shown), (ids, stops)
            if ours.stopped:  # as the engine does: generation ends at a stop string
                break
        assert ours.finish() == ref.finish(), (ids, stops)
        assert (ours.stopped, ours.text) == (ref.stopped, ref.text), (ids, stops)


def test_the_earliest_stop_string_wins_whichever_completes_first():
    # "bc" completes first (at the 3rd token) but "abcd" would begin earlier: the earliest
    # occurrence present when a push is judged wins, as a search of the whole text finds.
    tokenizer = FakeTokenizer([b"x", b"ab", b"c", b"d"])
    assembler = TextAssembler(tokenizer, ["abcd", "bc"])
    assert [assembler.push(t) for t in (0, 1, 2)] == ["x", "", "a"]
    assert assembler.stopped and assembler.text == "xa"
    assert assembler.push(3) == "" and assembler.text == "xa"  # after a stop, pushes change nothing
    together = TextAssembler(FakeTokenizer([b"x", b"abcd"]), ["bc", "abcd"])
    assert together.push(0) + together.push(1) == "x" and together.text == "x"


def test_a_60000_character_stop_string_over_thousands_of_tokens():
    # The reference would slice ~60,000 prefixes of up to 60,000 characters per token
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
