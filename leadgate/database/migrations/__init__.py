"""Alembic migrations (script location for ``leadgate db upgrade``)."""
