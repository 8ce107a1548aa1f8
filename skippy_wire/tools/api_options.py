"""The options of ``api``'s HTTP front only: the host it listens on, the web origins it lets
call it, and llama-server's names for the model and for what this front does anyway (its
API keys: :mod:`.api_keys`)."""

from __future__ import annotations

import argparse
import ipaddress
import urllib.parse

from .llama_sampling import add_sampling_options, max_tokens
from .options import MAX_PORT, UNTIL_FULL, Refused, address, utf8
from .template_options import add_chat_template_options


def _ipv6(text: str) -> str | None:
    """``text`` as an IPv6 address (``::1``, ``[::1]``), else None."""
    try:
        return str(ipaddress.IPv6Address(text[1:-1] if text[:1] == "[" and text[-1:] == "]" else text))
    except ValueError:
        return None


def listen_host(text: str) -> str:
    """The HOST of ``--listen`` alone (``--host``): an IPv6 address (``::1``; ``::`` is every
    address, IPv4 too), else read as :func:`address` reads a host (an empty one is 127.0.0.1,
    not every interface)."""
    if ":" not in text:
        return address(f"{text}:0")[0]
    host = _ipv6(text)
    if host is None:
        raise argparse.ArgumentTypeError(f"not a host name or an IPv4 or IPv6 address: {text!r}")
    return host


def listen_address(text: str) -> tuple[str, int]:
    """``--listen HOST:PORT``, read as :func:`address` reads it, or ``[IPv6]:PORT`` as a URL
    writes one (``[::1]:8080``)."""
    host, sep, port = text.rpartition(":")
    if ":" not in host:
        return address(text)
    literal = _ipv6(host) if host[:1] == "[" and host[-1:] == "]" else None
    if not (sep and literal and port.isascii() and port.isdigit()):
        raise argparse.ArgumentTypeError(f"address must be HOST:PORT, an IPv6 HOST in brackets ([::1]:8080), "
                                         f"not {text!r}")
    if int(port) > MAX_PORT:
        raise argparse.ArgumentTypeError(f"port {int(port)} is out of range (0-{MAX_PORT})")
    return literal, int(port)


def model_alias(text: str) -> str:
    """``--alias``: the model id the API reports and requests may name (argv's UTF-8)."""
    text = utf8(text)
    if not text.strip() or not text.isprintable():
        raise argparse.ArgumentTypeError(f"a model alias is printable text that is not blank, not {text!r}")
    return text


def add_llama_server_options(p: argparse.ArgumentParser) -> None:
    """llama-server's options for the model's name and for what this front does anyway, so
    that its command lines start it."""
    p.add_argument("-a", "--alias", type=model_alias, default=None, metavar="NAME",
                   help="the model id /v1/models reports and responses carry, as llama-server's --alias "
                        "(default: the GGUF file's name without .gguf)")
    p.add_argument("-n", "--n-predict", "--predict", dest="max_tokens", type=max_tokens, default=UNTIL_FULL,
                   metavar="N", help="the most tokens any request generates, whatever it asks for, as llama-server's "
                                     "-n (-1, or llama.cpp's -2: until the context is full)")
    for names, why in ((("--slots",), "the stages keep no slots to list, save or restore (/slots answers 501)"),
                       (("--embedding", "--embeddings"), "the stages compute next tokens only (/v1/embeddings "
                                                         "answers 501)"),
                       (("--reranking", "--rerank"), "the stages compute next tokens only (/v1/rerank answers 501)")):
        p.add_argument(*names, action=Refused, reason=why)
    p.add_argument("--log-disable", "--quiet", dest="quiet", action="store_true",
                   help="no progress lines, as llama-server's --log-disable (a warning about an open API and "
                        "the error that stops it are still written; default: off)")
    p.add_argument("--jinja", "--metrics", "--no-webui", "-cb", "--cont-batching", action="store_true",
                   dest="llama_server_defaults",
                   help="taken as llama-server takes them: chat templates are rendered by jinja2, /metrics is "
                        "always served, batching is continuous, and there is no web UI (default: off)")
    add_chat_template_options(p)
    add_sampling_options(p, per_request=True)


#: The port a browser leaves out of an Origin header, by scheme.
_DEFAULT_PORTS = {"http": 80, "https": 443}


def web_origin(text: str) -> str:
    """A browser's Origin header (matched exactly), or ``*``: written as a browser sends it
    (the scheme and host in lower case, an IPv6 host compressed, no default port), as
    ``http://[0::1]:080`` would otherwise match no request."""
    if text == "*":
        return text
    try:
        parts = urllib.parse.urlsplit(text)
        host, port = parts.hostname, parts.port  # raises on a port out of range
        ok = parts.scheme in _DEFAULT_PORTS and bool(host) and not (parts.path or parts.query or parts.fragment
                                                                     or parts.username is not None or "#" in text)
        if ok and ":" in host:
            host = f"[{ipaddress.IPv6Address(host).compressed}]"
    except ValueError:  # a broken IPv6 literal, a port out of range
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"an origin is SCHEME://HOST[:PORT] (no path) or '*', not {text!r}")
    return f"{parts.scheme}://{host}" + ("" if port in (None, _DEFAULT_PORTS[parts.scheme]) else f":{port}")


__all__ = ["add_llama_server_options", "listen_address", "listen_host", "model_alias",
           "web_origin"]
