// The official MCP TypeScript SDK against /mcp: StreamableHTTPClientTransport with the
// bearer key in requestInit.headers. argv[2]: JSON {url, apiKey, tool, agent, session}.
// Connects, lists tools and resource templates, sends a message, reads the session's
// transcript resource, subscribes to it, sends another message and waits for
// notifications/resources/updated, reads the resource again and ends the session (DELETE).
// Prints one JSON line.
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import { ResourceUpdatedNotificationSchema } from '@modelcontextprotocol/sdk/types.js';

const args = JSON.parse(process.argv[2]);
const uri = `leadgate://agents/${args.agent}/sessions/${args.session}/messages`;
const transport = new StreamableHTTPClientTransport(new URL(`${args.url}/mcp`), {
  requestInit: { headers: { Authorization: `Bearer ${args.apiKey}` } },
});
const client = new Client({ name: 'leadgate-node-peer', version: '1.0.0' });
const updates = [];
let updated = null;
const nextUpdate = () => new Promise((resolve) => { updated = resolve; });
client.setNotificationHandler(ResourceUpdatedNotificationSchema, (note) => {
  updates.push(note.params.uri);
  updated?.(note.params.uri);
});
const within = (promise, what, ms = 15_000) => {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`no ${what} within ${ms} ms`)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
};
const page = async () => JSON.parse((await client.readResource({ uri })).contents[0].text);
const send = (message) =>
  client.callTool({ name: args.tool, arguments: { agent: args.agent, message, session: args.session } });

await client.connect(transport);
const out = {
  protocolVersion: transport.protocolVersion ?? null,
  server: client.getServerVersion(),
  capabilities: client.getServerCapabilities(),
  tools: (await client.listTools()).tools.map((t) => t.name),
  templates: (await client.listResourceTemplates()).resourceTemplates.map((t) => t.uriTemplate),
};
out.first = await send('hello from node');
out.before = await page();
await client.subscribeResource({ uri });
const waiting = nextUpdate();
out.second = await send('and again');
out.updatedUri = await within(waiting, 'notifications/resources/updated');
out.after = await page();
out.updates = updates;
out.sessionId = transport.sessionId ?? null;
await transport.terminateSession(); // DELETE /mcp: the server ends the session
out.sessionAfterDelete = transport.sessionId ?? null;
await client.close();
console.log(JSON.stringify(out));
