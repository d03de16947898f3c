"""The documentation site builds without a warning, and every page is in its navigation."""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def test_mkdocs_build_is_strictly_clean(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    # the API reference was generated from the docstrings, not left empty
    api = (tmp_path / "site" / "api" / "treadle" / "index.html").read_text(encoding="utf-8")
    for name in ("treadle.run", "treadle.open_run", "treadle.Agent", "treadle.tool"):
        assert f'id="{name}"' in api, name


def test_every_page_is_in_the_navigation():
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\s*- (?:[^:\n]+: )?([\w./-]+\.md)\s*$", config, re.MULTILINE))
    pages = {str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md")}
    assert pages - listed == set()
    assert listed - pages == set()


def test_no_doc_or_docstring_cites_internal_briefs():
    cited = []
    for base in (ROOT / "src", DOCS, ROOT / "README.md", ROOT / "examples"):
        files = [base] if base.is_file() else [*base.rglob("*.py"), *base.rglob("*.md")]
        for path in files:
            text = path.read_text(encoding="utf-8")
            if re.search(r"\b(DESIGN|STYLE)(\.md)?\b", text):
                cited.append(str(path.relative_to(ROOT)))
    assert cited == []


def _headings(page: Path) -> set[str]:
    """A page's headings, lower case; "1. Model client — `...`" also as "model client"."""
    found = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(title)
            found.add(re.sub(r"^\d+\.\s*", "", title).split(" — ")[0])
    return found


def test_cited_doc_sections_exist():
    """Every `docs/<page>.md, "Section"` cited in code or docs names a heading of that page."""
    wrong = []
    sources = [*(ROOT / "src").rglob("*.py"), *DOCS.rglob("*.md"), ROOT / "README.md"]
    for source in sources:
        text = source.read_text(encoding="utf-8")
        for page in re.findall(r"docs/[\w./-]+\.md", text):
            if not (ROOT / page).exists():
                wrong.append(f"{source.relative_to(ROOT)}: {page} does not exist")
        # a citation may be broken over lines (and over comment markers)
        flat = re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)
        for page, section in re.findall(r'(docs/[\w-]+\.md),? "([^"]+)"', flat):
            if (ROOT / page).exists() and section.lower() not in _headings(ROOT / page):
                wrong.append(f'{source.relative_to(ROOT)}: {page} has no section "{section}"')
    assert wrong == []


def test_the_events_page_lists_every_event_kind():
    """docs/events.md's table of event types left out ``definition_accepted``: every
    `EventKind` has a row there, and every row is a kind."""
    from treadle.types import EventKind

    text = (DOCS / "events.md").read_text(encoding="utf-8")
    section = text.split("## Event types", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `(\w+)`(?: / `(\w+)`)? \|", section, re.MULTILINE))
    documented = {kind for row in rows for kind in row if kind}
    assert documented == {kind.value for kind in EventKind}


def test_the_seams_page_lists_every_operation_of_each_store_capability():
    """docs/seams.md's capability table left ``wake`` out of ``RunQueue``: a store built from
    it was no RunQueue. Each row names exactly the methods of its Protocol in
    `treadle.ports`."""
    from treadle import ports

    text = (DOCS / "seams.md").read_text(encoding="utf-8")
    section = text.split("| capability | operations | contract |", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", section, re.MULTILINE)
    assert {name for name, _ in rows} == {"LeaseStore", "ControlStream", "RunIndex", "RunQueue"}
    for name, operations in rows:
        protocol = getattr(ports, name)
        methods = {m for m, value in vars(protocol).items() if callable(value) and m[0] != "_"}
        assert set(re.findall(r"`(\w+)", operations)) == methods, name


def _documented_names(doc: str) -> list[str]:
    """The names an ``Args:`` or ``Attributes:`` section of a docstring lists, in order."""
    names = []
    for section in re.finditer(r"^(?:Args|Attributes):\n((?:(?:    .*)?\n?)*)", doc, re.MULTILINE):
        names += re.findall(r"^    (\w+)(?: \([^)]*\))?:", section.group(1), re.MULTILINE)
    return names


def test_every_attribute_the_api_reference_documents_exists():
    """`ModelResult`'s docstring listed ``history_text`` and ``visible_chars``, which it never
    had. Each name an ``Args:`` or ``Attributes:`` section of an attrs class in a module the
    API reference renders lists is a field (or its argument) or an attribute of the class."""
    modules = {
        name
        for page in (DOCS / "api").glob("*.md")
        for name in re.findall(r"^::: ([\w.]+)", page.read_text(encoding="utf-8"), re.MULTILINE)
    }
    classes = {
        value
        for module in map(importlib.import_module, sorted(modules))
        for name, value in vars(module).items()
        if not name.startswith("_") and inspect.isclass(value) and attrs.has(value)
    }
    assert len(classes) > 50  # the records of treadle.types among them
    wrong = []
    for cls in classes:
        known = {name for f in attrs.fields(cls) for name in (f.name, f.alias)}
        for name in _documented_names(inspect.getdoc(cls) or ""):
            if name not in known and not hasattr(cls, name):
                wrong.append(f"{cls.__module__}.{cls.__qualname__}.{name}")
    assert sorted(wrong) == []


def _cli_options() -> set[str]:
    """Every long option (``--name``) of `treadle` and its commands, ``--help`` included."""
    import click

    from treadle.cli import main

    context = click.Context(main)
    found = {"--help"}
    commands: list[click.Command] = [main]
    while commands:
        command = commands.pop()
        for param in command.params:
            found.update(o for o in (*param.opts, *param.secondary_opts) if o.startswith("--"))
        if isinstance(command, click.Group):
            for name in command.list_commands(context):
                sub = command.get_command(context, name)
                assert sub is not None, name
                commands.append(sub)
    return found


def test_every_cli_option_the_docs_name_exists():
    """docs/fleet.md named an ``--owner`` option that no command has. Each `--name` a page
    quotes is an option of some `treadle` command (decision records keep their history, and
    may name another program's options)."""
    options = _cli_options()
    assert {"--store", "--agent", "--follow", "--no-follow"} <= options
    unknown = []
    for page in sorted(DOCS.rglob("*.md")):
        if page.parent.name == "decisions":
            continue
        text = page.read_text(encoding="utf-8")
        for option in re.findall(r"`(--[a-z][a-z0-9-]*)`", text):
            if option not in options:
                unknown.append(f"{page.relative_to(DOCS)}: {option}")
    assert unknown == []


def test_the_docs_say_treadle_leaves_the_collector_alone_only_as_a_library():
    """docs/performance.md said twice that treadle never changes the collector's settings,
    while its "Garbage collection" section (and the code) has `treadle worker` raise the
    youngest generation's threshold and freeze what it loaded. Each sentence saying treadle
    leaves the collector alone says it of treadle as a library."""
    claims = []
    for page in sorted(DOCS.rglob("*.md")):
        text = " ".join(page.read_text(encoding="utf-8").split())
        for sentence in re.split(r"(?<=[.;:])\s", text):
            if "collector" in sentence and re.search(
                r"treadle (?:does not|doesn't|never) change|treadle leaves", sentence
            ):
                claims.append((page.relative_to(DOCS), sentence))
    assert claims, "the performance page says what treadle does with the collector"
    assert [c for c in claims if "as a library" not in c[1].lower()] == []
