"""Generated text as a client sees it: tokens detokenised incrementally, and where the text
stops (a stop string, or llama-server's ``n_indent``: a line indented less)."""

from __future__ import annotations

from typing import Sequence

#: The characters that indent a line, as llama-server counts a line's indentation.
INDENT_CHARS = " \t"


class TextAssembler:
    """Detokenise incrementally and apply stop strings.

    ``push(token)`` returns the text that is safe to show now: text that could still turn
    into a stop string, or an incomplete UTF-8 sequence, is held back until it is decided.
    ``stopped`` turns True when a stop string appeared, or a line indented less than
    ``min_indent``; ``text`` is everything before it (cut at the earliest of them).  Control
    tokens add no text, as llama.cpp renders generated text.

    Each push decodes only the tokens since the last complete character (byte-level
    vocabularies decode by concatenation), so a token costs the same at any length.  Stop
    strings are matched the same way: each has a Knuth-Morris-Pratt automaton whose state,
    the longest suffix of the text so far that begins the stop string, is advanced over the
    new characters only.  That state is both the match (when it covers the whole stop
    string) and the length to hold back, so a token costs its own characters (amortised),
    not the text's length or the stop strings' squared.
    """

    def __init__(self, tokenizer, stop: str | Sequence[str] = (), min_indent: int = 0) -> None:
        self.tokenizer = tokenizer
        #: llama-server's ``n_indent``: a line after the first that is indented by fewer spaces
        #: and tabs ends the text before its first other character (a blank line's new line).
        self.min_indent = min_indent
        self.under_indented = False  # the text ended at such a line
        self._open_line = -1  # where the line whose indentation is not yet known begins (-1: none)
        self.stop = [s for s in ([stop] if isinstance(stop, str) else stop) if s]  # one string: one stop string
        self.tokens: list[int] = []
        self.text = ""
        self.shown = 0
        self.stopped = False
        self.stopping_word = ""  # the stop string that stopped the text
        self._decoded = ""  # the text of tokens[:self._decoded_tokens], ending on a whole character
        self._decoded_tokens = 0
        self._fail = [self._failure(s) for s in self.stop]
        # Each stop string's automaton state over self._decoded[:self._fed]: the length of
        # the longest suffix of that text which is a (proper) prefix of the stop string.
        self._matched = [0] * len(self.stop)
        self._fed = 0

    @staticmethod
    def _failure(s: str) -> memoryview:
        """KMP's failure function: ``fail[i]`` is the length of the longest proper prefix of
        ``s[:i + 1]`` that is also its suffix (unsigned 32-bit cells, 4 bytes a character)."""
        fail = memoryview(bytearray(4 * len(s))).cast("I")
        k = 0
        for i in range(1, len(s)):
            c = s[i]
            while k and s[k] != c:
                k = fail[k - 1]
            if s[k] == c:
                k += 1
            fail[i] = k
        return fail

    def _decode(self) -> str:
        return self._decoded + self.tokenizer.decode(self.tokens[self._decoded_tokens:], special=False)

    def push(self, token: int) -> str:
        self.tokens.append(token)
        text = self._decode()
        if text.endswith("\ufffd"):  # a character still incomplete: the whole ones before it are scanned now
            return self._advance(text.rstrip("\ufffd"), final=False)
        self._decoded, self._decoded_tokens = text, len(self.tokens)
        return self._advance(text, final=False)

    def finish(self) -> str:
        """The held-back rest once generation has ended.  A character its last token left
        incomplete shows as U+FFFD but, as in llama-server, is no text a stop string matches
        (decoded text cannot tell it from a U+FFFD the model wrote last: that one is taken
        for incomplete too)."""
        if self.stopped:
            return ""
        text = self._decode()
        return self._advance(text, final=True, complete=len(text.rstrip("\ufffd")))

    def _scan(self, text: str, start: int) -> tuple[int, list[int]]:
        """Advance every stop string's automaton from its state at ``start`` over
        ``text[start:]``: the earliest index at which a stop string begins (-1: none; the
        string is ``stopping_word``), and the states at the end of ``text`` (meaningful only
        where none began)."""
        cut, states = -1, []
        for s, fail, q in zip(self.stop, self._fail, self._matched):
            m, first, i, n = len(s), s[0], start, len(text)
            while i < n:
                if not q:  # nothing of s under way: skip to where it could begin
                    i = text.find(first, i)
                    if i < 0:
                        break
                c = text[i]
                while q and s[q] != c:
                    q = fail[q - 1]
                if s[q] == c:
                    q += 1
                    if q == m:  # the first occurrence of s ends at i
                        if cut < 0 or i + 1 - m < cut:
                            cut, self.stopping_word = i + 1 - m, s
                        break
                i += 1
            states.append(q)
        return cut, states

    def _indent_scan(self, text: str, start: int) -> tuple[int, int]:
        """The ``min_indent`` rule over ``text[start:]`` from its state at ``start``: the index
        at which the text ends (-1: it goes on), and where the line whose indentation is not yet
        known at the end of ``text`` begins (-1: none)."""
        line, i, n = self._open_line, start, len(text)
        while i < n:
            if line < 0:  # the first line, or one indented enough: on to the next line
                i = text.find("\n", i)
                if i < 0:
                    break
                line = i = i + 1
            elif text[i] in INDENT_CHARS:
                i += 1
            elif i - line < self.min_indent:
                return i, line
            else:
                line = -1
        return -1, line

    def _advance(self, text: str, *, final: bool, complete: int | None = None) -> str:
        if self.stopped:  # the text stays cut where it stopped, shown already
            return ""
        # ``text`` extends the text of the last push (a push passes the decoded text, or the whole
        # characters before an incomplete one, which every later decode begins with), so no stop
        # string can lie wholly in ``text[:self._fed]``: none was found there.  A final text may end
        # in an incomplete character that a later token would redecode, so its states are not kept.
        cut, states = self._scan(text if complete is None else text[:complete], self._fed)
        # (a character left incomplete is one a line may begin with, as llama-server's bytes)
        short, open_line = self._indent_scan(text, self._fed) if self.min_indent > 0 else (-1, -1)
        if short >= 0 and (cut < 0 or short < cut):
            cut, self.stopping_word, self.under_indented = short, "", True
        if not final:
            self._matched, self._fed, self._open_line = states, len(text), open_line
        if cut >= 0:
            self.stopped = True
            text = text[:cut]
            safe = len(text)
        elif final:
            safe = len(text)
        else:
            safe = len(text) - max(states, default=0)
        self.text = text
        delta = text[self.shown:safe] if safe > self.shown else ""
        self.shown = max(self.shown, safe)
        return delta


__all__ = ["INDENT_CHARS", "TextAssembler"]
