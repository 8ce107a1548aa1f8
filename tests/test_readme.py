"""The README's Python example runs and does what its comments say."""

import re

from conftest import REPO

import skippy_wire as sw


def test_readme_example_runs():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    names: dict = {}
    exec(compile(code, "README.md", "exec"), names)
    assert names["codec"] is sw.ActivationCodec.BF16_RNE_V1
    assert bytes(names["view"]) == names["wire"]


def test_readme_starts_with_the_two_setup_commands():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    block = lines[lines.index("```sh") + 1:lines.index("```sh") + 3]
    assert block[0].endswith(".venv/bin/skippy-wire") and block[1] == "bash scripts/test.sh"
