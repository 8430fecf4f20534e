"""A floor for the plain SQLite turn: aiohttp and ``sqlite3`` doing only a turn's writes.

``python -m bench.floor_server --port N --database FILE`` serves ``POST
/v1/chat/completions`` on 127.0.0.1 over a SQLite file already migrated to leadgate's
schema. It is what a plain turn would cost with no product around it, so that
``bench_rest --only floor`` can say how far the real service is from the least this
machine could do (session 29). For each request it:

* checks a fixed bearer token (``Bearer floor``) by string comparison;
* parses the body with ``json.loads`` and takes the last message's text, with no
  validation;
* finds the session of ``X-Session-Id`` (a dict after the first lookup);
* writes the intake in a group-committed transaction: the user message, the session's
  event counter and its ``message`` event (the window is kept in memory and not read);
* answers ``Echo: <text>`` and writes the reply the same way;
* returns the chat.completion JSON once the reply is committed.

The transaction opened by the first write of a loop iteration takes every write made
before the loop runs its next callbacks, then commits once. leadgate's group commit
shares a COMMIT the same way.

Left out, against the service: API key hashing and lookup, request validation and
limits, the agent and binding checks, the busy check, idempotency keys, the window
read, run records, metrics, logs, request ids, error envelopes, the transaction
machinery's fencing and redo. WAL mode with ``synchronous=NORMAL``, as the service.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import time
import uuid

from aiohttp import web

TOKEN = "Bearer floor"
ORG, AGENT = "org_floor", "agent_floor"


class Floor:
    """The floor's state: one connection, the session ids seen, an open group."""

    def __init__(self, database: str) -> None:
        self.conn = sqlite3.connect(database, isolation_level=None, check_same_thread=False)
        for pragma in (
            "PRAGMA journal_mode=WAL",
            "PRAGMA synchronous=NORMAL",
            "PRAGMA temp_store=MEMORY",
            "PRAGMA foreign_keys=ON",
        ):
            self.conn.execute(pragma)
        self.sessions: dict[str, str] = {}
        self.windows: dict[str, list[tuple[str, str]]] = {}
        self.open = False
        self.waiters: list[asyncio.Future[None]] = []

    def join(self) -> asyncio.Future[None]:
        """The future of the group this iteration's writes go in (opened if none is)."""
        loop = asyncio.get_running_loop()
        if not self.open:
            self.conn.execute("BEGIN IMMEDIATE")
            self.open = True
            loop.call_soon(self.commit)
        waiter: asyncio.Future[None] = loop.create_future()
        self.waiters.append(waiter)
        return waiter

    def commit(self) -> None:
        self.conn.execute("COMMIT")
        self.open = False
        waiters, self.waiters = self.waiters, []
        for waiter in waiters:
            waiter.set_result(None)

    def session(self, key: str) -> str:
        sid = self.sessions.get(key)
        if sid is None:
            row = self.conn.execute(
                "SELECT id FROM sessions WHERE agent_id = ? AND key = ?", (AGENT, key)
            ).fetchone()
            if row is None:
                sid = new_id("ses")
                self.conn.execute(
                    "INSERT INTO sessions (id, org_id, agent_id, key, created_at, event_seq,"
                    " watched_until) VALUES (?, ?, ?, ?, ?, 0, 0)",
                    (sid, ORG, AGENT, key, int(time.time() * 1000)),
                )
            else:
                sid = str(row[0])
            self.sessions[key] = sid
        return sid

    def store(self, sid: str, role: str, content: str) -> None:
        mid, now = new_id("msg"), int(time.time() * 1000)
        self.conn.execute(
            "INSERT INTO messages (id, org_id, session_id, role, content, lead_gated,"
            " created_at) VALUES (?, ?, ?, ?, ?, 0, ?)",
            (mid, ORG, sid, role, content, now),
        )
        (seq,) = self.conn.execute(
            "UPDATE sessions SET event_seq = event_seq + 1 WHERE id = ? RETURNING event_seq",
            (sid,),
        ).fetchone()
        self.conn.execute(
            "INSERT INTO session_events (session_id, seq, kind, message_id, created_at)"
            " VALUES (?, ?, 'message', ?, ?)",
            (sid, seq, mid, now),
        )
        window = self.windows.setdefault(sid, [])
        window.append((role, content))
        del window[:-50]

    async def completions(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != TOKEN:
            return web.json_response({"error": "unauthorized"}, status=401)
        body = json.loads(await request.read())
        text = body["messages"][-1]["content"]
        waiter = self.join()
        sid = self.session(request.headers["X-Session-Id"])
        self.store(sid, "user", text)
        await waiter
        reply = "Echo: " + text
        waiter = self.join()
        self.store(sid, "assistant", reply)
        await waiter
        completion = {
            "id": "chatcmpl-" + uuid.uuid4().hex,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": reply},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        }
        return web.Response(body=json.dumps(completion).encode(), content_type="application/json")


def new_id(prefix: str) -> str:
    return f"{prefix}_{time.time_ns():016x}{os.urandom(5).hex()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--database", required=True, help="a SQLite file at the newest schema")
    args = parser.parse_args()
    floor = Floor(args.database)
    app = web.Application()
    app.router.add_post("/v1/chat/completions", floor.completions)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
