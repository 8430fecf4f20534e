// A throwaway HTTP proxy on 127.0.0.1 that adds "Authorization: Bearer <token>" to every
// request and forwards it to one upstream: the MCP conformance suite cannot send headers
// (tests/acceptance/test_mcp_conformance.py runs it through this; the same idea as
// /work/shared/tools/mcp-conformance).
//   node bearer_proxy.mjs '{"upstream": "http://127.0.0.1:PORT", "token": "KEY"}'
// Prints one JSON line, {"port": N}, once it listens; runs until it is killed.
// Host/Origin naming the proxy itself become the upstream's, exactly what the suite would
// send if it spoke to the server directly; other values (the DNS-rebinding scenario's
// evil.example.com) pass through untouched. Responses are piped chunk by chunk, so SSE
// streams as it comes.
import http from "node:http";
import { pipeline } from "node:stream";

const { upstream, token } = JSON.parse(process.argv[2]);
const up = new URL(upstream);
// Per-hop headers: Node sets its own on each side.
const HOP = ["connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"];
const strip = (h) => {
  for (const k of HOP) delete h[k];
  return h;
};

const server = http.createServer((req, res) => {
  const self = `127.0.0.1:${server.address().port}`;
  const headers = strip({ ...req.headers, authorization: `Bearer ${token}` });
  if (headers.host === self) headers.host = up.host;
  if (headers.origin === `http://${self}`) headers.origin = up.origin;
  const out = http.request(
    { hostname: up.hostname, port: up.port || 80, method: req.method, path: req.url, headers },
    (r) => {
      // The suite may have dropped the request before the answer came (it gives some
      // streams a deadline): piping into its closed response throws in Node 24.
      if (res.destroyed) return void r.destroy();
      res.writeHead(r.statusCode, r.statusMessage, strip({ ...r.headers }));
      res.flushHeaders();
      pipeline(r, res, () => {}); // either side closing (the suite drops a stream) ends both
    },
  );
  // A request the suite drops before the answer came is dropped upstream too.
  res.on("close", () => res.writableFinished || out.destroy());
  out.on("error", (e) => {
    if (res.destroyed) return; // dropped by the suite (above): nothing to answer
    console.error(`proxy: ${req.method} ${req.url}: ${e.message}`);
    if (res.headersSent) res.destroy();
    else res.writeHead(502).end(`proxy: ${e.message}\n`);
  });
  pipeline(req, out, () => {});
});
server.requestTimeout = 0; // GET streams stay open as long as the suite wants
server.listen(0, "127.0.0.1", () => console.log(JSON.stringify({ port: server.address().port })));
