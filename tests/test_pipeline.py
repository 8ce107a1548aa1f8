"""The pipeline driver: layer splits, streaming, summaries, and real stage processes.

Process tests run ``skippy-wire serve`` children on 127.0.0.1 (port 0) and always
terminate them; every wait is bounded by a timeout.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from process_helpers import thread_slices

from skippy_wire.errors import PipelineError
from skippy_wire.net.driver import GenerationResult, PipelineClient, generate_local, yielding_to_stages
from skippy_wire.net.supervision import default_model, launch_pipeline, split_layers
from skippy_wire.net.wakeup_slice import SHORT_SLICE_NS
from skippy_wire.stage.models import model_shape
from skippy_wire.stage.runtime import StageModel
from skippy_wire.tools.run_report import (TextStreamer, decode_path_lines, format_summary, json_summary,
                                          merge_session_events)
from skippy_wire.wire.messages import StageWireMessage

REPO = Path(__file__).resolve().parents[1]


def test_split_layers_is_even_and_contiguous():
    assert split_layers(30, 2) == [(0, 15), (15, 30)]
    assert split_layers(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert split_layers(4, 3) == [(0, 2), (2, 3), (3, 4)]
    assert split_layers(5, 1) == [(0, 5)]
    for bad in (0, 6):
        with pytest.raises(ValueError):
            split_layers(5, bad)


class _Tok:
    """A toy tokenizer whose ids are characters; 0 is end-of-generation."""

    def decode(self, ids, special=True):
        return "".join(chr(i) for i in ids)

    def is_eog(self, token):
        return token == 0


def test_text_streamer_prints_only_new_text():
    out = io.StringIO()
    streamer = TextStreamer(_Tok(), out)
    for ch in "hi there":
        streamer.push(ord(ch))
    streamer.push(0)
    streamer.finish()
    assert out.getvalue() == "hi there\n"


def test_summary_reports_rates_hops_codecs_and_encode_time():
    result = GenerationResult([1, 2, 3, 4], [5, 6, 7], prefill_s=0.5, decode_s=0.25, prefill_messages=1,
                              decode_messages=2, sent_bytes=1000, received_bytes=700)
    stage0 = [{"event": "session", "stage": 0, "forwarded_messages": 3, "messages": 5,
               "forwarded_bytes": {"bf16-rne-v1": 300, "raw-f32-v1": 400},
               "activation_bytes": {"bf16-rne-v1": 100, "raw-f32-v1": 200},
               "codec_counts": {"bf16-rne-v1": 2, "raw-f32-v1": 1}, "encode_ms": 0.3, "compute_ms": 9.0,
               "decode_tokens": 2, "decoded_ahead": 2}]
    stage1 = [{"event": "session", "stage": 1, "forwarded_messages": 0, "messages": 5, "compute_ms": 8.0}]
    text = format_summary(result, [stage0, stage1], stages=2, model="m.gguf", codec="raw-f32-v1",
                          policy="auto-lossless-v1", threads=2)
    assert "prefill: 4 tokens in 500.0 ms = 8.0 tok/s" in text
    assert "decode:  2 tokens in 250.0 ms = 8.0 tok/s" in text
    assert "hop 0 driver->stage 0: sent 1.0 KiB" in text
    assert "hop 1 stage 0->stage 1" in text and "bf16-rne-v1 0.3 KiB in 2 frames" in text
    assert "codec chosen: bf16-rne-v1 2x (67%), raw-f32-v1 1x (33%)" in text
    assert "activation encode: 0.30 ms total, 100.0 us/frame" in text
    assert "stage 0: compute 9.0 ms, 5 messages, 2 of 2 decode steps computed ahead" in text
    assert "stage 1: compute 8.0 ms, 5 messages\n" in text + "\n"


def test_the_json_summary_counts_an_end_of_generation_token_as_the_api_does():
    """``completion_tokens`` left out the end-of-generation token that ``tokens`` held and the
    API's ``usage.completion_tokens`` counts: one object said 11 and held 12 tokens."""
    result = GenerationResult([1, 2, 3], [5, 6, 0], stop_reason="eog")
    summary = json_summary(result, None, stages=2, model="m.gguf", codec="raw-f32-v1", policy="fixed",
                           threads=1, connected=None, sampling=None, chat=True)
    assert summary["completion_tokens"] == len(summary["tokens"]) == 3


def test_merge_session_events_sums_counters():
    merged = merge_session_events([{"event": "session", "stage": 0, "messages": 2, "codec_counts": {"a": 1}},
                                   {"event": "session", "stage": 0, "messages": 3, "codec_counts": {"a": 2, "b": 1}}])
    assert merged == {"messages": 5, "codec_counts": {"a": 3, "b": 1}}


def test_startup_failure_is_reported_and_cleaned_up(tmp_path):
    # The stage's own one-line reason reaches the driver (an "error" event), not a bare status.
    with pytest.raises(PipelineError, match=r"^stage 1 cannot start: .*missing\.gguf") as error:
        launch_pipeline(tmp_path / "missing.gguf", 2, layers=[(0, 2), (2, 4)], startup_timeout=60,
                        log_dir=tmp_path)
    assert "\n" not in str(error.value)
    log = (tmp_path / "stage1.log").read_text()
    assert "skippy-wire: error: stage 1 cannot start:" in log
    assert "Fatal Python error" not in log


# -- real stage processes over the tiny random llama -----------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from skippy_wire.stage.models import write_tiny_llama_gguf

    return write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


PROMPT = [1, 10, 20, 30, 40, 50, 60, 70, 80]


def _pipeline_tokens(model, stages, codec="raw-f32-v1", policy="fixed", max_tokens=12, chunk=4, **kwargs):
    with launch_pipeline(model, stages, codec=codec, policy=policy, threads=1, startup_timeout=60,
                         **kwargs) as cluster:
        with PipelineClient(*cluster.entry, timeout=30) as client:
            result = client.generate(PROMPT, max_tokens=max_tokens, chunk_size=chunk)
        events = cluster.session_events(wait=5)
        procs = [s.popen for s in cluster.stages]
    assert all(p.poll() is not None for p in procs), "stage processes must be terminated"
    return result, events


def test_two_stage_processes_match_one_in_process_stage(tiny_model):
    assert model_shape(tiny_model) == (4, 64)
    result, events = _pipeline_tokens(tiny_model, 2)
    local = generate_local(tiny_model, PROMPT, max_tokens=12, chunk_size=4, threads=1)
    assert result.tokens == local.tokens
    assert len(result.tokens) == 12
    assert events[0][0]["codec_counts"] == {"raw-f32-v1": 3 + 11}
    assert generate_local(tiny_model, PROMPT, max_tokens=0, chunk_size=4, threads=1).tokens == []


def test_stage_processes_run_the_drivers_package_whatever_stands_in_the_working_directory(tiny_model, tmp_path,
                                                                                         monkeypatch):
    # A `skippy_wire/` folder (a source checkout beside an installed package) or a module
    # named like a dependency where the user stands must not replace what the stages import.
    (tmp_path / "skippy_wire").mkdir()
    (tmp_path / "skippy_wire" / "__init__.py").write_text("raise ImportError('the decoy in the working directory')\n")
    (tmp_path / "numpy.py").write_text("raise ImportError('the decoy numpy')\n")
    monkeypatch.chdir(tmp_path)
    result, _ = _pipeline_tokens(tiny_model, 2)
    assert result.tokens == generate_local(tiny_model, PROMPT, max_tokens=12, chunk_size=4, threads=1).tokens


def test_a_context_whose_kv_cache_outgrows_the_memory_available_starts_no_stage(tiny_model, monkeypatch):
    """Each stage refused its share only once the stages before it had zeroed theirs (at
    -c 1000000 on SmolLM2, stage 0 still zeroing 22 GB when the driver's 60 s ran out)."""
    from skippy_wire.net import supervision
    from skippy_wire.stage.models import kv_cache_bytes

    assert kv_cache_bytes(tiny_model, 1) == 2 * 4 * 2 * 16 * 4  # K and V, 4 layers, 2 KV heads of 16, f32
    assert supervision.memory_available() > 0
    started = []
    monkeypatch.setattr(supervision, "StageProcess", lambda *a, **k: started.append(a))
    weights = tiny_model.stat().st_size  # the stages copy the weights out of the file
    monkeypatch.setattr(supervision, "memory_available", lambda: (1023 << 20) + weights)
    with pytest.raises(ValueError) as error:
        launch_pipeline(tiny_model, 2, threads=1, ctx_size=1 << 20)
    assert str(error.value) == (f"a context of {1 << 20} positions takes 1024 MiB of KV cache a session over "
                                f"{tiny_model.name}'s layers, more than the 1023 MiB of memory available beside "
                                f"its {weights >> 20} MiB of weights; give a smaller -c/--ctx-size") and not started
    supervision.check_memory_fits(tiny_model, 1 << 19)  # 512 MiB: fits
    # counted with the cache: weights that leave it no room (in a container, say) start nothing
    monkeypatch.setattr(supervision, "memory_available", lambda: (512 << 20) + weights - 1)
    with pytest.raises(ValueError, match="more than the 511 MiB of memory available beside its"):
        supervision.check_memory_fits(tiny_model, 1 << 19)
    monkeypatch.setattr(supervision, "memory_available", lambda: weights - 1)
    with pytest.raises(ValueError) as error:
        supervision.check_memory_fits(tiny_model, 1)
    assert str(error.value) == (f"{tiny_model.name}'s weights take {weights >> 20} MiB, more than the "
                                f"{(weights - 1) >> 20} MiB of memory available")


def test_a_local_generation_frees_its_model_and_session_also_when_a_callback_raises(tiny_model, monkeypatch):
    # they were left to the garbage collector: an exception kept referenced held them (~500 MB)
    opened, open_model = [], StageModel.open

    def recording_open(*args, **kwargs) -> StageModel:
        opened.append(open_model(*args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(StageModel, "open", recording_open)

    def failing(token: int) -> bool:
        raise KeyError("from the callback")

    with pytest.raises(KeyError) as kept:
        generate_local(tiny_model, [1, 5, 9], max_tokens=3, threads=1, is_eog=failing)
    assert kept.value is not None and len(opened) == 1 and opened[0]._native is None  # closed, not only unreferenced


def test_a_prompt_is_any_sequence_of_token_ids_and_nothing_else(tiny_model):
    import numpy as np

    prompt = [1, 5, 9]
    tokens = generate_local(tiny_model, prompt, max_tokens=3, threads=1).tokens
    assert generate_local(tiny_model, np.array(prompt), max_tokens=3, threads=1).tokens == tokens
    assert generate_local(tiny_model, tuple(prompt), max_tokens=3, threads=1).tokens == tokens
    with pytest.raises(TypeError, match="^is_eog must be callable or None, not str$"):
        generate_local("/nonexistent.gguf", prompt, max_tokens=1, is_eog="eos")
    # checked before any model is read: one line naming the item (they failed deep inside)
    for bad, error, text in (("hello", TypeError, "prompt must be a sequence of token ids, not str"),
                             (iter(prompt), TypeError, "prompt must be a sequence of token ids, not list_iterator"),
                             ({9, 1}, TypeError, "prompt must be a sequence of token ids, not set"),
                             ({1: 2}, TypeError, "prompt must be a sequence of token ids, not dict"),
                             ([1.5, 2.0], TypeError, "prompt item 0 must be a token id (an int), not 1.5"),
                             ([1, True], TypeError, "prompt item 1 must be a token id (an int), not True"),
                             ([1, 2**31], ValueError, "prompt item 1 is no token id: 2147483648"),
                             ([-1], ValueError, "prompt item 0 is no token id: -1"),
                             (np.array([]), ValueError, "the prompt must have at least one token")):
        with pytest.raises(error) as caught:
            generate_local("/nonexistent.gguf", bad, max_tokens=1)
        assert str(caught.value) == text


@pytest.mark.parametrize("layers, problem", [
    ([(0, 2), (3, 4)], "stage 1: layers 3..4 leaves a gap after stage 0's 0..2"),
    ([(0, 3), (2, 4)], "stage 1: layers 2..4 overlaps stage 0's 0..3"),
    ([(1, 4)], "stage 0 starts at layer 1, not 0"),
    ([(0, 0), (0, 4)], "stage 0: layers 0..0 hold no layer"),
    ([(0, 2), (2, 3)], "the last stage ends at layer 3, but tiny.gguf has 4 layers")])
def test_layers_that_would_not_compute_the_model_once_in_order_are_refused_before_any_start(tiny_model, layers,
                                                                                          problem):
    # they launched, and a gap or an overlap generated wrong tokens without a word
    with pytest.raises(ValueError) as caught:
        launch_pipeline(tiny_model, len(layers), layers=layers, threads=1)
    assert str(caught.value).startswith("layers: " + problem), caught.value


@pytest.mark.parametrize("arguments, error, text", [
    ({"stages": True}, TypeError, "stages must be an int, not bool"),  # True launched one stage
    ({"stages": "2"}, TypeError, "stages must be an int, not str"),
    ({"ctx_size": "512"}, TypeError, "ctx_size must be an int, not str"),
    ({"ctx_size": -1}, ValueError, "ctx_size must be from 0 to 16777216, got -1"),
    ({"codec": "nope"}, ValueError, "unknown activation codec 'nope'"),
    ({"codec": "bf16", "policy": "auto-lossless"}, ValueError,
     "policy auto-lossless-v1 requires codec raw-f32-v1, not bf16-rne-v1"),
    ({"protocol": 18}, ValueError, "protocol must be one of 15, 16, 17, got 18"),
    ({"protocol": "17"}, ValueError, "protocol must be one of 15, 16, 17, got '17'"),  # v17 without its run id
    ({"protocols": [15]}, ValueError, "protocols names 1 versions for 2 stages"),
    ({"extra_args": "--no-decode-ahead"}, TypeError,  # a stage got "- - n o ..." as its arguments
     "extra_args must be a list of serve arguments (strings), got '--no-decode-ahead'"),
    ({"stage_args": {2: ["--ctx-size", "16"]}}, ValueError, "stage_args names stages [2], but there are 2 (0..1)"),
    ({"tls": 5}, TypeError, "tls must be a TlsConfig, not int"),
    ({"startup_timeout": 0}, ValueError, "startup_timeout must be a number of seconds above 0 and at most 1000000, "
                                         "got 0"),
    ({"reply_timeout": "5"}, TypeError, "reply_timeout must be a number of seconds, not str"),
    ({"io_timeout": float("inf")}, ValueError,  # the stage refused it once started, in its command line's words
     "io_timeout must be a number of seconds above 0 and at most 1000000, got inf"),
    ({"session_events_kept": -1}, ValueError, "session_events_kept must be at least 0, got -1"),
    # a float bound reached a stage's command line ("--layer-start 15.0"), strings failed as "starts at layer 0,
    # not 0", a count of stages other than the ranges' was dropped, on_progress failed after a stage started
    ({"layers": [(0, 2.0), (2.0, 4)]}, TypeError, "layers[0] must be an int, not float"),
    ({"layers": [("0", "2"), ("2", "4")]}, TypeError, "layers[0] must be an int, not str"),
    ({"layers": [(0, 2, 4)]}, TypeError, "layers[0] must be a (start, end) pair of layer indices, got (0, 2, 4)"),
    ({"stages": 3, "layers": [(0, 2), (2, 4)]}, ValueError, "stages is 3, but layers gives 2 ranges"),
    ({"on_progress": 5}, TypeError, "on_progress must be callable or None, not int"),
    ({"threads": "x"}, TypeError, "threads must be an int or None, not str")])  # a ValueError after the model read
def test_launch_arguments_are_checked_in_the_callers_words_before_any_stage_starts(tiny_model, monkeypatch,
                                                                                   arguments, error, text):
    # A stage refused them only once started, in a PipelineError quoting its command line,
    # or took them: stages=True ran one stage, a string of extra_args ran its characters.
    def no_start(*_args, **_kwargs):
        raise AssertionError("a stage started")
    monkeypatch.setattr("skippy_wire.net.supervision.StageProcess", no_start)
    with pytest.raises(error) as caught:
        launch_pipeline(tiny_model, **{"stages": 2, "threads": 1, **arguments})
    assert str(caught.value) == text


def test_numpy_and_fraction_arguments_reach_the_stages_as_plain_numbers(tiny_model, monkeypatch):
    # their repr reached a stage's command line ("--reply-timeout np.float64(6.0)", "--io-timeout 10/3")
    # and it refused to start; np.int64 threads were a ValueError
    started = []

    def recorded(index, layers, args, **_kwargs):
        started.append(args)
        raise KeyboardInterrupt  # no stage starts: one command line is enough

    monkeypatch.setattr("skippy_wire.net.supervision.StageProcess", recorded)
    with pytest.raises(KeyboardInterrupt):
        launch_pipeline(tiny_model, np.int64(2), threads=np.int64(1), ctx_size=np.int32(64),
                        layers=[(np.int64(0), np.int64(2)), (np.int64(2), np.int64(4))],
                        reply_timeout=np.float64(10), io_timeout=Fraction(10, 3), startup_timeout=np.float32(60))
    args = started[0]
    value = dict(zip(args, args[1:]))
    assert value["--threads"] == "1" and value["--ctx-size"] == "64" and value["--layer-start"] == "2"
    assert float(value["--reply-timeout"]) < 10 and value["--io-timeout"] == str(10 / 3)


@pytest.mark.parametrize("kept", [3, 0])
def test_a_long_running_supervisor_keeps_a_bounded_number_of_session_events(tiny_model, kept):
    """Every session a stage freed left its event twice in the supervisor, for ever: some 6 KB
    a generation in a long-running API.  Now the latest ``session_events_kept`` (the API,
    which reads none, keeps none), and none queued."""
    with launch_pipeline(tiny_model, 2, threads=1, startup_timeout=60, session_events_kept=kept) as cluster:
        with PipelineClient(*cluster.entry, timeout=30) as client:
            for session in range(1, 7):
                client.generate(PROMPT, max_tokens=2, chunk_size=4, session_id=session, request_id=session)
        events = cluster.session_events(wait=5 if kept else 0.5, count=kept)
        time.sleep(0.5)  # the readers have the last events
        assert [len(stage.session_events) for stage in cluster.stages] == [kept, kept]
        assert [stage.events.qsize() for stage in cluster.stages] == [0, 0]
    assert [len(stage_events) for stage_events in events] == [kept, kept]


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("codec,policy", [("raw-f32-v1", "fixed"), ("bf16-rne-v1", "fixed"),
                                          ("raw-f32-v1", "auto-lossless-v1")])
def test_process_pipelines_match_one_stage(tiny_model, stages, codec, policy):
    result, events = _pipeline_tokens(tiny_model, stages, codec, policy)
    local = generate_local(tiny_model, PROMPT, max_tokens=12, chunk_size=4, threads=1)
    assert result.tokens == local.tokens
    for stage_events in events[:-1]:
        chosen = set(stage_events[0]["codec_counts"])
        assert chosen <= ({"raw-f32-v1", "bf16-rne-v1", "f16-rne-v1"} if policy != "fixed" else {codec})


class _StopAt(Exception):
    pass


def test_next_step_is_sent_before_on_token_and_a_raising_on_token_leaves_the_link_usable(tiny_model):
    """The stages compute token i + 1 while on_token(i) runs: at every call but the last the
    next DecodeEmbd is already written.  An on_token that raises has its step in flight
    read back and its session stopped, a before_step that raises sends none and stops its
    session, so the same connection carries the next generation of the same session id
    with the same tokens (the stages had kept the session: "PREFILL_FINAL_EMBD at position
    0, but session 1 holds 6 tokens")."""
    with launch_pipeline(tiny_model, 2, threads=1, startup_timeout=60) as cluster:
        with PipelineClient(*cluster.entry, timeout=30) as client:
            sent_at_call = []
            full = client.generate(PROMPT, max_tokens=4, chunk_size=4,
                                   on_token=lambda _: sent_at_call.append(client.sent_bytes))
            step = sent_at_call[1] - sent_at_call[0]  # one DecodeEmbd
            assert step > 0 and sent_at_call[2] - sent_at_call[1] == step
            assert sent_at_call[3] == sent_at_call[2]  # nothing is sent after the last token

            def stop_at_second(token):
                if len(seen) == 1:
                    raise _StopAt()
                seen.append(token)

            seen: list = []
            with pytest.raises(_StopAt):
                client.generate(PROMPT, max_tokens=6, chunk_size=4, on_token=stop_at_second,
                                request_id=2, session_id=2)
            assert client.generate(PROMPT, max_tokens=4, chunk_size=4, session_id=2).tokens == full.tokens

            steps: list = []

            def cancel_before_second_step():
                steps.append(1)
                if len(steps) == 2:
                    raise _StopAt()

            with pytest.raises(_StopAt):
                client.generate(PROMPT, max_tokens=6, chunk_size=4, before_step=cancel_before_second_step,
                                request_id=3, session_id=3)
            again = client.generate(PROMPT, max_tokens=4, chunk_size=4, request_id=4, session_id=3)
            sent = client.sent_bytes  # a callback that is no function: refused before anything goes out
            for name in ("on_token", "is_eog", "before_step"):
                with pytest.raises(TypeError, match=f"^{name} must be callable or None, not int$"):
                    client.generate(PROMPT, max_tokens=4, chunk_size=4, request_id=5, session_id=5, **{name: 5})
            assert client.sent_bytes == sent
    assert again.tokens == full.tokens and seen == full.tokens[:1]


def test_killed_stage_fails_the_request_with_a_reason(tiny_model):
    with launch_pipeline(tiny_model, 2, threads=1, startup_timeout=60, reply_timeout=10) as cluster:
        with PipelineClient(*cluster.entry, timeout=20) as client:
            client.generate(PROMPT, max_tokens=2, chunk_size=4)
            cluster.stages[1].popen.send_signal(signal.SIGKILL)
            cluster.stages[1].popen.wait(10)
            started = time.monotonic()
            with pytest.raises(PipelineError, match="closed the connection"):
                client.generate(PROMPT, max_tokens=4, chunk_size=4, session_id=2)
            assert time.monotonic() - started < 15
        # Stage 0 keeps serving: a new connection fails cleanly (its downstream is gone).
        with pytest.raises(PipelineError, match="READY handshake"):
            PipelineClient(*cluster.entry, timeout=20)
        assert cluster.stages[0].popen.poll() is None
        # A connection to a killed stage 0 names how it ended, not only the refused connect.
        cluster.stages[0].popen.send_signal(signal.SIGKILL)
        cluster.stages[0].popen.wait(10)
        with pytest.raises(PipelineError, match=r"^stage 0 at \S+ \(layers 0\.\.\d+\) was killed by SIGKILL; "
                                                r"cannot connect to stage 0 at \S+: connection refused$"):
            PipelineClient(*cluster.entry, timeout=20)


def test_capture_files_can_be_inspected(tiny_model, tmp_path):
    from skippy_wire.tools.inspect import main as inspect_main

    _pipeline_tokens(tiny_model, 2, "bf16-rne-v1", max_tokens=3, capture_dir=tmp_path)
    assert (tmp_path / "hop1-messages.bin").stat().st_size > 0
    assert inspect_main([str(tmp_path / "hop1-messages.bin")]) == 0
    assert inspect_main([str(tmp_path / "hop1-replies.bin")]) == 0


# -- the CLI with the real SmolLM2 -------------------------------------------------------------


def _cli(*args, timeout=240):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "skippy_wire", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


@pytest.mark.slow
def test_run_without_arguments_generates_through_two_stages():
    proc = _cli()
    assert proc.returncode == 0, proc.stderr
    # the summary goes to stderr, as llama-cli's timings: stdout holds the generated text alone
    assert "summary: 2 stage processes" in proc.stderr and "summary" not in proc.stdout
    assert "decode:" in proc.stderr and "tok/s" in proc.stderr
    assert "wire hop 1 stage 0->stage 1" in proc.stderr
    assert "codec chosen: raw-f32-v1" in proc.stderr
    assert "stage 1: layers 15..30 listening" in proc.stderr


@pytest.mark.slow
def test_run_check_with_auto_lossless_exits_0():
    proc = _cli("run", "The capital of France is", "--raw", "--temp", "0", "--max-tokens", "16", "--check",
                "--activation-codec-policy", "auto-lossless-v1", "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "check: OK" in proc.stderr
    assert "Paris" in proc.stdout


@pytest.mark.slow
def test_ignore_eos_generates_every_token_asked_for_as_llama_cli():
    """A chat answer ends early at the end-of-generation token; with --ignore-eos the -n
    tokens all come (their ids none of the model's end-of-generation tokens), and --check
    agrees; llama-cli's one chat turn (-cnv -st) is run's own."""
    from skippy_wire.stage.models import Tokenizer

    def tokens(*extra):
        proc = _cli("run", "What is 2+2?", "--temp", "0", "-n", "48", "--stages", "1", "--json", "--quiet", *extra)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)["summary"]["tokens"]

    assert len(tokens("-cnv", "-st")) < 48
    longer = tokens("--ignore-eos", "--check")
    eog = set(Tokenizer.from_gguf(default_model()).eog_ids)
    assert len(longer) == 48 and not eog & set(longer)


def test_stages_exit_when_the_driver_dies(tiny_model, tmp_path):
    script = (
        "import sys, time\n"
        "from skippy_wire.net.supervision import launch_pipeline\n"
        f"cluster = launch_pipeline({str(tiny_model)!r}, 2, threads=1, startup_timeout=60)\n"
        "print(' '.join(str(s.popen.pid) for s in cluster.stages), flush=True)\n"
        "time.sleep(60)\n"
    )
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 2
        driver.kill()
        driver.wait(10)
        deadline = time.monotonic() + 15
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = [pid for pid in alive if _alive(pid)]
            time.sleep(0.05)
        assert not alive, f"stage processes {alive} outlived their driver"
    finally:
        if driver.poll() is None:
            driver.kill()
        driver.stdout.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_stage_process_survives_garbage_and_logs_it(tiny_model, tmp_path):
    import socket

    with launch_pipeline(tiny_model, 1, threads=1, startup_timeout=60, log_dir=tmp_path) as cluster:
        sock = socket.create_connection(cluster.entry, timeout=10)
        try:
            assert sock.recv(4) == b"\x59\x44\x52\x53"
            sock.sendall(b"\x63\x00\x00\x00" + b"\xff" * 100)
            assert sock.recv(1) == b""  # closed by the stage
        finally:
            sock.close()
        with PipelineClient(*cluster.entry, timeout=30) as client:
            assert len(client.generate(PROMPT, max_tokens=3).tokens) == 3
    log = (tmp_path / "stage0.log").read_text()
    assert "malformed stage message (InvalidData: unknown stage message kind); closing" in log


def test_run_connects_to_running_stages(tiny_model, capsys, monkeypatch):
    from skippy_wire.tools.run import main

    policies = []  # the driver's scheduling policy while it generates: it yields to the stages
    before = os.sched_getscheduler(0)
    generate = PipelineClient.generate
    monkeypatch.setattr(PipelineClient, "generate",
                        lambda *a, **k: policies.append(os.sched_getscheduler(0)) or generate(*a, **k))
    with launch_pipeline(tiny_model, 2, threads=1, startup_timeout=60) as cluster:
        address = "%s:%d" % cluster.entry
        # a fixed seed: the tiny model samples an end of generation within 5 tokens for some seeds
        assert main(["hello", "--connect", address, "--model", str(tiny_model), "--max-tokens", "5", "--seed", "7",
                     "--check", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert f"summary: the pipeline at {address}, tiny.gguf, state version 15" in err
    assert "check: OK, 5 tokens identical" in err
    # stdout holds the text alone (`run ... > out.txt`): the raw prompt, its continuation, a newline
    assert out.startswith("hello") and out.endswith("\n") and out.count("\n") <= 6 and "summary" not in out
    assert (policies, os.sched_getscheduler(0)) == ([os.SCHED_BATCH], before)


def test_yielding_to_stages_is_batch_for_the_thread_and_its_new_threads_then_restored():
    import threading

    seen = []
    before = os.sched_getscheduler(0)
    with yielding_to_stages():
        inside = os.sched_getscheduler(0)
        worker = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0)))
        worker.start()
        worker.join(10)
    assert (inside, seen, os.sched_getscheduler(0)) == (os.SCHED_BATCH, [os.SCHED_BATCH], before)



def test_stage_processes_ask_for_it_themselves(tiny_model):
    """Started by a process that did not ask (this one), every thread of a stage has it."""
    assert thread_slices(os.getpid()) != {SHORT_SLICE_NS}
    with launch_pipeline(tiny_model, 2, threads=1, startup_timeout=60) as cluster:
        with PipelineClient(*cluster.entry, timeout=30) as client:
            client.generate(PROMPT, max_tokens=2)
        for stage in cluster.stages:
            assert thread_slices(stage.popen.pid) == {SHORT_SLICE_NS}


def _path_lines(round_trip_us: float, computes_us: list[int], tokens: int = 1) -> list[str]:
    result = SimpleNamespace(decode_messages=tokens, decode_round_trip_s=round_trip_us * tokens / 1e6,
                             driver_gap_s=0.0)
    return decode_path_lines(result, [[{"decode_path_us": {"compute": c * tokens}}] for c in computes_us])


def test_the_time_outside_compute_is_never_shown_negative():
    # one decode step whose stage 0 computed ahead of the driver's message: its compute lies
    # partly outside the round trip, so round trip - compute says nothing about the hops
    assert _path_lines(5000, [3000, 4000])[-1] == \
        "    outside compute: not separable over 1 decode step (stage 0 computed ahead of the driver's messages)"
    assert _path_lines(7400, [3000, 4000], tokens=96)[-1] == \
        "    outside compute: 400 per token over 2 hops = 200 per hop"


def test_a_short_startup_timeout_is_named_as_given(tiny_model):
    """0.01 s read "did not start listening within 0 s"."""
    with pytest.raises(PipelineError, match=r"^stage \d did not start listening within 0\.01 s"):
        launch_pipeline(tiny_model, stages=1, threads=1, startup_timeout=0.01)


def test_a_generation_ends_where_the_launched_stages_context_does(tiny_model):
    """The stages' "context full" failed the request (and closed the client) at the context's
    end; a prompt longer than it failed only after it was sent."""
    with launch_pipeline(tiny_model, stages=2, threads=1, ctx_size=16) as cluster:
        with PipelineClient(*cluster.entry, timeout=60) as client:
            assert client.ctx_size == 16
            result = client.generate(PROMPT, max_tokens=40, chunk_size=4)
            room = 16 - len(PROMPT) + 1  # the last token is not fed back
            assert (result.stop_reason, len(result.tokens)) == ("context_full", room)
            assert result.tokens == generate_local(tiny_model, PROMPT, max_tokens=room, chunk_size=4, threads=1,
                                                   ctx_size=16).tokens
            with pytest.raises(ValueError, match="^the prompt's 17 tokens do not fit the stages' context of 16 "):
                client.generate(list(range(1, 18)), max_tokens=1)
            assert client.alive() and client.generate(PROMPT, max_tokens=2).stop_reason == "max_tokens"


class _FakeStage:
    """A stage process that only notes its termination (``interrupt``: Ctrl-C meets it)."""

    def __init__(self, port: int, log: list, interrupt: bool = False) -> None:
        self.host, self.port, self.log, self.interrupt = "127.0.0.1", port, log, interrupt

    def terminate(self) -> None:
        self.log.append(self.port)
        if self.interrupt:
            raise KeyboardInterrupt


def test_closing_a_pipeline_twice_leaves_a_newer_one_on_its_address_known(monkeypatch):
    # the old pipeline's second close() forgot the newer one: a client then named no failed stage
    from skippy_wire.net import supervision

    monkeypatch.setattr(supervision, "_LAUNCHED", {})
    log: list = []
    old = supervision.StageCluster([_FakeStage(5000, log)], Path("m.gguf"), "raw-f32-v1", "fixed", 1)
    supervision._LAUNCHED[old.entry] = old
    old.close()
    new = supervision.StageCluster([_FakeStage(5000, log)], Path("m.gguf"), "raw-f32-v1", "fixed", 1)
    supervision._LAUNCHED[new.entry] = new
    old.close()
    assert supervision.launched_cluster("127.0.0.1", 5000) is new


def test_an_interrupted_close_still_terminates_every_stage():
    # Ctrl-C in stage 0's termination left the later stages running (and their ports held)
    from skippy_wire.net import supervision

    log: list = []
    stages = [_FakeStage(5000, log, interrupt=True), _FakeStage(5001, log), _FakeStage(5002, log)]
    with pytest.raises(KeyboardInterrupt):
        supervision.StageCluster(stages, Path("m.gguf"), "raw-f32-v1", "fixed", 1).close()
    assert log == [5000, 5001, 5002]
