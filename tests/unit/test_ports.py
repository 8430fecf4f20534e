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


def refused(server: dict[str, Any], **sections: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        check_ports(Settings.model_validate({"server": server, **sections}))
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
    assert err.message.startswith("cannot listen on 192.0.2.1:8080 ([server] port)")


def test_free_ports_pass() -> None:
    check_ports(Settings.model_validate({"server": {"host": "127.0.0.1", "port": 0}}))
