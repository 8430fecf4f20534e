"""Stand-in for Microsoft's two login services a Teams bot with an app id talks to, for a
``leadgate serve`` child process, which no setting points elsewhere.

* ``login.microsoftonline.com``: msal (under the Bot Framework SDK) trades the bot's app
  id and password for a token to call the Connector with: OpenID discovery of the
  ``botframework.com`` tenant, then a client-credentials form post to its token
  endpoint (``grant_type=client_credentials``, ``client_id``, ``client_secret``,
  ``scope``). A wrong id or password is ``401 invalid_client`` (``AADSTS7000215``), as
  Microsoft answers it.
* ``login.botframework.com``: the OpenID metadata and keys the SDK checks an inbound
  channel token against (:class:`tests.standins.botframework_keys.BotFrameworkKeys`).

msal takes only ``https`` authorities, so both are served over TLS (one certificate
for both names, signed by a CA made for the run and written to ``--ca-file``) behind an
HTTP ``CONNECT`` proxy on ``--port``: the child gets ``HTTPS_PROXY`` (the proxy) and
``REQUESTS_CA_BUNDLE`` (the CA), which ``requests`` (msal's and the SDK's client)
honours. Plain-HTTP requests for 127.0.0.1 that come to the proxy anyway (a client
given ``HTTP_PROXY``, or slack_sdk's before leadgate chose its proxy: it ignores
``NO_PROXY``) are passed on; anything else is ``403``. In-process,
``asyncio.start_server(login.tunnel, "127.0.0.1", 0)`` serves the proxy alone, and
``login.proxied`` lists what it was asked to carry.

Switches (attributes, in-process): ``token_mode`` (``"ok"``, ``"hang"``: the token
request is read and answered only once ``release_tokens()`` is called, from any thread;
``"reset"``: read, then the connection aborted; ``"page"``: a proxy's 502 HTML page),
``token_expires_in`` (the ``expires_in`` issued), ``access_token`` (the token issued);
``asked`` counts the token requests received, ``grants`` the ones answered.

As a subprocess::

    python -m tests.standins.microsoft_login --port 0 --http-port 0 --app-id ID \\
        --app-password PW --access-token TOKEN --ca-file ca.pem
    # prints "LISTENING <proxy port>" then "HTTP <control port>"

Control endpoints:

* ``POST /_standin/channel_token`` -> body ``{"service_url": ...}``: a channel token for
  the app id, signed as the Bot Connector signs one (``{"token": ...}``)
* ``GET  /_standin/grants`` -> JSON list of token requests: ``{"client_id", "ok"}``
  (never the password)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import ipaddress
import signal
import ssl
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from tests.standins.botframework_keys import BotFrameworkKeys

LOGIN = "login.microsoftonline.com"
CHANNEL_KEYS = "login.botframework.com"
TENANT = "botframework.com"  # the SDK's tenant for a MultiTenant bot


def _certificates(ca_file: Path, *, ips: tuple[str, ...] = ()) -> ssl.SSLContext:
    """A CA (written to ``ca_file``) and the server context of a certificate it signed
    for both host names (and for ``ips``: a TLS stand-in on 127.0.0.1)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "leadgate test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, LOGIN)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName(LOGIN),
                    x509.DNSName(CHANNEL_KEYS),
                    *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips),
                ]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([x509.OID_SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    with tempfile.TemporaryDirectory() as tmp:
        chain = Path(tmp) / "server.pem"
        chain.write_bytes(
            leaf.public_bytes(serialization.Encoding.PEM)
            + key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        context.load_cert_chain(chain)
    return context


class MicrosoftLogin:
    """The two login services over TLS, the ``CONNECT`` proxy in front of them, and the
    control application."""

    def __init__(self, *, app_id: str, app_password: str, access_token: str) -> None:
        self.app_id = app_id
        self.app_password = app_password
        self.access_token = access_token
        #: token requests, oldest first: the client id given and whether it matched
        self.grants: list[dict[str, Any]] = []
        #: every request the proxy was asked to carry, oldest first: its target
        #: (``host:443`` for a ``CONNECT``, the absolute URL of a plain-HTTP one)
        self.proxied: list[str] = []
        self.keys = BotFrameworkKeys()
        #: seconds each token request waits before it is answered (a slow login service)
        self.token_hold_s = 0.0
        #: how the token endpoint answers: ``"ok"``; ``"hang"`` (reads the request and
        #: answers only once :meth:`release_tokens` is called); ``"reset"`` (reads the
        #: request, then aborts the connection); ``"page"`` (a proxy's 502 HTML page)
        self.token_mode = "ok"
        #: the ``expires_in`` of the tokens issued
        self.token_expires_in = 3599
        #: token requests received, answered or not
        self.asked = 0
        self._held: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._hold_lock = threading.Lock()
        self._tls_port = 0
        # Each tunnel's task and the streams it pipes (closed by close_tunnels).
        self._tunnels: dict[asyncio.Task[None], list[asyncio.StreamWriter]] = {}

    def release_tokens(self) -> None:
        """(any thread) Answer the held token requests, and the next ones, as ``"ok"``."""
        with self._hold_lock:
            self.token_mode = "ok"
            held, self._held = self._held, []
        for loop, waiter in held:
            loop.call_soon_threadsafe(_wake, waiter)

    # -- the login services ------------------------------------------------------------

    def tls_app(self) -> web.Application:
        """What both names serve (told apart by ``Host``)."""
        app = web.Application()
        app.router.add_get(f"/{TENANT}/v2.0/.well-known/openid-configuration", self._discovery)
        app.router.add_post(f"/{TENANT}/oauth2/v2.0/token", self._token)
        app.router.add_get("/common/discovery/instance", self._instance)
        app.router.add_get("/v1/.well-known/openidconfiguration", self._channel_metadata)
        app.router.add_get("/v1/.well-known/keys", self._channel_keys)
        return app

    async def _discovery(self, request: web.Request) -> web.Response:
        base = f"https://{LOGIN}/{TENANT}"
        return web.json_response(
            {
                "issuer": f"{base}/v2.0",
                "authorization_endpoint": f"{base}/oauth2/v2.0/authorize",
                "token_endpoint": f"{base}/oauth2/v2.0/token",
                "token_endpoint_auth_methods_supported": ["client_secret_post"],
            }
        )

    async def _instance(self, request: web.Request) -> web.Response:
        # msal's look-up of the host's aliases (for its token cache)
        return web.json_response(
            {
                "tenant_discovery_endpoint": (
                    f"https://{LOGIN}/{TENANT}/v2.0/.well-known/openid-configuration"
                ),
                "api-version": "1.1",
                "metadata": [
                    {"preferred_network": LOGIN, "preferred_cache": LOGIN, "aliases": [LOGIN]}
                ],
            }
        )

    async def _token(self, request: web.Request) -> web.Response:
        form = await request.post()
        self.asked += 1
        with self._hold_lock:
            mode = self.token_mode
            if mode == "hang":
                loop = asyncio.get_running_loop()
                waiter: asyncio.Future[None] = loop.create_future()
                self._held.append((loop, waiter))
        if mode == "hang":
            await waiter
        elif mode == "reset":
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=500)  # (never reaches the client)
        elif mode == "page":
            return web.Response(
                status=502, text="<html><body>Bad Gateway</body></html>", content_type="text/html"
            )
        await asyncio.sleep(self.token_hold_s)
        client_id = str(form.get("client_id", ""))
        ok = (
            form.get("grant_type") == "client_credentials"
            and client_id == self.app_id
            and form.get("client_secret") == self.app_password
        )
        self.grants.append({"client_id": client_id, "ok": ok})
        if not ok:
            return web.json_response(
                {
                    "error": "invalid_client",
                    "error_description": "AADSTS7000215: Invalid client secret provided.",
                },
                status=401,
            )
        return web.json_response(
            {
                "token_type": "Bearer",
                "expires_in": self.token_expires_in,
                "ext_expires_in": self.token_expires_in,
                "access_token": self.access_token,
            }
        )

    async def _channel_metadata(self, request: web.Request) -> web.Response:
        jwks = f"https://{CHANNEL_KEYS}/v1/.well-known/keys"
        return web.json_response({"issuer": "https://api.botframework.com", "jwks_uri": jwks})

    async def _channel_keys(self, request: web.Request) -> web.Response:
        return await self.keys._keys(request)

    # -- the proxy ---------------------------------------------------------------------

    async def tunnel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One ``CONNECT host:443``: piped to the TLS server for the two login hosts. A
        plain-HTTP request for 127.0.0.1 is passed on as it is (aiohttp's server takes
        the absolute URL)."""
        task = asyncio.current_task()
        assert task is not None
        writers = self._tunnels.setdefault(task, [])
        writers.append(writer)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            method, target, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
            self.proxied.append(target)
            local = urlsplit(target) if target.startswith("http://") else None
            if local is not None and local.hostname == "127.0.0.1" and local.port:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", local.port)
                writers.append(up_writer)
                up_writer.write(head)
            elif method == "CONNECT" and target.rsplit(":", 1)[0] in (LOGIN, CHANNEL_KEYS):
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._tls_port)
                writers.append(up_writer)
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
                return
            await writer.drain()
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        except (OSError, ValueError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self._tunnels.pop(task, None)

    async def close_tunnels(self) -> None:
        """(the proxy's loop) End the tunnels still open (the kept-alive connections of
        msal's clients): their connections closed, each pipe ends at its end of file and
        its tunnel returns. (Cancelled, a tunnel's task made asyncio's stream server log
        an ERROR on Python 3.11: it reads the exception of a cancelled task.)"""
        tunnels = list(self._tunnels.items())
        for _, writers in tunnels:
            for writer in writers:
                writer.close()
        if tunnels:
            await asyncio.wait([task for task, _ in tunnels])

    # -- control -----------------------------------------------------------------------

    def control_app(self) -> web.Application:
        """``/_standin/channel_token`` and ``/_standin/grants``."""

        async def channel_token(request: web.Request) -> web.Response:
            body = await request.json()
            token = self.keys.token(app_id=self.app_id, service_url=str(body["service_url"]))
            return web.json_response({"token": token})

        async def grants(request: web.Request) -> web.Response:
            return web.json_response(self.grants)

        app = web.Application()
        app.router.add_post("/_standin/channel_token", channel_token)
        app.router.add_get("/_standin/grants", grants)
        return app

    async def serve(self, host: str, port: int, http_port: int, ca_file: Path) -> None:
        """Listen (printing the proxy's and the control's ports) until SIGTERM."""
        context = _certificates(ca_file)
        tls = web.AppRunner(self.tls_app())
        control = web.AppRunner(self.control_app())
        await tls.setup()
        await control.setup()
        await web.TCPSite(tls, "127.0.0.1", 0, ssl_context=context).start()
        self._tls_port = tls.addresses[0][1]
        proxy = await asyncio.start_server(self.tunnel, host, port)
        print(f"LISTENING {proxy.sockets[0].getsockname()[1]}", flush=True)
        await web.TCPSite(control, host, http_port).start()
        print(f"HTTP {control.addresses[0][1]}", flush=True)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        try:
            await stop.wait()
        finally:
            proxy.close()
            await self.close_tunnels()
            await control.cleanup()
            await tls.cleanup()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    with contextlib.suppress(OSError):
        writer.close()


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.standins.microsoft_login ...`` (see the module's docstring)."""
    parser = argparse.ArgumentParser(description="Microsoft login stand-in")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--http-port", type=int, default=0)
    parser.add_argument("--app-id", required=True)
    parser.add_argument("--app-password", required=True)
    parser.add_argument("--access-token", required=True)
    parser.add_argument("--ca-file", required=True, type=Path)
    args = parser.parse_args(argv)
    login = MicrosoftLogin(
        app_id=args.app_id, app_password=args.app_password, access_token=args.access_token
    )
    try:
        asyncio.run(login.serve(args.host, args.port, args.http_port, args.ca_file))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
