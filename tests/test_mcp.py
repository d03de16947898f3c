"""`treadle.mcp` against real MCP servers written with the same SDK (tests/fixtures/mcp_server.py).

The servers run as real processes: over stdio (a child of the client) and over streamable HTTP
on 127.0.0.1. Every call they receive is in their ledger file, so the tests count what reached
the server, also across a client process killed with a call in flight.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx2
import mcp_types
import pytest
import trio
from mcp import StdioServerParameters
from mcp.client.stdio import stdio_client
from tests.fixtures import mcp_server
from tests.fixtures.mcp_driver import ROOT, drive, http_server, make_agent, stdio_server
from tests.fixtures.schema_host import schema_host

from treadle import (
    ActionStatus,
    EnvironmentFailure,
    ImageRef,
    MemoryStore,
    ReplayPolicy,
    UsageError,
)
from treadle.mcp import IDEMPOTENCY_KEY, McpToolOptions, McpTools, open_mcp_tools, policy_of
from treadle.supervisors import run
from treadle.testing.crashdriver import open_store
from treadle.types import Action, ActionIntent, ActionOutcome, ActionResult, RunLog

SAFE, NEVER = ReplayPolicy.SAFE, ReplayPolicy.NEVER


def _ledger(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def _action(tool: str, intent_id: str = "i-1", **arguments: Any) -> Action:
    return Action(
        run_id="r", step=1, intent_id=intent_id, call_id="c", tool=tool, arguments=arguments
    )


# --------------------------------------------------------------------------- policies


@pytest.mark.parametrize(
    ("hints", "trusted", "expected"),
    [
        (None, False, (NEVER, False)),
        ({"read_only_hint": True}, False, (NEVER, False)),
        ({"idempotent_hint": True}, False, (NEVER, False)),
        (None, True, (NEVER, True)),  # absent annotations: destructive, not read-only
        ({}, True, (NEVER, True)),
        ({"read_only_hint": True}, True, (SAFE, False)),
        ({"read_only_hint": True, "destructive_hint": True}, True, (SAFE, False)),
        ({"idempotent_hint": True}, True, (SAFE, True)),
        ({"idempotent_hint": True, "destructive_hint": False}, True, (SAFE, False)),
        ({"destructive_hint": False}, True, (NEVER, False)),
        ({"read_only_hint": False, "idempotent_hint": False}, True, (NEVER, True)),
    ],
)
def test_annotations_decide_only_for_a_trusted_server(hints, trusted, expected):
    annotations = None if hints is None else mcp_types.ToolAnnotations(**hints)
    assert policy_of(annotations, trusted=trusted) == expected


async def test_a_trusted_servers_tools_take_their_policies_and_schemas_from_it(tmp_path):
    async with open_mcp_tools(stdio_server(tmp_path / "ledger"), trusted=True) as tools:
        found = {t.name: (t.replay, t.requires_approval) for t in tools.tools}
        specs = {s.name: s for s in tools.tool_specs()}
    assert found == {
        "lookup": (SAFE, False),
        "charge": (NEVER, True),
        "tag": (SAFE, False),
        "refuse": (SAFE, False),
        "chart": (SAFE, False),
        "hang": (NEVER, True),
    }
    served = {t.name: t for t in mcp_server.TOOLS}
    for name, spec in specs.items():
        assert spec.parameters == served[name].input_schema
        assert spec.description == served[name].description


async def test_an_untrusted_servers_tools_are_never_and_the_user_chooses_per_tool(tmp_path):
    options = {
        "lookup": McpToolOptions(replay=SAFE),
        "charge": McpToolOptions(requires_approval=True, secret_arguments=("account",)),
    }
    async with open_mcp_tools(stdio_server(tmp_path / "ledger"), tools=options) as tools:
        assert {t.name: (t.replay, t.requires_approval) for t in tools.tools} == {
            "lookup": (SAFE, False),
            "charge": (NEVER, True),
            "tag": (NEVER, False),
            "refuse": (NEVER, False),
            "chart": (NEVER, False),
            "hang": (NEVER, False),
        }
        assert tools.secret_arguments("charge") == {"account"}
        assert tools.replay_policy("nope") is NEVER
    # the user also overrides a trusted server's annotations
    overrides = {
        "charge": McpToolOptions(requires_approval=False),
        "lookup": McpToolOptions(replay=NEVER),
    }
    async with open_mcp_tools(
        stdio_server(tmp_path / "ledger"), trusted=True, tools=overrides
    ) as tools:
        assert not tools.requires_approval("charge")
        assert tools.replay_policy("lookup") is NEVER
        assert tools.replay_policy("tag") is SAFE


async def test_bad_options_and_names_are_clear_errors(tmp_path):
    server = stdio_server(tmp_path / "ledger")
    with pytest.raises(UsageError, match="no tool named 'chrage'"):
        async with open_mcp_tools(server, tools={"chrage": McpToolOptions()}):
            pass
    with pytest.raises(UsageError, match="secret_arguments names no argument of the tool: pin"):
        async with open_mcp_tools(
            server, tools={"charge": McpToolOptions(secret_arguments=["pin"])}
        ):
            pass
    with pytest.raises(UsageError, match="http:// or https://"):
        async with open_mcp_tools("ftp://127.0.0.1/mcp"):
            pass
    with pytest.raises(UsageError, match="timeout_s must be a positive number"):
        async with open_mcp_tools(server, tools={"tag": McpToolOptions(timeout_s=0)}):
            pass
    dotted = server.model_copy(update={"args": [*server.args, "--dotted"]})
    with pytest.raises(UsageError, match=r"files\.read; leave them out with include="):
        async with open_mcp_tools(dotted):
            pass
    async with open_mcp_tools(dotted, include=["lookup", "tag"], prefix="fs_") as tools:
        assert [s.name for s in tools.tool_specs()] == ["fs_lookup", "fs_tag"]
        outcome = await tools.execute(_action("fs_tag", item="x"))
    assert outcome.observation == "tagged x"
    assert [e["tool"] for e in _ledger(tmp_path / "ledger")] == ["tag"]  # its server name


async def test_a_server_that_cannot_be_reached_is_an_environment_failure(tmp_path):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(EnvironmentFailure, match=r"could not be opened: MCPError: .*ConnectError"):
        async with open_mcp_tools(f"http://127.0.0.1:{port}/mcp"):
            pass
    missing = StdioServerParameters(command=str(tmp_path / "no-such-server"))
    with pytest.raises(EnvironmentFailure, match="could not be opened: FileNotFoundError"):
        async with open_mcp_tools(missing):
            pass


async def test_an_environment_failure_never_shows_the_urls_credentials():
    """The message quoted the server's URL as given, its userinfo and query (a password, an
    API key) included. It shows the URL as a redirect's Location is shown: without them."""
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://alice:TOPSECRET1@127.0.0.1:{port}/mcp?api_key=TOPSECRET2#TOPSECRET3"
    with pytest.raises(EnvironmentFailure) as failed:
        async with open_mcp_tools(url):
            pass
    message = str(failed.value)
    assert message.startswith(f"the MCP session with http://127.0.0.1:{port}/mcp could not")
    assert "TOPSECRET" not in message


async def test_a_schema_that_is_no_json_schema_is_a_clear_error(tmp_path):
    broken = mcp_types.Tool(
        name="broken", input_schema={"type": "object", "properties": {"x": {"type": 5}}}
    )
    server = mcp_server.make_server(str(tmp_path / "ledger"), extra=[broken])
    with pytest.raises(UsageError, match="'broken': the server's input schema is no valid JSON"):
        async with open_mcp_tools(server):  # an in-process server
            pass
    async with open_mcp_tools(server, include=["tag"]) as tools:
        assert (await tools.execute(_action("tag", item="y"))).observation == "tagged y"


async def test_a_name_listed_twice_is_refused_only_among_the_tools_kept(tmp_path):
    """A server listing two tools under one name failed every open, ``include=`` or not, and
    the error did not say which name."""
    again = mcp_types.Tool(name="tag", description="Another tag.", input_schema={"type": "object"})
    server = mcp_server.make_server(str(tmp_path / "ledger"), extra=[again])
    with pytest.raises(UsageError, match="more than one tool under the name 'tag'; leave them"):
        async with open_mcp_tools(server):
            pass
    async with open_mcp_tools(server, include=["lookup", "chart"]) as tools:
        assert [t.name for t in tools.tools] == ["lookup", "chart"]


async def test_a_schema_whose_reference_leads_nowhere_makes_the_call_not_executed(tmp_path):
    # Accepted at open (its shape is valid JSON Schema), it failed the first call's check
    # with a referencing error: the run was interrupted, and the call's outcome read
    # "unknown" on resume although it never reached the server.
    nowhere = mcp_types.Tool(
        name="nowhere",
        input_schema={"type": "object", "properties": {"a": {"$ref": "#/definitions/nope"}}},
    )
    server = mcp_server.make_server(str(tmp_path / "ledger"), extra=[nowhere])
    async with open_mcp_tools(server, include=["nowhere"]) as tools:
        outcome = await tools.execute(_action("nowhere", a=1))
    assert outcome.status is ActionStatus.NOT_EXECUTED
    assert "input schema of 'nowhere' cannot be checked" in (outcome.detail or outcome.observation)


async def test_a_schema_reference_outside_it_is_never_fetched(tmp_path):
    # jsonschema's default registry fetched a $ref URL with urllib on the trio thread at
    # every check: the process froze (for ever on a host that never answers) and any server
    # could make the client request an internal address. Now such a reference resolves to
    # nothing, as a missing #/$defs/... does, without any I/O.
    with schema_host() as (url, asked):
        remote = mcp_types.Tool(
            name="remote", input_schema={"type": "object", "properties": {"x": {"$ref": url}}}
        )
        relative = mcp_types.Tool(  # a name relative to a remote $id
            name="relative",
            input_schema={
                "$id": url,
                "type": "object",
                "properties": {"x": {"$ref": "other.json"}},
            },
        )
        server = mcp_server.make_server(str(tmp_path / "ledger"), extra=[remote, relative])
        async with open_mcp_tools(server, include=["remote", "relative"]) as tools:
            by_url = await tools.execute(_action("remote", x="hello"))
            by_name = await tools.execute(_action("relative", x="hello"))
            left_out = await tools.execute(_action("remote"))  # the $ref is x's alone
    assert asked == []
    assert by_url.status is by_name.status is ActionStatus.NOT_EXECUTED
    assert by_url.detail == (
        f"the server's input schema of 'remote' cannot be checked: Unresolvable: {url}"
    )
    assert "of 'relative' cannot be checked: Unresolvable: other.json" in (by_name.detail or "")
    assert left_out.status is ActionStatus.EXECUTED
    assert [e["tool"] for e in _ledger(tmp_path / "ledger")] == ["remote"]


async def test_a_pattern_python_cannot_compile_is_left_to_the_server(tmp_path):
    # JSON Schema's patterns are ECMA-262 ones. The schema check compiled them with Python's
    # re (the meta-schema's "regex" format), refused these valid ones, and so failed the
    # open: none of the server's tools could be used.
    react = mcp_types.Tool(
        name="react",
        input_schema={
            "type": "object",
            "properties": {
                "emoji": {"type": "string", "pattern": r"^(\p{Extended_Pictographic})+$"}
            },
            "required": ["emoji"],
        },
    )
    release = mcp_types.Tool(
        name="release",
        input_schema={
            "$schema": "http://json-schema.org/draft-07/schema#",
            "type": "object",
            "properties": {"tag": {"type": "string", "pattern": r"^v(?<major>\d+)$"}},
            "patternProperties": {r"^(?<note>n)\d$": {"type": "string"}},
        },
    )
    server = mcp_server.make_server(str(tmp_path / "ledger"), extra=[react, release])
    async with open_mcp_tools(server, include=["react", "release", "tag"]) as tools:
        assert tools.invalid_arguments("react", {"emoji": "x"}) is None  # the server's to say
        assert tools.invalid_arguments("release", {"tag": "v1", "n1": "a"}) is None
        assert "tag: 1 is not of type 'string'" in (
            tools.invalid_arguments("release", {"tag": 1}) or ""
        )
        assert (await tools.execute(_action("tag", item="y"))).observation == "tagged y"
    not_text = mcp_types.Tool(
        name="not_text", input_schema={"type": "object", "properties": {"a": {"pattern": 5}}}
    )  # a pattern must still be a string
    server = mcp_server.make_server(str(tmp_path / "ledger"), extra=[not_text])
    with pytest.raises(UsageError, match="'not_text': the server's input schema is no valid"):
        async with open_mcp_tools(server):
            pass


async def test_a_pattern_that_backtracks_for_ever_is_left_to_the_server(tmp_path, monkeypatch):
    # ^(a+)+$ against 40 a's and a "!" takes about 2**40 steps in Python's re, which holds
    # the interpreter: the pre-check froze the whole process. Patterns are the server's now;
    # every other keyword is still checked.
    evil = mcp_types.Tool(
        name="evil",
        input_schema={
            "type": "object",
            "properties": {"a": {"type": "string", "pattern": "^(a+)+$"}, "n": {"type": "integer"}},
            "patternProperties": {"^(x+)+$": {"type": "integer"}},
            "additionalProperties": False,
        },
    )
    server = mcp_server.make_server(str(tmp_path / "ledger"), extra=[evil])
    async with open_mcp_tools(server, include=["evil"]) as tools:
        searched: list[str] = []
        search = re.search
        monkeypatch.setattr(
            re, "search", lambda p, *a, **k: searched.append(p) or search(p, *a, **k)
        )
        # (were a pattern matched, the test would stop on the spy's record, not hang)
        assert tools.invalid_arguments("evil", {"a": "b", "x!": 1}) is None
        assert searched == []
        assert tools.invalid_arguments("evil", {"a": "a" * 40 + "!", "x" * 40 + "!": 1}) is None
        assert "'one' is not of type 'integer'" in (
            tools.invalid_arguments("evil", {"n": "one"}) or ""
        )


async def test_json_rpc_errors_are_refusals_or_failures_by_their_code(tmp_path):
    server = mcp_server.make_server(str(tmp_path / "ledger"), extra=mcp_server.PROTOCOL_ERRORS)
    async with open_mcp_tools(server, include=["picky", "crash", "busy"]) as tools:
        picky = await tools.execute(_action("picky"))
        crash = await tools.execute(_action("crash"))
        # -32000 is also the SDK's code for a closed connection: a server's own error under
        # it was taken for a broken transport, ENV_ERROR, and ended the run
        busy = await tools.execute(_action("busy"))
    assert busy.status is ActionStatus.EXECUTED
    assert busy.observation == "Error: -32000: the queue is full, try later"
    assert picky.status is ActionStatus.NOT_EXECUTED
    assert picky.detail == (
        "the server refused the call of picky: Error: -32602: picky wants other arguments"
    )
    assert crash.status is ActionStatus.EXECUTED
    assert crash.observation.startswith("Error: -32603: ")
    assert [e["tool"] for e in _ledger(tmp_path / "ledger")] == ["picky", "crash", "busy"]


# --------------------------------------------------------------------------- calls and results


async def _calls(tools: McpTools, ledger: Path) -> None:
    """The result mapping, the same over either transport."""
    found = await tools.execute(_action("lookup", "i-lookup", key="a"))
    # the text block is the serialized structured content: it is not repeated
    assert found == ActionOutcome(
        status=ActionStatus.EXECUTED, observation='{"key": "a", "value": 42}'
    )
    refused = await tools.execute(_action("refuse", "i-refuse"))
    assert refused == ActionOutcome(
        status=ActionStatus.EXECUTED, observation="Error: the account is locked"
    )
    chart = await tools.execute(_action("chart", "i-chart"))
    assert chart.status is ActionStatus.EXECUTED
    text, image = chart.observation.split("\n")
    assert text == "the chart:"
    ref = image.split()[1]
    assert image == f"[image {ref} image/png, {len(mcp_server.PNG)} bytes]"
    assert tools.image_source(ImageRef(url=ref)) == mcp_server.PNG
    sha = ref.removeprefix("ref:mcp-")
    assert chart.images == (ImageRef(url=ref, digest=f"sha256:{sha}", media_type="image/png"),)
    with pytest.raises(KeyError):
        tools.image_source(ImageRef(url="ref:mcp-0"))
    invalid = await tools.execute(_action("charge", "i-bad", account="a", cents=0))
    assert invalid.status is ActionStatus.NOT_EXECUTED
    assert invalid.detail == "invalid arguments: cents: 0 is less than the minimum of 1"
    unknown = await tools.execute(_action("delete_everything"))
    assert unknown.status is ActionStatus.NOT_EXECUTED
    assert "unknown tool 'delete_everything'" in unknown.observation
    replayed = await tools.execute(attrs_evolve_replay(_action("tag", "i-tag", item="b")))
    assert replayed.observation == "tagged b"
    # what reached the server: no call with invalid arguments, each with its intent id
    assert [(e["tool"], e["key"], e["replay"]) for e in _ledger(ledger)] == [
        ("lookup", "i-lookup", False),
        ("refuse", "i-refuse", False),
        ("chart", "i-chart", False),
        ("tag", "i-tag", True),
    ]


def attrs_evolve_replay(action: Action) -> Action:
    import attrs

    return attrs.evolve(action, replay=True)


async def test_an_image_whose_media_type_is_no_image_type_is_not_kept(tmp_path):
    """An image block with no media type (and bytes no sniffing knows) or with ``text/html``
    became an image of the outcome, and the next model call failed on it ("unknown media
    type"), on every resume too. It is a line saying what was wrong, as bad base64 is."""
    server = mcp_server.make_server(str(tmp_path / "ledger"), extra=[mcp_server.ODD_IMAGES])
    async with open_mcp_tools(server, include=["odd_images"]) as tools:
        outcome = await tools.execute(_action("odd_images"))
    (image,) = outcome.images
    assert image.media_type == "image/png"
    assert outcome.observation.split("\n") == [
        "[image: the server sent no media type]",
        "[image text/html: the server sent a media type that is no image type]",
        f"[image {image.url} image/png, {len(mcp_server.PNG)} bytes]",
    ]


def _screens_server() -> Any:
    """An in-process server whose tool ``shot`` returns the image numbered by its ``i``."""
    from mcp.server import Server

    async def list_tools(ctx: Any, params: Any) -> mcp_types.ListToolsResult:
        schema = {"type": "object", "properties": {"i": {"type": "integer"}}, "required": ["i"]}
        tool = mcp_types.Tool(name="shot", description="Screenshot.", inputSchema=schema)
        return mcp_types.ListToolsResult(tools=[tool])

    async def call_tool(ctx: Any, params: Any) -> mcp_types.CallToolResult:
        data = base64.b64encode(_screen(params.arguments["i"])).decode()
        image = mcp_types.ImageContent(type="image", data=data, mimeType="image/png")
        return mcp_types.CallToolResult(content=[image])

    return Server("browser", on_list_tools=list_tools, on_call_tool=call_tool)


def _screen(i: int) -> bytes:
    return mcp_server.PNG + i.to_bytes(4, "big")


async def _shot(tools: McpTools, run_id: str, i: int) -> ImageRef:
    action = Action(
        run_id=run_id, step=1, intent_id=f"{run_id}/{i}", call_id="c", tool="shot",
        arguments={"i": i},
    )  # fmt: skip
    (image,) = (await tools.execute(action)).images
    return image


async def test_runs_sharing_a_session_never_evict_each_others_images():
    """The session kept its last 256 images, whichever run's: a run that got 256 images
    evicted the one of another run sharing the session, whose next model call failed
    ("could not be loaded: KeyError"), on every resume too. Each run keeps its own last 256."""
    async with open_mcp_tools(_screens_server()) as tools:
        first = await _shot(tools, "a", 0)
        shared = await _shot(tools, "a", 1)
        assert await _shot(tools, "b", 1) == shared  # one image, kept by both runs
        others = [await _shot(tools, "b", i) for i in range(2, 258)]  # b's last 256
        assert tools.image_source(first) == _screen(0)
        assert tools.image_source(shared) == _screen(1)  # a keeps it still
        assert [tools.image_source(image) for image in others] == [
            _screen(i) for i in range(2, 258)
        ]
        # a run's own images evict its oldest: a's 257th evicts its first
        for i in range(1000, 1255):
            await _shot(tools, "a", i)
        with pytest.raises(KeyError):
            tools.image_source(first)
        assert tools.image_source(shared) == _screen(1)


async def test_calls_over_stdio(tmp_path):
    async with open_mcp_tools(stdio_server(tmp_path / "ledger")) as tools:
        await _calls(tools, tmp_path / "ledger")


async def test_calls_over_streamable_http(tmp_path):
    with http_server(tmp_path / "ledger") as (url, _):
        async with open_mcp_tools(url) as tools:
            await _calls(tools, tmp_path / "ledger")


async def test_a_url_whose_scheme_is_in_capitals_is_an_http_url(tmp_path):
    """A URL's scheme is case-insensitive, but ``HTTP://...`` was refused, and the refusal
    quoted it lower-cased ("must start with http:// or https://, got 'http://...'")."""
    with http_server(tmp_path / "ledger") as (url, _):
        scheme, rest = url.split("://", 1)
        async with open_mcp_tools(f"{scheme.upper()}://{rest}") as tools:
            outcome = await tools.execute(_action("tag", item="x"))
    assert outcome.observation == "tagged x"
    assert [e["tool"] for e in _ledger(tmp_path / "ledger")] == ["tag"]


async def test_a_call_past_the_runs_shorter_timeout_is_unknown_too(tmp_path):
    """With the tool's timeout (30 s) longer than the run's `Limits.tool_timeout_s`, the run cut
    the call at its own limit and recorded it EXECUTED ("timed out"), though the server may
    still run it; and the documented 30 s never applied."""
    import treadle
    from treadle.testing.scripted import ScriptedModel, call, say

    options = {"hang": McpToolOptions(requires_approval=False)}
    async with open_mcp_tools(stdio_server(tmp_path / "ledger"), tools=options) as tools:
        assert tools.timeout_s("hang") == 30.0
        agent = treadle.Agent(
            model=ScriptedModel(turns=[call("hang", job="j"), say("done")]),
            executor=tools,
            parser=treadle.NativeToolCallParser(),
            limits=treadle.Limits(tool_timeout_s=0.5),
        )
        store = treadle.MemoryStore()
        await treadle.run(agent, "go", store=store, run_id="r")
    (result,) = [r for r in (await store.read_log("r")).records if isinstance(r, ActionResult)]
    assert result.outcome.status is ActionStatus.UNKNOWN
    assert "timed out after 0.5 s; the server was asked to cancel it" in result.outcome.observation


async def test_a_call_past_its_timeout_is_unknown(tmp_path):
    options = {"hang": McpToolOptions(timeout_s=0.5)}
    async with open_mcp_tools(stdio_server(tmp_path / "ledger"), tools=options) as tools:
        assert tools.timeout_s("hang") == 0.5
        outcome = await tools.execute(_action("hang", "i-hang", job="j"))
    assert outcome.status is ActionStatus.UNKNOWN
    assert "timed out after 0.5 s" in outcome.observation
    assert [e["key"] for e in _ledger(tmp_path / "ledger")] == ["i-hang"]


async def _broken_in_flight(tools: McpTools, in_flight: Any, kill: Any) -> ActionOutcome:
    """Call ``hang``, wait until ``in_flight()`` says the server has it, ``kill()`` the server."""
    outcome: list[ActionOutcome] = []

    async def call() -> None:
        outcome.append(await tools.execute(_action("hang", "i-hang", job="j")))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call)
        await in_flight()
        kill()
    return outcome[0]


def _broke(outcome: ActionOutcome) -> None:
    assert outcome.status is ActionStatus.ENV_ERROR
    assert outcome.observation.startswith(
        "Error: the connection to the MCP server broke during the call of hang"
    )


async def test_a_broken_stdio_transport_is_env_error(tmp_path):
    """The server process dies with a call in flight: the call is ENV_ERROR, not an error."""
    ledger = tmp_path / "ledger"
    read_fd, write_fd = os.pipe()
    errors = trio.lowlevel.FdStream(read_fd)

    async def in_flight() -> None:
        seen = b""
        while b"IN FLIGHT i-hang\n" not in seen:  # bounded: the server writes it
            chunk = await errors.receive_some()
            assert chunk, "the server's stderr closed before the call arrived"
            seen += chunk

    def kill() -> None:
        os.kill(_ledger(ledger)[0]["pid"], signal.SIGKILL)

    with os.fdopen(write_fd, "w") as errlog:
        transport = stdio_client(stdio_server(ledger), errlog=errlog)
        async with errors, open_mcp_tools(transport) as tools:
            _broke(await _broken_in_flight(tools, in_flight, kill))


async def _until_in_ledger(ledger: Path, count: int) -> None:
    """Wait until the server's ledger holds ``count`` calls (the caller bounds the wait)."""
    while len(_ledger(ledger)) < count:  # noqa: ASYNC110 (polling another process's file)
        await trio.sleep(0.01)


async def test_a_stdio_server_writing_bytes_that_are_no_text_breaks_the_session(tmp_path):
    """Invalid UTF-8 on the server's stdout killed the SDK's reader: every call waited out its
    timeout (UNKNOWN) and the block ended with a raw UnicodeDecodeError. It is a broken
    connection now: the calls in flight end ENV_ERROR at once, so does every later call, and
    the block ends cleanly (docs/mcp.md, "Results")."""
    ledger = tmp_path / "ledger"
    options = {name: McpToolOptions(timeout_s=600) for name in ("hang", "garble", "tag")}
    outcomes: dict[str, ActionOutcome] = {}

    async def call(tool: str, **arguments: Any) -> None:
        outcomes[tool] = await tools.execute(_action(tool, f"i-{tool}", **arguments))

    with trio.fail_after(60):  # the calls' own timeouts are ten minutes
        async with open_mcp_tools(stdio_server(ledger, "--garble"), tools=options) as tools:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(call, "hang", job="j"))
                await _until_in_ledger(ledger, 1)
                nursery.start_soon(call, "garble")
            await call("tag", item="x")
    assert {tool: outcome.status for tool, outcome in outcomes.items()} == {
        "hang": ActionStatus.ENV_ERROR,
        "garble": ActionStatus.ENV_ERROR,
        "tag": ActionStatus.ENV_ERROR,
    }
    assert outcomes["hang"].observation == (
        "Error: the connection to the MCP server broke during the call of hang (the server "
        "wrote bytes that are no utf-8 text on its stdout); its outcome is unknown"
    )
    assert [e["tool"] for e in _ledger(ledger)] == ["hang", "garble"]  # not the later tag


async def test_a_broken_http_transport_is_env_error(tmp_path):
    """The HTTP server dies holding the call (no response headers yet), then is gone."""
    with http_server(tmp_path / "ledger") as (url, proc):
        assert proc.stderr is not None

        async def in_flight() -> None:
            line = "start"
            while line and not line.startswith("IN FLIGHT i-hang"):  # bounded by the stream
                line = await trio.to_thread.run_sync(proc.stderr.readline)
            assert line, "the server's stderr closed before the call arrived"

        def kill() -> None:
            proc.kill()
            proc.wait()

        async with open_mcp_tools(url) as tools:
            _broke(await _broken_in_flight(tools, in_flight, kill))
            after = await tools.execute(_action("tag", "i-tag", item="x"))  # nobody listens now
    # no connection could be made: the call never left, which its detail says (it read as a
    # call whose outcome is unknown)
    assert after.status is ActionStatus.ENV_ERROR
    assert after.observation.startswith(
        "Error: the call of tag was never sent: no connection to the MCP server could be had "
        "(MCPError: the HTTP request failed: ConnectError: "
    )
    assert after.observation.endswith("; it did not run")


async def test_an_http_answer_cut_in_its_body_is_env_error_for_that_call_alone(tmp_path):
    """The server sends the headers of a JSON answer and dies in its body: the SDK let the
    read error escape its task group, which ended the whole block (every run sharing the
    session) with a raw httpx error. It is that call's broken connection now; the session
    goes on."""
    ledger = tmp_path / "ledger"
    with http_server(ledger, raw=True) as (url, _), trio.fail_after(60):
        async with open_mcp_tools(url) as tools:
            cut = await tools.execute(_action("cut_body", "i-cut"))
            reset = await tools.execute(_action("reset_body", "i-reset"))
            echo = await tools.execute(_action("echo", "i-echo"))
    for outcome in (cut, reset):
        assert outcome.status is ActionStatus.ENV_ERROR
        assert outcome.observation.startswith(
            "Error: the connection to the MCP server broke during the call of "
        )
        assert outcome.observation.endswith("; its outcome is unknown")
    assert "RemoteProtocolError" in cut.observation
    assert echo == ActionOutcome(status=ActionStatus.EXECUTED, observation="echo")
    assert [e["tool"] for e in _ledger(ledger)] == ["cut_body", "reset_body", "echo"]


async def test_http_answers_that_are_no_mcp_answers_are_env_error(tmp_path):
    """An error page, HTML, a 202 or JSON that is no JSON-RPC message answering a call was
    EXECUTED with a JSON-RPC error the SDK made up ("Error: -32603: Server returned an error
    response") and the run went on. They are HTTP failures: ENV_ERROR, the outcome unknown
    (docs/decisions/0103-mcp-http-failures-end-the-run.md). A JSON-RPC error at an HTTP error
    status is still the server's answer."""
    ledger = tmp_path / "ledger"
    broken = [
        "http_500",
        "http_502",
        "json_500",
        "html",
        "accepted",
        "bad_json",
        "not_jsonrpc",
        "gone",
    ]
    with http_server(ledger, raw=True) as (url, _), trio.fail_after(60):
        async with open_mcp_tools(url) as tools:
            outcomes = {
                name: await tools.execute(_action(name, f"i-{name}"))
                for name in [*broken, "refused_400", "failed_500", "closed_500", "echo"]
            }
    for name in broken:
        assert outcomes[name].status is ActionStatus.ENV_ERROR, name
        assert outcomes[name].observation.endswith("; its outcome is unknown"), name
    assert outcomes["http_502"].observation == (
        "Error: the connection to the MCP server broke during the call of http_502 (MCPError: "
        "the HTTP request failed: HTTP 502 Bad Gateway (text/html), no MCP answer); its "
        "outcome is unknown"
    )
    assert "HTTP 202 Accepted (application/json), no answer" in outcomes["accepted"].observation
    assert "HTTP 200 OK (application/json), no JSON-RPC message" in (
        outcomes["not_jsonrpc"].observation
    )
    assert outcomes["refused_400"].status is ActionStatus.NOT_EXECUTED
    assert outcomes["failed_500"] == ActionOutcome(
        status=ActionStatus.EXECUTED,
        observation="Error: -32603: broke",
        detail="Error: -32603: broke",
    )
    # the server sent it: its answer, though its words are those of the SDK's own error for a
    # closed connection (it read as one, ENV_ERROR)
    assert outcomes["closed_500"] == ActionOutcome(
        status=ActionStatus.EXECUTED,
        observation="Error: -32000: Connection closed",
        detail="Error: -32000: Connection closed",
    )
    assert outcomes["echo"].observation == "echo"
    assert [e["tool"] for e in _ledger(ledger)] == [
        *broken,
        "refused_400",
        "failed_500",
        "closed_500",
        "echo",
    ]


async def test_a_json_body_holding_a_notification_or_request_is_env_error(tmp_path):
    """A 200 JSON body holding a JSON-RPC notification or request instead of the answer was
    taken for an answer to come: the call waited out its whole timeout and was UNKNOWN. It
    answers nothing: an HTTP failure, ENV_ERROR, as a 202 with nothing is."""
    ledger = tmp_path / "ledger"
    names = ["notification_body", "request_body"]
    with http_server(ledger, raw=True) as (url, _), trio.fail_after(60):
        async with open_mcp_tools(url, default_timeout_s=20) as tools:
            outcomes = {name: await tools.execute(_action(name, f"i-{name}")) for name in names}
            echo = await tools.execute(_action("echo", "i-echo"))
    for name, kind in zip(names, ["notification", "request"], strict=True):
        assert outcomes[name].status is ActionStatus.ENV_ERROR, name
        assert (
            f"(MCPError: the HTTP request failed: HTTP 200 OK (application/json), a JSON-RPC "
            f"{kind}, no answer to the request); its outcome is unknown"
        ) in outcomes[name].observation, name
    assert echo.observation == "echo"  # the session goes on
    assert [e["tool"] for e in _ledger(ledger)] == [*names, "echo"]


# The SDK stops reading an event stream once it has the answer, leaving its reader (async
# generators of httpx2's) to the garbage collector, which trio warns about.
@pytest.mark.filterwarnings("ignore:Async generator:ResourceWarning")
async def test_an_event_stream_that_ends_without_the_answer_is_env_error(tmp_path):
    """An event stream cut before its answer (a proxy's timeout, a dying server), one with no
    event, or an event over the 1 MiB limit: the SDK ends the call with a JSON-RPC error of
    its own making (-32000 "SSE stream ended without a response", "SSE stream failed: ..."),
    which read as the server's, EXECUTED; the run went on and the model's retry repeated a
    ``never`` call. The server never sent them: ENV_ERROR. An answer the server did send on
    a stream, a -32000 error too, is still its answer."""
    ledger = tmp_path / "ledger"
    broken = ["sse_cut", "sse_cut_resumable", "sse_empty", "sse_huge", "sse_garbled"]
    with http_server(ledger, raw=True) as (url, _), trio.fail_after(60):
        async with open_mcp_tools(url) as tools:
            outcomes = {
                name: await tools.execute(_action(name, f"i-{name}"))
                for name in [*broken, "sse_busy", "sse_resumed_error", "sse_echo", "echo"]
            }
    for name in broken:
        assert outcomes[name].status is ActionStatus.ENV_ERROR, name
        assert outcomes[name].observation.startswith(
            f"Error: the connection to the MCP server broke during the call of {name} "
            "(MCPError: the HTTP request failed: "
        ), name
        assert outcomes[name].observation.endswith("; its outcome is unknown"), name
    assert "1048576 byte limit" in outcomes["sse_huge"].observation
    assert "reconnection attempts were exhausted" in outcomes["sse_cut_resumable"].observation
    assert outcomes["sse_busy"] == ActionOutcome(
        status=ActionStatus.EXECUTED,
        observation="Error: -32000: the queue is full",
        detail="Error: -32000: the queue is full",
    )
    # the server's error on the resumed stream, its id "4" for the request 4: the server's
    # answer (it was noted under "4", looked for under 4, and read as made up: ENV_ERROR)
    assert outcomes["sse_resumed_error"] == ActionOutcome(
        status=ActionStatus.EXECUTED,
        observation="Error: -32001: the server's own error, resumed",
        detail="Error: -32001: the server's own error, resumed",
    )
    assert outcomes["sse_echo"] == ActionOutcome(
        status=ActionStatus.EXECUTED, observation="sse_echo"
    )
    assert outcomes["echo"].observation == "echo"  # each HTTP request is its own
    assert [e["tool"] for e in _ledger(ledger)] == [
        *broken,
        "sse_busy",
        "sse_resumed_error",
        "sse_echo",
        "echo",
    ]


async def test_a_redirect_answering_a_call_is_env_error_and_the_call_is_sent_once(tmp_path):
    """A 307 to the same URL made the SDK send the same ``never`` call 21 times (a loop to its
    redirect limit), then EXECUTED with its own -32600; one to another origin was EXECUTED
    with that -32600 too, and one without a Location with "Unexpected content type"."""
    ledger = tmp_path / "ledger"
    names = ["redirect_loop", "redirect_other", "redirect_noloc"]
    with http_server(ledger, raw=True) as (url, _), trio.fail_after(60):
        async with open_mcp_tools(url) as tools:
            outcomes = {name: await tools.execute(_action(name, f"i-{name}")) for name in names}
    port = url.split(":")[2].split("/")[0]
    where = {
        "redirect_loop": f"a redirect to http://127.0.0.1:{port}/mcp",
        "redirect_other": f"a redirect to http://localhost:{port}/other",
        "redirect_noloc": "a redirect without a Location",
    }
    for name in names:
        assert outcomes[name].status is ActionStatus.ENV_ERROR, name
        assert (
            "(MCPError: the HTTP request failed: HTTP 307 Temporary Redirect (text/plain), "
            f"{where[name]}, not followed (a call is sent once))"
        ) in outcomes[name].observation, name
    assert "s3cret" not in outcomes["redirect_other"].observation
    assert [e["tool"] for e in _ledger(ledger)] == names  # each call reached the server once


async def test_leaving_the_block_does_not_wait_for_a_server_that_never_answers_its_close(
    tmp_path,
):
    """The session's closing DELETE waited for the HTTP client's read timeout: a server that
    never answered it held the block's end for 300 s. It waits 5 s now (CLOSE_TIMEOUT_S)."""
    ledger = tmp_path / "ledger"
    with http_server(ledger, "--hang-delete", raw=True) as (url, _), trio.fail_after(60):
        async with open_mcp_tools(url) as tools:
            echo = await tools.execute(_action("echo"))
    assert echo.observation == "echo"
    assert _ledger(ledger) == [{"tool": "echo", "key": "i-1"}, {"method": "DELETE"}]


async def test_leaving_the_block_bounds_the_whole_close_through_its_redirects(tmp_path):
    """A server answering the closing DELETE after 1 s with a redirect to the same URL held
    the block's end 21 s: the SDK follows the loop to its limit (20 redirects), 5 s allowed
    for each DELETE. The 5 s bound the whole close now."""
    ledger = tmp_path / "ledger"
    with http_server(ledger, "--redirect-delete", raw=True) as (url, _), trio.fail_after(60):
        async with open_mcp_tools(url) as tools:
            echo = await tools.execute(_action("echo"))
    assert echo.observation == "echo"
    deletes = [e for e in _ledger(ledger) if e.get("method") == "DELETE"]
    assert 1 <= len(deletes) <= 10  # about 5 (1 s each in 5 s); 21 without the bound


async def test_a_tool_calls_answer_has_no_read_timeout_of_the_http_client():
    """A call that ran longer than the HTTP client's read timeout (300 s) on a server that
    answers in a JSON body (no byte before its end) was ENV_ERROR (ReadTimeout) though its
    ``timeout_s`` was longer: the call's own timeout bounds it; other requests keep the read
    timeout."""
    from treadle._mcp_http import _Answers, _CheckedTransport

    timeouts: dict[str, Any] = {}

    def answer(request: Any) -> Any:
        sent = json.loads(request.content)
        timeouts[sent["method"]] = request.extensions["timeout"]["read"]
        body = {"jsonrpc": "2.0", "id": sent["id"], "result": {}}
        return httpx2.Response(200, json=body)

    checked = _CheckedTransport(httpx2.MockTransport(answer), _Answers())
    timeout = httpx2.Timeout(30.0, read=300.0)
    async with httpx2.AsyncClient(timeout=timeout, transport=checked) as http:
        for rid, method in enumerate(["tools/call", "tools/list"]):
            message = {"jsonrpc": "2.0", "id": rid, "method": method, "params": {}}
            await http.post("http://127.0.0.1:1/mcp", json=message)
    assert timeouts == {"tools/call": None, "tools/list": 300.0}


async def test_a_server_error_saying_the_http_request_failed_is_the_servers(tmp_path):
    """Treadle's own "the HTTP request failed: ..." was told from a server's error by its
    words: a server's -32000 error saying so was taken for a broken connection."""
    said = mcp_types.Tool(name="said", input_schema={"type": "object"})
    server = mcp_server.make_server(str(tmp_path / "ledger"), extra=[said])
    async with open_mcp_tools(server, include=["said"]) as tools:
        outcome = await tools.execute(_action("said"))
    assert outcome.status is ActionStatus.EXECUTED
    assert outcome.observation == "Error: -32000: the HTTP request failed: upstream"


# --------------------------------------------------------------------------- whole runs


async def test_a_run_sends_each_intent_id_as_the_idempotency_key(tmp_path):
    from treadle.agent import Agent
    from treadle.parsers import NativeToolCallParser
    from treadle.testing.scripted import ScriptedModel, call, say

    ledger = tmp_path / "ledger"
    store = MemoryStore()
    with http_server(ledger) as (url, _):
        async with open_mcp_tools(url, prefix="bank_") as tools:
            agent = Agent(
                model=ScriptedModel(
                    turns=[
                        call("bank_lookup", key="balance", call_id="c1"),
                        call("bank_charge", account="acme", cents=250, call_id="c2"),
                        say("charged"),
                    ]
                ),
                executor=tools,
                parser=NativeToolCallParser(),
                model_name="scripted",
                system_prompt="You charge accounts.",
            )
            result = await run(agent, "charge acme", store=store, run_id="run-http")
    assert result.final_answer == "charged"
    log = await store.read_log("run-http")
    intents = [r.intent_id for r in log.records if isinstance(r, ActionIntent)]
    assert [(e["tool"], e["key"]) for e in _ledger(ledger)] == list(
        zip(["lookup", "charge"], intents, strict=True)
    )
    results = [r.outcome.observation for r in log.records if isinstance(r, ActionResult)]
    assert results[1] == "charged 250 cents to acme"


# --------------------------------------------------------------------------- real crashes


def _result_of(log: RunLog, tool: str) -> tuple[ActionIntent, ActionResult]:
    intent = next(r for r in log.records if isinstance(r, ActionIntent) and r.tool == tool)
    result = next(r for r in log.records if isinstance(r, ActionResult) and r.tool == tool)
    return intent, result


def _kill_driver_in_flight(
    store: Path, run_id: str, server: str, ledger: Path, stderr: Any
) -> None:
    """Start the driver, wait (by its or the server's stderr) until ``hang`` is in flight,
    SIGKILL it."""
    args = [
        sys.executable,
        "-m",
        "tests.fixtures.mcp_driver",
        str(store),
        run_id,
        server,
        str(ledger),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    driver = subprocess.Popen(args, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        lines = stderr if stderr is not None else driver.stderr
        assert lines is not None
        for line in lines:  # bounded: the server writes the line, or the stream ends
            if line.startswith("IN FLIGHT "):
                break
        else:
            pytest.fail("the call never reached the server")
        driver.send_signal(signal.SIGKILL)
        assert driver.wait() == -signal.SIGKILL
    finally:
        driver.kill()
        driver.wait()
        if driver.stderr is not None:
            driver.stderr.close()


async def _resume_and_check(store: Path, run_id: str, server: Any, ledger: Path) -> None:
    in_flight = _ledger(ledger)
    assert [e["tool"] for e in in_flight] == ["hang"]  # the killed driver's call
    await drive(str(store), run_id, server)  # a new process's view: a new session
    async with open_store("sqlite", store) as reopened:
        log = await reopened.read_log(run_id)
    intent, result = _result_of(log, "hang")
    assert result.outcome.status is ActionStatus.UNKNOWN
    assert log.finished is not None and log.finished.state.value == "succeeded"
    # the server saw the call once, under the intent id the log holds: no re-send
    assert [(e["tool"], e["key"]) for e in _ledger(ledger)] == [("hang", intent.intent_id)]


async def test_a_killed_client_is_resumed_without_resending_over_http(tmp_path):
    ledger, store = tmp_path / "ledger", tmp_path / "runs.db"
    with http_server(ledger) as (url, server):
        _kill_driver_in_flight(store, "run-crash-http", url, ledger, server.stderr)
        await _resume_and_check(store, "run-crash-http", url, ledger)


async def test_a_killed_client_is_resumed_without_resending_over_stdio(tmp_path):
    ledger, store = tmp_path / "ledger", tmp_path / "runs.db"
    try:
        # the stdio server is the driver's child and writes to the driver's stderr
        _kill_driver_in_flight(store, "run-crash-stdio", "stdio", ledger, None)
        await _resume_and_check(store, "run-crash-stdio", stdio_server(ledger), ledger)
    finally:
        for entry in _ledger(ledger):  # the killed driver's server may outlive it
            with contextlib.suppress(ProcessLookupError):
                os.kill(entry["pid"], signal.SIGKILL)


async def test_a_safe_call_in_flight_is_sent_again_with_the_same_key(tmp_path):
    """The contrast: a tool the user marks ``safe`` is re-sent on resume, under the same
    idempotency key and flagged as a replay (so the no-re-send above is the policy's doing)."""
    ledger, store = tmp_path / "ledger", tmp_path / "runs.db"
    with http_server(ledger) as (url, server):
        _kill_driver_in_flight(store, "run-crash-safe", url, ledger, server.stderr)
        options = {"hang": McpToolOptions(replay=SAFE, timeout_s=0.5)}
        async with open_store("sqlite", store) as opened:
            async with open_mcp_tools(url, tools=options) as tools:
                from tests.fixtures.mcp_driver import OWNER

                await run(make_agent(tools), store=opened, run_id="run-crash-safe", owner=OWNER)
            log = await opened.read_log("run-crash-safe")
    intent, _ = _result_of(log, "hang")
    sent = [(e["key"], e["replay"]) for e in _ledger(ledger)]
    assert sent == [(intent.intent_id, False), (intent.intent_id, True)]
    assert IDEMPOTENCY_KEY == mcp_server.IDEMPOTENCY_KEY


async def test_a_trusted_servers_destructive_tool_waits_for_approval(tmp_path):
    from treadle.agent import Agent
    from treadle.parsers import NativeToolCallParser
    from treadle.supervisors import open_run
    from treadle.testing.scripted import ScriptedModel, call, say
    from treadle.types import RunState

    ledger = tmp_path / "ledger"
    async with open_mcp_tools(stdio_server(ledger), trusted=True) as tools:
        agent = Agent(
            model=ScriptedModel(
                turns=[
                    call("lookup", key="balance", call_id="c1"),  # read-only: no approval
                    call("charge", account="acme", cents=5, call_id="c2"),  # destructive
                    say("charged"),
                ]
            ),
            executor=tools,
            parser=NativeToolCallParser(),
            model_name="scripted",
            system_prompt="You charge accounts.",
        )
        async with open_run(agent, "charge", store=MemoryStore(), run_id="r") as handle:
            with trio.fail_after(60):
                await handle.wait_state(RunState.AWAITING_APPROVAL)
            assert handle.pending_approval.call_id == "c2"
            assert [e["tool"] for e in _ledger(ledger)] == ["lookup"]
            handle.approve("c2")
            result = await handle.wait()
    assert result.final_answer == "charged"
    assert [e["tool"] for e in _ledger(ledger)] == ["lookup", "charge"]


async def test_the_block_owns_the_session_and_its_server_process(tmp_path):
    """Leaving the block closes the session and stops a stdio server; an error raised in the
    block leaves it through the session's task group (docs/mcp.md, "The session")."""
    ledger = tmp_path / "ledger"

    class Boom(Exception):
        pass

    with pytest.RaisesGroup(Boom, flatten_subgroups=True):
        async with open_mcp_tools(stdio_server(ledger)) as tools:
            await tools.execute(_action("tag", item="z"))
            (entry,) = _ledger(ledger)
            os.kill(entry["pid"], 0)  # the server runs while the block does
            raise Boom
    with pytest.raises(ProcessLookupError):
        os.kill(entry["pid"], 0)  # stopped and reaped when the block ended


async def test_options_of_the_wrong_type_are_clear_errors_not_guesses():
    """``include="tag"`` is no collection of names (it would be the letters t, a, g);
    ``requires_approval="no"`` would be true; ``timeout_s=True`` would be 1 s."""
    from mcp.server import MCPServer

    server = MCPServer("one")

    @server.tool()
    def tag(item: str) -> str:
        """Tag an item."""
        return f"tagged {item}"

    with pytest.raises(
        UsageError, match=r"include takes a collection of tool names, e\.g\. \('tag',\)"
    ):
        async with open_mcp_tools(server, include="tag"):
            pass
    with pytest.raises(UsageError, match="prefix must be a string"):
        async with open_mcp_tools(server, prefix=None):
            pass
    with pytest.raises(UsageError, match="requires_approval must be True, False or None"):
        McpToolOptions(requires_approval="no")
    with pytest.raises(UsageError, match="timeout_s must be a positive number"):
        async with open_mcp_tools(server, tools={"tag": McpToolOptions(timeout_s=True)}):
            pass
    async with open_mcp_tools(server, include=("tag",)) as tools:
        assert [s.name for s in tools.tool_specs()] == ["tag"]


async def test_a_server_that_never_answers_the_handshake_is_an_environment_failure():
    """A process that starts but never speaks MCP: opening its session fails after
    ``connect_timeout_s`` with a clear error, it does not wait forever."""
    silent = StdioServerParameters(
        command=sys.executable, args=["-c", "import sys; sys.stdin.read()"]
    )
    with trio.fail_after(60):  # a hang limit: the open fails long before it
        with pytest.raises(EnvironmentFailure, match=r"could not be opened.*did not answer"):
            async with open_mcp_tools(silent, connect_timeout_s=0.5):
                pass
    with pytest.raises(UsageError, match="connect_timeout_s must be a positive number"):
        async with open_mcp_tools(silent, connect_timeout_s=0):
            pass


@contextlib.asynccontextmanager
async def _silent_transport() -> Any:
    """A transport to a server that reads every message and never writes one."""
    import anyio

    to_client, from_server = anyio.create_memory_object_stream[Any](0)
    to_server, from_client = anyio.create_memory_object_stream[Any](math.inf)
    async with to_client, from_server, to_server, from_client:
        yield from_server, to_server


async def test_the_handshake_is_bounded_by_connect_timeout_s(autojump_clock):
    """A server that never answered took 10 s more than ``connect_timeout_s`` to fail: the
    SDK first probes with ``server/discover``, which it waits 10 s for by itself, then sends
    ``initialize``. The whole handshake has ``connect_timeout_s`` now (trio's clock here)."""
    start = trio.current_time()
    with pytest.raises(EnvironmentFailure, match=r"could not be opened.*did not answer within 2 s"):
        async with open_mcp_tools(_silent_transport(), connect_timeout_s=2):
            pass
    assert trio.current_time() - start == pytest.approx(2.0)


# --------------------------------------------------------------------------- secret arguments

CARD = "4111222233334444"
_ONE_OF_SCHEMA = {
    "type": "object",
    "properties": {
        "card": {"type": "string", "maxLength": 16},
        "token": {"type": "string"},
        "cents": {"type": "integer"},
    },
    "required": ["cents"],
    "additionalProperties": False,
    "oneOf": [{"required": ["card"]}, {"required": ["token"]}],
}


def _pay_server() -> Any:
    """An in-process server with one tool, ``pay``, whose schema is `_ONE_OF_SCHEMA`."""
    from mcp.server import Server

    async def list_tools(ctx: Any, params: Any) -> mcp_types.ListToolsResult:
        tool = mcp_types.Tool(name="pay", description="Pay.", inputSchema=_ONE_OF_SCHEMA)
        return mcp_types.ListToolsResult(tools=[tool])

    async def call_tool(ctx: Any, params: Any) -> mcp_types.CallToolResult:
        return mcp_types.CallToolResult(content=[mcp_types.TextContent(type="text", text="paid")])

    return Server("bank", on_list_tools=list_tools, on_call_tool=call_tool)


def _pay_agent(tools: McpTools, **arguments: Any) -> Any:
    from treadle import Agent, NativeToolCallParser
    from treadle.testing.scripted import ScriptedModel, call, say

    turns = [call("pay", call_id="c1", **arguments), say("done")]
    return Agent(model=ScriptedModel(turns=turns), executor=tools, parser=NativeToolCallParser())


async def test_a_call_refused_by_the_schema_check_never_quotes_its_secret_value():
    """The check's text quoted the value (``card: '4111…9' is too long``) into the observation,
    and so into events, sinks, ``treadle show --json`` and the OpenTelemetry span status."""
    from treadle.stores._codec import record_to_dict

    long_card = CARD + "9"  # one character more than maxLength
    options = {"pay": McpToolOptions(secret_arguments=("card",))}
    seen: list[Any] = []

    class Sink:
        async def send(self, event: Any) -> None:
            seen.append(event)

    store = MemoryStore()
    async with open_mcp_tools(_pay_server(), tools=options) as tools:
        agent = _pay_agent(tools, card=long_card, cents=5)
        await run(agent, "pay", store=store, run_id="r", sinks=[Sink()])
    log = await store.read_log("r")
    (result,) = [r for r in log.records if isinstance(r, ActionResult)]
    assert result.outcome.status is ActionStatus.NOT_EXECUTED
    assert result.outcome.detail == "invalid arguments: card: '[redacted]' is too long"
    assert long_card not in result.outcome.observation
    shown = json.dumps([record_to_dict(e.record) for e in seen if e.record is not None])
    assert long_card not in shown and "is too long" in shown


async def test_a_refused_edit_never_quotes_a_secret_in_an_error_about_the_whole_object():
    """An edit made from the shown arguments gets the model's card back (``kept_secrets``);
    the schema's ``oneOf`` error quoted the whole object, real card and all."""
    from tests.fixtures.approval_waits import wait_for_state

    from treadle.redaction import REDACTED
    from treadle.supervisors import open_run
    from treadle.types import RunState

    options = {"pay": McpToolOptions(secret_arguments=("card",), requires_approval=True)}
    store = MemoryStore()
    async with (
        open_mcp_tools(_pay_server(), tools=options) as tools,
        open_run(_pay_agent(tools, card=CARD, cents=5), "pay", store=store, run_id="r") as handle,
    ):
        await wait_for_state(handle, RunState.AWAITING_APPROVAL)
        pending = handle.pending_approval
        assert pending is not None and pending.arguments == {"card": REDACTED, "cents": 5}
        with pytest.raises(UsageError, match="is valid under each of") as caught:
            handle.approve(edit={**pending.arguments, "token": "tok_abc"})
        assert CARD not in str(caught.value)
        assert "{'card': '[redacted]', 'cents': 5, 'token': 'tok_abc'}" in str(caught.value)
        handle.cancel("done")


@pytest.mark.parametrize(
    "server",
    [
        "ftp://bob:hunter2@host/mcp?token=s3cr3t-t0ken",
        "bob:hunter2@host/mcp",
        "http:/bob:hunter2@host/mcp",
    ],
)
async def test_a_server_string_refused_for_its_scheme_shows_no_credential(server):
    """A server string that is no http(s) URL was quoted whole in the refusal: its password
    and query token went to the error, and so to logs and tracebacks."""
    with pytest.raises(UsageError, match="must start with http:// or https://") as refused:
        async with open_mcp_tools(server):
            pass
    said = str(refused.value)
    assert "hunter2" not in said and "s3cr3t" not in said, said
    assert "host/mcp" in said, said  # what it was is still recognisable
