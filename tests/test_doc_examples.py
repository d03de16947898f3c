"""Every code block of README.md and docs/*.md runs here, or is checked as far as it can be.

A page's blocks run in order, in one fresh directory per page, so later blocks build on the
files and stores of earlier ones (the tutorial is one program in sequence). What a block is
comes from its info string and, optionally, a marker on the line right before its fence:

| info string | marker | what the test does |
|---|---|---|
| ``python`` | none | runs it as a script (``python3 block.py``) |
| ``python`` | ``<!-- example: file NAME -->`` | writes it to NAME for later blocks; compiles it |
| ``python`` | ``<!-- example: prelude NAME -->`` | runs it after the prelude NAME below, which
  defines the names the block takes from its page's context (``agent``, ``store`` ...);
  top-level ``await`` runs under ``trio.run`` |
| ``python`` | ``<!-- example: fragment -->`` | compiles it (top-level ``await`` allowed) |
| ``sh`` | none | runs it with ``bash -euo pipefail``, ``treadle`` and ``python3`` on the PATH |
| ``sh`` | ``<!-- example: fragment -->`` | parses every ``treadle`` command line with the real
  command-line interface: each command and option must exist and each value parse |
| ``text`` | none | output, diagrams and synopses: not code, nothing to run |

Any other block (no info string, another language, an unknown marker) fails the test, so a
new block cannot go unchecked by accident.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import attrs
import click
import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT_S = 60

_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^<!-- example: (?P<kind>[\w-]+)(?: (?P<arg>\S+))? -->$")

# The names blocks marked `prelude NAME` take from the prose around them.
_AGENT = '''
import trio
import treadle
from treadle.testing import ScriptedModel, call, say

@treadle.tool
async def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b

@treadle.tool
async def get_weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"

class _Payments:  # a payment provider's client
    fences: dict[str, int] = {}

    async def fence(self, run_id: str, token: int) -> None:
        self.fences[run_id] = max(token, self.fences.get(run_id, 0))

    async def lookup(self, idempotency_key: str) -> str | None:
        return None

    async def charge(self, amount: int, idempotency_key: str, fencing_token: int = 0) -> str:
        return "charged"

payments = _Payments()
agent = treadle.Agent(
    model=ScriptedModel(turns=[call("add", a=2, b=3), say("5")]),
    executor=treadle.Toolbox([add]),
    parser=treadle.NativeToolCallParser(),
)
store = treadle.MemoryStore()

def make_agent(started: treadle.types.RunStarted) -> treadle.Agent:
    return agent
'''
_OTEL = """
from opentelemetry.sdk.trace import TracerProvider
from treadle.sinks.otel import OpenTelemetrySink

provider = TracerProvider()
"""
PRELUDES = {"agent": _AGENT, "otel": _AGENT + _OTEL}

_RUNNER = """
import ast as _ast
import inspect as _inspect
import trio as _trio

_code = compile(_SOURCE, _NAME, "exec", flags=_ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
if _code.co_flags & _inspect.CO_COROUTINE:
    async def _main() -> None:
        await eval(_code, globals())

    _trio.run(_main)
else:
    exec(_code, globals())
"""

# What some blocks must print, by page and by a line the block contains.
EXPECTED_OUTPUT = {
    ("README.md", "trio.run(main)"): ["succeeded final_answer 2 + 3 = 5", "run_finished"],
    # every run takes its steps to the payment and the answer: the faults are injected into them
    ("tutorial.md", "python3 simulate_payments.py"): [
        "100 seeds, 241 faults injected, failing seeds: []"
    ],
}


@attrs.frozen
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    info: str
    marker: str | None
    arg: str | None
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        fence = _FENCE.match(lines[index])
        if fence is None:
            index += 1
            continue
        end = index + 1
        while lines[end].strip() != "```":
            end += 1
        before = lines[index - 1].strip() if index else ""
        marker = _MARKER.match(before)
        if before.startswith("<!-- example") and marker is None:
            raise AssertionError(f"{page}:{index}: malformed marker {before!r}")
        found.append(
            Block(
                page=page,
                line=index + 1,
                info=fence.group(1),
                marker=marker.group("kind") if marker else None,
                arg=marker.group("arg") if marker else None,
                code="\n".join(lines[index + 1 : end]) + "\n",
            )
        )
        index = end + 1
    return found


def _tools_dir(tmp_path: Path) -> Path:
    """A directory with ``treadle`` and ``python3`` running this interpreter and this treadle."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, command in (("treadle", f"{sys.executable} -m treadle"), ("python3", sys.executable)):
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\nexec {command} "$@"\n', encoding="utf-8")
        script.chmod(0o755)
    return bin_dir


def _env(bin_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TREADLE_STORE"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["COLUMNS"] = "100"
    return env


def _compile(block: Block) -> None:
    compile(block.code, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


def _run(command: list[str], block: Block, workdir: Path, env: dict[str, str]) -> str:
    done = subprocess.run(
        command,
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, (
        f"{block.where} failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}"
    )
    return done.stdout


def _commands(code: str) -> list[list[str]]:
    """The simple commands of a shell block: lines joined, comments and operators split off."""
    commands: list[list[str]] = []
    for line in code.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current: list[str] = []
        for token in lexer:
            if token in ("&&", "||", ";", "|", "&"):
                commands.append(current)
                current = []
            else:
                current.append(token)
        commands.append(current)
    return [c for c in commands if c]


def _treadle_args(command: list[str]) -> list[str] | None:
    """The arguments of a ``treadle`` command line (also ``python3 -m treadle``), else None."""
    while command and re.match(r"^[A-Z_][A-Z0-9_]*=", command[0]):
        command = command[1:]  # VAR=value prefixes
    if command[:1] == ["treadle"]:
        return command[1:]
    if command[:3] in (["python3", "-m", "treadle"], ["python", "-m", "treadle"]):
        return command[3:]
    return None


def check_command_line(args: list[str], env: dict[str, str]) -> None:
    """Parse ``treadle ARGS`` as the real command would, without running it."""
    from treadle.cli import main

    saved = dict(os.environ)
    os.environ.update(env)
    try:
        command: click.Command = main
        context = command.make_context("treadle", list(args))
        while isinstance(command, click.Group):
            rest = [*context._protected_args, *context.args]
            if not rest and command.invoke_without_command:
                break
            name, sub, rest = command.resolve_command(context, rest)
            assert sub is not None and name is not None, f"no command in {args}"
            command, context = sub, sub.make_context(name, rest, parent=context)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _check_fragment_commands(block: Block) -> None:
    env: dict[str, str] = {}
    checked = 0
    for command in _commands(block.code):
        if command[0] == "export":
            key, _, value = command[1].partition("=")
            env[key] = value
            continue
        args = _treadle_args(command)
        if args is None:
            continue
        try:
            check_command_line(args, env)
        except click.ClickException as exc:
            raise AssertionError(f"{block.where}: treadle {shlex.join(args)}: {exc}") from exc
        checked += 1
    assert checked, f"{block.where}: a checked shell block without a treadle command"


def run_page(page: Path, workdir: Path, bin_dir: Path) -> dict[int, str]:
    """Run or check every block of ``page`` in order; return each run block's output by line."""
    env = _env(bin_dir)
    outputs: dict[int, str] = {}
    for number, block in enumerate(blocks_of(page)):
        kind = (block.info, block.marker)
        if kind == ("text", None):
            continue
        if kind == ("python", "file"):
            assert block.arg, f"{block.where}: `file` needs a file name"
            _compile(block)
            (workdir / block.arg).write_text(block.code, encoding="utf-8")
        elif kind == ("python", None):
            script = workdir / f"_block{number}.py"
            script.write_text(block.code, encoding="utf-8")
            outputs[block.line] = _run([sys.executable, str(script)], block, workdir, env)
        elif kind == ("python", "prelude"):
            assert block.arg in PRELUDES, f"{block.where}: no prelude {block.arg!r}"
            _compile(block)
            script = workdir / f"_block{number}.py"
            source = (
                f"_SOURCE = {json.dumps(block.code)}\n_NAME = {json.dumps(block.where)}\n"
                + PRELUDES[block.arg]
                + _RUNNER
            )
            script.write_text(source, encoding="utf-8")
            outputs[block.line] = _run([sys.executable, str(script)], block, workdir, env)
        elif kind == ("python", "fragment"):
            _compile(block)
        elif kind == ("sh", None):
            outputs[block.line] = _run(
                ["bash", "-euo", "pipefail", "-c", block.code], block, workdir, env
            )
        elif kind == ("sh", "fragment"):
            _check_fragment_commands(block)
        else:
            raise AssertionError(
                f"{block.where}: no handling for a ```{block.info} block marked {block.marker!r}"
                " (see this module's docstring)"
            )
    return outputs


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_examples(page, tmp_path):
    workdir = tmp_path / "work"
    workdir.mkdir()
    bin_dir = _tools_dir(tmp_path)
    outputs = run_page(page, workdir, bin_dir)
    for (name, line_in_block), expected in EXPECTED_OUTPUT.items():
        if page.name != name:
            continue
        (line,) = [b.line for b in blocks_of(page) if line_in_block in b.code]
        for text in expected:
            assert text in outputs[line], (text, outputs[line])
    if page.name == "tutorial.md":
        check_tutorial_world(workdir)
        check_tutorial_simulation_catches_a_second_payment(workdir, _env(bin_dir))


def check_tutorial_world(workdir: Path) -> None:
    """The tutorial's ledger: one payment despite the crash, the two approved refunds only."""
    entries = [json.loads(line) for line in (workdir / "ledger.jsonl").read_text().splitlines()]
    moved = [(e["kind"], e["invoice"]) for e in entries]
    assert moved == [("payment", 17), ("refund", 18), ("refund", 19)]


def check_tutorial_simulation_catches_a_second_payment(workdir: Path, env: dict[str, str]) -> None:
    """The tutorial's simulation finds the bug its section 7 says it finds.

    With ``pay_invoice`` declared ``replay=SAFE`` instead of its reconcile hook, 6 of the 100
    seeds fail, seed 46 with ``sim-46-0: paid 2 times`` (docs/tutorial.md, "7. Simulation
    under seeded faults"). A simulation whose runs never reach the payment passes every seed.
    """
    buggy = workdir / "safe_payment"
    buggy.mkdir()
    for block in blocks_of(ROOT / "docs" / "tutorial.md"):
        if block.marker == "file" and block.arg is not None:
            (buggy / block.arg).write_text(block.code, encoding="utf-8")
    source = (buggy / "bookkeeping.py").read_text(encoding="utf-8")
    declared = "@treadle.tool(reconcile=moved)  # replay policy"
    assert source.count(declared) == 1, "pay_invoice's declaration moved: update this check"
    safe = source.replace(declared, "@treadle.tool(replay=treadle.ReplayPolicy.SAFE)  #")
    (buggy / "bookkeeping.py").write_text(safe, encoding="utf-8")
    seeds = subprocess.run(
        [sys.executable, "simulate_payments.py"],
        cwd=buggy,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    failing = re.search(r"failing seeds: \[([\d, ]*)\]", seeds.stdout)
    assert failing is not None, (seeds.stdout, seeds.stderr)
    numbers = [int(n) for n in failing.group(1).split(",") if n.strip()]
    assert len(numbers) == 6 and 46 in numbers, seeds.stdout
    simulate = ["simulate", "--agent", "simulate_payments:scenario", "--from", "46", "--seeds", "1"]
    one = subprocess.run(
        [sys.executable, "-m", "treadle", *simulate],
        cwd=buggy,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert one.returncode == 1, (one.returncode, one.stderr)
    assert "seed 46 failed: sim-46-0: paid 2 times" in one.stdout + one.stderr


def test_every_block_has_a_handling():
    """No block escapes: each page's blocks are all of a known kind (checked without running)."""
    known = {
        ("text", None),
        ("python", None),
        ("python", "file"),
        ("python", "prelude"),
        ("python", "fragment"),
        ("sh", None),
        ("sh", "fragment"),
    }
    unknown = [
        f"{b.where}: ```{b.info} {b.marker or ''}"
        for page in PAGES
        for b in blocks_of(page)
        if (b.info, b.marker) not in known
    ]
    assert unknown == []


def test_unrunnable_blocks_are_few():
    """Blocks only compiled or parsed, not run: kept to the ones that need what CI lacks."""
    fragments = [b.where for page in PAGES for b in blocks_of(page) if b.marker == "fragment"]
    assert len(fragments) <= 10, fragments


def test_command_line_check_refuses_what_does_not_exist():
    with pytest.raises(click.UsageError):
        check_command_line(["runs", "--no-such-option"], {})
    with pytest.raises(click.UsageError):
        check_command_line(["no-such-command"], {})
    with pytest.raises(click.BadParameter):
        check_command_line(["simulate", "--seeds", "many"], {})
    check_command_line(["show", "RUN_ID", "--store", "runs.db"], {})
