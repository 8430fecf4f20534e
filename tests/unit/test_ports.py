"""The startup port check (:mod:`leadgate.cli.ports`): every listener `serve` opens."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from leadgate.cli.ports import check_ports
from leadgate.core.config import Settings
from leadgate.core.errors import ConfigError


@pytest.fixture
def taken() -> Iterator[int]:
    """A port on 127.0.0.1 that a listening socket holds."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def refused(server: dict[str, Any], role: str = "all", **sections: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        check_ports(Settings.model_validate({"server": server, **sections}), role)
    return info.value


def test_the_metrics_port_is_checked_too(taken: int) -> None:
    err = refused(
        {"host": "127.0.0.1", "port": 0, "metrics_host": "127.0.0.1", "metrics_port": taken}
    )
    assert err.rule == "server.port_in_use"
    assert f"the metrics port 127.0.0.1:{taken} is already in use" in err.message
    assert "[server] metrics_port" in err.message


def test_two_listeners_on_one_port_are_refused() -> None:
    with socket.socket() as sock:  # a port free now, named twice
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    err = refused(
        {"host": "127.0.0.1", "port": port, "metrics_host": "127.0.0.1", "metrics_port": port}
    )
    assert err.rule == "server.port_in_use"
    assert err.message.startswith(f"the metrics port {port} is also the HTTP port")
    err = refused(
        {"host": "127.0.0.1", "port": port},
        email={"listen_host": "127.0.0.1", "listen_port": port},
    )
    assert err.message.startswith(f"the inbound SMTP port {port} is also the HTTP port")


def test_a_host_that_is_no_address_here_is_named() -> None:
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): never this machine's, so bind() fails at once.
    err = refused({"host": "192.0.2.1", "port": 8080})
    assert err.rule == "server.host"
    assert err.message.startswith("cannot listen on 192.0.2.1:8080 ([server] host)")


def test_free_ports_pass() -> None:
    check_ports(Settings.model_validate({"server": {"host": "127.0.0.1", "port": 0}}))


def test_the_smtp_port_is_checked_on_its_default_host(taken: int) -> None:
    """``[email] listen_port`` alone listens on 127.0.0.1; the check skipped it, so
    ``--check-ports`` said free and ``serve`` then died on a raw bind error."""
    err = refused({"host": "127.0.0.1", "port": 0}, email={"listen_port": taken})
    assert err.rule == "server.port_in_use"
    assert f"the inbound SMTP port 127.0.0.1:{taken} is already in use" in err.message


def test_a_worker_checks_its_http_port_but_takes_no_mail_in(taken: int) -> None:
    """A worker serves /healthz on the HTTP port (it was not checked: a raw OSError and
    exit 1), and starts no SMTP listener (its port is not its to check)."""
    err = refused({"host": "127.0.0.1", "port": taken}, "worker")
    assert err.rule == "server.port_in_use" and "the HTTP port" in err.message
    check_ports(
        Settings.model_validate(
            {"server": {"host": "127.0.0.1", "port": 0}, "email": {"listen_port": taken}}
        ),
        "worker",
    )
