"""Chat templates: render a conversation with the GGUF's ``tokenizer.chat_template``.

The template is Jinja, rendered as transformers and llama.cpp render it: a sandboxed,
immutable environment with ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols``
extension, a ``tojson`` filter that keeps non-ASCII text, and the ``raise_exception`` and
``strftime_now`` globals that Hugging Face templates call.  The result is text that still
has to be tokenized (special tokens such as ``<|im_start|>`` are matched by the tokenizer).
"""

from __future__ import annotations

import contextvars
import datetime
import functools
import json
from os import PathLike
from typing import Any, Mapping, Optional

import jinja2
import jinja2.ext
import jinja2.sandbox

from ..errors import StageRuntimeError
from .models import Tokenizer, read_gguf_metadata

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
ROLES = ("system", "user", "assistant", "tool", "developer", "function")
#: Roles that templates know by another name: OpenAI's newer and deprecated ones.
_TEMPLATE_ROLE = {"developer": "system", "function": "tool"}
#: Roles whose messages must carry content (an assistant's may be null beside tool calls).
CONTENT_ROLES = ("system", "user", "tool", "developer")
#: The name of the conversation a template renders, which extra names may not replace
#: (they may replace the others, ``add_generation_prompt``, ``bos_token``, ``eos_token``, as
#: llama-server's ``chat_template_kwargs`` do: they are set last).
MESSAGES = "messages"


class ChatTemplateError(StageRuntimeError, ValueError):
    """A model has no chat template, the template failed, or the messages are malformed."""


class NoChatTemplate(ChatTemplateError):
    """The model file carries no chat template."""


class MalformedMessages(ChatTemplateError):
    """``messages`` are not a conversation: ``field`` names the culprit (``messages[0].role``)
    and ``problem`` says what is wrong with it (one of :data:`MESSAGE_PROBLEMS`)."""

    def __init__(self, message: str, field: str, problem: str) -> None:
        super().__init__(message)
        self.field, self.problem = field, problem


#: What may be wrong with a field of ``messages``: absent, an empty list, of the wrong type, or a value not taken.
MESSAGE_PROBLEMS = ("missing", "empty", "type", "value")


#: What one render may do, so that a runaway template from a model file ends in an error: the
#: items all its ranges make together (the sandbox bounds each range alone, not a loop in a
#: loop), and the characters of a string or list it makes with ``*`` or ``+`` and of the
#: prompt it writes.  Far above what real templates need (a few loops over the messages).
MAX_RANGE_ITEMS = 1_000_000
MAX_RENDERED_CHARS = 16 << 20
#: The largest exponent of a template's ``**`` (2 ** 10 ** 9 would compute for minutes), and
#: the most bits an integer made by ``*`` or ``**`` may have (a number squared in a loop).
MAX_EXPONENT = 1024
MAX_INTEGER_BITS = 1 << 20
_RANGE_ITEMS: contextvars.ContextVar[list] = contextvars.ContextVar("range_items")


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _bounded_range(*args: int) -> range:
    items = jinja2.sandbox.safe_range(*args)
    counted = _RANGE_ITEMS.get()
    counted[0] += len(items)
    if counted[0] > MAX_RANGE_ITEMS:
        raise jinja2.exceptions.SecurityError(f"the template's ranges make more than {MAX_RANGE_ITEMS} items")
    return items


class _BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The sandbox with :data:`MAX_RENDERED_CHARS` on the sequences ``*`` and ``+`` make,
    :data:`MAX_EXPONENT` and :data:`MAX_INTEGER_BITS` on the integers ``*`` and ``**`` make."""

    intercepted_binops = frozenset({"*", "**", "+"})

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
            raise jinja2.exceptions.SecurityError(f"an exponent above {MAX_EXPONENT}")
        bits = (left.bit_length() * max(right, 0) if operator == "**" else left.bit_length() + right.bit_length()) \
            if ints and operator != "+" else 0
        if bits > MAX_INTEGER_BITS:
            raise jinja2.exceptions.SecurityError(f"an integer of more than {MAX_INTEGER_BITS} bits")
        sequences = (str, list, tuple)
        if operator == "*":
            seq, times = (left, right) if isinstance(left, sequences) else (right, left)
            if isinstance(seq, sequences) and isinstance(times, int) and len(seq) * times > MAX_RENDERED_CHARS:
                raise jinja2.exceptions.SecurityError(f"a repetition of more than {MAX_RENDERED_CHARS} items")
        if operator == "+" and isinstance(left, sequences) and isinstance(right, sequences) \
                and len(left) + len(right) > MAX_RENDERED_CHARS:
            raise jinja2.exceptions.SecurityError(f"a sequence of more than {MAX_RENDERED_CHARS} items")
        return super().call_binop(context, operator, left, right)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``, which templates made for training put around the
    assistant's turns (to find them), rendered as its body alone, as transformers renders it."""

    tags = {"generation"}

    def parse(self, parser) -> list:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment() -> jinja2.Environment:
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["range"] = _bounded_range
    return env


def check_messages(messages: Any, *, continued: bool = False) -> list[dict]:
    """Messages as a list of ``{"role", "content"}`` dicts; content parts of type "text"
    are joined as llama.cpp joins them (the OpenAI list form): a newline before each part
    once there is text, and so are an assistant message's parts of type "refusal" (OpenAI's
    form of a refusal: the assistant's text); with ``continued``, a last message of the
    assistant's, which the generation continues, has its parts joined with nothing between
    (llama-server's prefill).  A ``developer`` message is the system instructions (OpenAI's
    newer name for them), so it reaches the template as ``system``, as llama.cpp passes it:
    templates know only ``system``.  A ``name`` must be a string (a null one is dropped).
    Raises MalformedMessages with one line, the field and the problem."""
    if not isinstance(messages, list) or not messages:
        problem = "missing" if messages is None else "empty" if isinstance(messages, list) else "type"
        raise MalformedMessages(f"'{MESSAGES}' must be a non-empty list", MESSAGES, problem)
    out = []
    for i, m in enumerate(messages):
        field = f"{MESSAGES}[{i}]"
        if not isinstance(m, Mapping):
            raise MalformedMessages(f"{field} must be an object", field, "type")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise MalformedMessages(f"{field}.role must be one of {', '.join(ROLES)}", f"{field}.role",
                                    "missing" if role is None else "value")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise MalformedMessages(f"{field}.name must be a string", f"{field}.name", "type")
        if role in CONTENT_ROLES and (content is None or content == []):
            raise MalformedMessages(f"{field}.content is required for a {role} message"
                                    + (" (a list of at least one part)" if content == [] else ""),
                                    f"{field}.content", "missing" if content is None else "empty")
        if isinstance(content, list):
            texts = [_part_text(part, field, j, role) for j, part in enumerate(content)]
            prefill = continued and role == "assistant" and i == len(messages) - 1
            content = "".join(texts) if prefill else functools.reduce(_next_line, texts, "")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise MalformedMessages(f"{field}.content must be a string or a list of content parts",
                                    f"{field}.content", "type")
        message = {**m, "role": _TEMPLATE_ROLE.get(role, role), "content": content}
        if "name" in message and message["name"] is None:
            del message["name"]  # null, as clients that send every field send those unset: absent
        out.append(message)
    return out


def _next_line(text: str, part: str) -> str:
    return f"{text}\n{part}" if text else part


def _problem(part: Mapping, key: str) -> str:
    """What is wrong with ``part[key]``: absent (or null), else of the wrong type or value."""
    if part.get(key) is None:
        return "missing"
    return "value" if key == "type" and isinstance(part[key], str) else "type"


def _part_text(part: Any, message: str, j: int, role: str) -> str:
    """The text of content part ``j`` of ``message`` (``messages[i]``): a text part's, or an assistant's refusal."""
    field = f"{message}.content[{j}]"
    also = " or {'type': 'refusal', 'refusal': ...}" if role == "assistant" else ""
    shape = f"{message}.content parts must be {{'type': 'text', 'text': ...}}{also}"
    if not isinstance(part, Mapping):
        raise MalformedMessages(shape, field, "type")
    if part.get("type") == "refusal":
        if role != "assistant":
            raise MalformedMessages(f"{message}.content parts of type 'refusal' are only allowed in assistant "
                                    "messages", f"{field}.type", "value")
        if not isinstance(part.get("refusal"), str):
            raise MalformedMessages(f"{message}.content parts of type 'refusal' must be {{'type': 'refusal', "
                                    "'refusal': ...}", f"{field}.refusal", _problem(part, "refusal"))
        return part["refusal"]
    key = "text" if part.get("type") == "text" else "type"
    if key == "type" or not isinstance(part.get("text"), str):
        raise MalformedMessages(shape, f"{field}.{key}", _problem(part, key))
    return part["text"]


class ChatTemplate:
    """A compiled chat template with the special-token texts it may refer to."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", add_bos: bool = False) -> None:
        """``add_bos``: the tokenizer puts the BOS token before the prompt itself, so a BOS text
        that opens the rendered prompt is dropped (llama.cpp's rule: else the model saw two)."""
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from None
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos = add_bos

    @classmethod
    def from_gguf(cls, path: str | PathLike, tokenizer: Optional[Tokenizer] = None, *,
                  source: Optional[str] = None) -> "ChatTemplate":
        """The template of a GGUF file, or ``source`` with the file's special tokens;
        ChatTemplateError when the model has none.  ``tokenizer``: the model's, whose vocabulary
        names the BOS and EOS texts and which may add a BOS itself (without it: the file's
        vocabulary, and a BOS the template writes is kept)."""
        kv = read_gguf_metadata(path, "tokenizer.")
        source = kv.get(CHAT_TEMPLATE_KEY) if source is None else source
        if not isinstance(source, str) or not source.strip():
            raise NoChatTemplate(f"{path} has no chat template ({CHAT_TEMPLATE_KEY}); send a raw prompt instead")
        vocab = tokenizer.tokens if tokenizer is not None else kv.get("tokenizer.ggml.tokens") or []

        def text_of(key: str) -> str:
            i = kv.get(key)
            return vocab[i] if isinstance(i, int) and 0 <= i < len(vocab) else ""

        add_bos = tokenizer is not None and tokenizer.add_bos
        return cls(source, bos_token=text_of("tokenizer.ggml.bos_token_id"),
                   eos_token=text_of("tokenizer.ggml.eos_token_id"), add_bos=add_bos)

    def render(self, messages: Any, *, add_generation_prompt: bool = True, continue_final_message: bool = False,
               extra: Optional[Mapping[str, Any]] = None) -> str:
        """The prompt text of ``messages`` (OpenAI chat form).  ``continue_final_message``:
        a conversation that ends with an assistant message is continued from its text, as
        llama-server does (the rest rendered with the generation prompt, that text after it;
        a lone assistant message too, after the generation prompt of no messages).  ``extra``:
        more names the template sees, set last (llama-server's ``chat_template_kwargs``), any
        but :data:`MESSAGES`."""
        extra = dict(extra or {})
        if MESSAGES in extra:
            raise ChatTemplateError(f"an extra name may not replace the conversation, {MESSAGES!r}")
        checked = check_messages(messages, continued=continue_final_message)
        prefill = None
        if continue_final_message and checked[-1]["role"] == "assistant":
            prefill, add_generation_prompt = checked.pop()["content"], True
            if checked and checked[-1]["role"] == "assistant":  # which would it continue? (llama-server's text)
                raise MalformedMessages("Cannot have 2 or more assistant messages at the end of the list.",
                                        f"messages[{len(checked) - 1}].role", "value")
        counted = _RANGE_ITEMS.set([0])
        try:
            pieces, size = [], 0
            names = {"add_generation_prompt": add_generation_prompt, "bos_token": self.bos_token,
                     "eos_token": self.eos_token, **extra, MESSAGES: checked}
            for piece in self._template.generate(names):
                size += len(piece)
                if size > MAX_RENDERED_CHARS:
                    raise jinja2.exceptions.SecurityError(f"it wrote more than {MAX_RENDERED_CHARS} characters")
                pieces.append(piece)
            text = "".join(pieces)
            if self.add_bos and self.bos_token and text.startswith(self.bos_token):
                text = text[len(self.bos_token):]
            return text + (prefill or "")
        except Exception as exc:  # noqa: BLE001 -- over the client's data, any failure is the request's
            # (a TemplateError, or e.g. a TypeError from a message field of an unexpected type)
            lone = prefill is not None and not checked
            why = " (rendering no messages, to continue a lone assistant message)" if lone else ""
            raise ChatTemplateError(f"the chat template failed{why}: {exc}") from None
        finally:
            _RANGE_ITEMS.reset(counted)
