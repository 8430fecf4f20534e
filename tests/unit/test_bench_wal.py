"""``bench.sqlite_costs`` reads WAL files itself: its counts are what docs/performance-history.md
reports, so they are checked here against writes whose pages are known."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

from bench.sqlite_costs import btree_names, wal_commits


def _wal_db(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA wal_autocheckpoint=0")
    conn.execute("CREATE TABLE t (id TEXT PRIMARY KEY, k TEXT)")
    conn.execute("CREATE INDEX ix_t_k ON t (k)")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the schema out of the WAL
    return conn


def _copy(path: Path, into: Path) -> Path:
    into.mkdir()
    shutil.copyfile(path, into / "db")
    shutil.copyfile(f"{path}-wal", into / "db-wal")
    return into


def test_commits_and_their_frames_are_read_by_btree(tmp_path: Path) -> None:
    path = tmp_path / "x.db"
    conn = _wal_db(path)
    for i in range(3):
        conn.execute("BEGIN")
        conn.execute("INSERT INTO t VALUES (?, ?)", (f"id{i}", f"k{i}"))
        conn.execute("INSERT INTO t VALUES (?, ?)", (f"id{i}b", f"k{i}b"))
        conn.execute("COMMIT")
    copy = _copy(path, tmp_path / "copy")
    conn.close()

    page_size, commits = wal_commits((copy / "db-wal").read_bytes())
    assert page_size == 4096
    assert len(commits) == 3
    names = btree_names(copy / "db")
    # Each commit rewrites the table's page and both indexes' pages once, however many
    # rows it wrote (the tables are one page each here).
    for frames in commits:
        assert sorted(names[p] for p in frames) == ["ix_t_k", "sqlite_autoindex_t_1", "t"]


def test_frames_of_an_earlier_generation_end_the_walk(tmp_path: Path) -> None:
    path = tmp_path / "x.db"
    conn = _wal_db(path)
    for i in range(5):
        conn.execute("INSERT INTO t VALUES (?, ?)", (f"old{i}", "k"))
    # A RESTART checkpoint lets the next writer start over at the WAL's beginning with
    # new salts: the five old commits' frames stay in the file beyond the new ones.
    conn.execute("PRAGMA wal_checkpoint(RESTART)")
    conn.execute("INSERT INTO t VALUES ('new', 'k')")
    copy = _copy(path, tmp_path / "copy")
    conn.close()

    _, commits = wal_commits((copy / "db-wal").read_bytes())
    assert len(commits) == 1


def test_an_empty_or_headerless_wal_has_no_commits() -> None:
    assert wal_commits(b"") == (0, [])
