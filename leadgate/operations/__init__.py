"""The operations layer: what every surface does, written once.

REST, MCP, the console, the operator API, the channel adapters and the CLI call these
(sending a message, deciding, recovering a delivery, reading queues), never the domain
rules themselves. The session-key scheme (:mod:`.sessions`) and the input limits
(:mod:`leadgate.core.limits`, applied here) live in one place.

Each surface depends only on a narrow Protocol of what it uses (see the ``Protocol``
classes in :mod:`leadgate.web` and :mod:`bots.base`); the classes here satisfy them.
"""
