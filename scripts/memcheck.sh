#!/usr/bin/env bash
# Run the compiled extensions' tests under valgrind memcheck (default) or AddressSanitizer.
#
#   scripts/memcheck.sh                 # valgrind, debug build (-O1 -g) of _codec/_frame/_backend
#   MEMCHECK_TOOL=asan scripts/memcheck.sh    # ASan build, libasan preloaded
#   scripts/memcheck.sh tests/test_fuzz_codec.py -k encode    # other pytest arguments
#
# The tree is copied to $MEMCHECK_DIR (default /tmp/skippy_memcheck) and built there, so the
# working tree's optimised extensions are left alone.  Only the compiled implementation's
# tests run (-k "not python", -m "not slow"), with few hypothesis examples (MEMCHECK_EXAMPLES,
# default 25).
# Under valgrind, PYTHONMALLOC=malloc makes every Python allocation visible, and
# scripts/valgrind-python.supp removes CPython's own uninitialised-value noise (never an
# invalid read/write, never a frame inside an extension).  Leak checking is off: CPython
# does not free everything at exit.
#
# Prints the error count and exits 1 if there is any error (or a test failure).
# Environment: MEMCHECK_TOOL=valgrind|asan, MEMCHECK_DIR, MEMCHECK_EXTENSIONS, MEMCHECK_REUSE=1
# (skip the copy and build when $MEMCHECK_DIR already holds a build for this tool)
# (default _codec,_frame,_backend), MEMCHECK_EXAMPLES, PYTHON (default .venv/bin/python).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
TOOL="${MEMCHECK_TOOL:-valgrind}"
DIR="${MEMCHECK_DIR:-/tmp/skippy_memcheck}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
EXTS="${MEMCHECK_EXTENSIONS:-_codec,_frame,_backend}"
EXAMPLES="${MEMCHECK_EXAMPLES:-25}"
SUPP="$ROOT/scripts/valgrind-python.supp"


if [ "${MEMCHECK_REUSE:-0}" = 1 ] && [ -f "$DIR/.built-$TOOL" ]; then
    echo "== memcheck ($TOOL): reusing the build in $DIR (MEMCHECK_REUSE=1)"
    cd "$DIR"
else
echo "== memcheck ($TOOL): copying the tree to $DIR"
rm -rf "$DIR"
mkdir -p "$DIR"
tar -C "$ROOT" -c --exclude ./.git --exclude ./.venv --exclude ./build --exclude '*.so' \
    --exclude .hypothesis --exclude __pycache__ --exclude ./fuzz/corpus --exclude ./fuzz/findings \
    --exclude ./models . | tar -C "$DIR" -x
cd "$DIR"

echo "== building $EXTS (debug${TOOL:+, $TOOL})"
BUILD_ENV=(SKIPPY_WIRE_BUILD_ONLY="$EXTS" SKIPPY_WIRE_DEBUG_BUILD=1)
[ "$TOOL" = asan ] && BUILD_ENV+=(SKIPPY_WIRE_ASAN=1)
env "${BUILD_ENV[@]}" "$PY" setup.py build_ext --inplace >"$DIR/build.log" 2>&1 || {
    tail -40 "$DIR/build.log"; echo "memcheck: build failed"; exit 2; }
ls skippy_wire/*/*.so
touch "$DIR/.built-$TOOL"
fi

# The tests that drive the compiled code: codec, framing (and replies), backend, fuzz, limits
# (listed from the copy, which is what runs).
DEFAULT_TESTS=()
for t in tests/test_codec*.py tests/test_vectors_*.py tests/test_frame*.py tests/test_parity*.py \
         tests/test_replies.py tests/test_fuzz_*.py tests/test_limits.py tests/test_backend.py; do
    [ -e "$t" ] && DEFAULT_TESTS+=("$t")
done
if [ "$#" -gt 0 ]; then TESTS=("$@"); else TESTS=("${DEFAULT_TESTS[@]}"); fi

# Fewer hypothesis examples: a plugin loaded after conftest's own profile choice.
cat >"$DIR/_memcheck_profile.py" <<EOF
from hypothesis import HealthCheck, settings
def pytest_configure(config):
    settings.register_profile("memcheck", max_examples=$EXAMPLES, deadline=None,
                              suppress_health_check=list(HealthCheck))
    settings.load_profile("memcheck")
EOF

# valgrind runs one thread at a time, so a test that needs another Python thread to run
# during a compiled call (GIL released) cannot pass under it: deselected there.
SELECT="not python"
[ "$TOOL" = valgrind ] && SELECT="not python and not release_the_gil"
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -p _memcheck_profile -m "not slow" -k "$SELECT" "${TESTS[@]}")
LOG="$DIR/memcheck.log"
export PYTHONPATH="$DIR${PYTHONPATH:+:$PYTHONPATH}" SKIPPY_WIRE_IMPL=cython PYTHONDONTWRITEBYTECODE=1
# The copy is not beside ../shared: point the tests at the golden vectors explicitly.
export SKIPPY_WIRE_VECTORS="${SKIPPY_WIRE_VECTORS:-$(cd "$ROOT/.." && pwd)/shared/vectors/public}"
status=0
case "$TOOL" in
valgrind)
    echo "== valgrind memcheck: ${TESTS[*]}"
    PYTHONMALLOC=malloc valgrind --tool=memcheck --error-exitcode=99 --leak-check=no \
        --num-callers=40 --suppressions="$SUPP" --log-file="$LOG" \
        "${PYTEST[@]}" || status=$?
    summary=$(grep "ERROR SUMMARY" "$LOG" | tail -1 || true)
    errors=$(sed -n 's/.*ERROR SUMMARY: \([0-9]*\) errors.*/\1/p' <<<"$summary")
    echo "valgrind: $summary"
    echo "valgrind: full log in $LOG"
    if [ "${errors:-1}" != 0 ]; then
        grep -B2 -A30 -E "== (Invalid|Conditional|Use of|Syscall|Mismatched|Source and|Argument)" "$LOG" | head -200
        echo "memcheck: ${errors:-?} valgrind error(s)"
        exit 1
    fi
    ;;
asan)
    echo "== AddressSanitizer: ${TESTS[*]}"
    LD_PRELOAD="$(gcc -print-file-name=libasan.so)" \
    ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:halt_on_error=1:log_path=$DIR/asan" \
        "${PYTEST[@]}" || status=$?
    if ls "$DIR"/asan.* >/dev/null 2>&1; then
        cat "$DIR"/asan.* | head -100
        echo "memcheck: AddressSanitizer reported errors (logs: $DIR/asan.*)"
        exit 1
    fi
    echo "asan: 0 errors"
    ;;
*)
    echo "MEMCHECK_TOOL must be valgrind or asan"; exit 2 ;;
esac
if [ "$status" != 0 ]; then
    echo "memcheck: the tests failed under $TOOL (exit $status); see $LOG"
    exit 1
fi
echo "memcheck: 0 errors"
