"use strict";
// leadgate Studio: chat with one session of an agent.
// The session is rendered from its review-status event stream (EventSource resumes with
// Last-Event-ID by itself), so an answer held for Lead review shows "pending review" and
// is replaced in place by the approved answer when it is revealed, without a reload.
// Text is always set as text, never as HTML. Every write carries X-Leadgate-Console: 1
// (the console's CSRF rule); the console session cookie does the rest.
(() => {
  const BASE = "/console/studio";
  const ENDED = {
    rejected: "Lead review rejected this answer; nothing was released.",
    cancelled: "This work was cancelled; nothing was released.",
    failed: "The approved answer could not be delivered.",
    abandoned: "This work was abandoned.",
  };
  const $ = (id) => document.getElementById(id);

  let source = null; // the open session's EventSource
  let opened = null; // the path of the session the transcript shows (messages go there)
  let pendingBubble = null; // the "pending review" bubble waiting for its answer
  let provisional = []; // bubbles from our own POST, waiting for their message event
  let unclaimed = []; // assistant texts that arrived as events before our POST answered
  let reviewsSeen = 0; // review events so far (a POST's "pending" after one is stale)

  function showError(text) {
    const box = $("error");
    box.textContent = text || "";
    box.hidden = !text;
  }

  // A message whose answer never came (the connection dropped, a proxy's own error page)
  // may have been taken in: said so, and never offered to be sent again.
  const LOST =
    "The answer to this message was lost on the way (the connection dropped): it may have been taken in. Look for it in the transcript before sending it again.";
  // Errors of ours that say the message was, or may have been, taken in.
  const TAKEN = new Set(["turn.interrupted", "intake.in_doubt"]);

  async function api(path, options = {}) {
    const init = { method: options.method || "GET", credentials: "same-origin", headers: {} };
    if (init.method !== "GET") init.headers["X-Leadgate-Console"] = "1";
    if (options.body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(options.body);
    }
    let resp;
    try {
      resp = await fetch(path, init);
    } catch (_) {
      const err = new Error(LOST);
      err.status = 0; // no answer at all
      throw err;
    }
    let data = null;
    try {
      data = await resp.json();
    } catch (_) {
      data = null;
    }
    if (!resp.ok) {
      const message = data && data.error && data.error.message;
      const err = new Error(message || `HTTP ${resp.status}`);
      err.status = resp.status;
      err.rule = data && data.error && data.error.rule;
      throw err;
    }
    return data;
  }

  function bubble(role, text) {
    const li = document.createElement("li");
    li.className = `msg ${role}`;
    li.textContent = text;
    $("transcript").appendChild(li);
    li.scrollIntoView({ block: "nearest" });
    return li;
  }

  function pendingReview() {
    const li = bubble("assistant", "pending review");
    li.classList.add("pending");
    return li;
  }

  function onMessage(data) {
    const known = Array.from($("transcript").children).some((li) => li.dataset.id === data.id);
    if (known) return;
    const i = provisional.findIndex((p) => p.role === data.role && p.text === data.content);
    if (i >= 0) {
      provisional.splice(i, 1)[0].li.dataset.id = data.id;
      return;
    }
    if (data.role === "assistant" && pendingBubble) {
      // The approved answer, in the place of its "pending review".
      pendingBubble.textContent = data.content;
      pendingBubble.classList.remove("pending");
      pendingBubble.dataset.id = data.id;
      pendingBubble = null;
      return;
    }
    bubble(data.role, data.content).dataset.id = data.id;
    if (data.role === "assistant") unclaimed.push(data.content);
  }

  function onReview(status) {
    reviewsSeen += 1;
    if (status === "pending") {
      if (!pendingBubble) pendingBubble = pendingReview();
    } else if (ENDED[status] && pendingBubble) {
      pendingBubble.textContent = ENDED[status];
      pendingBubble.classList.replace("pending", "ended");
      pendingBubble = null;
    }
    if (status !== "pending") showError(""); // "under review" is over
    // "delivered" follows its revealed message, which already filled the bubble.
  }

  function sessionPath() {
    const agent = encodeURIComponent($("agent").value);
    const session = encodeURIComponent($("session").value.trim() || "default");
    return `${BASE}/agents/${agent}/sessions/${session}`;
  }

  function openSession() {
    if (source) source.close();
    $("transcript").replaceChildren();
    pendingBubble = null;
    provisional = [];
    unclaimed = [];
    reviewsSeen = 0;
    showError("");
    $("link").textContent = "connecting…";
    opened = sessionPath();
    source = new EventSource(`${opened}/events`);
    source.onopen = () => {
      $("link").textContent = "live";
    };
    source.onerror = () => {
      const closed = source.readyState === EventSource.CLOSED;
      $("link").textContent = closed ? "disconnected: open the session again" : "reconnecting…";
    };
    source.addEventListener("message", (e) => onMessage(JSON.parse(e.data)));
    source.addEventListener("review", (e) => onReview(JSON.parse(e.data).status));
    // The server ends the stream when the console session ends (logout, expiry), and
    // also when it cannot go on (a damaged database): ask which. Every end was taken
    // for a logout, and a person still logged in was sent to the login form.
    source.addEventListener("end", (e) => {
      const ended = source;
      ended.close();
      api("/console/me").then(
        () => {
          if (source !== ended) return; // another session was opened meanwhile
          let reason = "";
          try {
            reason = JSON.parse(e.data).reason || "";
          } catch (_) {
            reason = "";
          }
          $("link").textContent = "disconnected: open the session again";
          showError(`The live transcript stopped${reason ? `: ${reason}` : "."}`);
        },
        (err) => {
          if (source === ended && err.status === 401) loggedOut();
        }
      );
    });
    $("message").focus();
  }

  // Whether an error answer says the message was refused (nothing stored: it may be sent
  // again): a JSON error of ours, 4xx, or a 503 asking for a retry. Anything else (no
  // answer, a proxy's 502/504 page, a model error, a 500) may have come after the intake.
  function refused(err) {
    if (!err.rule || TAKEN.has(err.rule)) return false;
    return err.status < 500 || err.status === 503;
  }

  async function send(text) {
    // Messages go to the session the transcript shows, whose stream is open: a session
    // never opened (or typed in the box since, or whose stream ended at a logout) is
    // opened first. Sent without it, the message went to whatever the boxes said while
    // the transcript showed another session, and a held answer never appeared.
    if (!source || source.readyState === EventSource.CLOSED || opened !== sessionPath()) {
      openSession();
    }
    const path = opened;
    showError("");
    const user = bubble("user", text);
    const mine = { role: "user", text, li: user };
    provisional.push(mine);
    unclaimed = [];
    const before = reviewsSeen;
    const button = $("send-form").querySelector("button");
    button.disabled = true;
    try {
      const answer = await api(`${path}/messages`, {
        method: "POST",
        body: { message: text },
      });
      if (answer.outcome === "reply") {
        const k = unclaimed.indexOf(answer.text);
        if (k >= 0) {
          unclaimed.splice(k, 1); // the stream showed it already
        } else {
          provisional.push({ role: "assistant", text: answer.text, li: bubble("assistant", answer.text) });
        }
      } else if (answer.outcome === "pending" && !pendingBubble && reviewsSeen === before) {
        pendingBubble = pendingReview();
      }
    } catch (err) {
      if (!refused(err)) {
        // Taken in, then the turn failed (the model, or the database mid-turn), or maybe
        // taken in (intake.in_doubt: the database went away as it committed; no answer
        // at all, or one not of ours): the message is, or may be, in the transcript, and
        // sending it again would send it twice.
        showError(err.rule ? err.message : LOST);
        return;
      }
      // Refused: nothing was stored, so the message leaves the transcript and goes back
      // into the box to be sent again.
      user.remove();
      provisional = provisional.filter((p) => p !== mine);
      if (!$("message").value) $("message").value = text;
      if (err.status === 401) {
        loggedOut();
        return;
      }
      showError(err.message);
    } finally {
      button.disabled = false;
    }
  }

  function loggedOut() {
    if (source) source.close();
    source = null;
    $("link").textContent = "";
    showError("Your console session has ended. Log in again.");
    $("login-view").hidden = false;
  }

  async function start() {
    try {
      const me = await api("/console/me");
      $("who").textContent = me.user.email;
    } catch (err) {
      $("login-view").hidden = false;
      return;
    }
    $("login-view").hidden = true;
    try {
      const agents = await api(`${BASE}/agents`);
      const select = $("agent");
      select.replaceChildren();
      for (const agent of agents.data) {
        const option = document.createElement("option");
        option.value = agent.slug;
        option.textContent = agent.name;
        select.appendChild(option);
      }
      $("chat-view").hidden = false;
    } catch (err) {
      showError(err.status === 403 ? "Your role cannot chat with agents." : err.message);
    }
  }

  $("login-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    showError("");
    try {
      await api("/console/login", {
        method: "POST",
        body: { email: $("login-email").value, password: $("login-password").value },
      });
      await start();
    } catch (err) {
      showError(err.message);
    }
  });
  $("open-form").addEventListener("submit", (e) => {
    e.preventDefault();
    openSession();
  });
  $("send-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("message").value;
    if (!text.trim()) return;
    $("message").value = "";
    send(text);
  });
  start();
})();
