"""Shared pieces of the golden-vector tests: loading a group file and running its cases
through a conformance runner."""

from __future__ import annotations

import json

import pytest

from skippy_wire.errors import Mismatch, WireError


def load_cases(directory, name):
    """The cases of one group file, ``directory/name`` (``name`` with or without ``.jsonl``)."""
    path = directory / (name if name.endswith(".jsonl") else f"{name}.jsonl")
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def failing_cases(cases, run, *, with_note=False):
    """``run(case)`` for every case; the ``"id: mismatch"`` lines of those that fail."""
    failures = []
    for case in cases:
        try:
            run(case)
        except Mismatch as exc:
            label = f"{case['id']} ({case['note']})" if with_note else case["id"]
            failures.append(f"{label}: {exc}")
    return failures


def outcome(fn, *args, **kw):
    """``("ok", value)`` or ``("err", kind, message)``: the shape the vectors record."""
    try:
        return ("ok", fn(*args, **kw))
    except WireError as exc:
        return ("err", exc.kind, str(exc))


def group_fixture(group, name):
    """A module-scoped fixture ``name``: the cases of ``group`` in the v15 vectors."""

    @pytest.fixture(scope="module", name=name)
    def cases(vectors_dir):
        return load_cases(vectors_dir, group)

    return cases
