"""Startup check: the ports ``leadgate serve`` will listen on are free.

Run before anything is written (``scripts/run.sh`` calls it before migrating or minting
a key), so a second start while one runs fails at once with a clear message instead of
half-way through. A bind test is the only reliable check: connecting would miss a port
held by a process that does not accept, and the kernel decides what "in use" means.
"""

from __future__ import annotations

import errno
import socket

from leadgate.core.config import Settings
from leadgate.core.errors import ConfigError


def _busy(host: str, port: int, key: str) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As the real listener does (asyncio sets it on Unix): a port in TIME_WAIT is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return True
            # A host that does not resolve, or is no address of this machine.
            raise ConfigError(
                f"cannot listen on {host}:{port} ({key}): {exc.strerror or exc}",
                rule="server.host",
            ) from None
    return False


def check_ports(settings: Settings) -> None:
    """Raise :class:`ConfigError` (rule ``server.port_in_use``) when the HTTP port, the
    metrics port or the inbound SMTP port (those two when configured) is taken, or two of
    them are the same; ``server.host`` when a host cannot be listened on. Port 0 (pick a
    free one) is skipped."""
    server, email = settings.server, settings.email
    wanted = [("HTTP", server.host, server.port, "[server] port", "LEADGATE_SERVER__PORT")]
    if server.metrics_host:
        wanted.append(
            (
                "metrics",
                server.metrics_host,
                server.metrics_port,
                "[server] metrics_port",
                "LEADGATE_SERVER__METRICS_PORT",
            )
        )
    if email.listen_host and email.listen_port:
        wanted.append(
            (
                "inbound SMTP",
                email.listen_host,
                email.listen_port,
                "[email] listen_port",
                "LEADGATE_EMAIL__LISTEN_PORT",
            )
        )
    seen: dict[int, str] = {}
    for what, host, port, key, env in wanted:
        if port and port in seen:
            # Different hosts could share a port, but 0.0.0.0 covers them all: refused
            # alike rather than guessed at.
            raise ConfigError(
                f"the {what} port {port} is also the {seen[port]} port; give {key} "
                f"(or {env}) a port of its own",
                rule="server.port_in_use",
            )
        seen[port] = what
        if port and _busy(host, port, key):
            raise ConfigError(
                f"the {what} port {host}:{port} is already in use (is another leadgate "
                f"running?); stop it, or choose another port with {key} in the config "
                f"or {env}=...",
                rule="server.port_in_use",
            )
