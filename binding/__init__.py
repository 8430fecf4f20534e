"""Trigger bindings (where a session replies) and routes (who answers a channel)."""
