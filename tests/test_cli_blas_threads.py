"""A command run as a process of its own keeps numpy's OpenBLAS to one thread (tools/cli.py)."""

import os
import subprocess
import sys

_PROBE = """
import contextlib, io, os, sys
from skippy_wire.tools.cli import main
sys.argv = ["skippy-wire", *sys.argv[2:]]
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    main(None if {mode!r} == "process" else sys.argv[1:])  # None: the process's own command line
import numpy
print(len(os.listdir("/proc/self/task")), os.environ.get("OPENBLAS_NUM_THREADS"))
"""


def _after_cli(mode: str, blas_threads: str | None = None) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if blas_threads is not None:
        env["OPENBLAS_NUM_THREADS"] = blas_threads
    out = subprocess.run([sys.executable, "-c", _PROBE.format(mode=mode), "--", "inspect", "--help"],
                         capture_output=True, text=True, check=True, env=env)
    threads, setting = out.stdout.split()[-2:]
    return int(threads), setting


def test_a_command_process_loads_numpy_without_blas_threads():
    """One thread in all: OpenBLAS would add one per further CPU, each spinning as it loads."""
    assert _after_cli("process") == (1, "1")


def test_a_blas_setting_of_the_users_own_is_kept():
    assert _after_cli("process", "2")[1] == "2"
    assert _after_cli("call")[1] == "None"  # a program calling main() keeps its own environment
