"""The short scheduler slice a stage or API process asks for (skippy_wire.net.wakeup_slice)."""

import subprocess
import sys

from skippy_wire.net.wakeup_slice import SHORT_SLICE_NS

_PROBE = """
import os, threading
from skippy_wire.net.wakeup_slice import ask_for_short_slice
def slice_of(tid):
    for line in open(f"/proc/self/task/{tid}/sched"):
        if line.startswith("se.slice"):
            return int(line.split(":")[1])
before = slice_of(threading.get_native_id())
took = ask_for_short_slice()
seen = []
worker = threading.Thread(target=lambda: seen.append(slice_of(threading.get_native_id())))
worker.start(); worker.join()
print(took, before, slice_of(threading.get_native_id()), seen[0], os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0))
"""


def _probe(*prefix: str) -> list[str]:
    out = subprocess.run([*prefix, sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_the_slice_is_taken_and_inherited_by_later_threads():
    took, before, after, worker, nice, policy = _probe()
    assert took == "True"
    assert int(before) != SHORT_SLICE_NS  # the kernel's default, so the request is what changed it
    assert int(after) == int(worker) == SHORT_SLICE_NS
    assert (int(nice), int(policy)) == (0, 0)


def test_the_nice_value_and_the_policy_are_kept():
    """Asking for the slice must not undo `nice` or `chrt -b` (sched_setattr sets both)."""
    took, _, after, _, nice, policy = _probe("nice", "-n", "7", "chrt", "-b", "0")
    assert took == "True" and int(after) == SHORT_SLICE_NS
    assert (int(nice), int(policy)) == (7, 3)  # SCHED_BATCH



_CLI_PROBE = """
import contextlib, io, sys
from skippy_wire.tools.cli import main
def own_slice():
    for line in open("/proc/thread-self/sched"):
        if line.startswith("se.slice"):
            return int(line.split(":")[1])
sys.argv = ["skippy-wire", *sys.argv[2:]]
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    main(None if {mode!r} == "process" else sys.argv[1:])  # None: the process's own command line
print(own_slice())
"""


def _slice_after_cli(mode: str, *args: str) -> int:
    out = subprocess.run([sys.executable, "-c", _CLI_PROBE.format(mode=mode), "--", *args],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def test_the_serving_commands_ask_as_a_process_of_their_own_only():
    """`skippy-wire api|serve` asks; a program calling main() keeps its own threads' slice."""
    assert _slice_after_cli("process", "serve", "--help") == SHORT_SLICE_NS
    assert _slice_after_cli("process", "api", "--help") == SHORT_SLICE_NS
    assert _slice_after_cli("process", "inspect", "--help") != SHORT_SLICE_NS
    assert _slice_after_cli("call", "serve", "--help") != SHORT_SLICE_NS
