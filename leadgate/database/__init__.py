"""Database: the schema, the one transaction API (SQLite inline, PostgreSQL), migrations."""
