// leadgate operator console: plain JavaScript over the operator JSON API (SPEC 5).
//
// Every piece of data from the server is put on the page with textContent (through
// el() below), never as HTML. Every POST carries X-Leadgate-Console: 1 (CSRF guard).
// Live updates come from GET /operator/events (server-sent events): the queue, the
// detail and the navigation count follow the database without a reload.
"use strict";

(() => {
  const PAGE_SIZE = 25;
  const REASON_MAX = 2000;
  const FEEDBACK_MAX = 10000;
  const TERMINAL = new Set(["completed", "rejected", "failed", "cancelled", "abandoned"]);
  const STATUSES = [
    "inProgress", "reviewQueued", "reviewing", "awaitingHuman", "approved",
    "completed", "rejected", "failed", "cancelled", "abandoned",
  ];
  const CHANNELS = ["api", "studio", "slack", "discord", "teams", "email", "scheduled", "flow"];
  const REASON_LABELS = {
    escalated: "Lead escalated",
    roundsExhausted: "Changes requested, no rounds left",
    incompleteProvenance: "Incomplete provenance",
    leaseExpired: "Lead review kept failing",
    deliveryUnknown: "Delivery uncertain",
    other: "Other",
  };
  const RANGES = { "": "Any time", "1h": "Last hour", "24h": "Last 24 hours", "7d": "Last 7 days", "30d": "Last 30 days" };
  const RANGE_MS = { "1h": 3600e3, "24h": 86400e3, "7d": 7 * 86400e3, "30d": 30 * 86400e3 };
  const CHARTS = [
    ["decisions", "Decisions per day, by verdict"],
    ["deciders", "Decisions per day, lead or human"],
    ["time", "Time to decision (minutes)"],
    ["agreement", "Lead–human agreement"],
    ["rounds", "Revision rounds used"],
    ["deliveries", "Deliveries by outcome"],
  ];

  const $ = (id) => document.getElementById(id);
  const enc = encodeURIComponent;
  const fmt = (n) => n.toLocaleString("en-US");

  let user = null;
  let cursors = [null]; // queue pages visited: cursors[i] is the cursor of page i
  let filters = { agent: "", channel: "", reason: "", order: "oldest" };
  let activity = { agent: "", status: "", channel: "", range: "", q: "", draft: null, cursors: [null] };
  let insightDays = 30;
  let deliveryCursors = [null]; // uncertain-delivery pages visited
  let current = { view: null, id: null }; // what the page shows (for live updates)
  let events = null;
  let refreshTimer = null;
  // What a reviewer typed into a decision form, by item and form: it survives the live
  // re-renders of the page (another item's change re-renders this one too), and goes
  // once the decision is made.
  const drafts = new Map();
  // Whose drafts they are: a different person logging in on this page starts with none
  // (they showed the last person's words, ready to be sent under the new name).
  let draftsOwner = null;
  // Each render takes a number; a response that is not the newest one is dropped, so a
  // slow answer to an old filter never overwrites a newer one.
  let renderSeq = 0;

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

  const badge = (text, kind, label) => el("span", { class: `badge ${kind}-${text}` }, label || text);
  const when = (iso) => (iso ? el("time", { datetime: iso }, new Date(iso).toLocaleString()) : "—");
  const reviewLink = (id) => el("a", { href: `#/review/${enc(id)}` }, id);
  const textBlock = (text, id) =>
    text ? el("pre", { class: "text", id }, text) : el("p", { class: "empty", id }, "(none)");

  function ago(iso) {
    if (!iso) return "—";
    const s = Math.max(0, (Date.now() - new Date(iso).getTime()) / 1000);
    if (s < 60) return "just now";
    if (s < 3600) return `${Math.floor(s / 60)} min ago`;
    if (s < 86400) return `${Math.floor(s / 3600)} h ago`;
    return `${Math.floor(s / 86400)} d ago`;
  }
  const waited = (iso) =>
    iso ? el("time", { datetime: iso, "data-ago": "", title: new Date(iso).toLocaleString() }, ago(iso)) : "—";

  function select(id, label, value, options, onchange) {
    return el(
      "label",
      { for: id },
      label,
      el(
        "select",
        { id, onchange: (e) => onchange(e.target.value) },
        options.map(([v, text]) => el("option", { value: v, selected: v === value }, text))
      )
    );
  }

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
      stopEvents();
      showLogin("Your session has ended. Log in again.");
      return;
    }
    if (err.status === 403 && err.rule.startsWith("scope.")) {
      const titles = { activity: "Agent Activity", insights: "Insights" };
      const title = titles[current.view] || "Lead Reviews";
      showRoleMessage(title);
      // A role changed on the command line applies at the session's next request, so
      // the role read at login may be stale: name the one the server holds now.
      reloadUser().then(() => {
        if (!$("role-message")) return; // the page moved on meanwhile
        if (canReview()) route().catch(handle);
        else showRoleMessage(title);
      });
      return;
    }
    showError(err.message);
  }

  const canReview = () => Boolean(user && user.scopes && user.scopes.includes("agent:review"));

  // Read the logged-in user again (role and scopes); on any failure keep what we have.
  async function reloadUser() {
    try {
      const data = await api("GET", "/console/me");
      user = data.user;
      showWho(user);
    } catch (_) {
      // the page already says what failed; a 401 is met by the next request
    }
  }

  function showWho(u) {
    const name = u.name ? `${u.name} <${u.email}>` : u.email;
    $("who-name").textContent = `${name} (${u.role}, ${u.orgName})`;
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

  // --------------------------------------------------------------- live updates

  function setCount(n) {
    const badgeEl = $("queue-count");
    badgeEl.textContent = n > 0 ? fmt(n) : "";
    badgeEl.title = `${n} waiting for a decision`;
    badgeEl.hidden = !(n > 0);
  }

  function startEvents() {
    stopEvents();
    if (!canReview()) return;
    const source = new EventSource("/operator/events");
    events = source;
    source.addEventListener("open", () => {
      $("live").textContent = "live";
      $("live").classList.add("on");
      $("live").hidden = false;
    });
    source.addEventListener("hello", (e) => setCount(JSON.parse(e.data).queue));
    source.addEventListener("change", (e) => {
      const data = JSON.parse(e.data);
      setCount(data.queue);
      onChange(data.items);
    });
    // The server ends the stream when the session stops being valid (logged out
    // elsewhere, expired, the user removed) or no longer reviews (a role taken away):
    // find out which and show it. It only stopped following, and the page went on
    // showing a queue no longer kept current, as if nothing had happened.
    source.addEventListener("end", () => {
      if (events !== source) return;
      stopEvents();
      api("GET", "/console/me")
        .then((data) => {
          user = data.user;
          showWho(user);
          // Still reviewing (the stream ended for another cause): follow again shortly,
          // as after a dropped connection; a role that no longer reviews is named.
          if (canReview()) setTimeout(() => user && !events && startEvents(), 5000);
          else route();
        })
        .catch(handle);
    });
    source.addEventListener("error", () => {
      $("live").textContent = "reconnecting…";
      $("live").classList.remove("on");
      if (source.readyState === EventSource.CLOSED && events === source) {
        events = null;
        setTimeout(() => user && !events && startEvents(), 5000);
      }
    });
  }

  function stopEvents() {
    if (events) events.close();
    events = null;
    $("live").hidden = true;
  }

  // Something changed in the organization: refresh what the page shows (debounced).
  function onChange(items) {
    const mine = current.view === "detail" ? items === null || items.includes(current.id) : true;
    if (!mine || current.view === "insights") return;
    if (current.view === "activity" && activity.cursors.length > 1) return; // paging: keep still
    if (document.querySelector("#app-view textarea:focus, #app-view input:focus")) {
      // Someone is typing: do not pull the page from under them; refresh after.
      clearTimeout(refreshTimer);
      refreshTimer = setTimeout(() => onChange(items), 1500);
      return;
    }
    if ($("approve-dialog").open) {
      // The reviewer is confirming: refresh once the dialog is closed, not never.
      clearTimeout(refreshTimer);
      refreshTimer = setTimeout(() => onChange(items), 1500);
      return;
    }
    clearTimeout(refreshTimer);
    refreshTimer = setTimeout(async () => {
      try {
        if (current.view === "queue") await showQueue(false);
        else if (current.view === "activity") await showActivity(false);
        else if (current.view === "deliveries") await showDeliveries(false);
        else if (current.view === "detail") {
          const seq = ++renderSeq;
          const data = await api("GET", `/operator/reviews/${enc(current.id)}`);
          if (seq === renderSeq && current.view === "detail" && current.id === data.id) renderDetail(data, false);
        }
      } catch (err) {
        handle(err);
      }
    }, 150);
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
    if (draftsOwner !== u.id) drafts.clear();
    draftsOwner = u.id;
    showWho(u);
    $("nav").hidden = false;
    $("who").hidden = false;
    $("login-view").hidden = true;
    $("app-view").hidden = false;
    startEvents();
  }

  async function onLogin(event) {
    event.preventDefault();
    clearMessages();
    const button = event.target.querySelector("button");
    // The password check (argon2) takes a moment: say so, and take no second click meanwhile.
    button.disabled = true;
    button.textContent = "Logging in…";
    event.target.setAttribute("aria-busy", "true");
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
      button.textContent = "Log in";
      event.target.removeAttribute("aria-busy");
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
    drafts.clear(); // logging out leaves nothing typed behind for the next person
    stopEvents();
    setCount(0);
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

  function place(children, focus) {
    if (focus) view(...children);
    else $("app-view").replaceChildren(...children);
  }

  function queueQuery() {
    const cursor = cursors[cursors.length - 1];
    const q = new URLSearchParams({ limit: String(PAGE_SIZE), order: filters.order });
    for (const k of ["agent", "channel", "reason"]) if (filters[k]) q.set(k, filters[k]);
    if (cursor) q.set("cursor", cursor);
    return q.toString();
  }

  function queueFilters(data) {
    const c = data.counts;
    const agents = [["", `All agents (${c.all})`], ...c.agents.map((a) => [a.name, `${a.name} (${a.count})`])];
    if (filters.agent && !c.agents.some((a) => a.name === filters.agent)) agents.push([filters.agent, `${filters.agent} (0)`]);
    const channels = [["", "All channels"], ...Object.entries(c.channels).map(([k, n]) => [k, `${k} (${n})`])];
    if (filters.channel && !(filters.channel in c.channels)) channels.push([filters.channel, `${filters.channel} (0)`]);
    const reasons = [["", "All reasons"], ...Object.entries(c.reasons).map(([k, n]) => [k, `${REASON_LABELS[k] || k} (${n})`])];
    if (filters.reason && !(filters.reason in c.reasons)) reasons.push([filters.reason, `${REASON_LABELS[filters.reason] || filters.reason} (0)`]);
    const set = (key) => (value) => {
      filters[key] = value;
      cursors = [null];
      showQueue(false).catch(handle);
    };
    return el(
      "div",
      { class: "filters", role: "group", "aria-label": "Filter the queue" },
      select("filter-agent", "Agent", filters.agent, agents, set("agent")),
      select("filter-channel", "Channel", filters.channel, channels, set("channel")),
      select("filter-reason", "Why it is here", filters.reason, reasons, set("reason")),
      select("filter-order", "Order", filters.order, [["oldest", "Waiting longest first"], ["newest", "Newest first"]], set("order"))
    );
  }

  function whyCell(item) {
    const rounds = `round ${item.roundsUsed} of ${item.roundsAllowed}`;
    return el(
      "td",
      {},
      badge(item.reason, "reason", REASON_LABELS[item.reason] || item.reason),
      item.reasonText ? el("span", { class: "why" }, item.reasonText) : null,
      el("span", { class: "sub" }, rounds)
    );
  }

  async function showQueue(focus = true) {
    current = { view: "queue", id: null };
    const seq = ++renderSeq;
    const data = await api("GET", `/operator/reviews?${queueQuery()}`);
    if (seq !== renderSeq) return;
    if (!data.items.length && cursors.length > 1) {
      // Decisions made meanwhile emptied this later page: show the first one, which
      // holds what still waits (an empty page 2 said "Nothing needs a decision").
      cursors = [null];
      return showQueue(focus);
    }
    setCount(data.counts.all);
    const rows = data.items.map((item) =>
      el(
        "tr",
        { "data-id": item.id },
        el(
          "td",
          { class: "cell-text" },
          el("a", { class: "preview", href: `#/review/${enc(item.id)}` }, item.preview || "(no summary)"),
          el("code", { class: "sub" }, item.id)
        ),
        el("td", {}, item.agent ? item.agent.name : ""),
        el("td", {}, item.requester, el("span", { class: "sub" }, item.channelName)),
        whyCell(item),
        el("td", {}, waited(item.waitingSince), el("span", { class: "sub" }, badge(item.status, "status")))
      )
    );
    const pager = el(
      "div",
      { class: "pager" },
      el("button", { type: "button", disabled: cursors.length === 1, onclick: () => page(-1) }, "Previous page"),
      el("span", {}, `Page ${cursors.length}`),
      el("button", { type: "button", disabled: !data.next, onclick: () => page(1, data.next) }, "Next page")
    );
    const filtered = filters.agent || filters.channel || filters.reason;
    place(
      [
        el("h1", { tabindex: "-1" }, "Lead Reviews"),
        el(
          "p",
          { class: "hint" },
          "Work waiting for a human decision, and approved work whose delivery is uncertain. ",
          "This page updates by itself."
        ),
        queueFilters(data),
        el("p", { class: "count", id: "queue-total" }, filtered ? `${fmt(data.total)} of ${fmt(data.counts.all)} waiting` : `${fmt(data.total)} waiting`),
        rows.length
          ? el(
              "table",
              { id: "queue" },
              el("caption", { class: "sr-only" }, "Actionable work items"),
              el(
                "thead",
                {},
                el("tr", {}, ["Work", "Agent", "Requester", "Why it is here", "Waiting since"].map((h) => el("th", { scope: "col" }, h)))
              ),
              el("tbody", {}, rows)
            )
          : el("p", { class: "empty", id: "queue-empty" }, filtered ? "Nothing matches these filters." : "Nothing needs a decision right now."),
        pager,
      ],
      focus
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

  // ------------------------------------------------------------- agent activity

  function activityQuery() {
    const q = new URLSearchParams({ limit: String(PAGE_SIZE) });
    for (const k of ["agent", "status", "channel", "q"]) if (activity[k]) q.set(k, activity[k]);
    if (activity.range) q.set("since", String(Date.now() - RANGE_MS[activity.range]));
    const cursor = activity.cursors[activity.cursors.length - 1];
    if (cursor) q.set("cursor", cursor);
    return q.toString();
  }

  // A filter change or a live refresh replaces only the results: the filter form
  // stays the same DOM, so what someone is typing (and where) is never swapped out
  // from under them by a response that lands mid-keystroke.
  async function showActivity(focus = true) {
    const keepForm = !focus && current.view === "activity";
    current = { view: "activity", id: null };
    const seq = ++renderSeq;
    const data = await api("GET", `/operator/activity?${activityQuery()}`);
    if (seq !== renderSeq) return;
    const set = (key) => (value) => {
      activity[key] = value;
      activity.cursors = [null];
      showActivity(false).catch(handle);
    };
    // What is typed survives a live refresh of the page (activity.draft).
    const search = el("input", {
      id: "activity-q",
      type: "search",
      value: activity.draft ?? activity.q,
      maxlength: 200,
      placeholder: "words in the summary",
      oninput: (e) => (activity.draft = e.target.value),
    });
    const form = el(
      "form",
      {
        class: "filters",
        id: "activity-filters",
        role: "search",
        "aria-label": "Filter and search work items",
        onsubmit: (e) => {
          e.preventDefault();
          search.blur();
          activity.draft = null;
          set("q")(search.value.trim());
        },
      },
      select("activity-agent", "Agent", activity.agent, [["", "All agents"], ...data.agents.map((a) => [a.name, a.name])], set("agent")),
      select("activity-status", "Status", activity.status, [["", "All statuses"], ...STATUSES.map((s) => [s, s])], set("status")),
      select("activity-channel", "Channel", activity.channel, [["", "All channels"], ...CHANNELS.map((c) => [c, c])], set("channel")),
      select("activity-range", "Updated", activity.range, Object.entries(RANGES), set("range")),
      el("label", { for: "activity-q" }, "Search summaries", search),
      el("button", { type: "submit" }, "Search")
    );
    const rows = data.items.map((item) =>
      el(
        "tr",
        { "data-id": item.id },
        el("td", {}, reviewLink(item.id)),
        el("td", {}, item.agent),
        el("td", {}, badge(item.status, "status")),
        el("td", {}, item.requester, el("span", { class: "sub" }, item.channelName)),
        el("td", { class: "num" }, item.revision),
        el("td", {}, when(item.updatedAt))
      )
    );
    const pages = activity.cursors;
    const pager = el(
      "div",
      { class: "pager" },
      el(
        "button",
        { type: "button", disabled: pages.length === 1, onclick: () => { pages.pop(); showActivity().catch(handle); } },
        "Previous page"
      ),
      el("span", {}, `Page ${pages.length}`),
      el(
        "button",
        { type: "button", disabled: !data.next, onclick: () => { pages.push(data.next); showActivity().catch(handle); } },
        "Next page"
      )
    );
    const results = [
      rows.length
        ? el(
            "table",
            { id: "activity" },
            el("caption", { class: "sr-only" }, "Work items"),
            el(
              "thead",
              {},
              el("tr", {}, ["Work item", "Agent", "Status", "Requester", "Revision", "Updated"].map((h) => el("th", { scope: "col" }, h)))
            ),
            el("tbody", {}, rows)
          )
        : el("p", { class: "empty", id: "activity-empty" }, "No work items match."),
      pager,
    ];
    const shown = $("activity-results");
    if (keepForm && shown && $("activity-filters")) {
      shown.replaceChildren(...results);
      return;
    }
    place(
      [
        el("h1", { tabindex: "-1" }, "Agent Activity"),
        el(
          "p",
          { class: "hint" },
          "Work items of your organization, newest first. Search looks in the summaries; results never show the approved text: open an item for its review detail."
        ),
        form,
        el("div", { id: "activity-results", "aria-live": "polite" }, results),
      ],
      focus
    );
  }

  // ------------------------------------------------------------ uncertain deliveries

  // Every deliveryUnknown delivery: the gating ones (also in Lead Reviews) and those no
  // work item gates (plain replies, notices, review cards), which only this list shows.
  // Confirm and Retry name the send the operator checked (its attempts): one sent again
  // since, and uncertain again, is refused (409 delivery.attempts), so a Retry clicked
  // again after its answer was lost does not send it a third time.
  async function showDeliveries(focus = true) {
    current = { view: "deliveries", id: null };
    const seq = ++renderSeq;
    const cursor = deliveryCursors[deliveryCursors.length - 1];
    const q = new URLSearchParams({ limit: String(PAGE_SIZE) });
    if (cursor) q.set("cursor", cursor);
    const data = await api("GET", `/operator/deliveries?${q}`);
    if (seq !== renderSeq) return;
    if (!data.deliveries.length && deliveryCursors.length > 1) {
      deliveryCursors = [null]; // resolved meanwhile: back to the first page
      return showDeliveries(focus);
    }
    const rows = data.deliveries.map((x) =>
      el(
        "tr",
        { "data-id": x.id },
        el("td", {}, el("code", {}, x.id)),
        el("td", {}, x.kind),
        el("td", { class: "cell-text" }, x.to || x.channel || "—"),
        el("td", {}, x.workItemId ? reviewLink(x.workItemId) : "—"),
        el("td", {}, waited(x.since)),
        el("td", { class: "cell-text" }, x.error || ""),
        el(
          "td",
          {},
          el("button", { type: "button", onclick: () => act(`/operator/deliveries/${enc(x.id)}/confirm`, { attempts: x.attempts }, "Delivery confirmed.") }, "Confirm delivered"),
          " ",
          el("button", { type: "button", onclick: () => act(`/operator/deliveries/${enc(x.id)}/retry`, { attempts: x.attempts }, retried) }, "Retry delivery")
        )
      )
    );
    const turn = (step, next) => {
      clearMessages();
      if (step > 0) deliveryCursors.push(next);
      else if (deliveryCursors.length > 1) deliveryCursors.pop();
      showDeliveries().catch(handle);
    };
    place(
      [
        el("h1", { tabindex: "-1" }, "Uncertain deliveries"),
        el(
          "p",
          { class: "hint" },
          "Messages that may or may not have arrived (a timeout after the request was written): never sent again by themselves. Check the channel, then confirm that it arrived or send it again."
        ),
        rows.length
          ? el(
              "table",
              { id: "uncertain" },
              el("caption", { class: "sr-only" }, "Uncertain deliveries"),
              el("thead", {}, el("tr", {}, ["Delivery", "Kind", "Going to", "Work item", "Uncertain since", "Error", ""].map((h) => el("th", { scope: "col" }, h)))),
              el("tbody", {}, rows)
            )
          : el("p", { class: "empty", id: "uncertain-empty" }, "No delivery is uncertain."),
        el(
          "div",
          { class: "pager" },
          el("button", { type: "button", disabled: deliveryCursors.length === 1, onclick: () => turn(-1) }, "Previous page"),
          el("span", {}, `Page ${deliveryCursors.length}`),
          el("button", { type: "button", disabled: !data.next, onclick: () => turn(1, data.next) }, "Next page")
        ),
      ],
      focus
    );
  }

  // ------------------------------------------------------------------ insights

  const minutes = (ms) => (ms === null || ms === undefined ? "—" : `${(ms / 60000).toFixed(1)} min`);

  async function showInsights(focus = true) {
    current = { view: "insights", id: null };
    const seq = ++renderSeq;
    const data = await api("GET", `/operator/insights?days=${insightDays}`);
    if (seq !== renderSeq) return;
    const d = data.decisions;
    const t = data.timeToDecision;
    const a = data.agreement;
    const card = (title, big, sub, id) =>
      el("div", { class: "card", id }, el("span", { class: "sub" }, title), el("span", { class: "big" }, big), el("span", { class: "sub" }, sub));
    const total = Object.values(d.byVerdict).reduce((x, y) => x + y, 0);
    const stamp = Date.now();
    place(
      [
        el("h1", { tabindex: "-1" }, "Insights"),
        el(
          "div",
          { class: "filters" },
          select("insights-days", "Period", String(insightDays), [["7", "Last 7 days"], ["30", "Last 30 days"], ["90", "Last 90 days"]], (v) => {
            insightDays = Number(v);
            showInsights(false).catch(handle);
          })
        ),
        el(
          "div",
          { class: "cards" },
          card("Decisions", fmt(total), `lead ${d.byDecider.lead || 0} · human ${d.byDecider.human || 0}`, "card-decisions"),
          card("Lead time to verdict", minutes(t.lead.medianMs), `median · p90 ${minutes(t.lead.p90Ms)} · ${t.lead.count} verdicts`, "card-lead-time"),
          card("Human time to decision", minutes(t.human.medianMs), `median · p90 ${minutes(t.human.p90Ms)} · ${t.human.count} decisions`, "card-human-time"),
          card(
            "Lead–human agreement",
            a.rate === null ? "—" : `${Math.round(a.rate * 100)}%`,
            `confirmed ${a.confirmed} · overrode ${a.overrode}`,
            "card-agreement"
          ),
          card("Deliveries", fmt(Object.values(data.deliveries.byOutcome).reduce((x, y) => x + y, 0)), Object.entries(data.deliveries.byOutcome).map(([k, n]) => `${k} ${n}`).join(" · ") || "none", "card-deliveries")
        ),
        el(
          "p",
          { class: "hint" },
          "Agreement: when the lead escalated, or asked for changes with no rounds left, and a human then decided: approving overrode the lead; rejecting or returning confirmed it."
        ),
        el(
          "div",
          { class: "charts" },
          CHARTS.map(([name, title]) =>
            el(
              "figure",
              {},
              el("img", { id: `chart-${name}`, src: `/operator/insights/charts/${name}.svg?days=${insightDays}&t=${stamp}`, alt: title, width: 640, height: 320 }),
              el("figcaption", { class: "sr-only" }, title)
            )
          )
        ),
      ],
      focus
    );
  }

  // -------------------------------------------------------------------- detail

  async function showDetail(id) {
    current = { view: "detail", id };
    const seq = ++renderSeq;
    let data;
    try {
      data = await api("GET", `/operator/reviews/${enc(id)}`);
    } catch (err) {
      if (err instanceof ApiError && err.status === 404 && seq === renderSeq) {
        showMissing(err.message);
        return;
      }
      throw err;
    }
    if (seq === renderSeq) renderDetail(data);
  }

  // An address that names no work item: say so in place of the page, with the way back
  // (the previous page stayed under the error, no longer updating).
  function showMissing(message) {
    current = { view: "missing", id: null };
    ++renderSeq; // newer than any refresh still in flight
    view(
      el("h1", { tabindex: "-1" }, "No such work item"),
      el("p", {}, el("a", { href: "#/reviews" }, "Back to Lead Reviews"))
    );
    showError(message);
  }

  // Run a POST that answers the updated detail; buttons are disabled while it runs.
  // What a Retry did, from its answer: queued again, or (a review card whose item was
  // decided meanwhile) ended without being posted. It said "queued again" either way.
  function retried(answer) {
    const d = answer && answer.delivery;
    if (d && d.status === "cancelled") {
      return "Not sent again: the item was already decided, and a review card is not posted after its decision (the card is cancelled).";
    }
    return "Delivery queued again.";
  }

  // ``done``: the notice once it worked, or a function of the answer that gives it.
  async function act(path, body, done) {
    clearMessages();
    const buttons = [...$("app-view").querySelectorAll("button")];
    buttons.forEach((b) => (b.disabled = true));
    try {
      const detail = await api("POST", path, body);
      ++renderSeq; // newer than any refresh still in flight
      for (const key of [...drafts.keys()]) if (key.startsWith(`${current.id}:`)) drafts.delete(key);
      if (detail && detail.deliveries && current.view === "detail") renderDetail(detail, false);
      else await route();
      notify(typeof done === "function" ? done(detail) : done);
    } catch (err) {
      buttons.forEach((b) => (b.disabled = false));
      if (err instanceof ApiError && err.status === 409) {
        // Decided (or moved) by someone else meanwhile: show the item as it is now,
        // then say why this decision did not count.
        try {
          await route();
        } catch (reload) {
          handle(reload);
          return;
        }
      }
      handle(err);
    }
  }

  function counter(textarea, output, max) {
    const update = () => {
      // Characters as the server counts them (code points): an emoji is one, where
      // .length counted two and showed text the server accepts as over the limit.
      const n = [...textarea.value].length;
      output.textContent = `${fmt(n)} / ${fmt(max)}`;
      output.classList.toggle("over", n > max);
    };
    textarea.addEventListener("input", update);
    update();
  }

  function textForm(id, label, max, submitText, onSubmit) {
    const key = `${current.id}:${id}`;
    const area = el("textarea", { id: `${id}-text`, rows: 4, "aria-describedby": `${id}-count` });
    area.value = drafts.get(key) || "";
    area.addEventListener("input", () => {
      if (area.value) drafts.set(key, area.value);
      else drafts.delete(key);
    });
    const count = el("span", { class: "count", id: `${id}-count` });
    counter(area, count, max);
    return el(
      "form",
      {
        class: "decision",
        id: `${id}-form`,
        onsubmit: (e) => {
          e.preventDefault();
          area.blur();
          onSubmit(area.value);
        },
      },
      el("label", { for: `${id}-text` }, label),
      area,
      el("div", { class: "row" }, count, el("button", { type: "submit" }, submitText))
    );
  }

  function confirmApprove(d, base) {
    const dialog = $("approve-dialog");
    $("approve-destination").textContent = d.destination.description;
    dialog.returnValue = "";
    dialog.onclose = () => {
      if (dialog.returnValue === "approve") act(`${base}/approve`, { revision: d.revision }, "Approved.");
    };
    dialog.showModal();
    $("approve-keep").focus();
  }

  function decisionPanel(d) {
    const base = `/operator/reviews/${enc(d.id)}`;
    // Every decision names the revision this page shows: one made on a page left open
    // (the approval dialog, a typed reason, a dropped stream) after the item was sent
    // back and came again is refused (409 decision.revision), not applied to work nobody
    // here has read.
    const revision = d.revision;
    const parts = [el("h2", {}, "Decision")];
    parts.push(
      el("p", { class: "sub" }, d.status === "awaitingHuman" ? "If you approve:" : "Delivery:"),
      el("p", { class: "destination", id: "destination" }, d.destination.description)
    );
    if (d.status === "awaitingHuman") {
      parts.push(
        el(
          "div",
          { class: "row" },
          el("button", { type: "button", class: "primary", id: "approve", onclick: () => confirmApprove(d, base) }, "Approve…")
        ),
        textForm("reject", `Reason for rejecting (1–${fmt(REASON_MAX)} characters)`, REASON_MAX, "Reject", (reason) =>
          act(`${base}/reject`, { reason, revision }, "Rejected.")
        ),
        textForm(
          "return",
          `Feedback for the worker (1–${fmt(FEEDBACK_MAX)} characters)`,
          FEEDBACK_MAX,
          "Return to worker",
          (feedback) => act(`${base}/return`, { feedback, revision }, "Returned to the worker.")
        )
      );
    } else {
      const what = {
        approved: "Approved: the delivery is on its way (this page follows it).",
        inProgress: "The worker is revising; the lead reviews the next submission (this page follows it).",
        reviewQueued: "Waiting for the lead's review.",
        reviewing: "The lead is reviewing.",
      };
      parts.push(el("p", { class: "hint", id: "no-decision" }, what[d.status] || `No decision is open: the item is ${d.status}.`));
    }
    if (!TERMINAL.has(d.status)) {
      // Optional: an empty reason is sent as none (the audit keeps the one given).
      const why = el("input", { type: "text", id: "cancel-reason", maxlength: REASON_MAX, placeholder: "Reason (optional)", "aria-label": "Reason for cancelling (optional)" });
      const confirmRow = el(
        "div",
        { class: "row confirm", hidden: true },
        el("span", {}, "Cancelling stops this work item for good."),
        why,
        el("button", { type: "button", class: "danger", onclick: () => act(`${base}/cancel`, { revision, reason: why.value.trim() || undefined }, "Cancelled.") }, "Yes, cancel it"),
        el("button", { type: "button", onclick: () => (confirmRow.hidden = true) }, "Keep it")
      );
      parts.push(
        el("div", { class: "row" }, el("button", { type: "button", id: "cancel", onclick: () => (confirmRow.hidden = false) }, "Cancel work item…")),
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
      el("thead", {}, el("tr", {}, ["Delivery", "To", "Action", "Status", "When", "Attempts", "Last error", ""].map((h) => el("th", { scope: "col" }, h)))),
      el(
        "tbody",
        {},
        d.deliveries.map((x) =>
          el(
            "tr",
            {},
            el("td", {}, el("code", {}, x.id)),
            // Where it went in words (the channel alone named no conversation to check).
            el("td", { class: "cell-text" }, x.to || x.channel || "—"),
            el("td", {}, x.action || "—"),
            el("td", {}, badge(x.status, "status")),
            el("td", {}, x.nextAttemptAt ? ["next try ", when(x.nextAttemptAt)] : ["queued ", when(x.createdAt), x.updatedAt !== x.createdAt ? ["; last change ", when(x.updatedAt)] : ""]),
            el("td", { class: "num" }, x.attempts),
            el("td", { class: "cell-text" }, x.error || ""),
            el(
              "td",
              {},
              x.status === "deliveryUnknown"
                ? [
                    el("button", { type: "button", onclick: () => act(`/operator/deliveries/${enc(x.id)}/confirm`, { attempts: x.attempts }, "Delivery confirmed.") }, "Confirm delivered"),
                    " ",
                    el("button", { type: "button", onclick: () => act(`/operator/deliveries/${enc(x.id)}/retry`, { attempts: x.attempts }, retried) }, "Retry delivery"),
                  ]
                : ""
            )
          )
        )
      )
    );
  }

  function verdictTable(d) {
    if (!d.reviews.length) return el("p", { class: "empty", id: "verdicts-empty" }, "No verdicts yet.");
    return el(
      "table",
      { id: "verdicts" },
      el("thead", {}, el("tr", {}, ["Revision", "By", "Verdict", "Feedback", "When"].map((h) => el("th", { scope: "col" }, h)))),
      el(
        "tbody",
        {},
        d.reviews.map((r) =>
          el(
            "tr",
            {},
            el("td", { class: "num" }, r.revision),
            el("td", {}, r.actorName, el("span", { class: "sub" }, r.by)),
            el("td", {}, badge(r.verdict, "verdict"), r.roundsExhausted ? el("span", { class: "sub" }, "no rounds left") : null),
            el("td", { class: "cell-text" }, r.feedback || ""),
            el("td", {}, when(r.at))
          )
        )
      )
    );
  }

  // The detail lists an item's newest entries only (the API caps each list): say so.
  const cutNote = (cut, id, what) =>
    cut ? el("p", { class: "empty", id }, `Only the newest ${what} are shown; older ones exist.`) : null;

  function auditTable(d) {
    if (!d.audit.length) return el("p", { class: "empty" }, "No audit entries.");
    return el(
      "table",
      { id: "audit" },
      el("thead", {}, el("tr", {}, ["When", "Who", "Where", "Action", "Status", "Text"].map((h) => el("th", { scope: "col" }, h)))),
      el(
        "tbody",
        {},
        d.audit.map((a) =>
          el(
            "tr",
            {},
            el("td", {}, when(a.at)),
            el("td", { title: a.actor }, a.actorName, a.actorEmail && a.actorEmail !== a.actorName ? el("span", { class: "sub" }, a.actorEmail) : null),
            el("td", {}, a.surface || "—", a.identity ? el("span", { class: "sub" }, a.identity) : null),
            el("td", {}, a.action),
            el("td", {}, a.from || a.to ? `${a.from || "—"} → ${a.to || "—"}` : ""),
            el("td", { class: "cell-text" }, a.text || "")
          )
        )
      )
    );
  }

  function renderDetail(d, focus = true) {
    if (current.view !== "detail" || current.id !== d.id) current = { view: "detail", id: d.id };
    const meta = [
      ["Status", badge(d.status, "status"), "detail-status"],
      ["Agent", d.agent ? d.agent.name : "—"],
      ["Requester", `${d.requester} (${d.channelName})`, "detail-requester"],
      ["Revision", `round ${d.roundsUsed} of ${d.roundsAllowed} (max rounds ${d.maxRevisionRounds}, extra ${d.extraAllowance})`],
      [
        "Completion policy",
        [el("span", {}, d.completionPolicy), el("span", { class: "policy-note sub", id: "policy-note" }, d.completionPolicyNote)],
      ],
      ["Created", when(d.createdAt)],
      ["Updated", when(d.updatedAt), "detail-updated"],
    ];
    place(
      [
        el("p", { class: "row start" }, el("a", { href: "#/reviews" }, "← Lead Reviews")),
        el("h1", { tabindex: "-1" }, "Work item ", el("code", {}, d.id)),
        el("dl", { class: "meta" }, meta.map(([k, v, id]) => [el("dt", {}, k), el("dd", { id }, v)])),
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
            textBlock(d.taskContext, "task-context")
          ),
          decisionPanel(d)
        ),
        el("h2", {}, "Verdicts, per revision"),
        verdictTable(d),
        cutNote(d.reviewsTruncated, "verdicts-truncated", "verdicts"),
        el("h2", {}, "Deliveries"),
        deliveriesTable(d),
        cutNote(d.deliveriesTruncated, "deliveries-truncated", "deliveries, and those still pending, sending or uncertain,"),
        d.unsettledDeliveriesTruncated
          ? el(
              "p",
              { class: "empty", id: "unsettled-deliveries-truncated" },
              "More deliveries are still pending, sending or uncertain than are shown (the oldest of them are); ",
              el("a", { href: "#/deliveries" }, "Uncertain deliveries"),
              " lists every uncertain one."
            )
          : null,
        el("h2", {}, "Audit trail"),
        auditTable(d),
        cutNote(d.auditTruncated, "audit-truncated", "audit entries"),
      ],
      focus
    );
  }

  // -------------------------------------------------------------------- router

  async function route() {
    if (!user) return;
    clearMessages();
    if (!canReview()) {
      // A reviewing role given since login applies at the session's next request: read
      // the role again, so that the page (and its live updates) follow the new one.
      await reloadUser();
      if (canReview()) startEvents();
    }
    const hash = location.hash || "#/reviews";
    const section = ["#/activity", "#/deliveries", "#/insights"].find((s) => hash.startsWith(s)) || "#/reviews";
    for (const link of $("nav").querySelectorAll("a")) {
      if (link.getAttribute("href") === section) link.setAttribute("aria-current", "page");
      else link.removeAttribute("aria-current");
    }
    try {
      if (hash.startsWith("#/review/")) {
        let id;
        try {
          id = decodeURIComponent(hash.slice("#/review/".length));
        } catch (_) {
          id = null; // a hand-edited address: no item has that id
        }
        if (id === null) showMissing("There is no work item at this address.");
        else await showDetail(id);
      } else if (hash === "#/activity") {
        await showActivity();
      } else if (hash === "#/insights") {
        await showInsights();
      } else if (hash === "#/deliveries") {
        deliveryCursors = [null];
        await showDeliveries();
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
    setInterval(() => {
      for (const t of document.querySelectorAll("time[data-ago]")) t.textContent = ago(t.getAttribute("datetime"));
    }, 30000);
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
