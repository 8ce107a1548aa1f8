"""Thread counts: the warning when a stage is given more compute threads than CPUs."""

from __future__ import annotations

import pytest

from skippy_wire.errors import PipelineError
from skippy_wire.net import supervision
from skippy_wire.stage import threads


def test_more_threads_than_cpus_is_warned_of_and_a_fitting_count_is_not(monkeypatch):
    monkeypatch.setattr(threads, "available_cpus", lambda: 2)
    assert threads.oversubscription(None) is None and threads.oversubscription(2) is None
    assert threads.oversubscription(3).startswith("3 compute threads are more than the 2 CPUs")


def test_started_stages_report_the_warning_through_their_progress(monkeypatch, tmp_path):
    """launch_pipeline says it before any stage starts (a bad model stops it right after)."""
    monkeypatch.setattr(threads, "available_cpus", lambda: 1)
    said = []
    missing = tmp_path / "missing.gguf"
    with pytest.raises(PipelineError, match="no such file"):
        supervision.launch_pipeline(missing, 1, threads=2, layers=[(0, 1)], on_progress=said.append)
    assert said and said[0].startswith("warning: -t 2: 2 compute threads are more than the 1 CPUs")
