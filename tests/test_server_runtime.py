"""The server's runtime adapter (``RuntimeBackend``) over ``skippy_wire.stage.runtime`` on the
tiny generated GGUF: split stages behind TCP give the tokens of one whole stage."""

from __future__ import annotations

import pytest

from skippy_wire.net.driver import PipelineClient
from skippy_wire.stage import models
from skippy_wire.stage.runtime import StageModel
from skippy_wire.net.server import RuntimeBackend, StageServer
from skippy_wire.tools.serve import stage_config

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(models.write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny-f32.gguf"))


def _open(tiny, start, end, index):
    return RuntimeBackend(StageModel.open(tiny, start, end, stage_index=index, lane_count=4, n_threads=1))


def _reference(tiny, max_tokens, chunk):
    model = StageModel.open(tiny, 0, None, lane_count=1, n_threads=1)
    session = model.create_session()
    token = None
    for start in range(0, len(PROMPT), chunk):
        if start + chunk >= len(PROMPT):
            token, _ = session.prefill_chunk_frame_sampled(PROMPT[start:start + chunk], None)
        else:
            session.prefill_chunk_frame(PROMPT[start:start + chunk])
    out = [token]
    while len(out) < max_tokens:
        token, _ = session.decode_step_frame_sampled(token, None)
        out.append(token)
    return out


@pytest.mark.parametrize("splits", [[(0, 4)], [(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]], ids=["1", "2", "3"])
@pytest.mark.parametrize("codec,policy", [("raw-f32-v1", "fixed"), ("bf16-rne-v1", "fixed"),
                                          ("raw-f32-v1", "auto-lossless-v1")])
def test_runtime_stages_match_one_stage(tiny, splits, codec, policy):
    servers = []
    try:
        downstream = None
        for index in reversed(range(len(splits))):
            start, end = splits[index]
            server = StageServer(_open(tiny, start, end, index), stage_config(index, start, end, codec, policy),
                                 downstream=downstream, io_timeout=5, reply_timeout=5)
            server.start()
            servers.insert(0, server)
            downstream = server.address
        with PipelineClient(*servers[0].address, timeout=10) as client:
            result = client.generate(PROMPT, max_tokens=10, chunk_size=3)
    finally:
        for server in servers:
            server.shutdown()
    assert result.tokens == _reference(tiny, 10, 3)
    assert len(result.tokens) == 10
