"""API keys of ``skippy-wire api``, read as llama-server reads them: ``--api-key`` (repeatable,
each a comma-separated list) and ``--api-key-file`` (one a line, ``#`` starting a comment); the
middleware that asks every request but the health checks for one of them; the warning for an
API that listens beyond loopback with none."""

from __future__ import annotations

import argparse
import hmac
from typing import Optional, Sequence

from ..net.tls import is_loopback
from .error_shapes import error_response
from .http_front import PUBLIC_PATHS, netloc
from .options import file_error, given_path, utf8

#: The most characters of a key file's line, and its most lines (keys; not a whole /dev/zero).
MAX_KEY_LINE = 4096
MAX_KEY_LINES = 4096


def as_keys(keys: str | Sequence[str]) -> tuple[str, ...]:
    """``keys`` as a tuple of keys: one string is one key (never its characters, each a key)."""
    return (keys,) if isinstance(keys, str) else tuple(keys)


def key_list(value: str) -> list[str]:
    """The keys of one ``--api-key``: llama-server's comma-separated list (argv's UTF-8)."""
    keys = [key.strip() for key in utf8(value).split(",") if key.strip()]
    if not keys:
        raise argparse.ArgumentTypeError("the API key is empty")
    return keys


def key_file(path: str) -> list[str]:
    """The keys in the file ``path`` (``--api-key-file``), as llama-server reads them: one a
    line, blank lines and lines that start with ``#`` (comments) skipped."""
    keys, lines = [], 0
    try:
        with open(given_path(path), encoding="utf-8-sig") as fh:  # a byte order mark is no part of the first key
            while line := fh.readline(MAX_KEY_LINE + 1):
                lines += 1
                if lines > MAX_KEY_LINES:
                    raise argparse.ArgumentTypeError(f"{path}: more than {MAX_KEY_LINES} lines")
                if len(line.rstrip("\r\n")) > MAX_KEY_LINE:
                    raise argparse.ArgumentTypeError(f"{path}: line {lines} is over {MAX_KEY_LINE} characters")
                key = line.strip()
                if key and not key.startswith("#"):
                    keys.append(key)
    except (OSError, UnicodeError) as exc:
        raise argparse.ArgumentTypeError(file_error(path, exc)) from None
    if not keys:
        raise argparse.ArgumentTypeError(f"{path}: " + ("the file is empty" if not lines else
                                                        "it holds no key (one a line; '#' starts a comment)"))
    return keys


def open_api_warning(host: str, port: int, api_keys: Sequence[str]) -> Optional[str]:
    """What to say at start-up of an API that listens beyond loopback without a key."""
    if is_loopback(host) or api_keys:
        return None
    return (f"warning: listening on {netloc(host, port)}, beyond loopback, without --api-key: anyone who can reach "
            "this port can generate (docs/security.md)")


class RequireApiKey:
    """ASGI middleware: every route but :data:`PUBLIC_PATHS` needs one of the ``keys``
    (``--api-key``) in ``Authorization: Bearer KEY`` or ``X-Api-Key: KEY`` (the two headers
    llama-server reads), else 401 "Invalid API Key" (llama-server's words) in an error object.
    Each is compared with every key in constant time (which key, if any, is not told by the
    time taken)."""

    def __init__(self, app, keys: str | Sequence[str]) -> None:
        self.app, self.expected = app, [key.encode() for key in as_keys(keys)]

    def _admits(self, headers: dict) -> bool:
        # RFC 9110 11.1: the auth-scheme is case-insensitive; one or more spaces follow it.
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        token, bearer, api_key = token.lstrip(b" "), scheme.lower() == b"bearer", headers.get(b"x-api-key", b"")
        admitted = False
        for key in self.expected:
            admitted |= (hmac.compare_digest(token, key) and bearer) | hmac.compare_digest(api_key, key)
        return admitted

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS and not self._admits(dict(scope["headers"])):
            response = error_response(401, "Invalid API Key", type_="authentication_error", code="invalid_api_key",
                                      headers={"WWW-Authenticate": "Bearer"})  # RFC 9110 11.6.1: a 401 names its scheme
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


__all__ = ["MAX_KEY_LINE", "MAX_KEY_LINES", "RequireApiKey", "as_keys", "key_file", "key_list", "open_api_warning"]
