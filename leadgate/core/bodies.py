"""The one reading of a request body (see :mod:`leadgate.core.decoding` for what is done
with it): apart from the decoding because it needs aiohttp at import, which the CLI's
commands, importing the decoding, do not load (about 0.15 s per ``leadgate`` process).
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError

from leadgate.core.errors import PayloadTooLarge, RequestTimeout, ValidationError

#: Default time a client has to send its whole body.
BODY_TIMEOUT_S = 30.0
#: Where the application keeps its body timeout (see :func:`read_body`).
BODY_TIMEOUT_KEY = web.AppKey("leadgate_body_timeout_s", float)


async def read_body(request: web.Request) -> bytes:
    """The raw body: 413 over the size limit (also before reading, from Content-Length;
    a compressed body counts decompressed), 408 when it does not arrive within the body
    timeout, 400 when the client cut it or its ``Content-Encoding`` does not decode."""
    limit = request.client_max_size
    if limit and request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"the request body is larger than {limit:,} bytes", rule="body.size")
    timeout = BODY_TIMEOUT_S
    try:
        if request.content.is_eof():
            # The whole body came with the headers (nearly every request): nothing to wait
            # for, so no timer (arming and cancelling one cost more than the read).
            return await request.read()
        timeout = request.config_dict.get(BODY_TIMEOUT_KEY, BODY_TIMEOUT_S)
        async with asyncio.timeout(timeout):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(
            f"the request body is larger than {limit:,} bytes", rule="body.size"
        ) from None
    except TimeoutError:
        raise RequestTimeout(
            f"the request body did not arrive within {timeout:g} seconds", rule="body.timeout"
        ) from None
    except web.RequestPayloadError as exc:
        # aiohttp's parser failed on the body (bad gzip, broken chunked framing); it names
        # the cause. Either is the client's doing, never a 500.
        if isinstance(exc.__cause__, ContentEncodingError):
            raise ValidationError(
                "the request body does not decode as its Content-Encoding says",
                rule="body.encoding",
            ) from None
        raise ValidationError("the request body is malformed", rule="body.incomplete") from None
    except (ConnectionError, asyncio.IncompleteReadError, web.HTTPBadRequest) as exc:
        raise ValidationError("the request body is incomplete", rule="body.incomplete") from exc
