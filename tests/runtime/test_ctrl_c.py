"""Ctrl-C: a process driving runs ends in KeyboardInterrupt, and its runs resume.

The subprocess tests send a real SIGINT to a process driving many runs at once
(tests/fixtures/ctrl_c_driver.py), at moments spread over its steps: whichever task the
signal lands in, the process must end in `KeyboardInterrupt`, not in a `trio.TrioInternalError`
(a waiting task noted by an inbox when the interrupt struck, woken later while it waited
elsewhere) nor in a run error that hides the interrupt.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from tests.fixtures import ctrl_c_driver

import treadle
from treadle.ports import DeltaCallback
from treadle.testing.scripted import ScriptedModel, say
from treadle.types import ActionIntent, Attempt, ModelReply, ModelRequest, RunFinished

DRIVER = Path(__file__).parent.parent / "fixtures" / "ctrl_c_driver.py"
ROOT = Path(__file__).parent.parent.parent


def interrupt(where: str, runs: int, steps: int, effects: Path, delay_s: float) -> str:
    """Start the driver, SIGINT it ``delay_s`` after its runs started; its stderr."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    child = subprocess.Popen(
        [sys.executable, str(DRIVER), where, str(runs), str(steps), str(effects)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "driving"
        try:
            child.wait(delay_s)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=60)
    finally:
        child.kill()
        child.communicate()  # reaped, its pipes closed, whatever failed above
    assert "done" not in out, "the runs finished before the interrupt: make them longer"
    assert child.returncode != 0
    return err


def test_ctrl_c_while_many_runs_go_ends_in_keyboard_interrupt(tmp_path: Path) -> None:
    rng = random.Random(8)
    for round_ in range(8):
        err = interrupt("memory", 60, 400, tmp_path / f"e{round_}", rng.uniform(0.05, 0.8))
        assert "KeyboardInterrupt" in err, err[-3000:]
        for wrong in ("TrioInternalError", "RunInterrupted", "BrokenResourceError"):
            assert wrong not in err, err[-3000:]


def interrupt_at_task_start(nth: int, effects: Path) -> subprocess.CompletedProcess[str]:
    """Run 5 runs of 30 steps; SIGINT lands inside trio's nth task-start call."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    args = [sys.executable, str(DRIVER), "memory", "5", "30", str(effects), str(nth)]
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=30)


def test_ctrl_c_inside_trio_task_start_ends_in_keyboard_interrupt(tmp_path: Path) -> None:
    """trio's `start`, `start_soon` and `started` are not protected from Ctrl-C: an interrupt
    raised inside ``started()`` left a ``start()`` waiting for ever, and the process went on
    driving its other runs (treadle makes these calls from protected frames; decision 0097).
    Each moment from the 20th to the 59th such call, as the runs and their actors start."""
    moments = range(20, 60)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        ended = list(pool.map(lambda n: interrupt_at_task_start(n, tmp_path / f"e{n}"), moments))
    for nth, child in zip(moments, ended, strict=True):
        assert child.returncode != 0 and "done" not in child.stdout, (nth, child.stdout)
        assert "KeyboardInterrupt" in child.stderr, (nth, child.stderr[-3000:])
        assert "TrioInternalError" not in child.stderr, (nth, child.stderr[-3000:])


async def test_runs_stopped_by_ctrl_c_resume_and_run_each_call_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, effects = tmp_path / "s.db", tmp_path / "effects"
    runs, steps = 20, 60
    err = await trio.to_thread.run_sync(interrupt, str(path), runs, steps, effects, 0.4)
    assert "KeyboardInterrupt" in err and "TrioInternalError" not in err, err[-3000:]
    done_before = effects.read_text().count("\n") if effects.exists() else 0
    assert done_before < runs * (steps - 1)
    monkeypatch.setenv("CTRL_C_EFFECTS", str(effects))  # the driver's tool writes there
    async with treadle.open_sqlite_store(path) as store:
        with trio.fail_after(60):
            await ctrl_c_driver.drive(ctrl_c_driver.agent(steps), store, runs)
        logged = set()
        for i in range(runs):
            log = await store.read_log(f"r{i}")
            assert isinstance(log.records[-1], RunFinished)
            logged |= {f"r{i} {r.intent_id}" for r in log.records if isinstance(r, ActionIntent)}
    calls = collections.Counter(effects.read_text().splitlines())
    assert max(calls.values()) == 1  # no call ran twice
    assert set(calls) <= logged  # and each ran under its durable intent
    # At most the call in flight at the interrupt, per run, did not run: its intent is
    # durable, its outcome unknown, and a `never`-replay call is not run again on resume.
    assert len(logged - set(calls)) <= runs


class InterruptedModel:
    """Raises KeyboardInterrupt in the model gateway's task, as Ctrl-C landing there does."""

    async def complete(
        self,
        request: ModelRequest,
        *,
        on_delta: DeltaCallback | None = None,
        attempt: Attempt = Attempt.STANDALONE,
    ) -> ModelReply:
        await trio.lowlevel.checkpoint()
        raise KeyboardInterrupt


async def test_an_interrupt_in_one_actor_is_not_hidden_by_the_errors_it_causes() -> None:
    """The gateway's task ends with the interrupt; the coordinator then fails on its closed
    inbox. The run must raise the interrupt, not a run error about the inbox, and stay
    unfinished: the same run finishes when driven again."""
    store = treadle.MemoryStore()
    agent = _plain(InterruptedModel())
    with pytest.raises(KeyboardInterrupt):
        await treadle.run(agent, "hi", store=store, run_id="r")
    log = await store.read_log("r")
    assert not any(isinstance(r, RunFinished) for r in log.records)
    again = _plain(ScriptedModel(turns=[say("hello")]))
    result = await treadle.run(again, "hi", store=store, run_id="r")
    assert result.final_answer == "hello"


def _plain(model: treadle.ports.ModelClient) -> treadle.Agent:
    return treadle.Agent(
        model=model,
        executor=treadle.Toolbox([]),
        parser=treadle.NativeToolCallParser(),
        budgets=treadle.Budgets(max_steps=3),
    )


class ProtectionProbe(ScriptedModel):
    """Notes whether Ctrl-C is held off where the model gateway calls the model."""

    protected: list[bool]

    async def complete(self, request: ModelRequest, **options: Any) -> ModelReply:
        self.protected.append(trio.lowlevel.currently_ki_protected())
        return await super().complete(request, **options)


async def test_a_run_and_what_its_tasks_call_are_protected_from_ctrl_c() -> None:
    """By `treadle.run` in the caller's task and by `open_run` in a task of its own, the
    model is called with Ctrl-C held off (delivered to the main task instead), while the
    caller's own code is not (docs/crash-safety.md, item 8)."""
    assert not trio.lowlevel.currently_ki_protected()
    model = ProtectionProbe(turns=[say("one")])
    model.protected = []
    await treadle.run(_plain(model), "hi", store=treadle.MemoryStore(), run_id="a")
    async with treadle.open_run(_plain(model), "hi", store=treadle.MemoryStore()) as handle:
        assert not trio.lowlevel.currently_ki_protected()
        await handle.wait()
    assert model.protected == [True, True]
