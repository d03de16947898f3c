// treadle run console: live updates over server-sent events, filtering, and actions.
// The server renders every fragment with its values escaped; this script only places them.
"use strict";

function token() {
  const meta = document.querySelector('meta[name="treadle-token"]');
  return meta ? meta.content : "";
}

function filterRows() {
  const q = document.getElementById("q");
  const state = document.getElementById("state");
  if (!q || !state) return;
  const words = q.value.toLowerCase().split(/\s+/).filter(Boolean);
  let shown = 0;
  const rows = document.querySelectorAll("#rows tr.run");
  rows.forEach((row) => {
    const text = row.dataset.search || "";
    const states = (row.dataset.state || "").split(" ");
    const ok = words.every((w) => text.includes(w)) && (!state.value || states.includes(state.value));
    row.hidden = !ok;
    if (ok) shown += 1;
  });
  const count = document.getElementById("count");
  if (count) count.textContent = shown + " of " + rows.length + " runs";
}

// A live stream held only while the page is shown. A browser opens at most six HTTP/1.1
// connections to a host, shared by all its tabs, and an open stream holds one: tabs in the
// background that kept theirs would leave none for the page in front, whose loads and
// actions would wait (docs/ui.md, "Many tabs"). So a page that is hidden (another tab in
// front, its window minimized) closes its stream, and opens a new one when it is shown
// again, at `url()` as it is then (a run's page: after the last record it placed). Each new
// stream gets the live mark's handlers and `listen(source, end)`; `end()` closes the stream
// for good (the run finished, the store cannot be read), shown or not.
function whileShown(url, listen) {
  const live = document.getElementById("live");
  const notice = document.getElementById("notice");
  let source = null;
  let ended = false;
  const open = () => {
    source = new EventSource(url());
    source.addEventListener("open", () => live.classList.add("on"));
    source.addEventListener("error", () => live.classList.remove("on"));
    listen(source, end);
  };
  const close = () => {
    if (source) source.close();
    source = null;
    live.classList.remove("on");
    // why the closed stream waited on the store: the next one says it again if it still does
    if (notice.dataset.store === "retrying") {
      notice.hidden = true;
      delete notice.dataset.store;
    }
  };
  const end = () => {
    ended = true;
    close();
  };
  document.addEventListener("visibilitychange", () => {
    if (ended) return;
    if (document.hidden) close();
    else if (!source) open();
  });
  if (!document.hidden) open();
  return end;
}

// What a live stream says of the store's reads (the same on both pages): "retrying" shows
// why the page is not updated for now and keeps the stream open, "recovered" takes that
// notice away, "unreadable" shows why it stopped for good and ends the stream (`end`).
function followStore(source, end) {
  const live = document.getElementById("live");
  const notice = document.getElementById("notice");
  source.addEventListener("retrying", (event) => {
    live.classList.remove("on");
    notice.hidden = false;
    notice.textContent = JSON.parse(event.data).message;
    notice.className = "notice refused";
    notice.dataset.store = "retrying";
  });
  source.addEventListener("recovered", () => {
    live.classList.add("on");
    if (notice.dataset.store === "retrying") notice.hidden = true; // not an action's answer
    delete notice.dataset.store;
  });
  source.addEventListener("unreadable", (event) => {
    end();
    live.hidden = true;
    notice.hidden = false;
    notice.textContent = JSON.parse(event.data).message;
    notice.className = "notice refused";
    delete notice.dataset.store;
  });
}

function runsPage() {
  const q = document.getElementById("q");
  const state = document.getElementById("state");
  q.addEventListener("input", filterRows);
  state.addEventListener("change", filterRows);
  // a stream opened again sends the whole table first: what changed meanwhile shows
  whileShown(() => "/rows", (source, end) => {
    source.addEventListener("rows", (event) => {
      document.getElementById("rows").innerHTML = event.data;
      filterRows();
    });
    followStore(source, end);
  });
  filterRows();
}

function place(data) {
  const timeline = document.getElementById("timeline");
  if (data.html) {
    const holder = document.createElement("template");
    holder.innerHTML = data.html.trim();
    const fresh = holder.content.firstElementChild;
    const old = document.getElementById(data.block);
    if (old) {
      const open = Array.from(old.querySelectorAll("details")).map((d) => d.open);
      old.replaceWith(fresh);
      fresh.querySelectorAll("details").forEach((d, i) => { if (open[i]) d.open = true; });
    } else {
      timeline.appendChild(fresh);
    }
  }
  if (data.panel != null) showPanel(data.panel, false);
  if (data.charts != null) document.getElementById("charts").innerHTML = data.charts;
}

// The panel as the run's latest record shows it, held back while the operator types in one
// of the panel's fields (placing it would wipe what they typed). It is placed once the focus
// leaves the panel, once a decision or cancel sent from the panel was answered, when the run
// finishes, or with the next update that finds nobody typing: no update is dropped.
let heldPanel = null;

function typingIn(panel) {
  const field = document.activeElement;
  if (!field || !panel.contains(field)) return false;
  if (field.tagName === "TEXTAREA" || field.tagName === "SELECT") return true;
  return field.tagName === "INPUT" && !["button", "submit", "reset", "hidden"].includes(field.type);
}

function showPanel(html, always) {
  const panel = document.getElementById("panel");
  if (!always && typingIn(panel)) { heldPanel = html; return; }
  heldPanel = null;
  panel.innerHTML = html;
  bindForms();
}

function showHeldPanel() {
  if (heldPanel != null) showPanel(heldPanel, true);
}

function holdPanelWhileTyping() {
  const panel = document.getElementById("panel");
  // Once the focus moved: a field or button of the panel keeps the update held (a click on a
  // button sends its form, whose answer places it); anywhere else places it. A pointer pressed
  // in the panel defers that to its release, so the click it makes lands on the button it
  // pressed (some browsers focus no button on a click). A window that lost the focus keeps its
  // focused field, so switching windows wipes nothing.
  let pressed = false;
  const settle = () => setTimeout(() => {
    if (!pressed && !panel.contains(document.activeElement)) showHeldPanel();
  }, 0);
  const released = () => { if (pressed) { pressed = false; settle(); } };
  panel.addEventListener("pointerdown", () => { pressed = true; });
  document.addEventListener("pointerup", released);
  document.addEventListener("pointercancel", released);
  panel.addEventListener("focusout", settle);
}

// The console's token as each stream brings it when it opens (a restarted console has a new
// one): every form and the header the script sends carry it, also while one is being edited.
function useToken(value) {
  const meta = document.querySelector('meta[name="treadle-token"]');
  if (meta) meta.content = value;
  document.querySelectorAll('form[data-action] input[name="token"]').forEach((input) => {
    input.value = value;
  });
}

function runPage() {
  const run = document.getElementById("run");
  bindForms();
  if (run.dataset.finished === "true") return;
  holdPanelWhileTyping();
  document.getElementById("live").hidden = false;
  // A stream opened again starts after the last record placed: `from` is read as strictly as
  // the Last-Event-ID a stream that reconnects by itself sends (docs/ui.md, "A run's page").
  const url = () =>
    "/runs/" + encodeURIComponent(run.dataset.run) + "/events?from=" +
    (Number(run.dataset.lastSeq) + 1);
  whileShown(url, (source, end) => {
    source.addEventListener("record", (event) => {
      const data = JSON.parse(event.data);
      run.dataset.lastSeq = String(data.seq);
      place(data);
    });
    source.addEventListener("token", (event) => useToken(JSON.parse(event.data).token));
    // the run's state or driver changed without a new record (a lease renewed, lost, taken over)
    source.addEventListener("panel", (event) => showPanel(JSON.parse(event.data).panel, false));
    followStore(source, end);
    source.addEventListener("finished", () => {
      end();
      document.getElementById("live").hidden = true;
      run.dataset.finished = "true";
      showHeldPanel(); // the final panel: no form is left to type in
    });
  });
}

// A form is sent once at a time: a second submit (a double click) while its request is under
// way is dropped, so the answer the page shows is that of the one request sent.
function bindForms() {
  document.querySelectorAll("form[data-action]").forEach((form) => {
    if (form.dataset.bound) return;
    form.dataset.bound = "1";
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      if (form.dataset.sending) return;
      form.dataset.sending = "1";
      try {
        await send(form, event.submitter);
      } finally {
        delete form.dataset.sending;
      }
      showHeldPanel(); // what was sent is done with: the run's latest panel replaces its form
    });
  });
}

async function send(form, submitter) {
  const body = new FormData(form);
  if (submitter && submitter.name) body.set(submitter.name, submitter.value);
  const notice = document.getElementById("notice");
  let said;
  try {
    const response = await fetch(form.action, {
      method: "POST",
      body: body,
      headers: { "Accept": "application/json", "X-Treadle-Token": token() },
      credentials: "same-origin",
    });
    try { said = await response.json(); } catch (e) { said = { ok: false, message: response.statusText }; }
  } catch (e) {
    said = { ok: false, message: "the console did not answer: " + e.message };
  }
  notice.hidden = false;
  notice.textContent = said.message;
  notice.className = "notice " + (said.ok ? "ok" : "refused");
  delete notice.dataset.store; // an action's answer: a "recovered" keeps it
}

document.addEventListener("DOMContentLoaded", () => {
  const page = document.body.dataset.page;
  if (page === "runs") runsPage();
  if (page === "run") runPage();
});
