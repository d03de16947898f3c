"""Live mode: the airline agent against a real endpoint, with a person as the customer.

Part of `treadle.demo.airline.replay`, which re-exports the public names (docs/demo.md).
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from treadle.demo.airline._discovery import RUN_ID_PREFIX
from treadle.demo.airline._report import agent_replies
from treadle.demo.airline._workspace import Workspace
from treadle.demo.airline.agent import (
    RESPOND_TOOL,
    AirlineExecutor,
    ReadLine,
    TerminalCustomer,
    airline_agent,
)
from treadle.demo.airline.data import (
    AirlineDataNotFound,
    AirlineTask,
    Recording,
)
from treadle.demo.airline.scoring import (
    score,
)
from treadle.ports import ModelClient
from treadle.stores.sqlite import open_sqlite_store
from treadle.supervisors import run
from treadle.types import (
    Action,
    ActionOutcome,
    ActionResult,
    StopReason,
)


@attrs.frozen(kw_only=True)
class LiveReport:
    """How a live conversation went.

    Attributes:
        run_id: the run.
        store: the run store file.
        state / stop_reason: how the run ended.
        steps: steps taken.
        tool_calls: airline tool calls made.
        reward: the score against ``task_id``'s ground truth; ``None`` without a task.
        task_id: the task played, if any.
    """

    run_id: str
    store: str
    state: str
    stop_reason: str
    steps: int
    tool_calls: int
    reward: float | None
    task_id: int | None

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON object."""
        return attrs.asdict(self)


def policy_text(data_dir: Path, recordings: Sequence[Recording]) -> str:
    """The airline policy: ``policy.md``, else the recordings' system message."""
    path = data_dir / "policy.md"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if recordings:
        return str(recordings[0].messages[0].get("content") or "")
    raise AirlineDataNotFound([path])


def live_run_id(task_id: int | None, now: datetime.datetime | None = None) -> str:
    """``airline-live-[<task_id>-]<UTC timestamp>``."""
    stamp = (now or datetime.datetime.now(datetime.UTC)).strftime("%Y%m%dT%H%M%S%f")
    middle = f"{task_id}-" if task_id is not None else ""
    return f"{RUN_ID_PREFIX}-live-{middle}{stamp}"


def tasks_by_id(recordings: Sequence[Recording]) -> dict[int, AirlineTask]:
    """Task id -> its task (the same for every trial of a task)."""
    return {r.task_id: r.task for r in recordings}


LiveShow = Callable[[str, str], None]
"""Shows a line of a live conversation: ``(kind, text)``, kind ``agent`` or ``tool``."""


async def run_live(
    *,
    client: ModelClient,
    model: str,
    workspace: Callable[[], Workspace],
    data_dir: Path,
    system: str,
    read_line: ReadLine,
    show: LiveShow,
    task: AirlineTask | None = None,
    task_id: int | None = None,
) -> LiveReport | None:
    """Hold one conversation between a live model and the person at the terminal.

    The agent definition is the replay's (`airline_agent`), over a fresh copy of the airline
    database, on the workspace's SQLite store. The person's first message is the run input;
    each reply of the agent is shown and the person's next line is its observation. Nothing
    is made before that first message (docs/demo.md, "Live mode").

    Args:
        client: the model client (e.g. `treadle.OpenAIChatClient` on the live endpoint).
        model: the model name sent with every request.
        workspace: makes the workspace (the store and, beside it, the conversation's
            database); called once the first message came, never when input ends before.
        data_dir: the workload folder (its ``data/*.json`` build the database).
        system: the system prompt (the airline policy, see `policy_text`).
        read_line: reads one line typed by the person; ``None`` at end of input.
        show: prints the agent's replies and the tool calls as they happen.
        task: a task to score the conversation against (the person plays its customer).
        task_id: that task's id (in the run id and the report).

    Returns:
        The report, or ``None`` when input ended before the first message.

    Raises:
        treadle.RunInterrupted: the run could not continue (it stays resumable).
        treadle.StoreError: the store failed.
    """
    customer = TerminalCustomer(read_line, lambda text: show("agent", text))
    first = await customer.first_message()
    if first is None:
        return None
    run_id = live_run_id(task_id)
    made = workspace()
    fresh = await trio.to_thread.run_sync(made.fresh_database, data_dir)
    db = await trio.to_thread.run_sync(made.conversation, run_id, fresh)

    def observe(action: Action, outcome: ActionOutcome) -> None:
        if action.tool != RESPOND_TOOL:
            arguments = json.dumps(dict(action.arguments), ensure_ascii=False)
            show("tool", f"{action.tool}({arguments}) -> {outcome.observation}")

    executor = AirlineExecutor(db, customer, observer=observe)
    agent = airline_agent(model=client, executor=executor, system=system, model_name=model)
    async with open_sqlite_store(made.store) as store:
        result = await run(agent, first, store=store, run_id=run_id)
        log = await store.read_log(run_id)
    reward = None
    if task is not None:
        completed = result.stop_reason is StopReason.TASK_COMPLETED
        found = await trio.to_thread.run_sync(
            functools.partial(score, db, task, agent_replies(log), completed=completed, fresh=fresh)
        )
        reward = found.reward
    tool_calls = sum(
        1 for r in log.records if isinstance(r, ActionResult) and r.tool != RESPOND_TOOL
    )
    return LiveReport(
        run_id=run_id,
        store=str(made.store),
        state=result.state.value,
        stop_reason=result.stop_reason.value,
        steps=result.totals.steps,
        tool_calls=tool_calls,
        reward=reward,
        task_id=task_id,
    )
