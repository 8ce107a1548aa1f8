"""A diagnostic file that cannot be written (a full disk, here /dev/full) is said once and
dropped; the connection, the stage and the generation it watches go on."""

from __future__ import annotations

import logging
import os

import pytest

from skippy_wire.net.driver import PipelineClient
from skippy_wire.net.server import StageServer
from skippy_wire.net.transport import DiagnosticFile
from skippy_wire.tools.serve import stage_config

from test_server import PROMPT, Chain, FakeBackend, closing_factory, fake_reference

FULL = "/dev/full"  # every write fails with ENOSPC


@pytest.fixture
def chain_factory():
    yield from closing_factory(Chain, Chain.close)


def _full_capture(directory, prefix: str) -> None:
    for suffix in ("-messages.bin", "-replies.bin"):
        os.symlink(FULL, directory / f"{prefix}{suffix}")


def test_a_write_that_fails_is_logged_once_and_the_file_dropped(caplog):
    trace = DiagnosticFile(FULL, "--trace-compute", "a")
    with caplog.at_level(logging.ERROR, logger="skippy_wire.net.transport"):
        for _ in range(3):
            trace.write("1 2 3\n")
        trace.close()
    assert [r.getMessage() for r in caplog.records] == [
        "--trace-compute: cannot write /dev/full (no space left on device); nothing more is written to it"]


def test_a_full_disk_under_a_stages_capture_leaves_its_generations_whole(chain_factory, tmp_path, caplog):
    _full_capture(tmp_path, "hop1")
    _full_capture(tmp_path, "hop1-2")  # the second connection's files
    chain = chain_factory([(0, 3), (3, 6)], capture=str(tmp_path))
    with caplog.at_level(logging.ERROR, logger="skippy_wire.net.transport"):
        for _ in range(2):  # the first connection's close does not fail the stage either
            with PipelineClient(*chain.entry, timeout=10) as client:
                assert client.generate(PROMPT, max_tokens=6, chunk_size=4).tokens == fake_reference(PROMPT, 6)
    said = [r.getMessage() for r in caplog.records]
    assert f"--capture: cannot write {tmp_path}/hop1-messages.bin (no space left on device); " \
           "nothing more is written to it" in said
    assert len(said) == 4  # once for each file of each connection


def test_a_full_disk_under_the_drivers_capture_leaves_its_generation_whole(chain_factory, tmp_path, caplog):
    _full_capture(tmp_path, "hop0")
    chain = chain_factory([(0, 6)])
    with caplog.at_level(logging.ERROR, logger="skippy_wire.net.transport"):
        with PipelineClient(*chain.entry, timeout=10, capture=tmp_path / "hop0") as client:
            assert client.generate(PROMPT, max_tokens=6, chunk_size=4).tokens == fake_reference(PROMPT, 6)
    assert len(caplog.records) == 2


def test_a_full_disk_under_the_compute_trace_leaves_the_stage_serving(caplog):
    server = StageServer(FakeBackend(0, 6, 0), stage_config(0, 0, 6, "raw-f32-v1", "fixed"),
                         compute_trace=DiagnosticFile(FULL, "--trace-compute", "a"))
    server.start()
    try:
        with caplog.at_level(logging.ERROR, logger="skippy_wire.net.transport"):
            for _ in range(2):
                with PipelineClient(*server.address, timeout=10) as client:
                    assert client.generate(PROMPT, max_tokens=6, chunk_size=4).tokens == fake_reference(PROMPT, 6)
        assert len(caplog.records) == 1
    finally:
        server.shutdown()
