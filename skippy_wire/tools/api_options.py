"""The option types of ``api``'s HTTP front only: the host it listens on, the file its key
is read from, the web origins it lets call it."""

from __future__ import annotations

import argparse
import urllib.parse

from .options import address, file_error

#: The most characters of a key file's first line read (a key; not a whole /dev/zero).
MAX_KEY_LINE = 4096


def key_file(path: str) -> str:
    """The key on the first line of the file ``path`` (``--api-key-file``)."""
    try:
        with open(path, encoding="utf-8") as fh:
            line = fh.readline(MAX_KEY_LINE + 1).rstrip("\r\n")
            empty = not line and not fh.tell()
    except (OSError, UnicodeError) as exc:
        raise argparse.ArgumentTypeError(file_error(path, exc)) from None
    if len(line) > MAX_KEY_LINE:
        raise argparse.ArgumentTypeError(f"{path}: its first line is over {MAX_KEY_LINE} characters")
    if not line.strip():
        raise argparse.ArgumentTypeError(f"{path}: {'the file is empty' if empty else 'its first line holds no key'}")
    return line.strip()


def listen_host(text: str) -> str:
    """The HOST of ``HOST:PORT`` alone, read as :func:`address` reads it (an empty one is
    127.0.0.1, not every interface)."""
    return address(f"{text}:0")[0]


def web_origin(text: str) -> str:
    """A browser's Origin header as it is sent (matched exactly), or ``*``."""
    try:
        parts = urllib.parse.urlsplit(text)
        parts.port  # raises on a port out of range
        ok = text == "*" or (parts.scheme in ("http", "https") and bool(parts.hostname)
                             and text == f"{parts.scheme}://{parts.netloc}")
    except ValueError:  # a broken IPv6 literal, a port out of range
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"an origin is SCHEME://HOST[:PORT] (no path) or '*', not {text!r}")
    return text


__all__ = ["MAX_KEY_LINE", "key_file", "listen_host", "web_origin"]
