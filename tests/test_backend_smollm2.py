"""SmolLM2-135M (Q4_1, tied head; runtime.md §6.1) on the ggml stage backend, one stage and
split in two.  Slow; never skipped: a missing model package is a failure that says how to
install it."""

from __future__ import annotations

import pytest

from skippy_wire.errors import Status, StageRuntimeError
from skippy_wire.stage import _backend as B
from skippy_wire.stage import models

pytestmark = pytest.mark.slow

PROMPT = [504, 3575, 282, 4649, 314]  # "The capital of France is"
PARIS = 7042


@pytest.fixture(scope="module")
def smollm2():
    try:
        return str(models.smollm2_path())
    except FileNotFoundError as exc:
        pytest.fail(str(exc))


def frame_call(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except StageRuntimeError as error:
        assert error.status == Status.BUFFER_TOO_SMALL, error
        return fn(*args, **{**kw, "capacity": error.required})


def test_one_stage_rows_and_paris(smollm2):
    m = B.Model(smollm2, n_threads=2, ctx_size=128)
    assert (m.n_layer, m.n_embd, m.n_vocab, m.is_source, m.is_terminal) == (30, 576, 49152, True, True)
    s = m.create_session()
    preds = frame_call(s.verify_tokens_frame_sampled, PROMPT).predicted_tokens
    assert preds == [29, 282, 260, 314, PARIS]  # runtime.md §5.3


def test_two_stages_give_paris_and_match_one_stage(smollm2):
    a = B.Model(smollm2, layer_end=15, n_threads=2, ctx_size=128)
    b = B.Model(smollm2, layer_start=15, stage_index=1, n_threads=2, ctx_size=128)
    assert not a.is_terminal and not b.is_source
    sa, sb = a.create_session(), b.create_session()
    out = frame_call(sa.prefill_chunk_frame, PROMPT)
    tok = frame_call(sb.prefill_chunk_frame, PROMPT, sample=True, input_desc=out.out_desc,
                     input_payload=out.out_payload).predicted_token
    assert tok == PARIS
    tk = models.Tokenizer.from_gguf(smollm2)
    assert tk.token_to_piece(tok) == " Paris"
    split = [tok]
    for _ in range(3):
        out = frame_call(sa.decode_step_frame_sampled, split[-1])
        split.append(frame_call(sb.decode_step_frame_sampled, split[-1], input_desc=out.out_desc,
                                input_payload=out.out_payload).predicted_token)
    one = B.Model(smollm2, n_threads=2, ctx_size=128).create_session()
    single = [frame_call(one.prefill_chunk_frame, PROMPT, sample=True).predicted_token]
    for _ in range(3):
        single.append(frame_call(one.decode_step_frame_sampled, single[-1]).predicted_token)
    assert split == single
