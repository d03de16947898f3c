"""Simulating your own agent: a note-taking agent whose `save_note` must never run twice.

Run it with:

    treadle simulate --agent examples.simulate_notes_agent:NotesScenario --seeds 200

Every seed builds a world (a scripted provider and a notes "database" that survives crashes),
runs the agent under seeded crashes, store failures, model errors and cancels, resumes it
after every crash, and checks the runtime's invariants plus this scenario's own: no note is
saved twice.
"""

from __future__ import annotations

import random
from typing import Any

import attrs
import trio

import treadle
from treadle.testing import ScriptedModel, call, say
from treadle.testing.simulation import FaultPlan
from treadle.types import Action, ActionOutcome, ActionResult, ActionStatus, ModelErrorInfo, RunLog


@attrs.define(eq=False)
class Notes:
    """The world outside our process: saved notes by idempotency key, and the provider."""

    saved: dict[str, list[str]] = attrs.Factory(dict)
    provider: ScriptedModel | None = None


@attrs.frozen
class NotesScenario:
    """Saves a few notes, lists them, then answers."""

    notes: int = 4

    def world(self, rng: random.Random, plan: FaultPlan, counts: dict[str, int]) -> Notes:
        """The script (with the plan's 5xx faults injected) and an empty notes database."""
        turns = [call("save_note", text=f"note {i}", call_id=f"n{i}") for i in range(self.notes)]
        turns += [call("list_notes", call_id="list"), say("Saved them all.")]
        failures: dict[int, list[ModelErrorInfo]] = {}
        for turn in range(len(turns)):
            if plan.roll(rng, "model_5xx"):
                counts["model_5xx"] = counts.get("model_5xx", 0) + 1
                failures[turn] = [ModelErrorInfo(kind="server_error", retryable=True)]
        world = Notes()
        world.provider = ScriptedModel(turns=turns, failures=failures, latency_s=0.1)
        return world

    def agent(self, world: Notes) -> treadle.Agent:
        """A fresh agent on ``world``: save_note (never replayed, reconciled) and list_notes."""

        async def reconcile(action: Action) -> ActionOutcome | None:
            await trio.lowlevel.checkpoint()
            if action.intent_id in world.saved:
                return ActionOutcome(status=ActionStatus.EXECUTED, observation="saved (reconciled)")
            return None

        @treadle.tool(reconcile=reconcile)
        async def save_note(text: str, ctx: treadle.ToolContext) -> str:
            """Save a note."""
            world.saved.setdefault(ctx.intent_id, []).append(text)
            return "saved"

        @treadle.tool(replay=treadle.ReplayPolicy.SAFE)
        async def list_notes() -> list[str]:
            """List the saved notes."""
            return [texts[0] for texts in world.saved.values()]

        assert world.provider is not None
        return treadle.Agent(
            model=world.provider,
            executor=treadle.Toolbox([save_note, list_notes]),
            parser=treadle.NativeToolCallParser(),
        )

    def input(self, world: Notes) -> str:
        """The instruction."""
        return "Save four notes."

    def check(self, log: RunLog, world: Notes) -> list[str]:
        """No note saved twice."""
        twice = [key for key, texts in world.saved.items() if len(texts) > 1]
        return [f"{log.run_id}: notes saved twice: {twice}"] if twice else []

    def changed_observation(self, result: ActionResult) -> bool:
        """Outcomes established by reconcile after a crash."""
        return result.outcome.observation == "saved (reconciled)"


def scenario() -> Any:
    """Factory form, for ``--agent examples.simulate_notes_agent:scenario``."""
    return NotesScenario()
