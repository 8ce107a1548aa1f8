"""The command line's first moments: importing ``skippy_wire`` and its CLI loads nothing
heavy, so a Ctrl-C while numpy and the kernels load (inside ``cli.main``) is the quiet exit
130, and the package's public names still all import (lazily, PEP 562)."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
from pathlib import Path

import skippy_wire as sw
from process_helpers import default_sigint

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).with_name("skippy-wire")

#: A sitecustomize that raises Ctrl-C in the process the moment numpy starts to load: where
#: the package's eager imports used to run, before ``main`` could catch it.
INTERRUPT_AT_NUMPY = """
import signal, sys

class InterruptAtNumpy:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy":
            sys.meta_path.remove(self)
            signal.raise_signal(signal.SIGINT)
        return None

sys.meta_path.insert(0, InterruptAtNumpy())
"""


def _loaded_after(statement: str) -> list[str]:
    probe = (f"import sys; {statement}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'numpy' "
             "or m.startswith(('skippy_wire.wire', 'skippy_wire.net.transport', 'skippy_wire.stage'))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return ast.literal_eval(out.stdout.strip())


def test_importing_the_cli_or_the_package_loads_no_numpy_and_no_kernels():
    assert _loaded_after("import skippy_wire.tools.cli") == []
    assert _loaded_after("import skippy_wire") == []
    assert _loaded_after("import skippy_wire.errors") == []
    assert "numpy" in _loaded_after("from skippy_wire import encode_activation")  # on first use


def test_ctrl_c_while_numpy_loads_exits_130_without_a_traceback(tmp_path):
    """`skippy-wire run ...` interrupted 0.1-0.3 s in printed a KeyboardInterrupt traceback
    through numpy's imports and died by the signal."""
    (tmp_path / "sitecustomize.py").write_text(INTERRUPT_AT_NUMPY)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    for command in ([str(SCRIPT)], [sys.executable, "-m", "skippy_wire"]):
        proc = subprocess.run([*command, "run", "-n", "10", "--raw", "Once upon a time"], capture_output=True,
                              text=True, timeout=60, cwd=tmp_path, env=env, preexec_fn=default_sigint)
        assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr
        assert (proc.returncode, proc.stdout, proc.stderr) == (128 + signal.SIGINT, "", ""), command


def test_a_bad_implementation_request_is_one_line_from_the_cli():
    """SKIPPY_WIRE_IMPL is read when the kernels load: inside main, as a one-line error."""
    env = dict(os.environ, SKIPPY_WIRE_IMPL="fortran")
    proc = subprocess.run([sys.executable, "-m", "skippy_wire", "demo"], capture_output=True, text=True,
                          timeout=60, env=env, cwd=REPO)
    assert proc.returncode == 1
    assert proc.stderr == "skippy-wire: error: SKIPPY_WIRE_IMPL must be one of ('cython', 'python'), not 'fortran'\n"


def test_every_public_name_is_listed_alike_and_imports():
    assert len(set(sw.__all__)) == len(sw.__all__)
    import importlib

    for module, names in sw._PUBLIC.items():
        for name in names:
            assert getattr(sw, name) is getattr(importlib.import_module(module, "skippy_wire"), name), name
    namespace: dict = {}
    exec("from skippy_wire import *", namespace)
    assert set(sw.__all__) <= set(namespace) and set(sw.__all__) <= set(dir(sw))
    try:
        sw.no_such_name
    except AttributeError as exc:
        assert str(exc) == "module 'skippy_wire' has no attribute 'no_such_name'"
    else:
        raise AssertionError("an unknown name resolved")
