#!/usr/bin/env bash
# The wire kernels (codecs and framing, compiled and twin) built and tested on another CPython,
# PYTHON (e.g. 3.13, which keeps a plain instance's attributes inline), in .venv-wire-VERSION:
# the conformance vectors given and the framing tests.  The ggml backend is not built.
#   bash scripts/test_wire_on.sh PYTHON [VECTOR_DIR ...]
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:?usage: bash scripts/test_wire_on.sh PYTHON [VECTOR_DIR ...]}; shift
venv=.venv-wire-$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
# the versions pyproject.toml asks for, of what the wire modules build and test with
requirements=$("$venv/bin/python" - <<'PY'
import re
import tomllib

with open("pyproject.toml", "rb") as fh:
    project = tomllib.load(fh)
specs = (project["build-system"]["requires"] + project["project"]["dependencies"]
         + project["project"]["optional-dependencies"]["test"])
wanted = {"setuptools", "cython", "numpy", "ml_dtypes", "pytest", "hypothesis"}
print(" ".join(dict.fromkeys(s for s in specs if re.split(r"[<>=!~ ]", s)[0].lower() in wanted)))
PY
)
"$venv/bin/python" -m pip install -q $requirements
for module in _codec _frame _frame_gen; do
  SKIPPY_WIRE_BUILD_ONLY=$module "$venv/bin/python" setup.py -q build_ext --inplace
done
for dir in "$@"; do
  for impl in cython python; do
    "$venv/bin/python" -m skippy_wire conformance "$dir" --impl "$impl"
  done
done
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_frame.py tests/test_frame_stream.py \
  tests/test_parity_frame.py tests/test_parity_frame_gen.py tests/test_codec.py tests/test_vectors_frame.py
