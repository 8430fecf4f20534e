// leadgate operator console: plain JavaScript over the operator JSON API (SPEC 5).
//
// Every piece of data from the server is put on the page with textContent (through
// el() below), never as HTML. Every POST carries X-Leadgate-Console: 1 (CSRF guard).
"use strict";

(() => {
  const PAGE_SIZE = 25;
  const REASON_MAX = 2000;
  const FEEDBACK_MAX = 10000;
  const TERMINAL = new Set(["completed", "rejected", "failed", "cancelled", "abandoned"]);

  const $ = (id) => document.getElementById(id);
  const enc = encodeURIComponent;
  const fmt = (n) => n.toLocaleString("en-US");

  let user = null;
  let cursors = [null]; // queue pages visited: cursors[i] is the cursor of page i

  class ApiError extends Error {
    constructor(status, message, rule) {
      super(message);
      this.status = status;
      this.rule = rule || "";
    }
  }

  async function api(method, path, body) {
    const init = { method, credentials: "same-origin", headers: { Accept: "application/json" } };
    if (method !== "GET") init.headers["X-Leadgate-Console"] = "1";
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    let resp;
    try {
      resp = await fetch(path, init);
    } catch (_) {
      throw new ApiError(0, "The server could not be reached. Check the connection and try again.");
    }
    let data = null;
    try {
      data = await resp.json();
    } catch (_) {
      data = null;
    }
    if (!resp.ok) {
      const err = (data && data.error) || {};
      throw new ApiError(resp.status, err.message || `HTTP ${resp.status}`, err.rule);
    }
    return data;
  }

  // A DOM element; string children become text nodes (never parsed as HTML).
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else if (key === "class") node.className = value;
      else node.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children.flat(Infinity)) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  const badge = (text, kind) => el("span", { class: `badge ${kind}-${text}` }, text);
  const when = (iso) => (iso ? el("time", { datetime: iso }, new Date(iso).toLocaleString()) : "—");
  const reviewLink = (id) => el("a", { href: `#/review/${enc(id)}` }, id);
  const textBlock = (text, id) =>
    text ? el("pre", { class: "text", id }, text) : el("p", { class: "empty", id }, "(none)");

  // ------------------------------------------------------------------ messages

  function notify(text) {
    $("notice").textContent = text;
  }

  function clearMessages() {
    $("notice").textContent = "";
    $("error").hidden = true;
    $("error").textContent = "";
  }

  function showError(message) {
    const box = $("error");
    box.replaceChildren(el("strong", {}, "Error: "), message);
    box.hidden = false;
  }

  function handle(err) {
    if (!(err instanceof ApiError)) {
      showError(String(err));
      return;
    }
    if (err.status === 401 && err.rule !== "csrf") {
      user = null;
      showLogin("Your session has ended. Log in again.");
      return;
    }
    if (err.status === 403 && err.rule.startsWith("scope.")) {
      showRoleMessage(location.hash === "#/activity" ? "Agent Activity" : "Lead Reviews");
      return;
    }
    showError(err.message);
  }

  function showRoleMessage(title) {
    const role = user ? user.role : "unknown";
    view(
      el("h1", { tabindex: "-1" }, title),
      el(
        "div",
        { class: "role-message", role: "note", id: "role-message" },
        el("p", {}, `Your role (${role}) cannot review work items.`),
        el("p", {}, "Reviewing needs the Owner, Admin or Member role; ask an Owner or Admin.")
      )
    );
  }

  // --------------------------------------------------------------- login / out

  function showLogin(message) {
    $("nav").hidden = true;
    $("who").hidden = true;
    $("app-view").hidden = true;
    $("app-view").replaceChildren(); // nothing of the last session stays in the page
    $("login-view").hidden = false;
    clearMessages();
    if (message) showError(message);
    $("login-email").focus();
  }

  function loggedIn(u) {
    user = u;
    $("who-name").textContent = `${u.email} (${u.role}, ${u.orgName})`;
    $("nav").hidden = false;
    $("who").hidden = false;
    $("login-view").hidden = true;
    $("app-view").hidden = false;
  }

  async function onLogin(event) {
    event.preventDefault();
    clearMessages();
    const button = event.target.querySelector("button");
    button.disabled = true;
    try {
      const data = await api("POST", "/console/login", {
        email: $("login-email").value,
        password: $("login-password").value,
      });
      $("login-password").value = "";
      loggedIn(data.user);
      await route();
    } catch (err) {
      showError(err.message);
    } finally {
      button.disabled = false;
    }
  }

  async function onLogout() {
    clearMessages();
    try {
      await api("POST", "/console/logout", {});
    } catch (err) {
      showError(err.message);
      return;
    }
    user = null;
    cursors = [null];
    history.replaceState(null, "", "#/reviews");
    showLogin();
    notify("You are logged out.");
  }

  // --------------------------------------------------------------------- views

  function view(...children) {
    const main = $("app-view");
    main.replaceChildren(...children);
    const heading = main.querySelector("h1");
    if (heading) heading.focus({ preventScroll: true });
  }

  async function showQueue() {
    const cursor = cursors[cursors.length - 1];
    const query = `limit=${PAGE_SIZE}` + (cursor ? `&cursor=${enc(cursor)}` : "");
    const data = await api("GET", `/operator/reviews?${query}`);
    const rows = data.items.map((item) =>
      el(
        "tr",
        { "data-id": item.id },
        el("td", {}, reviewLink(item.id)),
        el("td", {}, item.agent ? item.agent.name : ""),
        el("td", {}, badge(item.status, "status")),
        el("td", {}, badge(item.reason, "reason")),
        el("td", { class: "num" }, item.revision),
        el("td", {}, when(item.updatedAt))
      )
    );
    const pager = el(
      "div",
      { class: "pager" },
      el(
        "button",
        { type: "button", disabled: cursors.length === 1, onclick: () => page(-1) },
        "Previous page"
      ),
      el("span", {}, `Page ${cursors.length}`),
      el("button", { type: "button", disabled: !data.next, onclick: () => page(1, data.next) }, "Next page"),
      el("button", { type: "button", onclick: () => page(0) }, "Refresh")
    );
    view(
      el("h1", { tabindex: "-1" }, "Lead Reviews"),
      el(
        "p",
        { class: "hint" },
        "Work items waiting for a human decision, and approved items whose delivery is uncertain."
      ),
      rows.length
        ? el(
            "table",
            { id: "queue" },
            el("caption", { class: "sr-only" }, "Actionable work items"),
            el(
              "thead",
              {},
              el("tr", {}, ["Work item", "Agent", "Status", "Reason", "Revision", "Updated"].map((h) => el("th", { scope: "col" }, h)))
            ),
            el("tbody", {}, rows)
          )
        : el("p", { class: "empty", id: "queue-empty" }, "Nothing needs a decision right now."),
      pager
    );
  }

  async function page(step, next) {
    clearMessages();
    if (step > 0) cursors.push(next);
    else if (step < 0 && cursors.length > 1) cursors.pop();
    try {
      await showQueue();
    } catch (err) {
      handle(err);
    }
  }

  async function showActivity() {
    const data = await api("GET", "/operator/activity");
    const rows = data.items.map((item) =>
      el(
        "tr",
        { "data-id": item.id },
        el("td", {}, reviewLink(item.id)),
        el("td", {}, item.agent),
        el("td", {}, badge(item.status, "status")),
        el("td", { class: "num" }, item.revision),
        el("td", {}, when(item.updatedAt))
      )
    );
    view(
      el("h1", { tabindex: "-1" }, "Agent Activity"),
      el("p", { class: "hint" }, "Recent work items of your organization. Open one for its review detail."),
      rows.length
        ? el(
            "table",
            { id: "activity" },
            el("caption", { class: "sr-only" }, "Recent work items"),
            el(
              "thead",
              {},
              el("tr", {}, ["Work item", "Agent", "Status", "Revision", "Updated"].map((h) => el("th", { scope: "col" }, h)))
            ),
            el("tbody", {}, rows)
          )
        : el("p", { class: "empty" }, "No work items yet.")
    );
  }

  async function showDetail(id) {
    renderDetail(await api("GET", `/operator/reviews/${enc(id)}`));
  }

  async function refresh(id) {
    clearMessages();
    try {
      renderDetail(await api("GET", `/operator/reviews/${enc(id)}`), false);
    } catch (err) {
      handle(err);
    }
  }

  // Run a POST that answers the updated detail; buttons are disabled while it runs.
  async function act(path, body, done) {
    clearMessages();
    const buttons = [...$("app-view").querySelectorAll("button")];
    buttons.forEach((b) => (b.disabled = true));
    try {
      const detail = await api("POST", path, body);
      if (detail && detail.deliveries) renderDetail(detail, false);
      else await route();
      notify(done);
    } catch (err) {
      buttons.forEach((b) => (b.disabled = false));
      handle(err);
    }
  }

  function counter(textarea, output, max) {
    const update = () => {
      const n = textarea.value.length;
      output.textContent = `${fmt(n)} / ${fmt(max)}`;
      output.classList.toggle("over", n > max);
    };
    textarea.addEventListener("input", update);
    update();
  }

  function textForm(id, label, max, submitText, onSubmit) {
    const area = el("textarea", { id: `${id}-text`, rows: 4, "aria-describedby": `${id}-count` });
    const count = el("span", { class: "count", id: `${id}-count` });
    counter(area, count, max);
    return el(
      "form",
      {
        class: "decision",
        id: `${id}-form`,
        onsubmit: (e) => {
          e.preventDefault();
          onSubmit(area.value);
        },
      },
      el("label", { for: `${id}-text` }, label),
      area,
      el("div", { class: "row" }, count, el("button", { type: "submit" }, submitText))
    );
  }

  function decisionPanel(d) {
    const base = `/operator/reviews/${enc(d.id)}`;
    const parts = [el("h2", {}, "Decision")];
    if (d.status === "awaitingHuman") {
      parts.push(
        el(
          "div",
          { class: "row" },
          el(
            "button",
            { type: "button", class: "primary", id: "approve", onclick: () => act(`${base}/approve`, {}, "Approved.") },
            "Approve"
          )
        ),
        textForm("reject", `Reason for rejecting (1–${fmt(REASON_MAX)} characters)`, REASON_MAX, "Reject", (reason) =>
          act(`${base}/reject`, { reason }, "Rejected.")
        ),
        textForm(
          "return",
          `Feedback for the worker (1–${fmt(FEEDBACK_MAX)} characters)`,
          FEEDBACK_MAX,
          "Return to worker",
          (feedback) => act(`${base}/return`, { feedback }, "Returned to the worker.")
        )
      );
    } else {
      parts.push(el("p", { class: "hint" }, `No decision is open: the item is ${d.status}.`));
    }
    if (!TERMINAL.has(d.status)) {
      const confirmRow = el(
        "div",
        { class: "row confirm", hidden: true },
        el("span", {}, "Cancelling stops this work item for good."),
        el(
          "button",
          { type: "button", class: "danger", onclick: () => act(`${base}/cancel`, {}, "Cancelled.") },
          "Yes, cancel it"
        ),
        el("button", { type: "button", onclick: () => (confirmRow.hidden = true) }, "Keep it")
      );
      parts.push(
        el(
          "div",
          { class: "row" },
          el("button", { type: "button", id: "cancel", onclick: () => (confirmRow.hidden = false) }, "Cancel work item…")
        ),
        confirmRow
      );
    }
    return el("aside", { class: "panel", "aria-label": "Decision" }, parts);
  }

  function deliveriesTable(d) {
    if (!d.deliveries.length) return el("p", { class: "empty" }, "No deliveries.");
    return el(
      "table",
      { id: "deliveries" },
      el(
        "thead",
        {},
        el("tr", {}, ["Delivery", "Channel", "Action", "Status", "Attempts", "Error", ""].map((h) => el("th", { scope: "col" }, h)))
      ),
      el(
        "tbody",
        {},
        d.deliveries.map((x) =>
          el(
            "tr",
            {},
            el("td", {}, el("code", {}, x.id)),
            el("td", {}, x.channel || "—"),
            el("td", {}, x.action || "—"),
            el("td", {}, badge(x.status, "status")),
            el("td", { class: "num" }, x.attempts),
            el("td", {}, x.error || ""),
            el(
              "td",
              {},
              x.status === "deliveryUnknown"
                ? [
                    el(
                      "button",
                      { type: "button", onclick: () => act(`/operator/deliveries/${enc(x.id)}/confirm`, {}, "Delivery confirmed.") },
                      "Confirm delivered"
                    ),
                    " ",
                    el(
                      "button",
                      { type: "button", onclick: () => act(`/operator/deliveries/${enc(x.id)}/retry`, {}, "Delivery queued again.") },
                      "Retry delivery"
                    ),
                  ]
                : ""
            )
          )
        )
      )
    );
  }

  function auditTable(d) {
    if (!d.audit.length) return el("p", { class: "empty" }, "No audit entries.");
    return el(
      "table",
      { id: "audit" },
      el("thead", {}, el("tr", {}, ["When", "Actor", "Action", "Status", "Text"].map((h) => el("th", { scope: "col" }, h)))),
      el(
        "tbody",
        {},
        d.audit.map((a) =>
          el(
            "tr",
            {},
            el("td", {}, when(a.at)),
            el("td", {}, a.actor),
            el("td", {}, a.action),
            el("td", {}, a.from || a.to ? `${a.from || "—"} → ${a.to || "—"}` : ""),
            el("td", { class: "cell-text" }, a.text || "")
          )
        )
      )
    );
  }

  function renderDetail(d, focus = true) {
    const meta = [
      ["Status", badge(d.status, "status"), "detail-status"],
      ["Agent", d.agent ? d.agent.name : "—"],
      ["Revision", `${d.revision} (max rounds ${d.maxRevisionRounds}, extra ${d.extraAllowance})`],
      ["Completion policy", d.completionPolicy],
      ["Created", when(d.createdAt)],
      ["Updated", when(d.updatedAt)],
    ];
    const content = [
      el(
        "p",
        { class: "row start" },
        el("a", { href: "#/reviews" }, "← Lead Reviews"),
        el("button", { type: "button", onclick: () => refresh(d.id) }, "Refresh")
      ),
      el("h1", { tabindex: "-1" }, "Work item ", el("code", {}, d.id)),
      el(
        "dl",
        { class: "meta" },
        meta.map(([k, v, id]) => [el("dt", {}, k), el("dd", { id }, v)])
      ),
      el(
        "div",
        { class: "detail" },
        el(
          "div",
          {},
          el("h2", {}, "Summary"),
          textBlock(d.summary, "summary"),
          el("h2", {}, "Snapshot"),
          textBlock(d.snapshot, "snapshot"),
          el("h2", {}, "Task context"),
          textBlock(d.taskContext, "task-context"),
          d.lastFeedback ? [el("h2", {}, "Last feedback"), textBlock(d.lastFeedback, "last-feedback")] : null
        ),
        decisionPanel(d)
      ),
      el("h2", {}, "Deliveries"),
      deliveriesTable(d),
      el("h2", {}, "Audit trail"),
      auditTable(d),
    ];
    if (focus) view(...content);
    else $("app-view").replaceChildren(...content);
  }

  // -------------------------------------------------------------------- router

  async function route() {
    if (!user) return;
    clearMessages();
    const hash = location.hash || "#/reviews";
    for (const link of $("nav").querySelectorAll("a")) {
      const current = link.getAttribute("href") === (hash === "#/activity" ? "#/activity" : "#/reviews");
      if (current) link.setAttribute("aria-current", "page");
      else link.removeAttribute("aria-current");
    }
    try {
      if (hash.startsWith("#/review/")) {
        await showDetail(decodeURIComponent(hash.slice("#/review/".length)));
      } else if (hash === "#/activity") {
        await showActivity();
      } else {
        cursors = [null];
        await showQueue();
      }
    } catch (err) {
      handle(err);
    }
  }

  async function start() {
    $("login-form").addEventListener("submit", onLogin);
    $("logout").addEventListener("click", onLogout);
    window.addEventListener("hashchange", route);
    try {
      const data = await api("GET", "/console/me");
      loggedIn(data.user);
      await route();
    } catch (err) {
      if (err.status === 401) showLogin();
      else showError(err.message);
    }
  }

  start();
})();
