"""The README's embedding example runs as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_example_runs(tmp_path):
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    (code,) = re.findall(r"## Embedding\n\n```python\n(.*?)```", text, re.DOTALL)
    assert len(code.splitlines()) <= 32
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert done.returncode == 0, done.stderr
    assert "succeeded final_answer 2 + 3 = 5" in done.stdout
    assert "run_finished" in done.stdout
    assert (tmp_path / "runs.db").exists()


def test_quickstart_has_exactly_two_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"## Quickstart\n\n```sh\n(.*?)```", text, re.DOTALL)
    lines = [line for line in block.splitlines() if line.strip()]
    assert len(lines) == 2
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "python3 -m pytest" in lines[1] and "python3 -m pytest" in ci
