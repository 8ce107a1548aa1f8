"""``--poll-ms``, the busy-poll window of a pipeline's socket reads, as ``run``, ``api`` and
``serve`` take it, and what the stages ``run`` and ``api`` start get without it."""

from __future__ import annotations

import argparse

from ..stage.threads import available_cpus
from .options import float_between

#: ``run`` and ``api`` without ``--poll-ms``: the stages they start poll with this window,
#: wide enough to cover a decode step's whole wait, while a lone session decodes there, when
#: no more stages than CPUs share the machine; the driver sleeps (docs/pipeline.md, "Polling").
AUTO_STAGE_POLL_MS = 50.0
#: The widest ``--poll-ms``: a reader sleeps through waits over a second (they are no decode
#: steps), and a wider window would keep an idle stage's CPU busy that long after a request.
MAX_POLL_MS = 1000.0
_POLL_MS = float_between(0, MAX_POLL_MS)


def poll_window(text: str) -> float | None:
    """``--poll-ms`` where it may be ``auto`` (None: as :func:`poll_args` decides) or ms in
    0..:data:`MAX_POLL_MS`."""
    if text == "auto":
        return None
    try:
        float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a number, got {text!r}") from None
    return _POLL_MS(text)


def add_poll_option(p: argparse.ArgumentParser, *, starts_stages: bool = False) -> None:
    """``--poll-ms``: the busy-poll window of every socket read of a pipeline
    (:attr:`skippy_wire.net.transport.SocketReader.poll_s`); ``starts_stages``: the command
    starts stage processes, and without the option they poll as :func:`poll_args` says."""
    text = ("busy-poll the socket from MS before (or from the start of a wait shorter than MS) to MS after "
            "a message's or reply's expected arrival (the previous wait) instead of sleeping through the "
            "wait (a stage: while at most one session decodes there): saves waking an idle CPU on every hop, "
            "costs CPU time (0: sleep)")
    if starts_stages:
        text += (f"; default (auto): the stages this command starts poll {AUTO_STAGE_POLL_MS:g} ms while a lone "
                 "request decodes if no more stages than CPUs share the machine, and the driver sleeps")
    p.add_argument("--poll-ms", type=poll_window if starts_stages else _POLL_MS,
                   default=None if starts_stages else 0.0, metavar="MS", help=text)


def poll_args(poll_ms: float | None, stages: int) -> list[str]:
    """The ``serve`` arguments that give each of ``stages`` started stages ``--poll-ms``:
    as given, or for None :data:`AUTO_STAGE_POLL_MS` when every stage has a CPU."""
    if poll_ms is None:
        poll_ms = AUTO_STAGE_POLL_MS if stages <= available_cpus() else 0.0
    return ["--poll-ms", repr(poll_ms)] if poll_ms else []


def driver_poll_s(poll_ms: float | None) -> float:
    """The driver's poll window in seconds: ``--poll-ms`` as given, else sleep."""
    return (poll_ms or 0.0) / 1000.0


__all__ = ["AUTO_STAGE_POLL_MS", "MAX_POLL_MS", "poll_window", "add_poll_option", "poll_args", "driver_poll_s"]
