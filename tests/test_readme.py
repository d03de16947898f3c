"""The README's shape: a short embedding example, a two-command quickstart."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_example_is_short():
    # it runs, with its output checked, in tests/test_doc_examples.py
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    (code,) = re.findall(r"## Embedding\n\n```python\n(.*?)```", text, re.DOTALL)
    assert len(code.splitlines()) <= 32


def test_quickstart_has_exactly_two_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    (block,) = re.findall(
        r"## Quickstart\n\n(?:<!-- example: \w+ -->\n)?```sh\n(.*?)```", text, re.DOTALL
    )
    lines = [line for line in block.splitlines() if line.strip()]
    assert len(lines) == 2
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "python3 -m pytest" in lines[1] and "python3 -m pytest" in ci
