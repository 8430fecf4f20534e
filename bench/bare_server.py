"""The baseline for ``bench_rest``: a bare aiohttp endpoint with a fixed chat.completion.

``python -m bench.bare_server --port N`` serves ``POST /v1/chat/completions`` on
127.0.0.1: it reads the body and answers the same JSON every time (no auth, no parsing,
no database). The caller polls it until it answers.
"""

from __future__ import annotations

import argparse
import json

from aiohttp import web

BODY = json.dumps(
    {
        "id": "chatcmpl-bare",
        "object": "chat.completion",
        "created": 0,
        "model": "plain",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Echo: hello"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }
).encode()


async def completions(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=BODY, content_type="application/json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
