"""``treadle probe``: one streaming call to an OpenAI-compatible endpoint, printed as JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import cattrs
import click

from treadle._cli_common import run_async
from treadle.types import Message, ToolSpec

_PLAIN = cattrs.Converter()


@click.command("probe")
@click.option("--base-url", required=True, help="API root, e.g. http://127.0.0.1:8000/v1")
@click.option("--model", required=True, help="Model name.")
@click.option("--api-key-env", default=None, help="Environment variable holding the API key.")
@click.option(
    "--tools",
    "tools_file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="JSON file: a list of tools ({name, description, parameters}).",
)
@click.option(
    "--messages",
    "messages_file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="JSON file: a list of chat messages to send.",
)
@click.option("--max-attempts", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True, help="Print JSON (the only output form).")
def probe(
    base_url: str,
    model: str,
    api_key_env: str | None,
    tools_file: str | None,
    messages_file: str | None,
    max_attempts: int,
    as_json: bool,
) -> None:
    """Make one streaming call and print the assembled reply as JSON."""
    from treadle.models._probe import probe as probe_endpoint
    from treadle.parsers import NativeToolCallParser

    api_key = _api_key(api_key_env)
    tools = _load_tools(tools_file) if tools_file else ()
    messages = _load_messages(messages_file) if messages_file else None

    async def go() -> dict[str, Any]:
        return await probe_endpoint(
            base_url=base_url,
            model=model,
            api_key=api_key,
            tools=tools,
            messages=messages,
            max_attempts=max_attempts,
        )

    report = run_async(go)
    if tools and report.get("error") is None:
        report["decision"] = _decision(report, tools, NativeToolCallParser())
    click.echo(json.dumps(report, ensure_ascii=False))


def _api_key(env: str | None) -> str | None:
    if env is None:
        return None
    value = os.environ.get(env)
    if not value:
        raise click.BadParameter(
            f"environment variable {env} is not set", param_hint="--api-key-env"
        )
    return value


def _load_tools(path: str) -> tuple[ToolSpec, ...]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    items = data if isinstance(data, list) else data.get("tools", [])
    specs = []
    for item in items:
        spec = item.get("function", item) if isinstance(item, dict) else item
        specs.append(_PLAIN.structure(spec, ToolSpec))
    return tuple(specs)


def _load_messages(path: str) -> tuple[Message, ...]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return tuple(Message(role=m["role"], content=m.get("content")) for m in data)


def _decision(report: dict[str, Any], tools: tuple[ToolSpec, ...], parser: Any) -> dict[str, Any]:
    from treadle.types import ModelReply, ToolCall

    reply = ModelReply(
        text=report.get("text"),
        tool_calls=tuple(
            ToolCall(id=c["id"], name=c["name"], arguments=c["arguments"])
            for c in report.get("tool_calls", [])
        ),
        finish_reason=report.get("finish_reason"),
    )
    parsed = parser.parse(reply, tools)
    return {
        "kind": parsed.kind.value,
        "actions": [
            {"id": a.id, "name": a.name, "arguments": dict(a.arguments)} for a in parsed.actions
        ],
        "text": parsed.text,
        "feedback": parsed.feedback,
        "repairs": list(parsed.repairs),
    }
