"""Model gateway overhead per streamed chunk and per call (docs/models.md, "Performance").

A loopback HTTP server, in its own process, streams a reply of ``--tokens`` tokens, one SSE
event per token, each event its own chunked write (OpenAI chat-completion chunks, or
Anthropic Messages events). The same response is read three ways in this process:

* ``bare httpx``: ``client.stream(...)`` and ``async for _ in response.aiter_bytes()``,
  nothing else (the floor);
* ``client``: the treadle model client's ``complete`` (SSE decoding, JSON, assembly);
* ``gateway``: the model gateway actor's whole call: a durable intent (barrier, answered at
  once by a stub writer), the client call under its deadlines, scopes and usage observer,
  and the result record.

Per call it reports wall time and this process's CPU time; the ratio is against the bare
read. Per-chunk overhead is (gateway - bare) / tokens; per-call overhead is measured on a
one-token reply. Run with:

    python benchmarks/bench_gateway.py [--tokens 4000] [--calls 30]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import httpx
import trio
from rich.console import Console
from rich.table import Table

from _args import at_least
from treadle._clock import SystemClock
from treadle.actors import (
    Append,
    CallModel,
    ModelGateway,
    ModelOutcome,
    ReplySlot,
    StepScope,
    WriterClient,
    WriterRequest,
)
from treadle.models import AnthropicMessagesClient, OpenAIChatClient
from treadle.ports import ModelClient
from treadle.testing.loopback import CannedResponse, RecordedRequest, open_loopback_server
from treadle.types import Budgets, Limits, Message, ModelRequest

REQUEST = ModelRequest(messages=(Message(role="user", content="Write a story."),), model="m")
SSE = {"content-type": "text/event-stream"}


# --------------------------------------------------------------------------- the server


def openai_events(tokens: int) -> list[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        payload = {"id": "chatcmpl-b", "object": "chat.completion.chunk", "choices": [choice]}
        return f"data: {json.dumps(payload)}\n\n".encode()

    usage = {"prompt_tokens": 12, "completion_tokens": tokens, "total_tokens": tokens + 12}
    return [
        chunk({"role": "assistant", "content": ""}),
        *(chunk({"content": f" tok{i}"}) for i in range(tokens)),
        chunk({}, "stop"),
        f"data: {json.dumps({'id': 'chatcmpl-b', 'choices': [], 'usage': usage})}\n\n".encode(),
        b"data: [DONE]\n\n",
    ]


def anthropic_events(tokens: int) -> list[bytes]:
    def event(payload: dict[str, Any]) -> bytes:
        return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n".encode()

    start = {"id": "msg_b", "usage": {"input_tokens": 12, "output_tokens": 1}}
    text = {"type": "text", "text": ""}
    return [
        event({"type": "message_start", "message": start}),
        event({"type": "content_block_start", "index": 0, "content_block": text}),
        *(
            event(
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": f" tok{i}"},
                }
            )
            for i in range(tokens)
        ),
        event({"type": "content_block_stop", "index": 0}),
        event(
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn"},
                "usage": {"output_tokens": tokens},
            }
        ),
        event({"type": "message_stop"}),
    ]


def serve(conn: Connection, tokens: int) -> None:
    """Serve both streams until the parent closes ``conn`` (runs in a child process)."""

    async def main() -> None:
        big_openai = CannedResponse(headers=SSE, chunks=openai_events(tokens), pause_s=0)
        big_anthropic = CannedResponse(headers=SSE, chunks=anthropic_events(tokens), pause_s=0)
        small_openai = CannedResponse(headers=SSE, chunks=openai_events(1), pause_s=0)
        small_anthropic = CannedResponse(headers=SSE, chunks=anthropic_events(1), pause_s=0)
        by_path = {
            "/big/chat/completions": big_openai,
            "/big/v1/messages": big_anthropic,
            "/small/chat/completions": small_openai,
            "/small/v1/messages": small_anthropic,
        }

        def handler(request: RecordedRequest) -> CannedResponse:
            return by_path[request.path]

        async with open_loopback_server(handler) as server:
            conn.send(server.port)
            await trio.to_thread.run_sync(wait_closed, conn)

    trio.run(main)


def wait_closed(conn: Connection) -> None:
    """Block until the other end closes ``conn``."""
    try:
        conn.recv_bytes()
    except EOFError:
        pass


# --------------------------------------------------------------------------- the readers


async def stub_writer(inbox: trio.MemoryReceiveChannel[WriterRequest]) -> None:
    """Acknowledge every write at once (the store's cost is not the gateway's)."""
    seq = 0
    async for request in inbox:
        if isinstance(request, Append):
            seq += len(request.records)
            if request.reply_to is not None:
                with request.reply_to:
                    request.reply_to.send_nowait(seq)


def gateway_for(client: ModelClient, writer: WriterClient) -> ModelGateway:
    return ModelGateway(
        run_id="bench",
        client=client,
        writer=writer,
        clock=SystemClock(),
        limits=Limits(),
        budgets=Budgets(max_model_attempts=None, token_budget=10**9, time_budget_s=3600),
        rng=random.Random(0),
    )


def gateway_call(gateway: ModelGateway) -> Callable[[], Awaitable[object]]:
    step = 0

    async def once() -> object:
        nonlocal step
        step += 1
        reply_to = ReplySlot[ModelOutcome]()  # unused: `call` returns it
        outcome = await gateway.call(
            CallModel(
                step=step,
                request=REQUEST,
                run_attempts=0,
                step_attempts=0,
                step_failures=0,
                tokens=0,
                scope=StepScope(trio.current_time() + 3600),
                reply_to=reply_to,
            )
        )
        assert outcome.reply is not None, outcome
        return outcome

    return once


async def timed(
    readers: dict[str, Callable[[], Awaitable[object]]], calls: int
) -> dict[str, tuple[float, float]]:
    """Median wall and CPU milliseconds per call of each reader, after two warm-up calls.

    The readers take turns call by call, so load from elsewhere on the machine falls on all
    of them alike.
    """
    for call in readers.values():
        for _ in range(2):
            await call()
    walls: dict[str, list[float]] = {name: [] for name in readers}
    cpus: dict[str, list[float]] = {name: [] for name in readers}
    for _ in range(calls):
        for name, call in readers.items():
            wall0, cpu0 = time.perf_counter(), time.process_time()
            await call()
            walls[name].append(time.perf_counter() - wall0)
            cpus[name].append(time.process_time() - cpu0)
    return {
        name: (statistics.median(walls[name]) * 1e3, statistics.median(cpus[name]) * 1e3)
        for name in readers
    }


async def measure(port: int, calls: int) -> dict[tuple[str, str, str], tuple[float, float]]:
    """``(provider, size, reader) -> (wall ms, CPU ms)`` per call."""
    results: dict[tuple[str, str, str], tuple[float, float]] = {}
    send, recv = trio.open_memory_channel[WriterRequest](1024)
    writer = WriterClient(inbox=send)
    async with httpx.AsyncClient() as http, trio.open_nursery() as nursery:
        nursery.start_soon(stub_writer, recv)
        for provider in ("openai", "anthropic"):
            for size in ("big", "small"):
                base = f"http://127.0.0.1:{port}/{size}"
                client: ModelClient
                if provider == "openai":
                    url, body = (
                        f"{base}/chat/completions",
                        OpenAIChatClient(base_url=base).request_body(REQUEST),
                    )
                    client = OpenAIChatClient(base_url=base, http_client=http)
                else:
                    url = f"{base}/v1/messages"
                    body = AnthropicMessagesClient(base_url=base).request_body(REQUEST)
                    client = AnthropicMessagesClient(base_url=base, http_client=http)
                content = json.dumps(body).encode()

                async def bare(url: str = url, content: bytes = content) -> object:
                    async with http.stream("POST", url, content=content, headers=SSE) as response:
                        async for _ in response.aiter_bytes():
                            pass
                    return None

                async def direct(client: ModelClient = client) -> object:
                    return await client.complete(REQUEST)

                readers: dict[str, Callable[[], Awaitable[object]]] = {
                    "bare httpx": bare,
                    "client": direct,
                    "gateway": gateway_call(gateway_for(client, writer)),
                }
                for reader, figures in (await timed(readers, calls)).items():
                    results[(provider, size, reader)] = figures
        send.close()
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokens", type=at_least(1), default=4000, help="tokens (SSE events) per reply"
    )
    parser.add_argument("--calls", type=at_least(1), default=30, help="timed calls per reader")
    args = parser.parse_args(argv)
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    server = context.Process(target=serve, args=(child, args.tokens), daemon=True)
    server.start()
    try:
        results = trio.run(measure, parent.recv(), args.calls)
    finally:
        parent.close()
        server.join(timeout=5)
        if server.is_alive():
            server.terminate()
    report(results, args.tokens)


def report(results: dict[tuple[str, str, str], tuple[float, float]], tokens: int) -> None:
    console = Console()
    table = Table(
        title=f"treadle model gateway: a {tokens:,}-token streamed reply (median per call)"
    )
    for column in ("provider", "reader", "wall ms", "× bare", "CPU ms", "CPU × bare"):
        table.add_column(column, justify="right")
    for provider in ("openai", "anthropic"):
        bare_wall, bare_cpu = results[(provider, "big", "bare httpx")]
        for reader in ("bare httpx", "client", "gateway"):
            wall, cpu = results[(provider, "big", reader)]
            table.add_row(
                provider,
                reader,
                f"{wall:,.1f}",
                f"{wall / bare_wall:.2f}",
                f"{cpu:,.1f}",
                f"{cpu / bare_cpu:.2f}",
            )
    console.print(table)
    overhead = Table(title="gateway overhead over the bare read")
    columns = ("per chunk µs (wall)", "per chunk µs (CPU)", "per call ms (wall)", "(CPU)")
    for column in ("provider", *columns):
        overhead.add_column(column, justify="right")
    for provider in ("openai", "anthropic"):
        gw_wall, gw_cpu = results[(provider, "big", "gateway")]
        bare_wall, bare_cpu = results[(provider, "big", "bare httpx")]
        small_gw = results[(provider, "small", "gateway")]
        small_bare = results[(provider, "small", "bare httpx")]
        overhead.add_row(
            provider,
            f"{(gw_wall - bare_wall) / tokens * 1e3:.2f}",
            f"{(gw_cpu - bare_cpu) / tokens * 1e3:.2f}",
            f"{small_gw[0] - small_bare[0]:.3f}",
            f"{small_gw[1] - small_bare[1]:.3f}",
        )
    console.print(overhead)
    console.print("target: gateway wall time ≤ 1.3 × the bare httpx read of the same stream")


if __name__ == "__main__":
    main()
