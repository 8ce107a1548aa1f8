"""atheris (libFuzzer) harness for the stage-message/reply readers and the codecs.

Every input runs through the compiled and the reference implementation (see
fuzz/wire_targets.py for the targets and the checks).  Anything but a
``skippy_wire.errors.WireError`` escaping, or the two implementations disagreeing, is a
crash; libFuzzer then writes the input to ``crash-*`` and stops.

    # 10 million inputs, one core, seeded from the golden vectors:
    nice -n 10 .venv/bin/python fuzz/fuzz_wire.py -runs=10000000 fuzz/corpus
    # the compiled readers alone, uninstrumented (fast; the 10M-input run):
    FUZZ_MODE=compiled FUZZ_INSTRUMENT=0 FUZZ_KEEP_GOING=1 nice -n 10 \
        .venv/bin/python fuzz/fuzz_wire.py -runs=10000000 fuzz/corpus
    # or a time budget:
    .venv/bin/python fuzz/fuzz_wire.py -max_total_time=600 fuzz/corpus
    # replay one input:
    .venv/bin/python fuzz/fuzz_wire.py crash-<sha1>

The corpus directory is created and seeded from the vendored v15 vectors
(tests/golden/v15; SKIPPY_WIRE_VECTORS overrides) on first use.  Python code of
skippy_wire is coverage-instrumented; the Cython extensions are not (they are black boxes
here, checked differentially).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import sys
import time
import traceback
from pathlib import Path

try:
    import atheris
except ImportError:
    sys.exit("fuzz: atheris is not installed: pip install -e '.[fuzz]' (docs/reliability.md)")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

#: FUZZ_INSTRUMENT=0: only the harness is coverage-instrumented, not skippy_wire's Python
#: code (faster): the harness's outcome branches (``wire_targets._hint``) are then
#: libFuzzer's whole signal, as they are of the compiled kernels in any case.  Without
#: any, libFuzzer keeps no seed and mutates one byte.
with atheris.instrument_imports(include=["skippy_wire", "wire_targets"]
                                if os.environ.get("FUZZ_INSTRUMENT", "1") == "1" else ["wire_targets"]):
    import wire_targets

    TARGETS = wire_targets.Targets()  # here: it imports the reference readers and codecs
_t0 = time.monotonic()


#: FUZZ_KEEP_GOING=1: record each distinct failure (first input under fuzz/findings/ or
#: $FUZZ_FINDINGS) and keep fuzzing, instead of stopping at the first one.
KEEP_GOING = os.environ.get("FUZZ_KEEP_GOING") == "1"
FINDINGS_DIR = Path(os.environ.get("FUZZ_FINDINGS", HERE / "findings"))
FINDINGS: dict = {}


def _signature(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    if isinstance(code, str):
        return code
    tb = traceback.extract_tb(exc.__traceback__)[-1]
    return f"crash {type(exc).__name__} at {Path(tb.filename).name}:{tb.lineno}"


RUNS = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("-runs=")), None)
_done = 0


def test_one_input(data: bytes) -> None:
    global _done
    _done += 1
    if _done % 1_000_000 == 0 or _done == RUNS:
        _summary()  # libFuzzer leaves with _exit(): no atexit hooks, so report as we go
    try:
        TARGETS.run(data)
    except Exception as exc:  # noqa: BLE001 - every escape is a finding
        if not KEEP_GOING:
            raise
        sig = _signature(exc)
        entry = FINDINGS.get(sig)
        if entry is None:
            FINDINGS_DIR.mkdir(parents=True, exist_ok=True)
            name = "finding-" + hashlib.sha1(data).hexdigest()
            (FINDINGS_DIR / name).write_bytes(data)
            (FINDINGS_DIR / (name + ".txt")).write_text(f"{sig}\n\n{''.join(traceback.format_exception(exc))}")
            FINDINGS[sig] = entry = [0, name]
            print(f"fuzz_wire: NEW FINDING {sig} -> {name}", file=sys.stderr)
        entry[0] += 1


def _seed(corpus: Path) -> None:
    corpus.mkdir(parents=True, exist_ok=True)
    if any(corpus.iterdir()):
        return
    vectors = wire_targets.vectors_dir()
    if not (vectors / "frame.jsonl").is_file():
        sys.exit(f"fuzz: no frame vectors to seed {corpus} from in {vectors} (SKIPPY_WIRE_VECTORS names the folder)")
    for data in wire_targets.seed_inputs():
        (corpus / hashlib.sha1(data).hexdigest()).write_bytes(data)


@atexit.register
def _summary() -> None:
    total = _done
    if total:
        secs = time.monotonic() - _t0
        per = ", ".join(f"{k}={v}" for k, v in sorted(TARGETS.counts.items()))
        print(f"fuzz_wire: {total} inputs ({sum(TARGETS.counts.values())} >= 2 bytes) in {secs:.0f} s ({total / max(secs, 1e-9):.0f}/s); {per}; "
              f"{TARGETS.describe()}; {len(FINDINGS)} distinct finding(s)", file=sys.stderr)
        for sig, (count, name) in sorted(FINDINGS.items()):
            print(f"fuzz_wire: finding x{count}: {sig} (first input {name})", file=sys.stderr)


def main(argv: list[str]) -> None:
    print(f"fuzz_wire: {TARGETS.describe()}", file=sys.stderr)
    for arg in argv[1:]:
        if not arg.startswith("-") and not os.path.isfile(arg):
            _seed(Path(arg))
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
