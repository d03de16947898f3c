"""Screenshots of the run console for the docs: docs/images/ui-runs.png and ui-run.png.

    python3 benchmarks/ui_screenshots.py [--out docs/images]

Builds a demo SQLite store in a temporary directory (a support agent's runs: one that
succeeded over several steps, one failed, one cancelled, one that waits on an approval, held
by this process while the pictures are taken), serves it with ``treadle ui`` on a free
loopback port, and photographs the pages in Debian's headless Chromium (no browser is
downloaded: the driver is /usr/bin/chromedriver). Needs the ``ui`` and ``test`` extras.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import trio

import treadle
from treadle.supervisors import open_run
from treadle.testing.scripted import ScriptedModel
from treadle.types import ModelErrorInfo, ModelReply, RunState, ToolCall, Usage

ROOT = Path(__file__).resolve().parents[1]


@treadle.tool
async def find_order(order_id: str) -> str:
    """Look an order up."""
    await trio.sleep(0.12)
    return f'{{"order": "{order_id}", "status": "lost in transit", "total": 42.5}}'


@treadle.tool
async def carrier_status(order_id: str) -> str:
    """Ask the carrier."""
    await trio.sleep(0.35)
    return "<carrier-api>tracking 1Z999: no scan for 9 days</carrier-api>"


@treadle.tool(requires_approval=True)
async def refund(order_id: str, amount: float) -> str:
    """Refund an order."""
    await trio.sleep(0.05)
    return f"refunded {amount} for {order_id}"


def reply(text, *calls, reasoning=None, usage=(0, 0)):
    tool_calls = tuple(
        ToolCall(id=f"c{i}-{name}", name=name, arguments=args)
        for i, (name, args) in enumerate(calls)
    )
    return ModelReply(
        text=text,
        reasoning=reasoning,
        tool_calls=tool_calls,
        finish_reason="tool_calls" if calls else "stop",
        usage=Usage(input_tokens=usage[0], output_tokens=usage[1]),
    )


def support_agent(turns, *, failures=None):
    return treadle.Agent(
        model=ScriptedModel(turns=turns, failures=failures or {}, latency_s=0.25),
        executor=treadle.Toolbox([find_order, carrier_status, refund]),
        parser=treadle.NativeToolCallParser(),
        system_prompt="You are a support agent for an online shop.",
    )


HAPPY = [
    reply(
        "Let me look the order up.",
        ("find_order", {"order_id": "1042"}),
        reasoning="The customer says order 1042 never arrived. First check its status.",
        usage=(412, 38),
    ),
    reply(
        "The shop marks it lost; I'll check with the carrier.",
        ("carrier_status", {"order_id": "1042"}),
        usage=(560, 41),
    ),
    reply(
        "No scan for 9 days: I'll refund it.",
        ("refund", {"order_id": "1042", "amount": 42.5}),
        reasoning="Policy: a parcel without a scan for 7+ days counts as lost; refund in full.",
        usage=(702, 52),
    ),
    reply("Your order 1042 was lost in transit; I refunded 42.50 in full.", usage=(790, 29)),
]


async def build(db: Path, ready: trio.Event, done: trio.Event) -> None:
    async with treadle.open_sqlite_store(db) as store:
        async with open_run(
            support_agent(HAPPY),
            "My order 1042 never arrived.",
            store=store,
            run_id="refund-1042",
            control_poll_s=0.05,
        ) as handle:
            while handle.state is not RunState.AWAITING_APPROVAL:  # noqa: ASYNC110 (a property)
                await trio.sleep(0.01)
            handle.approve()
            await handle.wait()
        failing = {
            0: [
                ModelErrorInfo(
                    kind="rate_limited", message="slow down", retryable=False, status=429
                )
            ]
        }
        await treadle.run(
            support_agent(HAPPY, failures=failing),
            "Where is order 77?",
            store=store,
            run_id="lookup-77",
        )
        async with open_run(
            support_agent(HAPPY), "Cancel my subscription", store=store, run_id="unsubscribe-9"
        ) as handle:
            handle.cancel("duplicate ticket")
            await handle.wait()
        async with open_run(
            support_agent(HAPPY[:1] + HAPPY[2:]),
            "Order 2210 arrived broken.",
            store=store,
            run_id="refund-2210",
            control_poll_s=0.05,
        ) as handle:
            while handle.state is not RunState.AWAITING_APPROVAL:  # noqa: ASYNC110 (a property)
                await trio.sleep(0.01)
            ready.set()
            await done.wait()  # held (driven) while the pictures are taken
            handle.cancel("screenshots taken")


def photograph(url: str, out: Path) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    with tempfile.TemporaryDirectory() as profile:
        for flag in (
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            "--window-size=1280,900",
            f"--user-data-dir={profile}",
        ):
            options.add_argument(flag)
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
        try:
            seen = lambda css: ec.presence_of_element_located((By.CSS_SELECTOR, css))  # noqa: E731
            driver.get(url)
            WebDriverWait(driver, 60).until(seen('#rows tr[data-run="refund-2210"]'))
            WebDriverWait(driver, 60).until(seen("#live.on"))
            driver.save_screenshot(str(out / "ui-runs.png"))
            driver.set_window_size(1280, 1500)
            driver.get(f"{url}/runs/refund-1042")
            WebDriverWait(driver, 60).until(seen("#timeline .block.finish"))
            for details in driver.find_elements(By.CSS_SELECTOR, "#step-1 details.reasoning"):
                details.click()
            driver.save_screenshot(str(out / "ui-run.png"))
            driver.set_window_size(1280, 900)
            driver.get(f"{url}/runs/refund-2210")
            WebDriverWait(driver, 60).until(seen("#approval"))
            driver.save_screenshot(str(out / "ui-approval.png"))
        finally:
            driver.quit()


async def main(out: Path) -> None:
    await trio.Path(out).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "demo.db"
        ready, done = trio.Event(), trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(build, db, ready, done)
            await ready.wait()
            console = subprocess.Popen(  # noqa: ASYNC220 (read from a thread below)
                [sys.executable, "-m", "treadle", "ui", "--store", str(db), "--port", "0"],
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                line = await trio.to_thread.run_sync(console.stdout.readline)
                url = line.removeprefix("treadle ui: serving ").strip()
                await trio.to_thread.run_sync(photograph, url, out)
            finally:
                console.terminate()
                console.wait(timeout=30)
                console.stdout.close()
                done.set()
    print(f"wrote {out}/ui-runs.png, ui-run.png, ui-approval.png")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    trio.run(main, parser.parse_args().out)
