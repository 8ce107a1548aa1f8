"""The ``--tls-*`` options of ``serve``, ``run`` and ``api`` (docs/security.md)."""

from __future__ import annotations

import argparse

from ..net.tls import TlsConfig
from .options import describe, given_path


def add_tls_options(p: argparse.ArgumentParser, what: str) -> None:
    """``--tls-cert/--tls-key/--tls-ca`` (docs/security.md): mutual TLS on ``what``."""
    p.add_argument("--tls-cert", default=None, type=given_path, metavar="PEM",
                   help=f"certificate chain presented on {what} (with --tls-key and --tls-ca: mutual TLS; "
                        "default: plain TCP)")
    p.add_argument("--tls-key", default=None, type=given_path, metavar="PEM",
                   help="the private key of --tls-cert (default: none)")
    p.add_argument("--tls-ca", default=None, type=given_path, metavar="PEM",
                   help="CA every peer's certificate must be signed by (peers without one are refused; "
                        "default: none)")


def tls_config(args, *, listens: bool, connects: bool = True):
    """The ``TlsConfig`` of parsed ``--tls-*`` options (None without them); ValueError
    unless all three are given, each names a readable file (the option and the path) and
    they load: a certificate, its key, a CA, fit for the ends of links the process (and the
    stages it starts) plays: it ``listens``, it ``connects`` (:meth:`TlsConfig.check`)."""
    config = TlsConfig.from_options(args.tls_cert, args.tls_key, args.tls_ca)
    if config is not None:
        for option, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key), ("--tls-ca", args.tls_ca)):
            try:
                open(path, "rb").close()
            except OSError as exc:
                raise ValueError(f"{option}: {describe(exc)}") from None
        config.check(listens=listens, connects=connects)
    return config
