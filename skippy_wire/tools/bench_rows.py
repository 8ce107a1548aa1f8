"""The result types of the benchmarks (``skippy-wire bench``): timed rows and goal ratios.
Every benchmark module yields these; ``skippy_wire.tools.bench`` prints them."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import timeit
from dataclasses import dataclass
from typing import Callable, Iterable, Union

from ..stage.models import model_shape, smollm2_path
from ..stage.threads import available_cpus
from .cli import guarded
from .options import MAX_ROUNDS, int_at_least, int_between, once_each, seconds
from .signals import exiting_on_signals


@dataclass
class Row:
    """One timed operation: ``seconds`` per call on ``nbytes`` of f32 activation."""

    op: str
    size: str
    impl: str
    seconds: float
    nbytes: int

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9


@dataclass
class Ratio:
    """A goal: ``ratio`` (higher is better) must reach ``target``."""

    goal: str
    ratio: float
    target: float
    detail: str = ""

    @property
    def met(self) -> bool:
        return self.ratio >= self.target


Producer = Callable[[argparse.Namespace], Iterable[Union[Row, Ratio]]]


def best_seconds(fn: Callable[[], object], repeat: int, min_time: float) -> float:
    """Best seconds per call over ``repeat`` rounds of about ``min_time`` seconds each
    (the minimum is the least disturbed by other processes)."""
    timer = timeit.Timer(fn)
    # the loop count from a run long enough to time (a single cold call is slow and rounds
    # came out at a fraction of min_time)
    number, elapsed = 1, timer.timeit(number=1)
    while elapsed < min_time / 10 and number < 1 << 30:
        number *= 10
        elapsed = timer.timeit(number=number)
    number = max(1, round(number * min_time / max(elapsed, 1e-9)))
    return min(timer.repeat(repeat=repeat, number=number)) / number


def paired_seconds(ours: Callable[[], object], base: Callable[[], object], repeat: int,
                   min_time: float) -> tuple[float, float]:
    """Best seconds per call of two callables timed alternately, round by round, so that
    both see the same machine load."""
    a, b = [], []
    for _ in range(repeat):
        a.append(best_seconds(ours, 1, min_time))
        b.append(best_seconds(base, 1, min_time))
    return min(a), min(b)


_progress_width = 0  # of the progress line on the terminal now


def progress(text: str = "") -> None:
    """A live progress line for a person waiting at a terminal (stderr), replaced by the next
    one; ``progress()`` clears it.  Logs and pipes get nothing.  Spaces, not an erase escape,
    cover a longer line before it, so a terminal without escapes (TERM=dumb) shows it too."""
    global _progress_width
    if sys.stderr.isatty():
        line = f"[skippy-wire] {text}" if text else ""
        cover = max(0, _progress_width - len(line))
        _progress_width = len(line)
        print("\r" + line + " " * cover + ("" if line else "\r"), end="", file=sys.stderr, flush=True)


def script_options(doc: str, argv, types: dict[str, Callable[[str], object]] | None = None,
                   conflicts: Callable[[argparse.Namespace], str | None] = lambda args: None,
                   said: dict[str, str] | None = None, **defaults) -> argparse.Namespace:
    """The command line of a ``bench/`` script: one ``--NAME`` option per default, described
    by the first paragraph of the script's ``doc``; an int is at least 1, another value is
    its default's type or what ``types`` names for it (a string default then converted too),
    so a value the script cannot use is a usage error before anything starts, as are options
    that ``conflicts`` finds at odds (its text says how).  ``said`` words a default for the
    help where its value would not say it."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], allow_abbrev=False)  # as every command
    for name, default in defaults.items():
        kind = (types or {}).get(name) or (int_at_least(1) if type(default) is int else type(default))
        p.add_argument(f"--{name}", type=kind, default=default,
                       help=f"default: {(said or {}).get(name) or default or 'none'}")
    args = p.parse_args(argv)
    problem = conflicts(args)
    if problem:
        p.error(problem)
    return args


def script_main(main: Callable[[], int]) -> int:
    """A ``bench/`` script's exit status, as a command's (:func:`.cli.guarded`); SIGTERM and
    SIGHUP unwind like Ctrl-C, so that the stage and API processes it started are stopped
    and its temporary files removed before it exits 143 or 129."""
    def run() -> int:
        with exiting_on_signals():
            return main()

    return guarded(run)


def within_layers(convert: Callable[[str], object]) -> Callable[[str], object]:
    """A script's stage count (or list of them) read by ``convert``, each at most the layers
    of the model the scripts run (one layer a stage), refused before any stage starts."""
    def checked(text: str):
        value = convert(text)
        n_layer = model_shape(smollm2_path())[0]
        for count in value if isinstance(value, list) else [value]:
            if count > n_layer:
                raise argparse.ArgumentTypeError(f"the model's {n_layer} layers make at most {n_layer} stages, "
                                                 f"got {count}")
        return value

    checked.__name__ = "stage count"
    return checked


def one_of(*choices: str) -> Callable[[str], str]:
    """One of ``choices``."""
    def convert(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(choices)}, got {text!r}")
        return text

    convert.__name__ = "choice"
    return convert


def comma_list(one: Callable[[str], object]) -> Callable[[str], list]:
    """Comma-separated values (blanks around them ignored), each as ``one`` takes it
    (``comma_list(one_of("on", "off"))``), each once."""
    def convert(text: str) -> list:
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma list, got {text!r}")
        try:
            values = [one(item) for item in items]
        except argparse.ArgumentTypeError as exc:  # "each value must be ...", or the value's own words
            raise argparse.ArgumentTypeError(f"each value {exc}" if str(exc).startswith("must") else str(exc)) from None
        return once_each(values, items)

    convert.__name__ = "list"
    return convert


def round_ratios(ratios: list[float]) -> str:
    """Ratios measured back to back within each round, as ``median (min-max)``: on a host
    whose speed drifts between minutes, a ratio of two runs of the same round is steadier
    than the ratio of each figure's best round."""
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x)"


def cpu_model() -> str:
    """The CPU's model name (recorded with every figure: machines differ between runs)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def add_timing_options(parser: argparse.ArgumentParser, min_time: float) -> None:
    """``--repeat`` (timing rounds, 5) and ``--min-time`` (seconds a round, ``min_time``) of a
    module's own benchmark command."""
    parser.add_argument("--repeat", type=int_between(1, MAX_ROUNDS), default=5, help="timing rounds (the best is kept)")
    parser.add_argument("--min-time", type=seconds(), default=min_time, help="seconds per timing round")


def cpu_text() -> str:
    """The CPU and the cores this process may use, as every figure records them ("AMD EPYC,
    2 cores"; under ``taskset -c 0``: "AMD EPYC, 1 of 2 cores usable")."""
    usable, total = available_cpus(), os.cpu_count() or 1
    if usable == total:
        return f"{cpu_model()}, {total} core{'s' if total > 1 else ''}"
    return f"{cpu_model()}, {usable} of {total} cores usable"

