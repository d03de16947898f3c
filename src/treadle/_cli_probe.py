"""``treadle probe``: one call to a model endpoint, reported as the JSON a run would record.

The call goes through the client a run uses (``--protocol openai``: `OpenAIChatClient`;
``anthropic``: `AnthropicMessagesClient`), and the reply is parsed by the run's decision
parser, so the decision printed is the one a run would make (docs/models.md, "Probing an
endpoint"). The exit status is 0 when the endpoint answered, 1 when the call failed (the JSON
then holds the error), 2 for bad arguments or input files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click

from treadle._cli_common import printable_json, run_async
from treadle._credentials import check_base_url
from treadle._exceptions import UsageError
from treadle.types import JSONValue, Message, ToolCall, ToolSpec

ROLES = ("system", "user", "assistant", "tool")


@click.command("probe")
@click.option("--base-url", required=True, help="API root, e.g. http://127.0.0.1:8000/v1")
@click.option("--model", required=True, help="Model name.")
@click.option(
    "--protocol",
    type=click.Choice(["openai", "anthropic"]),
    default="openai",
    show_default=True,
    help="OpenAI chat completions, or Anthropic Messages (--base-url as that client takes it).",
)
@click.option("--api-key-env", default=None, help="Environment variable holding the API key.")
@click.option(
    "--tools",
    "tools_file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="JSON file: a list of tools ({name, description, parameters}, or OpenAI's "
    '{"type": "function", "function": {...}}).',
)
@click.option(
    "--messages",
    "messages_file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="JSON file: a list of chat messages (OpenAI's shape: tool_calls and tool_call_id kept).",
)
@click.option("--max-attempts", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True, help="Print JSON (the only output form).")
def probe(
    base_url: str,
    model: str,
    protocol: str,
    api_key_env: str | None,
    tools_file: str | None,
    messages_file: str | None,
    max_attempts: int,
    as_json: bool,
) -> None:
    """Make one streaming call and print the assembled reply as JSON."""
    from treadle.models import probe as probe_endpoint

    try:
        check_base_url(base_url)
    except UsageError as exc:
        raise click.BadParameter(str(exc), param_hint="--base-url") from exc
    api_key = _api_key(api_key_env)
    tools = load_tools(tools_file) if tools_file else ()
    messages = load_messages(messages_file) if messages_file else None

    async def go() -> dict[str, Any]:
        return await probe_endpoint(
            base_url=base_url,
            model=model,
            api_key=api_key,
            tools=tools,
            messages=messages,
            max_attempts=max_attempts,
            protocol="anthropic" if protocol == "anthropic" else "openai",
        )

    report = run_async(go)
    click.echo(printable_json(report))
    if report["error"] is not None:
        raise SystemExit(1)


def _api_key(env: str | None) -> str | None:
    if env is None:
        return None
    value = os.environ.get(env)
    if not value:
        raise click.BadParameter(
            f"environment variable {env} is not set", param_hint="--api-key-env"
        )
    return value


def _read_json(path: str, option: str) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise click.BadParameter(f"{path}: cannot be read: {exc}", param_hint=option) from exc
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"{path}: not JSON: {exc}", param_hint=option) from exc


def load_tools(path: str) -> tuple[ToolSpec, ...]:
    """The tools of a ``--tools`` file: a JSON list (or ``{"tools": [...]}``) of tool objects.

    Each is ``{name, description?, parameters?}`` or OpenAI's ``{"type": "function",
    "function": {...}}``.

    Raises:
        click.BadParameter: the file is not JSON, lists no tools, or an entry has the wrong
            shape (the message names the file and the entry).
    """
    data = _read_json(path, "--tools")
    items = data.get("tools") if isinstance(data, dict) else data
    if not isinstance(items, list) or not items:
        raise click.BadParameter(
            f'{path}: expected a non-empty JSON list of tools (or {{"tools": [...]}}); '
            "leave --tools out to offer none",
            param_hint="--tools",
        )
    return tuple(_tool(path, index, item) for index, item in enumerate(items))


def _tool(path: str, index: int, item: Any) -> ToolSpec:
    where = f"{path}: tool {index}"
    if isinstance(item, dict) and item.get("type") == "function" and "function" not in item:
        raise click.BadParameter(
            f'{where}: a {{"type": "function"}} tool needs its \'function\' object',
            param_hint="--tools",
        )
    spec = item.get("function", item) if isinstance(item, dict) else item
    if not isinstance(spec, dict):
        raise click.BadParameter(f"{where}: expected an object", param_hint="--tools")
    unknown = sorted(set(spec) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise click.BadParameter(
            f"{where}: unknown keys {', '.join(unknown)}", param_hint="--tools"
        )
    name, description = spec.get("name"), spec.get("description", "")
    parameters = spec.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(name, str) or not name:
        raise click.BadParameter(
            f"{where}: 'name' must be a non-empty string", param_hint="--tools"
        )
    if not isinstance(description, str):
        raise click.BadParameter(f"{where}: 'description' must be a string", param_hint="--tools")
    if not isinstance(parameters, dict):
        raise click.BadParameter(
            f"{where}: 'parameters' must be a JSON-schema object", param_hint="--tools"
        )
    return ToolSpec(name=name, description=description, parameters=parameters)


def load_messages(path: str) -> tuple[Message, ...]:
    """The conversation of a ``--messages`` file, in OpenAI's chat shape.

    A message is ``{role, content, tool_calls?, tool_call_id?, name?}``; an assistant's
    ``tool_calls`` are ``{"id", "type": "function", "function": {"name", "arguments"}}``
    (``arguments`` a JSON text or object) and are kept, as is a tool message's
    ``tool_call_id``, so the request is one a server accepts.

    Raises:
        click.BadParameter: the file is not JSON, lists no messages, or a message has the
            wrong shape (the message names the file and the entry).
    """
    data = _read_json(path, "--messages")
    if isinstance(data, dict) and set(data) == {"messages"}:
        data = data["messages"]  # a request body's `messages`, as it stands
    if not isinstance(data, list) or not data:
        raise click.BadParameter(
            f'{path}: expected a non-empty JSON list of messages (or {{"messages": [...]}})',
            param_hint="--messages",
        )
    return tuple(_message(f"{path}: message {index}", item) for index, item in enumerate(data))


def _message(where: str, item: Any) -> Message:
    def bad(text: str) -> click.BadParameter:
        return click.BadParameter(f"{where}: {text}", param_hint="--messages")

    if not isinstance(item, dict):
        raise bad("expected an object")
    unknown = sorted(set(item) - {"role", "content", "tool_calls", "tool_call_id", "name"})
    if unknown:
        raise bad(f"unknown keys {', '.join(unknown)}")
    role, content = item.get("role"), _content(item.get("content"))
    if role not in ROLES:
        raise bad(f"'role' must be one of {', '.join(ROLES)}, got {role!r}")
    if content is _NOT_TEXT:
        raise bad("'content' must be a string, a list of text parts, or null")
    if content is None and role in ("system", "user"):
        raise bad(f"a {role} message needs 'content'")
    calls = tuple(_call(where, i, c) for i, c in enumerate(item.get("tool_calls") or ()))
    if calls and role != "assistant":
        raise bad("only an assistant message has tool_calls")
    call_id = item.get("tool_call_id")
    if role == "tool" and not isinstance(call_id, str):
        raise bad("a tool message needs 'tool_call_id', the id of the call it answers")
    name = item.get("name")
    return Message(
        role=role,
        content=content,
        tool_calls=calls,
        tool_call_id=call_id if role == "tool" else None,
        name=name if isinstance(name, str) else None,
    )


_NOT_TEXT: Any = object()


def _content(content: Any) -> Any:
    """A message's content as text: a string, or OpenAI's list of ``{"type": "text"}`` parts."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    ):
        return "".join(part["text"] for part in content)
    return _NOT_TEXT


def _call(where: str, index: int, item: Any) -> ToolCall:
    def bad(text: str) -> click.BadParameter:
        return click.BadParameter(f"{where}: tool call {index}: {text}", param_hint="--messages")

    function = item.get("function", item) if isinstance(item, dict) else None
    if not isinstance(function, dict) or not isinstance(item.get("id"), str):
        raise bad('expected {"id", "type": "function", "function": {"name", "arguments"}}')
    name, arguments = function.get("name"), function.get("arguments", {})
    if not isinstance(name, str) or not name:
        raise bad("'name' must be a non-empty string")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise bad(f"'arguments' is not JSON: {exc}") from exc
    if not isinstance(arguments, dict):
        raise bad("'arguments' must be a JSON object")
    parsed: dict[str, JSONValue] = arguments
    return ToolCall(id=item["id"], name=name, arguments=parsed)
