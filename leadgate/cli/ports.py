"""Startup check: the ports ``leadgate serve`` will listen on are free.

Run before anything is written (``scripts/run.sh`` calls it before migrating or minting
a key), so a second start while one runs fails at once with a clear message instead of
half-way through. A bind test is the only reliable check: connecting would miss a port
held by a process that does not accept, and the kernel decides what "in use" means.
"""

from __future__ import annotations

import errno
import socket
from typing import TYPE_CHECKING

from leadgate.core.errors import ConfigError

if TYPE_CHECKING:
    from leadgate.core.config import Settings


def _busy(host: str, port: int, key: str, host_key: str) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As the real listener does (asyncio sets it on Unix): a port in TIME_WAIT is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            if exc.errno == errno.EACCES:
                raise ConfigError(
                    f"not allowed to listen on {host}:{port} ({key}): ports below 1024 need "
                    "privileges (CAP_NET_BIND_SERVICE); choose a port of 1024 or above",
                    rule="server.port_denied",
                ) from None
            # A host that does not resolve, or is no address of this machine.
            raise ConfigError(
                f"cannot listen on {host}:{port} ({host_key}): {exc.strerror or exc}",
                rule="server.host",
            ) from None
    return False


#: The host the inbound SMTP listener binds when ``[email] listen_host`` is empty
#: (``bots.email``'s default).
SMTP_DEFAULT_HOST = "127.0.0.1"


def check_ports(settings: Settings, role: str = "all") -> None:
    """Raise :class:`ConfigError` (rule ``server.port_in_use``) when a port ``serve
    --role role`` listens on is taken, or two of them are the same: the HTTP port (every
    role: a worker serves ``/healthz``), the metrics port and, for the roles that take
    channel traffic in (not ``worker``), the inbound SMTP port, those two when
    configured; ``server.port_denied`` for a port the process may not bind;
    ``server.host`` when a host cannot be listened on. Port 0 (pick a free one) is
    skipped."""
    server, email = settings.server, settings.email
    wanted = [
        (
            "HTTP",
            server.host,
            server.port,
            "[server] port",
            "[server] host",
            "LEADGATE_SERVER__PORT",
        )
    ]
    if server.metrics_host:
        wanted.append(
            (
                "metrics",
                server.metrics_host,
                server.metrics_port,
                "[server] metrics_port",
                "[server] metrics_host",
                "LEADGATE_SERVER__METRICS_PORT",
            )
        )
    if role != "worker" and email.listens and email.listen_port:
        wanted.append(
            (
                "inbound SMTP",
                email.listen_host or SMTP_DEFAULT_HOST,
                email.listen_port,
                "[email] listen_port",
                "[email] listen_host",
                "LEADGATE_EMAIL__LISTEN_PORT",
            )
        )
    seen: dict[int, str] = {}
    for what, host, port, key, host_key, env in wanted:
        if port and port in seen:
            # Different hosts could share a port, but 0.0.0.0 covers them all: refused
            # alike rather than guessed at.
            raise ConfigError(
                f"the {what} port {port} is also the {seen[port]} port; give {key} "
                f"(or {env}) a port of its own",
                rule="server.port_in_use",
            )
        seen[port] = what
        if port and _busy(host, port, key, host_key):
            raise ConfigError(
                f"the {what} port {host}:{port} is already in use (is another leadgate "
                f"running?); stop it, or choose another port with {key} in the config "
                f"or {env}=...",
                rule="server.port_in_use",
            )
