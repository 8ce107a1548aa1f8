"""models.Tokenizer against llama.cpp's tokenizer, re-implemented here in plain Python.

``LlamaCppBpe`` follows llama.cpp's ``llm_tokenizer_bpe_session`` for byte-level BPE
vocabularies with the ``smollm`` pre-tokenizer (``\\p{N}`` split first, then the custom GPT-2
splitter of unicode.cpp), ``tokenizer_st_partition`` for control tokens, and
``token_to_piece``.  It is slow but independent of the HuggingFace ``tokenizers`` library the
real ``Tokenizer`` uses, so the two disagree where either is wrong.  (transformers' own GGUF
loader is no reference here: it ignores ``tokenizer.ggml.pre = smollm`` and splits "a  1" as
"a", " ", " ", "1" where llama.cpp and SmolLM2's tokenizer.json give "a", "  ", "1".)
"""

from __future__ import annotations

import codecs
import functools
import unicodedata

import pytest
from hypothesis import given, settings, strategies as st

from skippy_wire.stage import models

_WHITE_SPACE = {*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F,
                0x205F, 0x3000}


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what byte-level vocabularies are spelled in)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b], extra = chr(256 + extra), extra + 1
    return out


BYTE_CHAR = _byte_chars()
CHAR_BYTE = {c: b for b, c in BYTE_CHAR.items()}


def _kind(ch: str | None) -> str:
    """llama.cpp's codepoint flags, as far as the GPT-2 splitter asks: '' past the end."""
    if ch is None:
        return ""
    if ord(ch) in _WHITE_SPACE:
        return "space"
    cat = unicodedata.category(ch)[0]
    return {"L": "letter", "N": "number"}.get(cat, "other")


def gpt2_split(text: str) -> list[str]:
    """unicode.cpp's unicode_regex_split_custom_gpt2 on one chunk."""
    out, pos, n = [], 0, len(text)

    def at(i):
        return text[i] if i < n else None

    while pos < n:
        start, ch = pos, text[pos]
        if ch == "'" and pos + 1 < n:
            if text[pos + 1] in "stmd":
                out.append(text[pos:pos + 2])
                pos += 2
                continue
            if text[pos + 1:pos + 3] in ("re", "ve", "ll"):
                out.append(text[pos:pos + 3])
                pos += 3
                continue
        kind = _kind(at(pos + 1)) if ch == " " else _kind(ch)
        if kind in ("letter", "number", "other"):
            pos += ch == " "
            while _kind(at(pos)) == kind:
                pos += 1
            out.append(text[start:pos])
            continue
        spaces = 0
        while _kind(at(pos + spaces)) == "space":
            spaces += 1
        if spaces > 1 and pos + spaces < n:
            pos += spaces - 1
        elif spaces:
            pos += spaces
        else:
            pos += 1
        out.append(text[start:pos])
    return out


def smollm_split(text: str) -> list[str]:
    """The smollm pre-tokenizer: every \\p{N} on its own, then the GPT-2 split of each chunk."""
    chunks, cur = [], ""
    for ch in text:
        if _kind(ch) == "number":
            chunks += [cur, ch] if cur else [ch]
            cur = ""
        else:
            cur += ch
    if cur:
        chunks.append(cur)
    return [w for c in chunks for w in gpt2_split(c)]


class LlamaCppBpe:
    """llama.cpp's tokenize/detokenize for a byte-level BPE GGUF vocabulary (pre = smollm)."""

    def __init__(self, path) -> None:
        kv = models.read_gguf_metadata(path, "tokenizer.")
        assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.pre"] == "smollm"
        self.tokens, self.types = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.token_type"]
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.ranks = {}
        for rank, merge in enumerate(kv["tokenizer.ggml.merges"]):
            cut = merge.find(" ", 1)
            self.ranks[(merge[:cut], merge[cut + 1:])] = rank
        self.add_bos, self.bos = bool(kv.get("tokenizer.ggml.add_bos_token", False)), kv["tokenizer.ggml.bos_token_id"]
        special = [i for i, ty in enumerate(self.types) if ty in (2, 3, 4)]  # unknown, control, user-defined
        self.special = sorted(special, key=lambda i: -len(self.tokens[i].encode()))

    @functools.lru_cache(maxsize=None)
    def bpe(self, word: str) -> tuple[int, ...]:
        syms = [BYTE_CHAR[b] for b in word.encode()]
        while True:  # the lowest rank first, the leftmost of equals: llama.cpp's work queue
            found = [(self.ranks[p], k) for k, p in enumerate(zip(syms, syms[1:])) if p in self.ranks]
            if not found:
                break
            k = min(found)[1]
            syms[k:k + 2] = [syms[k] + syms[k + 1]]
        out = []
        for s in syms:  # a symbol with no token goes byte by byte, and a byte with none is dropped
            out += [self.ids[s]] if s in self.ids else [self.ids[c] for c in s if c in self.ids]
        return tuple(out)

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        frags: list = [text]
        for sid in self.special:
            if not parse_special and self.types[sid] != 4:
                continue
            needle, nxt = self.tokens[sid], []
            for f in frags:
                while isinstance(f, str) and needle in f:
                    left, f = f.split(needle, 1)
                    nxt += [left, sid] if left else [sid]
                if f != "":
                    nxt.append(f)
            frags = nxt
        out = [self.bos] if add_special and self.add_bos else []
        for f in frags:
            out += [f] if isinstance(f, int) else [t for w in smollm_split(f) for t in self.bpe(w)]
        return out

    def piece(self, tid: int) -> bytes:
        """token_to_piece with special = true."""
        text = self.tokens[tid]
        if self.types[tid] != 1:
            return text.encode()
        return bytes(CHAR_BYTE[c] for c in text)


# ------------------------------------------------------------------------------------------
# fast checks on hand-made vocabularies (no model file)


def _byte_vocab(missing=(), merges=(), special=()):
    tokens = list(special) + [c for b, c in sorted(BYTE_CHAR.items()) if b not in missing]
    tokens += ["".join(m.split(" ")) for m in merges]
    types = [3] * len(special) + [1] * (len(tokens) - len(special))
    return models.Tokenizer(model="gpt2", pre="smollm", tokens=tokens, token_types=types, merges=list(merges),
                            bos_id=0 if special else None, eos_id=None)


def test_a_byte_without_a_token_still_keeps_its_neighbours_apart():
    # SmolLM2 has no token for 21 bytes (0x04, 0x06, 0x13, ...); llama.cpp drops such a byte
    # only after merging, so "(\x04)" is "(", ")", never "()"
    tk = _byte_vocab(missing={0x04}, merges=["( )", "Ġ Ġ"])
    paren, close, pair = (tk.tokens.index(t) for t in ("(", ")", "()"))
    assert tk.encode("()") == [pair]
    assert tk.encode("(\x04)") == [paren, close]
    assert tk.encode("\x04") == [] and tk.encode("a\x04") == [tk.tokens.index("a")]
    assert all(i < tk.n_vocab for i in tk.encode("x\x04 \x04  \x04(\x04)"))  # no placeholder id leaks


def test_parse_special_false_spells_control_tokens_out():
    tk = _byte_vocab(merges=["< |"], special=["<|im_end|>"])
    assert tk.encode("a<|im_end|>") == [tk.tokens.index("a"), 0]
    literal = tk.encode("a<|im_end|>", parse_special=False)
    assert 0 not in literal and tk.decode(literal) == "a<|im_end|>"
    assert literal[1] == tk.tokens.index("<|")


def test_a_lone_surrogate_is_a_value_error():
    tk = _byte_vocab()
    for text in ("\ud800", "ok \udfff"):
        with pytest.raises(ValueError, match="surrogate"):
            tk.encode(text)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="ab <|im_end|>\u00e9\U0001f600", max_size=60))
def test_no_token_stands_for_more_bytes_than_max_token_bytes(text):
    # what lets the API refuse a text too long for the context before tokenizing it
    tk = _byte_vocab(merges=["a b", "ab ab", "abab abab", "Ġ Ġ", "ĠĠ ĠĠ"], special=["<|im_end|>"])
    assert tk.max_token_bytes == len("<|im_end|>")
    assert len(tk.encode(text)) * tk.max_token_bytes >= len(text.encode())
    assert len(tk.encode(text, parse_special=False)) * 8 >= len(text.encode())  # "abababab", 8 bytes


def test_reference_splitter_agrees_with_llama_cpp_test_vectors():
    # a few splits spelled out by hand from llama.cpp's regex, to keep the reference honest
    assert smollm_split("Hello world") == ["Hello", " world"]
    assert smollm_split("a  1") == ["a", "  ", "1"]
    assert smollm_split("it's 42") == ["it", "'s", " ", "4", "2"]
    assert smollm_split("x  \ty") == ["x", "  ", "\t", "y"]
    assert smollm_split("!!  ?") == ["!!", " ", " ?"]
    assert smollm_split("IT'S") == ["IT", "'", "S"]


# ------------------------------------------------------------------------------------------
# SmolLM2-135M


@pytest.fixture(scope="module")
def pair():
    path = models.smollm2_path()
    return models.Tokenizer.from_gguf(path), LlamaCppBpe(path)


CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 3:45pm; we'll see, don't you think?",
    "I'M SURE THEY'VE GONE, THEY'D SAID SO. YOU'RE RIGHT, HE'LL COME. 'S 'T 'Re 'lL ''s ' s",
    "def f(x: int) -> int:\n\tif x  >= 10:\n\t\treturn x**2  # square\n    return {'a': [1, 2, 3]}\n",
    "int main(){printf(\"%d\\n\", 42);}\r\n\r\n  x = y != z && !w || (a<<2)>>=3;  \r\n",
    " " * 17 + "x", "x" + " " * 9, "\n\n\ny", "\t\t\tz", "a \t \n b", "\u00a0\u3000\u2009x", "\u200bx\ufeff",
    "1234567890", "3.14159", " 42", "  42", "1,000,000", "a1b2c3", "١٢٣ ०१२ ²³ ½ Ⅻ ①", "$9.99 100%",
    "...!!!?!---—–()[]{}<>@#$%^&*~`|\\/«»„“”‘’。，、", " . ", ":-) <3 -> => :: '''",
    "café cafe\u0301 naïve nai\u0308ve Ångström A\u030angstro\u0308m straße İstanbul ǅemal",
    "中文字符测试 日本語のテキスト 한국어 مرحبا بالعالم שלום नमस्ते क्षत्रिय ภาษาไทย Ελληνικά Русский",
    "😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷🇩🇪 ❤️ 👩🏿‍💻 1️⃣ a\u0300\u0301\u0302 Z\u0351\u0352a\u0489 \u0301x x\u200dy \u202eRTL",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝐛𝐨𝐥𝐝 ｆｕｌｌｗｉｄｔｈ ﬁ ﬂ \uE000 \uFFFD \U0010FFFF",
    "\x00\x01\x07\x08\x1b[31mred\x1b[0m\x1c\x1d\x1e\x1f\x7f\x80\x9f", "(\x04) !\x06! :\x1d: it\x16's \x13\x14",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi! 12 apples?<|im_end|>\n",
    "x<|endoftext|>y <|im_start|><|im_end|> <|im_start<|im_end|>|> <<|im_start|>> <|IM_END|> <|im_end| <file_sep>",
    "", " ", "\n", "'", "a",
]



def _stable(ch: str) -> bool:
    """Classified alike by every Unicode version since 3.2 (tokenizers' regex engine, llama.cpp's
    tables and this Python's unicodedata each date from a different one)."""
    return unicodedata.ucd_3_2_0.category(ch) == unicodedata.category(ch)


TEXT = st.text(st.characters(blacklist_categories=("Cs", "Cn")).filter(_stable), max_size=40)
PIECES = st.lists(st.sampled_from(["'s", "'T", "'re", " ", "  ", "\t", "\n", "\r\n", "1", "42", "a", "Ab", "é",
                                   "e\u0301", "中", "!", "?!", "<|im_end|>", "<|im_start|>", "😀", "\u200d", "\x04"]),
                  max_size=12).map("".join)


@pytest.mark.slow
def test_smollm2_encodes_and_decodes_as_llama_cpp(pair):
    tk, ref = pair
    assert tk.add_bos is False  # tokenizer.ggml.add_bos_token = false: llama.cpp adds no BOS
    for text in CORPUS + [c + "'s" for c in CORPUS[:6]]:
        want = ref.encode(text)
        assert tk.encode(text) == want, text
        assert tk.encode(text, add_bos=True) == [tk.bos_id] + want, text
        assert tk.encode(text, parse_special=False) == ref.encode(text, parse_special=False), text
        assert tk.decode(want) == b"".join(ref.piece(i) for i in want).decode("utf-8", "replace"), text


@pytest.mark.slow
def test_smollm2_token_pieces_match_llama_cpp(pair):
    tk, ref = pair
    for tid in range(tk.n_vocab):
        assert tk.token_to_piece(tid) == ref.piece(tid).decode("utf-8", "replace"), tid
        assert tk.token_bytes(tid) == ref.piece(tid), tid


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(text=st.one_of(TEXT, PIECES))
def test_smollm2_generated_text_encodes_as_llama_cpp(pair, text):
    tk, ref = pair
    assert tk.encode(text) == ref.encode(text)
    assert tk.encode(text, parse_special=False) == ref.encode(text, parse_special=False)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(text=st.one_of(TEXT, PIECES))
def test_smollm2_round_trips_and_streams_whole_characters(pair, text):
    tk, ref = pair
    ids = tk.encode(text, parse_special=False)
    # every byte has a token except 21 (0x04, 0x06, 0x13, 0x14, 0x16, 0x1d and bytes never in
    # UTF-8 text); llama.cpp drops those, so the round trip loses exactly them
    kept = bytes(b for b in text.encode() if BYTE_CHAR[b] in ref.ids).decode("utf-8", "replace")
    assert tk.decode(ids) == kept
    # streamed piece by piece: the incremental UTF-8 decoder only ever emits whole characters,
    # and what it emits adds up to decode() of the whole sequence
    dec, shown = codecs.getincrementaldecoder("utf-8")("replace"), ""
    for tid in ids:
        shown += dec.decode(ref.piece(tid))
    assert shown + dec.decode(b"", final=True) == tk.decode(ids)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), max_size=16))
def test_smollm2_decodes_any_ids_as_llama_cpp(pair, ids):
    tk, ref = pair
    assert tk.decode(ids) == b"".join(ref.piece(i) for i in ids).decode("utf-8", "replace")
