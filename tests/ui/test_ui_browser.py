"""The run console in a real browser: headless Chromium driven by Selenium.

The browser and its driver are Debian's (``apt-get install chromium chromium-driver``; .ci/run
installs them). Nothing downloads a browser: the driver's path is given, so Selenium Manager
never runs. Without them these tests skip, except in CI (``CI`` set), where they fail.
Every wait is on the page's DOM, bounded by a generous hang limit, never a wall-time check.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import trio
from ui_support import MARKUP, markup_agent, self_signed, start_console, start_driver, stop

import treadle

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
HANG_S = 60
"""The hang limit of each wait on the page (it is no speed check: a wait ends when the DOM
shows what it waits for)."""


def _missing() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not (os.path.exists(path) or shutil.which(Path(path).name)):
            return f"{path} is missing (apt-get install chromium chromium-driver)"
    return None


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    why = _missing()
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser tests: {why}")
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        # the console served over TLS has a self-signed certificate (`tls_console`); the
        # browser visits nothing but the consoles on 127.0.0.1
        "--ignore-certificate-errors",
        "--window-size=1280,1000",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(HANG_S)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def console(tmp_path_factory):
    """A served console over a SQLite store holding one finished run (``markup``)."""
    tmp = tmp_path_factory.mktemp("console")
    db = tmp / "runs.db"

    async def first_run():
        async with treadle.open_sqlite_store(db) as store:
            await treadle.run(markup_agent(), "read the page", store=store, run_id="markup")

    trio.run(first_run)
    process, url = start_console(db)
    try:
        yield tmp, db, url
    finally:
        stop(process)


def wait(browser, condition):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, HANG_S, poll_frequency=0.05).until(condition)


def present(css):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec

    return ec.presence_of_element_located((By.CSS_SELECTOR, css))


def shows(css, text):
    """The element holds ``text``; an element the live list replaced meanwhile is looked up
    again (Selenium's condition treats a stale element as not yet showing it)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec

    return ec.text_to_be_present_in_element((By.CSS_SELECTOR, css), text)


def find(browser, css):
    from selenium.webdriver.common.by import By

    return browser.find_element(By.CSS_SELECTOR, css)


def clicked(browser, css) -> bool:
    """Click the element, if it is there: the live list may replace it between find and click."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException

    try:
        find(browser, css).click()
    except (NoSuchElementException, StaleElementReferenceException):
        return False
    return True


def typed(browser, css, text) -> bool:
    """Type ``text`` into the field, if it is there: a panel update may replace it between
    find and typing (once the field has the focus, updates wait for the operator)."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException

    try:
        find(browser, css).send_keys(text)
    except (NoSuchElementException, StaleElementReferenceException):
        return False
    return True


def finish(process) -> str:
    """The last line a driver process printed (its run's state) once it exited."""
    out = process.stdout.read()
    assert process.wait(timeout=HANG_S) == 0
    process.stdout.close()
    return out.strip().splitlines()[-1]


def test_markup_in_an_observation_stays_text(browser, console):
    _, _, url = console
    browser.get(f"{url}/runs/markup")
    observation = wait(browser, present("#step-1 pre.observation"))
    assert observation.text == MARKUP  # shown as the characters the tool returned
    assert browser.find_elements("css selector", "#pwned-img") == []
    assert browser.find_elements("css selector", "#timeline script, #timeline b") == []
    assert browser.execute_script("return window.pwned === undefined")
    assert "run finished" in find(browser, "#timeline").text
    # nothing on the page broke the policy or failed to load (the console logs both)
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []


def test_a_live_run_streams_in_and_approving_it_from_the_page_resumes_it(browser, console):
    tmp, db, url = console
    browser.get(url)
    assert wait(browser, shows('#rows tr[data-run="markup"]', "succeeded"))
    browser.execute_script("window.notReloaded = true")
    driver, gate, marker = start_driver(tmp, db, "live")
    try:
        # the list shows the new run without a reload
        wait(browser, present('#rows tr[data-run="live"]'))
        assert browser.execute_script("return window.notReloaded === true")
        wait(browser, lambda b: clicked(b, '#rows tr[data-run="live"] a'))
        wait(browser, present("#step-1 .call"))  # step 1 waits on the gate: its call runs
        assert "wait_gate" in find(browser, "#step-1").text
        browser.execute_script("window.notReloaded = true")
        gate.touch()  # the tool returns: its result and step 2 are written now
        wait(browser, present("#step-1 pre.observation"))
        approve = wait(browser, present("#approve-button"))
        assert browser.execute_script("return window.notReloaded === true")
        assert "<script>window.pwned = true</script>" in find(browser, "#step-1").text
        assert browser.execute_script("return window.pwned === undefined")
        assert '"amount": 5' in find(browser, "#approval textarea").get_attribute("value")
        assert not marker.exists()
        # Enter in a field submits with the form's default button, the first submit button:
        # it is disabled, so Enter in the rejection message never approves (HTML's implicit
        # submission does nothing then). The three decisions are buttons after it.
        default = "return document.querySelector('#approval button[type=submit]')"
        assert browser.execute_script(default + ".disabled") is True
        assert browser.execute_script(default + ".id") == ""
        approve.click()
        wait(browser, present("#timeline .block.finish.state-succeeded"))
        assert "paid" in find(browser, "#timeline .block.finish").text
        assert browser.execute_script("return window.notReloaded === true")
        assert "approve" in find(browser, "#notice").text
        # what streamed in broke no policy either
        assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
        assert finish(driver) == "succeeded"
    finally:
        driver.kill()
        driver.wait(timeout=HANG_S)
    assert marker.read_text() == "5\n"  # the approved call ran once


def test_cancel_from_the_page_stops_a_live_run(browser, console):
    tmp, db, url = console
    driver, _, marker = start_driver(tmp, db, "stop-me")
    try:
        browser.get(url)
        wait(browser, present('#rows tr[data-run="stop-me"] a')).click()
        wait(browser, present("#step-1 .call"))  # waits on a gate nobody opens
        wait(browser, lambda b: typed(b, "#cancel input[name=reason]", "not needed"))
        wait(browser, lambda b: clicked(b, "#cancel-button"))
        wait(browser, present("#timeline .block.finish.state-cancelled"))
        assert "not needed" in find(browser, "#timeline .block.cancel").text
        assert "cancel requested" in find(browser, "#notice").text
        assert finish(driver) == "cancelled"
    finally:
        driver.kill()
        driver.wait(timeout=HANG_S)
    assert not marker.exists()


def test_cancel_without_javascript_posts_the_plain_form(browser, console):
    """With scripts off the form is posted as HTML: the console's own referrer policy made
    Chromium send ``Origin: null``, and the same-origin check refused every such post."""
    tmp, db, url = console
    driver, _, marker = start_driver(tmp, db, "no-script")
    browser.execute_cdp_cmd("Emulation.setScriptExecutionDisabled", {"value": True})
    try:
        # without scripts nothing streams in: load the page again until the call shows
        wait(
            browser,
            lambda b: (
                b.get(f"{url}/runs/no-script") or b.find_elements("css selector", "#step-1 .call")
            ),
        )
        wait(browser, lambda b: typed(b, "#cancel input[name=reason]", "posted plainly"))
        wait(browser, lambda b: clicked(b, "#cancel-button"))
        wait(browser, lambda b: "/cancel" in b.current_url)  # the console's answer page
        text = find(browser, "body").text
        assert "refused" not in text, text
        assert "cancel requested" in text, text
        assert finish(driver) == "cancelled"
    finally:
        browser.execute_cdp_cmd("Emulation.setScriptExecutionDisabled", {"value": False})
        driver.kill()
        driver.wait(timeout=HANG_S)
    assert not marker.exists()


def test_a_run_named_rows_opens_as_a_run(browser, console):
    """The runs list's live stream was served at /runs/rows, so run ``rows`` never opened."""
    _, db, url = console

    async def named_rows():
        async with treadle.open_sqlite_store(db) as store:
            await treadle.run(markup_agent(), "read the page", store=store, run_id="rows")

    trio.run(named_rows)
    browser.get(url)
    wait(browser, lambda b: clicked(b, '#rows tr[data-run="rows"] a'))
    observation = wait(browser, present("#step-1 pre.observation"))
    assert observation.text == MARKUP
    assert "run finished" in find(browser, "#timeline").text


def approval_for(call_id):
    """The panel's approval form names call ``call_id`` (a replaced form is looked up again)."""
    from selenium.common.exceptions import StaleElementReferenceException

    def shown(browser) -> bool:
        try:
            fields = browser.find_elements("css selector", "#approval input[name=call_id]")
            return bool(fields) and fields[0].get_attribute("value") == call_id
        except StaleElementReferenceException:
            return False

    return shown


def test_the_panel_follows_each_decision_made_from_it(browser, console):
    """The panel was not replaced while anything in it had the focus, and a clicked button
    keeps it: after the first of two approvals the page kept the form for ``t1`` while the run
    waited on ``t2``, and once the run finished it still showed it waiting."""
    tmp, db, url = console
    driver, gate, marker = start_driver(tmp, db, "twice", approvals=2)
    gate.touch()  # no wait: step 2 asks its approval at once
    try:
        browser.get(url)
        wait(browser, lambda b: clicked(b, '#rows tr[data-run="twice"] a'))
        wait(browser, approval_for("t1"))
        wait(browser, lambda b: clicked(b, "#approve-button"))
        wait(browser, approval_for("t2"))  # the run waits on its second call now
        assert find(browser, "#run-state").text == "awaiting_approval"
        wait(browser, lambda b: clicked(b, "#approve-button"))
        wait(browser, shows("#run-state", "succeeded"))
        assert browser.find_elements("css selector", "#approval, #cancel") == []
        assert finish(driver) == "succeeded"
    finally:
        driver.kill()
        driver.wait(timeout=HANG_S)
    assert marker.read_text() == "5\n6\n"


def test_the_panel_waits_while_the_operator_types_in_it_and_follows_after(browser, console):
    """An update that came while a field of the panel had the focus was dropped, not kept:
    the panel stayed as it was until the page was loaded again."""
    tmp, db, url = console
    driver, gate, _ = start_driver(tmp, db, "typing")
    try:
        browser.get(url)
        wait(browser, lambda b: clicked(b, '#rows tr[data-run="typing"] a'))
        wait(browser, present("#step-1 .call"))  # waits on the gate
        wait(browser, lambda b: typed(b, "#cancel input[name=reason]", "half typed"))
        gate.touch()  # step 2 asks an approval: the update comes while the operator types
        wait(browser, shows("#step-2 .approval-record", "approval requested"))
        # the panel arrives with that record; held, it wipes nothing the operator typed
        assert find(browser, "#cancel input[name=reason]").get_attribute("value") == "half typed"
        assert browser.find_elements("css selector", "#approval") == []
        find(browser, "h1").click()  # the focus leaves the panel: the held update shows
        wait(browser, approval_for("t1"))
        wait(browser, lambda b: clicked(b, "#approve-button"))
        wait(browser, shows("#run-state", "succeeded"))
        assert finish(driver) == "succeeded"
    finally:
        driver.kill()
        driver.wait(timeout=HANG_S)


def test_a_queued_run_cancelled_from_its_page_shows_cancelled(browser, console):
    """Cancelling a queued run finished it at once, but its page kept saying ``queued``."""
    from click.testing import CliRunner

    from treadle.cli import main

    _, db, url = console
    queued = CliRunner().invoke(
        main, ["submit", "--store", str(db), "--agent", "nobody", "--run-id", "queued", "hi"]
    )
    assert queued.exit_code == 0, queued.output
    browser.get(f"{url}/runs/queued")
    wait(browser, shows("#run-state", "queued"))
    wait(browser, lambda b: typed(b, "#cancel input[name=reason]", "not needed"))
    wait(browser, lambda b: clicked(b, "#cancel-button"))
    wait(browser, shows("#run-state", "cancelled"))
    assert "cancel requested" in find(browser, "#notice").text
    assert browser.find_elements("css selector", "#cancel") == []


def test_a_double_click_sends_a_decision_once_and_says_it_was_applied(browser, console):
    """Two clicks on approve sent two requests: the call was approved, yet the page's notice
    ended red, the second answer refusing an "already" decided call. A form is not sent
    again while its request is under way."""
    tmp, db, url = console
    driver, gate, marker = start_driver(tmp, db, "double")
    gate.touch()
    try:
        browser.get(url)
        wait(browser, lambda b: clicked(b, '#rows tr[data-run="double"] a'))
        wait(browser, approval_for("t1"))
        browser.execute_script(
            "window.posts = 0; const sent = window.fetch;"
            "window.fetch = (...args) => { window.posts += 1; return sent(...args); };"
        )
        browser.execute_script(
            "const b = document.getElementById('approve-button'); b.click(); b.click();"
        )
        wait(browser, shows("#notice", "approve"))
        assert browser.execute_script("return window.posts") == 1
        assert "ok" in find(browser, "#notice").get_attribute("class").split()
        assert finish(driver) == "succeeded"
    finally:
        driver.kill()
        driver.wait(timeout=HANG_S)
    assert marker.read_text() == "5\n"


def test_the_panel_says_the_run_is_orphaned_once_its_drivers_lease_lapses(browser, console):
    """A driver killed with SIGKILL writes nothing more: the page kept saying the run was
    driven by the dead process, its heartbeat's age frozen, while ``treadle runs`` said
    orphaned. The panel follows the lease without a new record."""
    tmp, db, url = console
    driver, _, _ = start_driver(tmp, db, "dies")  # waits on its gate: never opened
    try:
        browser.get(url)
        wait(browser, lambda b: clicked(b, '#rows tr[data-run="dies"] a'))
        wait(browser, present("#step-1 .call"))  # waits on the gate
        wait(browser, shows("#run-driver", "gen. 1"))
    finally:
        driver.kill()
        driver.wait(timeout=HANG_S)
        driver.stdout.close()
    wait(browser, shows("#run-driver", "nobody: orphaned"))  # once the lease's TTL passed
    assert find(browser, "#run-state").text == "running"


def test_the_runs_list_says_why_it_waits_while_the_store_cannot_be_read(browser, tmp_path):
    """The list's stream broke with a traceback when the store failed its read (here a JSONL
    store's folder gone for a while), and the page said nothing; now it shows why and takes
    the notice away once the store reads again."""
    store = tmp_path / "runs"

    async def first_run():
        async with treadle.open_jsonl_store(store) as opened:
            await treadle.run(markup_agent(), "read the page", store=opened, run_id="one")

    trio.run(first_run)
    process, url = start_console(store)
    try:
        browser.get(url)
        wait(browser, present('#rows tr[data-run="one"]'))
        store.rename(tmp_path / "away")
        wait(browser, shows("#notice", "cannot list"))
        (tmp_path / "away").rename(store)
        wait(browser, lambda b: not find(b, "#notice").is_displayed())
        assert find(browser, "#live").get_attribute("class") == "live on"
        assert browser.find_elements("css selector", '#rows tr[data-run="one"]')
    finally:
        stop(process)


TABS = 8
"""Tabs open at once on the console's live pages: more than the six HTTP/1.1 connections a
browser opens to one host."""

OPENED_STREAMS = """
window.opened = [];
const Stream = window.EventSource;
window.EventSource = class extends Stream {
  constructor(url, init) {
    super(url, init);
    window.opened.push({ url: String(url), source: this });
  }
};
"""
"""A script run before the page's own: it keeps each EventSource the page opens, and its URL."""


def test_hidden_tabs_hold_no_stream_and_the_tab_in_front_is_answered(browser, console):
    """Every tab of a run's page or of the runs list held a live stream, one of the six
    connections a browser opens to a host: with six tabs a decision or cancel sent from one got
    no answer until a tab closed, and a seventh page did not load. A hidden tab closes its
    stream; shown again, it opens one after the last record it placed."""
    tmp, db, url = console
    driver, gate, marker = start_driver(tmp, db, "many-tabs")
    first = browser.current_window_handle
    script = browser.execute_cdp_cmd(
        "Page.addScriptToEvaluateOnNewDocument", {"source": OPENED_STREAMS}
    )["identifier"]
    tabs = []
    try:
        browser.get(url)
        wait(browser, lambda b: clicked(b, '#rows tr[data-run="many-tabs"] a'))
        wait(browser, present("#step-1 .call"))  # waits on a gate: nothing more is written
        wait(browser, present("#live.on"))
        placed = int(find(browser, "#run").get_attribute("data-last-seq"))
        for n in range(TABS - 1):
            browser.switch_to.new_window("tab")  # in front: the tabs before it are hidden
            tabs.append(browser.current_window_handle)
            browser.get(url if n % 2 else f"{url}/runs/many-tabs")
            wait(browser, present("#live.on"))  # its own stream is open
        gate.touch()  # step 1's result and step 2's approval are written while tab 1 is hidden
        if browser.find_elements("css selector", "#run"):  # the last tab shows the run
            wait(browser, approval_for("t1"))
        browser.switch_to.window(first)
        wait(browser, approval_for("t1"))  # what was written while hidden came in
        opened = browser.execute_script(
            "return window.opened.map((o) => [o.url, o.source.readyState])"
        )
        assert [(u.rsplit("/", 2)[-1], state) for u, state in opened] == [
            (f"events?from={placed + 1}", 2),  # closed while hidden
            (f"events?from={placed + 1}", 1),  # shown again: after the last record placed
        ]
        assert "wait_gate" in find(browser, "#step-1").text
        assert browser.find_elements("css selector", "#step-1 pre.observation")
        wait(browser, lambda b: clicked(b, "#approve-button"))
        wait(browser, shows("#notice", "approve"))  # answered with seven more tabs open
        wait(browser, shows("#run-state", "succeeded"))
        assert finish(driver) == "succeeded"
    finally:
        browser.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument", {"identifier": script})
        for tab in tabs:
            browser.switch_to.window(tab)
            browser.close()
        browser.switch_to.window(first)
        driver.kill()
        driver.wait(timeout=HANG_S)
    assert marker.read_text() == "5\n"


@pytest.fixture(scope="module")
def tls_console(console, tmp_path_factory):
    """The store of `console` served again over TLS (``--certfile``, ``--keyfile``): its URL."""
    _, db, _ = console
    cert, key = self_signed(tmp_path_factory.mktemp("tls"))
    process, url = start_console(db, "--certfile", str(cert), "--keyfile", str(key))
    try:
        yield url
    finally:
        stop(process)


def test_over_tls_live_pages_shown_side_by_side_share_one_connection(browser, console, tls_console):
    """Windows side by side are all shown, so each live page in them keeps its stream: over
    HTTP/1.1 the seventh page did not load and an action got no answer. Over TLS the browser
    speaks HTTP/2, which carries every window's page, stream and action on one connection."""
    tmp, db, _ = console
    url = tls_console
    driver, gate, marker = start_driver(tmp, db, "windows")
    first = browser.current_window_handle
    script = browser.execute_cdp_cmd(
        "Page.addScriptToEvaluateOnNewDocument", {"source": OPENED_STREAMS}
    )["identifier"]
    protocol = "return performance.getEntriesByType('navigation')[0].nextHopProtocol"
    windows = []
    try:
        browser.get(url)
        wait(browser, lambda b: clicked(b, '#rows tr[data-run="windows"] a'))
        wait(browser, present("#step-1 .call"))  # waits on a gate
        wait(browser, present("#live.on"))
        assert browser.execute_script(protocol) == "h2"
        for n in range(TABS - 1):
            browser.switch_to.new_window("window")  # shown beside the others: none is hidden
            windows.append(browser.current_window_handle)
            browser.get(url if n % 2 else f"{url}/runs/windows")
            wait(browser, present("#live.on"))
            assert browser.execute_script(protocol) == "h2"
        browser.switch_to.window(first)
        gate.touch()
        wait(browser, approval_for("t1"))
        # the first window's stream stayed open throughout: no window was hidden
        assert browser.execute_script("return window.opened.map((o) => o.source.readyState)") == [1]
        wait(browser, lambda b: clicked(b, "#approve-button"))
        wait(browser, shows("#notice", "approve"))  # answered beside seven more live pages
        wait(browser, shows("#run-state", "succeeded"))
        assert finish(driver) == "succeeded"
    finally:
        browser.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument", {"identifier": script})
        for window in windows:
            browser.switch_to.window(window)
            browser.close()
        browser.switch_to.window(first)
        driver.kill()
        driver.wait(timeout=HANG_S)
    assert marker.read_text() == "5\n"
