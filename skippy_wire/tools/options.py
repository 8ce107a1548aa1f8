"""Command-line plumbing shared by the ``skippy-wire`` subcommands.

* :class:`Parser`: usage errors ``skippy-wire: error: ...`` (after argparse's usage line),
  status 2; ``--help`` shows every default (:class:`DefaultsFormatter`).
* Range-checked argument types (:func:`int_at_least`, :func:`int_list`, ...): a bad value
  is refused before any process starts; :data:`MAX_THREADS`, :data:`MAX_CTX_SIZE` bound all.
* :class:`StartedStagesOption` and :func:`refuse_started_stage_options`: an option that
  configures only the stage processes a command starts is a usage error, whatever its value,
  with ``--connect`` or ``--topology``.
* :func:`describe`: one line for an exception that reaches the user.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import signal
import sys
from pathlib import Path
from typing import Callable, NoReturn

from ..errors import TopologyError, os_reason
from ..stage.threads import DEFAULT_THREADS, MAX_THREADS, default_threads
from ..wire.constants import (CODEC_SHORT_NAMES, DEFAULT_STAGES, MAX_CTX_SIZE, MAX_WAIT_S, POLICY_SHORT_NAMES,
                              ActivationCodec, CodecPolicy)

#: The prefix of every error line the command prints.
ERROR_PREFIX = "skippy-wire: error:"
#: A log record on a command's stderr, as its progress lines read.
LOG_FORMAT = "[skippy-wire] %(message)s"
#: Exit statuses: a runtime failure, a usage error, and 128 + the signal: SIGHUP, Ctrl-C
#: (SIGINT), a closed stdout (SIGPIPE), SIGTERM.
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_HANGUP = 128 + signal.SIGHUP
EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE
EXIT_TERMINATED = 128 + signal.SIGTERM
#: The TCP port range (port 0: any free port).
MAX_PORT = 65535


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows every default: argparse's ``(default: X)`` where there is a value,
    ``(default: off)`` for a flag; options without a value (None) and flags that switch
    something off say what their absence means in their own text, which then names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "%(default)" in text or "default" in text or default is argparse.SUPPRESS:
            return text
        if action.nargs == 0:  # a flag: only one that switches something on has a plain default
            return f"{text} (default: off)" if default is False else text
        if default is None:
            return text
        return f"{text} (default: %(default)s)"


_NEGATIVE_NUMBERS = re.compile(r"^-\d+(?:,-?\d+)*$|^-\d*\.\d+$")


class Parser(argparse.ArgumentParser):
    """``argparse`` with the command's one error prefix, :class:`DefaultsFormatter`
    unless told otherwise, and help without the docstrings' double backticks.  Options are
    matched whole, as llama.cpp's tools match them (argparse would take ``--chec`` for
    ``--check``, and a prefix that is an option today may mean another one tomorrow); an
    unknown option names the one it probably meant."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        # A list of numbers that starts with a negative one (`bench-backend -t -1,2`) is a
        # value, as a lone negative number is; argparse's own pattern took it for an option.
        self._negative_number_matcher = _NEGATIVE_NUMBERS

    def format_help(self) -> str:
        return super().format_help().replace("``", "")

    def _print_message(self, message: str, file=None) -> None:
        # argparse drops a failed write: a help longer than stdout's buffer piped into `true`
        # ended 0, not 141 (cli.guarded says why it failed)
        if message:
            (file or sys.stderr).write(message)

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:  # only the unknown options where there are any: `-b 512 hi` gave 512 to a PROMPT, "-b hi"
            self.error("unrecognized arguments: " + " ".join([w for w in extras if w.startswith("-")] or extras))
        return namespace

    def parse_known_args(self, args=None, namespace=None):
        return super().parse_known_args(self._values_taken_whole(sys.argv[1:] if args is None else list(args)),
                                        namespace)

    def _values_taken_whole(self, args: list[str]) -> list[str]:
        """``-p -hello`` as ``-p=-hello``: an option's value may begin with a dash, as in
        llama.cpp (argparse took it for an option), unless it is one of this command's options."""
        one_value = {name for action in self._actions if action.nargs is None for name in action.option_strings}
        out, i = [], 0
        while i < len(args):
            word = args[i]
            if word == "--":
                return out + args[i:]
            value = args[i + 1] if i + 1 < len(args) else None
            if (word in one_value and value is not None and value.startswith("-") and value != "--"
                    and value.split("=", 1)[0] not in self._option_string_actions):
                out.append(f"{word}={value}")
                i += 2
            else:
                out.append(word)
                i += 1
        return out

    def _get_option_tuples(self, option_string: str) -> list:
        # A single-dash word is an option only as a whole, as in llama.cpp: argparse would
        # read `-ngl 99` as `-n gl`, and `-hf` as `-h -f` (help, exit 0).
        if option_string[1:2] not in self.prefix_chars:
            return []
        return super()._get_option_tuples(option_string)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{ERROR_PREFIX} {shown(message)}{self._suggestion(message)}\n")

    def _suggestion(self, message: str) -> str:
        """``; did you mean '--check'?`` for the first unknown option of ``message``."""
        import difflib

        prefix = "unrecognized arguments: "
        if not message.startswith(prefix):
            return ""
        unknown = next((word.split("=", 1)[0] for word in message[len(prefix):].split()
                        if word.startswith("-") and len(word) > 2), None)
        if unknown is None:
            return ""
        dashes = "--" if unknown.startswith("--") else "-"
        # --version is every command's too (read before the command's parser runs)
        options = [name for name in [*self._option_string_actions, "--version"]
                   if name.startswith(dashes) and (dashes == "--") == name.startswith("--")]
        close = sorted(name for name in options if name.startswith(unknown))
        if dashes == "--":  # a short option's spelling is too short to be close to another's
            close = close or difflib.get_close_matches(unknown, options, n=1, cutoff=0.75)
        return f"; did you mean {close[0]!r}?" if close else ""


def doc_summary(doc: str | None) -> str:
    """A command's description from its module docstring: the first paragraph on one line."""
    return " ".join((doc or "").split("\n\n")[0].split())


def error_line(message: str) -> str:
    """``skippy-wire: error: message`` on one line."""
    return f"{ERROR_PREFIX} {' '.join(shown(str(message)).split())}"


def shown(text: str) -> str:
    """``text`` with the bytes of a file name or argument that are not UTF-8 (which Python
    keeps as the lone surrogates U+DC80-U+DCFF) written as ``\\xff``, as they were given."""
    return _UNDECODED.sub(lambda m: f"\\x{ord(m.group()) - 0xDC00:02x}", text)


_UNDECODED = re.compile("[\udc80-\udcff]")


def describe(exc: BaseException) -> str:
    """One line for ``exc``: ``path: reason`` for an OSError, else its message."""
    if isinstance(exc, OSError) and exc.strerror:
        # socket.create_server appends "(while attempting to bind on address ('H', P))": a
        # Python tuple the caller, who names the address, does not need
        reason = os_reason(exc).split(" (while attempting to bind on address ")[0]
        return f"{exc.filename}: {reason}" if exc.filename is not None else reason
    if isinstance(exc, UnicodeError):
        return "text is not valid UTF-8"
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def file_error(path, exc: BaseException) -> str:
    """One line for ``exc`` raised while reading the file ``path``, naming it once (an empty
    file says so rather than how the reader failed)."""
    try:
        empty = os.path.isfile(path) and os.path.getsize(path) == 0  # a FIFO or a device sizes 0 too
    except OSError:
        empty = False
    text = "the file is empty" if empty else describe(exc)
    return text if str(path) in text else f"{path}: {text}"


#: ``-c 0`` (``run``, ``serve``, ``api``, ``cluster``, ``bench-cluster``), as in llama-cli and
#: llama-server: the model's training context (``{arch}.context_length`` in the GGUF).
TRAINING_CONTEXT = 0
#: ``-n -1`` and an API request's ``max_tokens: -1``, as in llama.cpp: generate until the
#: context is full (or an end-of-generation token).
UNTIL_FULL = -1


def _named_path(what: str) -> Callable[[str], str]:
    def path(text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError(f"an empty path names no {what}")
        return text
    return path


#: A path option's value, not empty: ``-m "$MODEL"`` with MODEL unset would run the packaged
#: model, ``--tls-cert "$CERT"`` turn mutual TLS off, ``--topology ""`` start stages of its own.
model_file, given_path = _named_path("model file"), _named_path("file or directory")


def training_context(model: Path) -> int | None:
    """The context the model was trained with, None if unsaid (:func:`skippy_wire.stage.models.training_context`)."""
    from ..stage.models import training_context as trained  # here: the GGUF reader loads numpy

    return trained(model)


def context_overflow(ctx_size: int, model: Path) -> str | None:
    """llama.cpp's warning, in its words, for a context longer than the model was trained
    with (it runs, its later positions beyond what the model learned), or None."""
    trained = training_context(model)
    if trained is not None and ctx_size > trained:
        return f"n_ctx ({ctx_size}) > n_ctx_train ({trained}) -- possible training context overflow"
    return None


def training_context_size(parser: argparse.ArgumentParser | None, model: Path) -> int:
    """``-c 0`` (``run``, ``serve``, ``api``, ``cluster``, ``bench-cluster``): the model's
    training context; a model that does not record one, or one over the stages' limit, is a
    usage error (``parser.error``; without a parser, a ValueError with the same line, for a
    caller that turns it into one: :func:`skippy_wire.tools.cluster.run_cluster`)."""
    trained = training_context(model)
    problem = None
    if trained is None:
        problem = f"-c {TRAINING_CONTEXT}: {model.name} does not record its training context; give -c/--ctx-size"
    elif not 1 <= trained <= MAX_CTX_SIZE:
        problem = (f"-c {TRAINING_CONTEXT}: the training context of {model.name} ({trained} tokens) is over the "
                   f"stages' limit of {MAX_CTX_SIZE}; give -c/--ctx-size")
    if problem is not None:
        if parser is None:
            raise ValueError(problem)
        parser.error(problem)
    return trained


def check_output_file(parser: argparse.ArgumentParser, option: str, value: str) -> None:
    """A file the command writes once its work is done must be writable now (else a usage
    error naming the option and why, before the work is lost); a missing one is made and removed."""
    existed = os.path.lexists(value)
    try:
        open(value, "a", encoding="utf-8").close()
    except OSError as exc:  # a directory too: "is a directory"
        parser.error(f"{option} {value}: {os_reason(exc)}")
    if not existed:
        os.unlink(value)


def check_output_dir(parser: argparse.ArgumentParser, option: str, value: str | None) -> None:
    """``--capture DIR``, ``--log-dir DIR``: a directory the command makes later (parents
    included) must exist or be possible to make, else a usage error naming the option and why,
    before anything starts.  The check makes the missing directories and removes them again:
    a refused or failed run leaves nothing behind."""
    if not value:
        return
    path = Path(value)
    if path.exists() and not path.is_dir():
        parser.error(f"{option} {value}: not a directory")
    missing, parent = [], path.absolute()
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    made, why = [], None
    try:
        if not parent.is_dir():
            why = f"{parent} is not a directory"
        else:
            for directory in reversed(missing):
                directory.mkdir()
                made.append(directory)
    except OSError as exc:  # the reason alone: the option and the path come first
        why = os_reason(exc)
    finally:
        for directory in reversed(made):
            with contextlib.suppress(OSError):
                directory.rmdir()
    if why is not None:
        parser.error(f"{option} {value}: cannot create the directory: {why}")
    if not missing and not os.access(path, os.W_OK | os.X_OK):
        parser.error(f"{option} {value}: the directory is not writable")


def _number(kind: type, check: Callable[[float], bool], rule: str, *, base: int = 10, finite: bool = False,
            special: tuple[int, str] | None = None) -> Callable[[str], float]:
    if special is not None:
        rule = f"{special[0]} ({special[1]}) or {rule}"

    def convert(text: str):
        try:
            value = int(text, base) if kind is int else kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if special is not None and value == special[0]:
            return value
        if value != value:  # NaN: "must be at least 0, got nan" would read as if it were a number below 0
            raise argparse.ArgumentTypeError(f"must be a number, got {text}")
        if finite and math.isinf(value):
            raise argparse.ArgumentTypeError(f"must be finite, got {text}")
        if not check(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    convert.__name__ = kind.__name__  # argparse names the type in some messages
    return convert


def int_at_least(lo: int, *, base: int = 10, special: tuple[int, str] | None = None) -> Callable[[str], int]:
    """An integer ``>= lo``.  ``base`` 0 takes ``0x`` prefixes too; ``special`` is a value
    outside the range accepted as is and what it means (llama-cli's ``-n -1``: "until the
    context is full"), named in the error."""
    return _number(int, lambda v: v >= lo, f"at least {lo}", base=base, special=special)


def int_between(lo: int, hi: int, *, base: int = 10,
                special: tuple[int, str] | None = None) -> Callable[[str], int]:
    """An integer in ``[lo, hi]`` (``base`` and ``special``: as :func:`int_at_least`)."""
    return _number(int, lambda v: lo <= v <= hi, f"between {lo} and {hi}", base=base, special=special)


#: ``-t -1``: the default thread count, as llama.cpp's tools take it.
_THREADS = int_between(1, MAX_THREADS, special=(DEFAULT_THREADS, "the default"))


def thread_count(text: str) -> int | None:
    """``-t``: compute threads in ``[1, MAX_THREADS]``, or -1 for the default (None)."""
    value = _THREADS(text)
    return None if value == DEFAULT_THREADS else value


thread_count.__name__ = "int"


class Refused(argparse.Action):
    """A llama.cpp option for what this command does not do (``reason``): a usage error that
    says so, where an unknown option would read as a typo.  Hidden from ``--help``."""

    def __init__(self, *args, reason: str, **kwargs) -> None:
        super().__init__(*args, nargs=0, help=argparse.SUPPRESS, **kwargs)
        self.reason = reason

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} is not supported: {self.reason}")


class IgnoredGpuLayers(argparse.Action):
    """llama.cpp's ``-ngl N``: taken (its command lines run here), ignored with its CPU build's warning."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if values not in ("auto", "all") and not re.fullmatch("-1|[0-9]+", values):
            raise argparse.ArgumentError(self, f"expected an integer from -1, auto or all, got {values!r}")
        print("[skippy-wire] warning: no usable GPU found, --gpu-layers option will be ignored "
              "(skippy-wire computes on the CPU)", file=sys.stderr, flush=True)


def add_gpu_layers_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("-ngl", "--gpu-layers", "--n-gpu-layers", action=IgnoredGpuLayers, metavar="N",
                   default=argparse.SUPPRESS, help="ignored with llama.cpp's no-GPU warning (default: off)")


def once_each(values: list, texts: list[str]) -> list:
    """``values`` (parsed from ``texts``) when none repeats, else argparse's error naming it:
    a benchmark would run a repeated setting again and print its row twice."""
    for i, value in enumerate(values):
        if (first := values.index(value)) < i:
            shown, again = texts[first].strip(), texts[i].strip()
            same = "twice" if shown == again else f"and {again!r}, the same value"
            raise argparse.ArgumentTypeError(f"lists {shown!r} {same}; each value once")
    return values


def int_list(lo: int, hi: int | None = None, *, special: tuple[int, str] | None = None,
             repeats: bool = False) -> Callable[[str], list[int]]:
    """Comma-separated integers, each ``>= lo`` (and ``<= hi``): ``1,2,4``; ``special``: as
    :func:`int_at_least`, for each value; each value once unless ``repeats``."""
    one = int_at_least(lo, special=special) if hi is None else int_between(lo, hi, special=special)

    def convert(text: str) -> list[int]:
        try:
            values = [int(item) for item in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        try:
            values = [one(str(value)) for value in values]
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"each value {exc}") from None
        return values if repeats else once_each(values, text.split(","))

    convert.__name__ = "list"
    return convert


def thread_counts(text: str) -> list[int]:
    """``-t T,T,...`` (``bench-backend``): comma-separated :func:`thread_count` values, each
    -1 (the default) resolved to :func:`default_threads`, and then each once."""
    given = int_list(1, MAX_THREADS, special=(DEFAULT_THREADS, "the default"), repeats=True)(text)
    return once_each([default_threads() if value == DEFAULT_THREADS else value for value in given], text.split(","))


thread_counts.__name__ = "list"


def float_at_least(lo: float) -> Callable[[str], float]:
    return _number(float, lambda v: v >= lo, f"at least {lo:g}", finite=True)


def float_above(lo: float, hi: float) -> Callable[[str], float]:
    return _number(float, lambda v: lo < v <= hi, f"greater than {lo:g} and at most {hi:g}")


#: The most timing rounds a benchmark option may ask for (a billion hung after the header).
MAX_ROUNDS = 1000


def seconds(*, zero: bool = False) -> Callable[[str], float]:
    """A wait in seconds: above 0 (``zero``: at least 0) and at most :data:`MAX_WAIT_S`."""
    if zero:
        return _number(float, lambda v: 0 <= v <= MAX_WAIT_S, f"between 0 and {MAX_WAIT_S}", finite=True)
    return _number(float, lambda v: 0 < v <= MAX_WAIT_S, f"greater than 0 and at most {MAX_WAIT_S}", finite=True)


def milliseconds(text: str) -> float:
    """A delay in milliseconds: at least 0, at most :data:`MAX_WAIT_S` in milliseconds."""
    return _number(float, lambda v: 0 <= v <= MAX_WAIT_S * 1000, f"between 0 and {MAX_WAIT_S * 1000}",
                   finite=True)(text)


def float_between(lo: float, hi: float) -> Callable[[str], float]:
    return _number(float, lambda v: lo <= v <= hi, f"between {lo:g} and {hi:g}")


def address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` with a port in 0..65535."""
    # here: net.transport loads the compiled framing, which the error path of cli.main
    # (this module) must not need
    from ..net.transport import parse_address

    try:
        host, port = parse_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if port > MAX_PORT:
        raise argparse.ArgumentTypeError(f"port {port} is out of range (0-{MAX_PORT})")
    return host, port


def stage_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` of a running stage (``--connect``): as :func:`address`, but not port 0."""
    host, port = address(text)
    if port == 0:
        raise argparse.ArgumentTypeError("port 0 names no stage (give the port the stage listens on)")
    return host, port


def _named_choice(names: list[str], short: dict[str, str]) -> Callable[[str], str]:
    """A choice among ``names`` or their ``short`` aliases (returned as the full name); a
    wrong one lists both."""

    def convert(text: str) -> str:
        name = short.get(text, text)
        if name not in names:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {text!r} (choose from {', '.join(map(repr, names))}; "
                f"or the short names {', '.join(map(repr, short))})")
        return name

    convert.__name__ = "choice"
    return convert


#: The namespace attribute where :class:`StartedStagesOption` notes the options given.
_GIVEN_STAGE_OPTIONS = "_given_stage_options"
#: How the ``--help`` of a :class:`StartedStagesOption` says so.
STARTED_STAGES_ONLY = "only for the stages this command starts: not with --connect/--topology"


class StartedStagesOption(argparse.Action):
    """``action=StartedStagesOption``: an option that configures only the stage processes the
    command starts (``run``, ``api``).  Stored as ``store`` stores it, with its real default (which
    ``--help`` shows), and noted as given whatever its value, the default's included, for
    :func:`refuse_started_stage_options`."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        given = getattr(namespace, _GIVEN_STAGE_OPTIONS, {})
        setattr(namespace, _GIVEN_STAGE_OPTIONS, {**given, self.dest: "/".join(self.option_strings)})


def refuse_started_stage_options(parser: argparse.ArgumentParser, args, *, used: tuple[str, ...] = ()) -> None:
    """With ``--connect`` or ``--topology`` the command drives running stages and starts none:
    a :class:`StartedStagesOption` given there (whatever its value) would configure nothing, so
    it is a usage error in argparse's words for a conflict (as ``--stages`` with ``--connect``),
    before anything is checked further.  ``used``: the destinations of such options the command
    does use this time (``run -t`` with ``--check``: the in-process stage's threads)."""
    where = "--connect" if getattr(args, "connect", None) else "--topology" if getattr(args, "topology", None) else None
    if where is None:
        return
    for dest, name in getattr(args, _GIVEN_STAGE_OPTIONS, {}).items():
        if dest not in used:
            parser.error(f"argument {name}: not allowed with argument {where}: it configures the stage processes "
                         f"this command starts, and with {where} it starts none")


def add_codec_options(p: argparse.ArgumentParser, what: str = "the activations between stages", *,
                      started_stages: bool = False) -> None:
    """``--activation-codec`` and ``--activation-codec-policy`` (wire-format.md 6.1 and 8.2);
    ``started_stages``: they configure only the stage processes the command starts
    (:class:`StartedStagesOption`)."""
    codecs = [c.identity() for c in ActivationCodec]
    policies = [policy.serde_name for policy in CodecPolicy]
    action, only = (StartedStagesOption, f"; {STARTED_STAGES_ONLY}") if started_stages else ("store", "")
    p.add_argument("--activation-codec", default=ActivationCodec.default().identity(), action=action,
                   type=_named_choice(codecs, CODEC_SHORT_NAMES), metavar="{" + ",".join(codecs) + "}",
                   help=f"codec of {what} (or {', '.join(CODEC_SHORT_NAMES)}{only})")
    p.add_argument("--activation-codec-policy", default=CodecPolicy.FIXED.serde_name, action=action,
                   type=_named_choice(policies, POLICY_SHORT_NAMES), metavar="{" + ",".join(policies) + "}",
                   help="fixed: always the codec; auto-lossless-v1 (or auto-lossless): the smallest exact "
                        f"codec per frame{only}")


def check_codec_options(p: argparse.ArgumentParser, args) -> None:
    """The one rule between the two: a lossless policy selects from raw f32 frames."""
    if not CodecPolicy.from_serde_name(args.activation_codec_policy).compatible(
            ActivationCodec.from_identity(args.activation_codec)):
        p.error("auto-lossless-v1 requires --activation-codec raw-f32-v1")


def utf8(text: str) -> str:
    """A command-line string that must be valid UTF-8: argv's bytes (decoded in the locale's
    encoding with surrogateescape: in the C locale "café" arrives as escaped bytes) read as
    UTF-8."""
    try:
        return os.fsencode(text).decode("utf-8")
    except UnicodeError:
        raise argparse.ArgumentTypeError("not valid UTF-8") from None


def apply_topology(parser: argparse.ArgumentParser, args, min_ctx_size: int = 1) -> tuple[str, int] | None:
    """``--topology FILE``: its model replaces ``args``', and its ctx_size unless ``-c`` asks
    for less (more than the stages hold is a usage error, and so is a file's ctx_size under
    ``min_ctx_size``, the command's own ``-c`` bound); returns its stage 0's address (None
    without the option).  A bad file is a usage error."""
    if not args.topology:
        return None
    # here: it loads the model reader, which --help need not
    from ..net.topology import drive_topology, load_topology

    try:
        topology = load_topology(args.topology, model=args.model)
    except TopologyError as exc:
        parser.error(str(exc))
    given = args.ctx_size  # None unless -c was given
    if given is not None and given > topology.ctx_size:
        parser.error(f"--ctx-size {given} is more than the {topology.ctx_size} tokens of {args.topology}'s stages")
    if topology.ctx_size < min_ctx_size:
        parser.error(f"{args.topology}: ctx_size {topology.ctx_size} is under the least --ctx-size {parser.prog} "
                     f"takes ({min_ctx_size})")
    args.model, args.ctx_size = str(topology.model_path), given or topology.ctx_size
    args.topology_model_id = topology.model_id  # the stages' v17 model id, as serve --topology takes it
    drive_topology(topology)  # a failed request names the stage that no longer answers
    return tuple(topology.entry)


__all__ = ["ERROR_PREFIX", "LOG_FORMAT", "EXIT_FAILURE", "EXIT_USAGE", "EXIT_HANGUP", "EXIT_INTERRUPTED",
           "EXIT_BROKEN_PIPE", "EXIT_TERMINATED", "MAX_PORT", "MAX_THREADS", "MAX_CTX_SIZE",
           "once_each", "Refused", "add_gpu_layers_option", "DefaultsFormatter", "Parser", "doc_summary", "error_line",
           "describe", "file_error", "check_output_dir", "int_at_least", "int_between", "int_list", "thread_count",
           "thread_counts", "TRAINING_CONTEXT", "UNTIL_FULL", "model_file", "given_path", "training_context",
           "training_context_size",
           "context_overflow", "float_above", "float_at_least", "float_between", "seconds", "MAX_WAIT_S", "MAX_ROUNDS",
           "milliseconds", "address", "stage_address", "check_output_file",
           "apply_topology", "utf8", "StartedStagesOption", "refuse_started_stage_options",
           "STARTED_STAGES_ONLY", "DEFAULT_STAGES"]
