"""Transactional outbox: delivery rows written with the state change, and the relay."""
