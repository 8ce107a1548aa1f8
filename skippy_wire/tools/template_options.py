"""``--chat-template`` and ``--chat-template-file``, llama-server's and llama-cli's (as they
take them with ``--jinja``): a chat template to render messages with instead of the model
file's, for ``run`` and ``api``."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..stage.chat import ChatTemplate, ChatTemplateError
from ..stage.models import Tokenizer
from .options import file_error


#: How a usage error names the two options (it cannot tell which one gave the template).
CHAT_TEMPLATE_OPTIONS = "--chat-template/--chat-template-file"
#: The most ``--chat-template-file`` reads: templates run to a few KiB; a longer file
#: (``/dev/zero``) is refused, not read on, as ``run -f`` refuses one.
MAX_TEMPLATE_FILE_BYTES = 1 << 20


def _template_text(text: str) -> str:
    if "{" not in text:  # no Jinja in it: one of llama.cpp's built-in names (chatml, llama3 ...)
        raise argparse.ArgumentTypeError(f"{text!r} is no Jinja template (llama.cpp's built-in template names are "
                                         "not built in here): give the template's text, or --chat-template-file FILE")
    return text


def _template_file(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_TEMPLATE_FILE_BYTES + 1)
        if len(data) > MAX_TEMPLATE_FILE_BYTES:
            raise argparse.ArgumentTypeError(f"{path}: longer than {MAX_TEMPLATE_FILE_BYTES >> 20} MiB")
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(file_error(path, exc)) from None
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{path}: the file holds no template")
    return text


def add_chat_template_options(p: argparse.ArgumentParser) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("--chat-template", dest="chat_template", type=_template_text, default=None, metavar="JINJA",
                       help="the chat template to render messages with, as its Jinja text, instead of the model "
                            "file's, as llama-server's --chat-template with --jinja (default: the GGUF's "
                            "tokenizer.chat_template)")
    group.add_argument("--chat-template-file", dest="chat_template", type=_template_file, metavar="FILE",
                       help="the same, read from FILE (UTF-8; default: none)")


def load_chat_template(parser: argparse.ArgumentParser, args, model: Path, tokenizer: Tokenizer) -> ChatTemplate:
    """The chat template ``args`` give, else the model's (ChatTemplateError when it has none or
    it does not compile); a given one that does not compile is a usage error."""
    try:
        return ChatTemplate.from_gguf(model, tokenizer, source=args.chat_template)
    except ChatTemplateError as exc:
        if args.chat_template is None:
            raise
        parser.error(f"{CHAT_TEMPLATE_OPTIONS}: {exc}")


__all__ = ["CHAT_TEMPLATE_OPTIONS", "add_chat_template_options", "load_chat_template"]
