"""The ``skippy-wire`` command (also ``python -m skippy_wire``).

Each subcommand lives in the module of its concept and exposes ``main(argv) -> int``;
this file dispatches, importing the module on demand so that one command never pays for
another's imports, and owns the one place where failures become what the user sees:

* a ``SkippyError``, ``OSError``, ``ValueError``, ``ImportError`` (an extension that is
  not built, an optional package missing) or ``MemoryError`` escaping a subcommand: one line
  ``skippy-wire: error: ...`` on stderr, exit status 1 (usage errors exit 2 from argparse,
  with the same prefix, see :class:`skippy_wire.tools.options.Parser`);
* Ctrl-C: exit 130 quietly (the subcommand's ``with``/``finally`` blocks have already
  stopped its stage processes; SIGTERM and SIGHUP unwind the same way inside the commands
  that start processes, see :func:`skippy_wire.tools.signals.exiting_on_signals`);
* a closed stdout (``skippy-wire run | head``): exit 141 quietly; a closed or failing
  stderr drops the diagnostics (:class:`ForgivingStderr`), the command goes on.

Importing this module loads only the standard library's basics (and the package's empty
``__init__``): everything else, numpy and the compiled kernels included, is imported inside
:func:`main`'s handling, so a Ctrl-C at any point after it starts exits 130 quietly.
"""

from __future__ import annotations

import errno
import importlib
import io
import os
import sys
from typing import Callable

COMMANDS = {
    "run": ("skippy_wire.tools.run", "generate text through a pipeline of stage processes (the main job)"),
    "serve": ("skippy_wire.tools.serve", "run one stage process"),
    "cluster": ("skippy_wire.tools.cluster", "run a pipeline over network-namespace hosts with shaped links (root)"),
    "bench-cluster": ("skippy_wire.tools.cluster_bench", "prefill/decode over namespace hosts per link rate, delay, codec"),
    "api": ("skippy_wire.tools.api", "serve an OpenAI-compatible HTTP API from a pipeline of stage processes"),
    "inspect": ("skippy_wire.tools.inspect", "dissect a byte stream of stage messages and replies"),
    "conformance": ("skippy_wire.tools.conformance", "run golden-vector files (*.jsonl) against an implementation"),
    "bench": ("skippy_wire.tools.bench", "measure codec and framing throughput against reference encoders"),
    "bench-backend": ("skippy_wire.tools.backend_bench", "stage backend prefill/decode side by side with llama.cpp"),
    "verify-exhaustive": ("skippy_wire.tools.verify", "check every f32 bit pattern through the live encoders"),
    "demo": ("skippy_wire.tools.demo", "encode a realistic activation through every codec"),
}
#: The commands that serve tokens: their threads wake each other for every token, so run as
#: a process of their own (not called by an embedding program) they ask for a short scheduler
#: slice (skippy_wire.net.wakeup_slice) before any import starts a thread (numpy's BLAS
#: pool): every thread and stage process after inherits it.
SERVING_COMMANDS = ("serve", "api")
#: How close (difflib ratio) a one-word first argument must be to a command name to be
#: taken for a mistyped command rather than a prompt.
TYPO_CUTOFF = 0.75
DISTRIBUTION = "skippy_wire"


def package_version() -> str | None:
    """The version of the installed package (None: not installed, run from a source tree)."""
    import importlib.metadata

    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_text() -> str:
    """What ``skippy-wire --version`` prints (one function, so more build facts can join it)."""
    version = package_version() or "unknown (not installed)"
    ggml = importlib.import_module("skippy_wire.stage._ggml")
    try:
        build = ggml.describe(ggml.load_backend())
    except ImportError as exc:
        build = f"no ggml backend ({exc})"
    return f"skippy-wire {version}; {build}"


USAGE_LINE = "usage: skippy-wire [--version] COMMAND [ARGS...]"


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [USAGE_LINE, "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines.append("\nWith no command, `run` is used: `skippy-wire \"What is the capital of France?\"`.")
    lines.append("--version: the package and the live ggml build.")
    lines.append("`skippy-wire COMMAND --help` (or `skippy-wire help COMMAND`) describes a command's options and "
                 "their defaults.")
    return "\n".join(lines)


def mistyped_command(word: str) -> str | None:
    """The command ``word`` probably meant, if it looks like a mistyped command name (one
    word, no spaces or quotes, close to a name) rather than a prompt."""
    import difflib

    if not word or word.startswith("-") or any(c.isspace() or c in "\"'" for c in word):
        return None
    word = word.lower()
    close = difflib.get_close_matches(word, COMMANDS, n=1, cutoff=TYPO_CUTOFF)
    if not close and len(word) >= 3:  # a prefix: `skippy-wire verify`
        close = [name for name in COMMANDS if name.startswith(word)]
    return close[0] if close else None


class ClosedStdout(io.TextIOBase):
    """``sys.stdout`` of a command started with its stdout closed (``>&-``; Python then has
    none, and every print vanished): a write fails as on a closed pipe, so that no output is
    lost silently (a command exits 141; ``serve`` serves on without its events)."""

    refused = False  # a write failed: flush() fails too, as a pipe's unwritten buffer would

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.refused = True
        raise BrokenPipeError(errno.EPIPE, "stdout is closed")

    def flush(self) -> None:
        if self.refused:  # (argparse drops the error of a --help write: guarded() asks here)
            raise BrokenPipeError(errno.EPIPE, "stdout is closed")


class ForgivingStderr:
    """``sys.stderr`` whose first failed write (``2>/dev/full``, a pipe whose reader left)
    drops the diagnostics from then on, as a closed stderr's are: a progress line that
    cannot be written neither stops a generation nor turns a usage error's status 2 into 1.
    Everything else is the stream's own."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError:
            self._drop()
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError:
            self._drop()

    def _drop(self) -> None:
        # the descriptor too: what the stream still holds then flushes there, not at the exit as an error
        if not _point_at_devnull(self.stream):
            self.stream = open(os.devnull, "w", encoding="utf-8")

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def _point_at_devnull(stream) -> bool:
    """Point ``stream``'s descriptor at /dev/null and flush it there; False where it has no
    descriptor (io.UnsupportedOperation is an OSError and a ValueError) or that fails."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
        stream.flush()
    except (OSError, ValueError):
        return False
    return True


def quiet_stdout() -> None:
    """After a BrokenPipeError: point stdout at /dev/null so the exit flush stays silent (and
    later writes, as ``serve``'s events, vanish without another error)."""
    if isinstance(sys.stdout, ClosedStdout):  # no descriptor to point elsewhere
        sys.stdout = open(os.devnull, "w", encoding="utf-8")
        return
    _point_at_devnull(sys.stdout)


def dispatch(args: list[str], own_process: bool = False) -> int:
    from .options import EXIT_USAGE, error_line
    if args[:1] == ["help"] and args[1:2] and args[1] not in ("-h", "--help", "help"):  # git's `help COMMAND`
        if args[1] not in COMMANDS:
            guess = mistyped_command(args[1])
            hint = f"; did you mean {guess!r}?" if guess is not None else f"; the commands: {', '.join(COMMANDS)}"
            print(f"{USAGE_LINE}\n{error_line(f'unknown command {args[1]!r}{hint}')}", file=sys.stderr)
            return EXIT_USAGE
        args = [args[1], "--help"]
    elif args and args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if args and args[0] in ("-V", "--version"):
        print(version_text())
        return 0
    if args[:1] != ["--"] and "--version" in args[1:args.index("--") if "--" in args else len(args)]:
        print(version_text())  # `skippy-wire run --version`, as llama-cli takes it anywhere
        return 0
    if args and args[0] not in COMMANDS:
        guess = mistyped_command(args[0])
        if guess is not None:
            # argparse's shape: the usage line, then the error
            print(f"{USAGE_LINE}\n{error_line(f'unknown command {args[0]!r}; did you mean {guess!r}?')}",
                  file=sys.stderr)
            return EXIT_USAGE
    # `skippy-wire "a prompt"` and `skippy-wire --max-tokens 8` both mean `run`.
    command = args.pop(0) if args and args[0] in COMMANDS else "run"
    if own_process:
        # numpy's OpenBLAS starts a thread per further CPU as it loads, each spinning about
        # 0.1 s for work no command here gives it (none multiplies matrices with numpy): a
        # sixth of the CPU time of a short `skippy-wire run` with its stage processes on two CPUs.
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    if own_process and command in SERVING_COMMANDS:
        from ..net.wakeup_slice import ask_for_short_slice

        ask_for_short_slice()
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(args) or 0)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    return guarded(lambda: dispatch(args, own_process=argv is None))


def guarded(run: Callable[[], int | None]) -> int:
    """The exit status of ``run()`` as a command's: a Ctrl-C the quiet exit 130, a closed
    stdout 141, an error one line (the scripts in bench/ end the same way).  Every import
    but the standard library's basics happens in ``run`` (the commands', numpy's, the
    kernels'), so that a Ctrl-C at any moment is the quiet exit 130, not a traceback."""
    if sys.stdout is None:
        sys.stdout = ClosedStdout()
    if sys.stderr is None:  # `2>&-`: diagnostics are dropped, as C tools drop them (print put them on stdout)
        sys.stderr = open(os.devnull, "w", encoding="utf-8")
    for stream in (sys.stdout, sys.stderr):  # UTF-8 whatever the locale, as llama-cli writes its text
        if (getattr(stream, "encoding", None) or "utf-8").lower().replace("-", "") != "utf8" \
                and hasattr(stream, "reconfigure"):
            stream.reconfigure(encoding="utf-8", errors=stream.errors)  # stderr's backslashreplace kept
    if not isinstance(sys.stderr, ForgivingStderr):
        sys.stderr = ForgivingStderr(sys.stderr)
    try:
        status = int(run() or 0)
        sys.stdout.flush()  # a full disk behind stdout is this command's error, not the exit's traceback
        return status
    except BrokenPipeError:
        quiet_stdout()
        return _status("EXIT_BROKEN_PIPE")
    except KeyboardInterrupt:
        return _status("EXIT_INTERRUPTED")
    except SystemExit as end:  # a command's --help: argparse drops the error of its write
        failed = stdout_error() if end.code in (None, 0) else None
        if failed is None:
            raise
        if isinstance(failed, BrokenPipeError):
            quiet_stdout()
            return _status("EXIT_BROKEN_PIPE")
        return _failed(failed)
    except Exception as exc:
        from ..errors import SkippyError, thread_start_failed

        if isinstance(exc.__cause__, KeyboardInterrupt):  # Ctrl-C in a class body being made (a dataclass
            return _status("EXIT_INTERRUPTED")  # import): Python 3.11 re-raises it as RuntimeError
        if not isinstance(exc, (SkippyError, OSError, ValueError, ImportError, MemoryError)) \
                and not thread_start_failed(exc):
            raise
        return _failed(exc)


def _failed(exc: Exception) -> int:
    """Say what ``exc`` was, in one line on stderr; the status of a failed command."""
    from .options import describe, error_line

    try:
        text = describe(exc)
        if isinstance(exc, OSError) and exc.filename is None and stdout_error() is not None:
            text = f"cannot write to stdout: {text}"
            quiet_stdout()  # what it still holds would fail again at the exit's flush
        print(error_line(f"out of memory: {text}" if isinstance(exc, MemoryError) else text), file=sys.stderr,
              flush=True)
    except BrokenPipeError:
        pass
    return _status("EXIT_FAILURE")


def stdout_error() -> OSError | None:
    """Why stdout does not take what it holds, or None: after an OSError that names no file,
    a stdout that still cannot flush (the bytes it could not write wait in its buffer;
    unbuffered, as with PYTHONUNBUFFERED, an empty write tells on /dev/full) is what failed."""
    try:
        sys.stdout.flush()
    except OSError as exc:
        return exc
    try:
        os.write(sys.stdout.fileno(), b"")
    except ValueError:  # no descriptor to ask (io.UnsupportedOperation, an OSError too)
        return None
    except OSError as exc:
        return exc
    return None


def _status(name: str) -> int:
    """The exit status ``name`` of :mod:`.options` (imported here: this module imports
    nothing heavy before :func:`main` runs)."""
    from . import options

    return int(getattr(options, name))


if __name__ == "__main__":
    sys.exit(main())
