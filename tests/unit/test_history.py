"""The history a worker's model sees (engine/history.py): the newest 50 messages of the
session, oldest first, and on SQLite the in-process cache behind it. Whatever the cache
does, the window must equal a fresh full query."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from contextlib import closing
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import given
from hypothesis import strategies as st

from leadgate.database import schema as t
from leadgate.turns import history
from leadgate.turns.history import HISTORY_LIMIT, HistoryCache, Window, to_message
from leadgate.turns.providers.base import ChatMessage, ModelEvent, ModelRequest
from leadgate.turns.providers.registry import ProviderRegistry
from leadgate.turns.providers.script import ScriptProvider
from tests.helpers import Org, api_trigger, fake_clock, make_agent, make_org
from tests.stack import Stack

SQLITE_ONLY = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
FEEDBACK = "Feedback from your lead reviewer:\n"


class Boom(Exception):
    """Raised inside a transaction body on purpose."""


class Recorder:
    """The script model, recording for every request the history it carried and, at that
    very moment, what a fresh full query of the session returns."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.script = ScriptProvider()
        self.session: tuple[str, str] | None = None  # (agent id, session key) to check
        self.seen: list[tuple[list[ChatMessage], list[ChatMessage]]] = []

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        if self.session is not None:
            # Concurrent turns of other sessions may reach the model before the checked
            # session's first intake committed (PostgreSQL): nothing to compare yet.
            s = t.sessions.c
            agent_id, key = self.session
            async with self.stack.db.read() as conn:
                sid = await conn.scalar(sa.select(s.id).where(s.agent_id == agent_id, s.key == key))
            if sid is not None:
                truth = await full_window(self.stack, str(sid))
                self.seen.append((list(request.messages[1:]), truth))
        async for event in self.script.stream(request):
            yield event


@pytest.fixture
def recorder(stack: Stack) -> Recorder:
    rec = Recorder(stack)
    stack.turns.providers = ProviderRegistry({"script": ScriptProvider(), "rec": rec})
    return rec


async def full_window(stack: Stack, sid: str) -> list[ChatMessage]:
    """Ground truth: the full window query in a read transaction, oldest first."""
    async with stack.db.read() as conn:
        rows = (await conn.execute(history._WINDOW, {"p_session_id": sid})).all()
    return [to_message(r.role, r.content) for r in reversed(rows)]


async def cached_read(stack: Stack, sid: str, cache: HistoryCache | None = None) -> Any:
    """The window as the turn path reads it: in a transaction, through the cache."""
    if cache is None:  # (an empty cache is falsy: it has a __len__)
        cache = stack.turns.history
    async with stack.db.tx() as conn:
        return await cache.read(conn, sid)


async def session_id(stack: Stack, agent_id: str, key: str = "s1") -> str:
    s = t.sessions.c
    async with stack.db.read() as conn:
        sid = await conn.scalar(sa.select(s.id).where(s.agent_id == agent_id, s.key == key))
    assert sid is not None
    return str(sid)


def db_path(stack: Stack) -> str:
    path = sa.engine.make_url(stack.db.url).database
    assert path
    return path


async def insert_message(
    stack: Stack,
    sid: str,
    content: str,
    *,
    role: str = "user",
    created_at: int | None = None,
    raw: bool = False,
) -> str:
    """A message row written outside the turn path: through the SQLAlchemy engine (as
    another code path would), or (``raw``) through a plain sqlite3 connection to the same
    file, as another process would."""
    message_id = stack.ids.new("msg")
    row = {
        "id": message_id,
        "org_id": "org_x",
        "session_id": sid,
        "work_item_id": None,
        "role": role,
        "content": content,
        "lead_gated": False,
        "tool_name": "complete_task" if role == "tool" else None,
        "created_at": stack.clock.now_ms() if created_at is None else created_at,
    }
    if raw:
        with closing(sqlite3.connect(db_path(stack), isolation_level=None)) as conn:
            conn.execute(
                "INSERT INTO messages (id, org_id, session_id, work_item_id, role, content,"
                " lead_gated, tool_name, created_at) VALUES (:id, :org_id, :session_id,"
                " :work_item_id, :role, :content, :lead_gated, :tool_name, :created_at)",
                row,
            )
    else:
        async with stack.db.tx() as conn:
            await conn.execute(t.messages.insert(), row)
    return message_id


def raw_sql(stack: Stack, sql: str, *args: Any) -> list[Any]:
    with closing(sqlite3.connect(db_path(stack), isolation_level=None)) as conn:
        return conn.execute(sql, args).fetchall()


def contents(messages: list[ChatMessage]) -> list[str]:
    return [m.content for m in messages]


@pytest.fixture
async def worker(stack: Stack, recorder: Recorder) -> tuple[Org, dict[str, Any]]:
    org = await make_org(stack)
    agent = await make_agent(stack, org, "worker", model="rec")
    recorder.session = (agent["id"], "s1")
    return org, agent


@pytest.fixture
def small_cache(request: pytest.FixtureRequest, stack: Stack) -> Any:
    """Factory of extra caches wired to the stack's after-commit topic."""
    made: list[HistoryCache] = []

    def make(**bounds: int) -> HistoryCache:
        cache = HistoryCache(**bounds)
        stack.db.on_commit_payloads(history.TOPIC, cache.apply)
        made.append(cache)
        return cache

    def unhook() -> None:
        for cache in made:
            stack.db.off_commit_payloads(history.TOPIC, cache.apply)

    request.addfinalizer(unhook)
    return make


# ---------------------------------------------------------------- the window


def test_to_message_maps_lead_feedback_to_a_user_message() -> None:
    assert to_message("internal", "fix it") == ChatMessage("user", FEEDBACK + "fix it")
    assert to_message("user", "hi") == ChatMessage("user", "hi")
    assert to_message("assistant", "yo") == ChatMessage("assistant", "yo")


_ROWS = st.lists(
    st.tuples(
        st.integers(0, 20), st.sampled_from(["user", "assistant", "internal"]), st.text(max_size=3)
    ),
    max_size=HISTORY_LIMIT,
)


@given(rows=_ROWS, shuffle=st.randoms(use_true_random=False))
def test_a_window_read_in_one_statement_is_the_newest_50_oldest_first(
    rows: list[tuple[int, str, str]], shuffle: Any
) -> None:
    """PostgreSQL's plain intake gets the window as arrays, newest first (or, should the
    server ever hand them over otherwise, in any order); with the turn's own message
    added (stamped after every row its statement saw: the newest), what the model sees
    is what sorting everything by (created_at, id) and taking the newest 50 gives, lead
    feedback shown as a user message."""
    stored = [(created, f"msg_{n:03d}", role, text) for n, (created, role, text) in enumerate(rows)]
    mine = ChatMessage("user", "mine")
    expected = [
        *(
            to_message(role, text)
            for _, _, role, text in sorted(stored, key=lambda r: (r[0], r[1]))
        ),
        mine,
    ][-HISTORY_LIMIT:]
    for order in ("newest first", "shuffled"):
        given_rows = sorted(stored, key=lambda r: (r[0], r[1]), reverse=True)
        if order == "shuffled":
            shuffle.shuffle(given_rows)
        window = Window.newest_first(
            [r[2] for r in given_rows],
            [r[3] for r in given_rows],
            [r[0] for r in given_rows],
            [r[1] for r in given_rows],
        )
        assert window.with_newest(mine) == expected, order


async def test_window_after_many_turns_equals_a_full_query(
    stack: Stack, recorder: Recorder, worker: tuple[Org, dict[str, Any]]
) -> None:
    """60 turns: every turn's model sees exactly the fresh full query's window; at the end
    the 50 newest messages, in order. On SQLite the first turn (a new session: its only
    message is the one it stored) reads nothing and caches the session as new; the cache
    serves every later turn."""
    org, agent = worker
    clock = fake_clock(stack)
    turns = 60
    for i in range(turns):
        if i % 3 == 0:  # several turns share a millisecond: ordered by id then
            clock.advance(1_000)
        await stack.turns.run(api_trigger(org, agent, f"message {i}"))
    assert len(recorder.seen) == turns
    for i, (seen, truth) in enumerate(recorder.seen):
        assert seen == truth, f"turn {i}"
        assert len(seen) == min(2 * i + 1, HISTORY_LIMIT)

    last, _ = recorder.seen[-1]
    # Before the 60th reply: 119 messages; the newest 50 start at turn 34's reply.
    expected = [ChatMessage("assistant", "Echo: message 34")]
    for i in range(35, turns):
        expected.append(ChatMessage("user", f"message {i}"))
        if i < turns - 1:
            expected.append(ChatMessage("assistant", f"Echo: message {i}"))
    assert last == expected

    cache = stack.turns.history
    if stack.db.is_sqlite:
        assert (cache.misses, cache.hits, len(cache)) == (0, turns - 1, 1)
    else:  # PostgreSQL: the window is simply queried
        assert (cache.misses, cache.hits, len(cache)) == (0, 0, 0)


async def test_rows_written_elsewhere_with_an_older_created_at_are_sorted_in(
    stack: Stack, recorder: Recorder, worker: tuple[Org, dict[str, Any]]
) -> None:
    """Clock skew: rows another code path or process commits after the window was cached,
    but with an older created_at, appear in their sorted place when among the newest 50
    (and not at all when older than all of them)."""
    org, agent = worker
    clock = fake_clock(stack)
    start = clock.now_ms()
    for i in range(30):
        clock.advance(1_000)
        await stack.turns.run(api_trigger(org, agent, f"message {i}"))
    sid = await session_id(stack, agent["id"])
    turn_at = {i: start + 1_000 * (i + 1) for i in range(30)}
    is_sqlite = stack.db.is_sqlite
    cache = stack.turns.history
    hits, misses = cache.hits, cache.misses

    await insert_message(stack, sid, "late via the engine", created_at=turn_at[20] + 500)
    await insert_message(
        stack,
        sid,
        "late via another process",
        role="assistant",
        created_at=turn_at[25] + 500,
        raw=is_sqlite,  # SQLite: a plain sqlite3 connection, as another process would
    )
    await insert_message(stack, sid, "far too old", created_at=start - 1, raw=is_sqlite)
    clock.advance(1_000)
    await stack.turns.run(api_trigger(org, agent, "after the skew"))

    seen, truth = recorder.seen[-1]
    assert seen == truth
    assert len(seen) == HISTORY_LIMIT
    texts = contents(seen)
    assert "far too old" not in texts
    at = texts.index("late via the engine")
    assert texts[at - 1 : at + 2] == ["Echo: message 20", "late via the engine", "message 21"]
    at = texts.index("late via another process")
    assert texts[at - 1 : at + 2] == ["Echo: message 25", "late via another process", "message 26"]
    assert seen[at].role == "assistant"
    assert texts[-1] == "after the skew"
    if is_sqlite:
        # Served from the cache plus the new rows (by rowid), not by a full re-read.
        assert (cache.hits, cache.misses) == (hits + 1, misses)

    # The next turn (the cached entry now includes the skewed rows) is exact too.
    clock.advance(1_000)
    await stack.turns.run(api_trigger(org, agent, "and once more"))
    seen, truth = recorder.seen[-1]
    assert seen == truth
    assert contents(seen).count("late via the engine") == 1


async def test_lead_feedback_is_a_user_message_and_tool_rows_are_left_out(
    stack: Stack, recorder: Recorder, worker: tuple[Org, dict[str, Any]]
) -> None:
    org, agent = worker
    clock = fake_clock(stack)
    await stack.turns.run(api_trigger(org, agent, "first"))
    sid = await session_id(stack, agent["id"])
    clock.advance(1_000)
    await insert_message(stack, sid, "please cite sources", role="internal")
    await insert_message(stack, sid, '{"ok": true}', role="tool")
    clock.advance(1_000)
    await stack.turns.run(api_trigger(org, agent, "second"))

    expected = [
        ChatMessage("user", "first"),
        ChatMessage("assistant", "Echo: first"),
        ChatMessage("user", FEEDBACK + "please cite sources"),
        ChatMessage("user", "second"),
    ]
    seen, truth = recorder.seen[-1]
    assert seen == truth == expected

    if stack.db.is_sqlite:
        # The same from a full (uncached) read.
        cache = stack.turns.history
        cache.drop(sid)
        misses = cache.misses
        clock.advance(1_000)
        await stack.turns.run(api_trigger(org, agent, "third"))
        seen, truth = recorder.seen[-1]
        assert cache.misses == misses + 1
        assert seen == truth
        assert seen[:4] == [*expected[:3], ChatMessage("user", "second")]
        assert '{"ok": true}' not in contents(seen)


async def test_concurrent_turns_keep_every_window_exact(
    stack: Stack, recorder: Recorder, worker: tuple[Org, dict[str, Any]]
) -> None:
    """Turns of several sessions (and several turns of one session) at once share group
    commits on SQLite; afterwards each session's window still equals the full query."""
    org, agent = worker
    keys = ["s1", "s2", "s3"]
    for round_ in range(4):
        fake_clock(stack).advance(1_000)
        await asyncio.gather(
            *(
                stack.turns.run(api_trigger(org, agent, f"{key} r{round_} #{n}", session=key))
                for key in keys
                for n in range(2)
            )
        )
    for key in keys:
        sid = await session_id(stack, agent["id"], key)
        truth = await full_window(stack, sid)
        assert len(truth) == 4 * 2 * 2
        assert await cached_read(stack, sid) == truth, key
    if stack.db.is_sqlite:
        assert len(stack.turns.history) == len(keys)


# ----------------------------------------------------------- the cache (SQLite)


@SQLITE_ONLY
async def test_a_rolled_back_transaction_leaves_the_cache_alone(stack: Stack) -> None:
    """The cache changes only after the reading transaction commits: a transaction that
    read (even rows it wrote itself) and then raised leaves no entry and no phantom."""
    cache = stack.turns.history
    sid = "sess_rollback"
    for i in range(3):
        await insert_message(stack, sid, f"m{i}", created_at=1_000 + i)

    with pytest.raises(Boom):
        async with stack.db.tx() as conn:
            assert contents(await cache.read(conn, sid)) == ["m0", "m1", "m2"]
            raise Boom
    assert (len(cache), cache.hits, cache.misses) == (0, 0, 1)

    async with stack.db.tx() as conn:
        assert contents(await cache.read(conn, sid)) == ["m0", "m1", "m2"]
        assert len(cache) == 0, "stored before the commit"
    assert (len(cache), cache.hits, cache.misses) == (1, 0, 2)

    with pytest.raises(Boom):
        async with stack.db.tx() as conn:
            await conn.execute(
                t.messages.insert(),
                {
                    "id": stack.ids.new("msg"),
                    "org_id": "org_x",
                    "session_id": sid,
                    "role": "user",
                    "content": "phantom",
                    "created_at": 2_000,
                },
            )
            assert contents(await cache.read(conn, sid)) == ["m0", "m1", "m2", "phantom"]
            raise Boom
    assert (len(cache), cache.hits, cache.misses) == (1, 1, 2)

    # The entry is the committed one: a plain hit (a stored phantom entry would have
    # failed the newest-row check and cost a miss), and no phantom.
    assert await cached_read(stack, sid) == await full_window(stack, sid)
    assert contents(await cached_read(stack, sid)) == ["m0", "m1", "m2"]
    assert (len(cache), cache.hits, cache.misses) == (1, 3, 2)

    # A turn-like transaction that adds a row and commits updates the entry.
    await insert_message(stack, sid, "m3", created_at=3_000)
    assert contents(await cached_read(stack, sid)) == ["m0", "m1", "m2", "m3"]
    assert contents(await cached_read(stack, sid)) == ["m0", "m1", "m2", "m3"]
    assert (cache.hits, cache.misses) == (5, 2)


@SQLITE_ONLY
async def test_an_older_entry_never_replaces_a_newer_one(stack: Stack) -> None:
    """Entries reach ``apply`` in commit order only approximately: an entry read before
    a newer one was stored must not replace it (the newer one serves the next read
    without any new row to read)."""
    signalled: list[Any] = []
    stack.db.on_commit_payloads(history.TOPIC, signalled.extend)
    sid = "sess_order"
    await insert_message(stack, sid, "m0", created_at=1_000)
    await cached_read(stack, sid)  # miss: the entry with m0
    await insert_message(stack, sid, "m1", created_at=2_000)
    await cached_read(stack, sid)  # hit plus m1: the entry with m0 and m1
    assert len(signalled) == 2
    older, newer = signalled

    cache = HistoryCache()
    cache.apply([newer])
    cache.apply([older])
    signalled.clear()
    assert contents(await cached_read(stack, sid, cache)) == ["m0", "m1"]
    assert (cache.hits, cache.misses) == (1, 0)
    assert signalled == [], "the older entry replaced the newer one"
    stack.db.off_commit_payloads(history.TOPIC, signalled.extend)


@SQLITE_ONLY
async def test_renumbered_rowids_are_detected(stack: Stack) -> None:
    """VACUUM may renumber rowids: the cached newest row is checked by id before its rowid
    is trusted; a mismatch drops the entry and reads the window in full."""
    cache = stack.turns.history
    sid = "sess_vacuum"
    ids = [await insert_message(stack, sid, f"m{i}", created_at=1_000 + i) for i in range(5)]
    # Another session's rows around ours, some deleted: gaps VACUUM could close.
    for i in range(3):
        other = await insert_message(stack, "sess_other", f"o{i}", created_at=1)
        raw_sql(stack, "DELETE FROM messages WHERE id = ?", other)
    ids.append(await insert_message(stack, sid, "m5", created_at=1_005))
    assert contents(await cached_read(stack, sid)) == [f"m{i}" for i in range(6)]
    assert cache.misses == 1

    raw_sql(stack, "VACUUM")
    assert await cached_read(stack, sid) == await full_window(stack, sid)
    assert len(await cached_read(stack, sid)) == 6

    # Force the mismatch: the cached newest row moves away from its rowid...
    misses = cache.misses
    raw_sql(stack, "UPDATE messages SET rowid = rowid + 1000 WHERE id = ?", ids[-1])
    ids.append(await insert_message(stack, sid, "m6", created_at=1_006))
    window = await cached_read(stack, sid)
    assert cache.misses == misses + 1
    assert window == await full_window(stack, sid)
    assert contents(window) == [f"m{i}" for i in range(7)]
    hits = cache.hits
    assert await cached_read(stack, sid) == window
    assert (cache.hits, cache.misses) == (hits + 1, misses + 1)

    # ...and another row of the session takes its place: same rowid, different id.
    [(rowid,)] = raw_sql(stack, "SELECT rowid FROM messages WHERE id = ?", ids[-1])
    raw_sql(stack, "UPDATE messages SET rowid = rowid + 1000 WHERE id = ?", ids[-1])
    raw_sql(stack, "UPDATE messages SET rowid = ? WHERE id = ?", rowid, ids[0])
    window = await cached_read(stack, sid)
    assert cache.misses == misses + 2
    assert window == await full_window(stack, sid)
    assert contents(window) == [f"m{i}" for i in range(7)], "no duplicated rows"


@SQLITE_ONLY
async def test_the_cache_keeps_the_most_recently_used_sessions(
    stack: Stack, small_cache: Any
) -> None:
    cache: HistoryCache = small_cache(max_sessions=2)
    for key in ("a", "b", "c", "d"):
        await insert_message(stack, f"sess_{key}", f"{key}0", created_at=1_000)

    for key in ("a", "b", "c"):
        assert contents(await cached_read(stack, f"sess_{key}", cache)) == [f"{key}0"]
    assert (len(cache), cache.hits, cache.misses) == (2, 0, 3)
    await cached_read(stack, "sess_b", cache)
    await cached_read(stack, "sess_c", cache)
    assert (cache.hits, cache.misses) == (2, 3), "b and c are kept"
    await cached_read(stack, "sess_a", cache)
    assert (cache.hits, cache.misses) == (2, 4), "a was dropped first"
    assert len(cache) == 2  # now c and a: b, the least recently used, went

    # New rows for c make it the most recently used: d pushes out a, not c.
    await insert_message(stack, "sess_c", "c1", created_at=2_000)
    assert contents(await cached_read(stack, "sess_c", cache)) == ["c0", "c1"]
    assert (cache.hits, cache.misses) == (3, 4)
    await cached_read(stack, "sess_d", cache)
    assert (cache.hits, cache.misses) == (3, 5)
    await cached_read(stack, "sess_c", cache)
    assert (cache.hits, cache.misses) == (4, 5)
    await cached_read(stack, "sess_a", cache)
    assert (cache.hits, cache.misses) == (4, 6)
    assert len(cache) == 2
    for key in ("a", "b", "c", "d"):
        sid = f"sess_{key}"
        assert await cached_read(stack, sid, cache) == await full_window(stack, sid)


@SQLITE_ONLY
async def test_the_cache_is_bounded_by_characters(stack: Stack, small_cache: Any) -> None:
    cache: HistoryCache = small_cache(max_chars=100)
    for key in ("a", "b", "c"):
        await insert_message(stack, f"sess_{key}", key * 40, created_at=1_000)
    await insert_message(stack, "sess_big", "z" * 150, created_at=1_000)

    for key in ("a", "b", "c"):
        await cached_read(stack, f"sess_{key}", cache)
    assert (len(cache), cache.misses) == (2, 3), "120 characters do not fit in 100"
    await cached_read(stack, "sess_b", cache)
    await cached_read(stack, "sess_c", cache)
    assert (cache.hits, cache.misses) == (2, 3)

    # A window larger than the whole budget is read correctly but not kept.
    assert contents(await cached_read(stack, "sess_big", cache)) == ["z" * 150]
    assert contents(await cached_read(stack, "sess_big", cache)) == ["z" * 150]
    assert cache.misses == 5
    assert len(cache) <= 2

    # A kept window that grows past the budget evicts the older session, not itself.
    for key in ("d", "e"):
        await insert_message(stack, f"sess_{key}", key * 40, created_at=1_000)
        await cached_read(stack, f"sess_{key}", cache)
    assert len(cache) == 2  # d and e: 80 characters
    await insert_message(stack, "sess_d", "d" * 30, created_at=2_000)
    await insert_message(stack, "sess_d", "d" * 20, created_at=3_000)
    hits, misses = cache.hits, cache.misses
    assert contents(await cached_read(stack, "sess_d", cache)) == ["d" * 40, "d" * 30, "d" * 20]
    assert (cache.hits, cache.misses, len(cache)) == (hits + 1, misses, 1)
    await cached_read(stack, "sess_d", cache)
    await cached_read(stack, "sess_e", cache)
    assert (cache.hits, cache.misses) == (hits + 2, misses + 1), "d kept, e dropped"
    for key in ("a", "b", "c", "d", "e", "big"):
        sid = f"sess_{key}"
        assert await cached_read(stack, sid, cache) == await full_window(stack, sid)
