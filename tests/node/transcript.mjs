// Waits, with plain fetch, for a session's held work to be settled, then reads its transcript.
// argv[2]: JSON {url, apiKey, agent, session}. Reads GET .../events (from the start of the
// session's log, so nothing is missed) until a `review` event other than `pending`, then
// GET .../messages once. Prints {review, events, messages}.
const args = JSON.parse(process.argv[2]);
const base = `${args.url}/v1/agents/${encodeURIComponent(args.agent)}/sessions/${encodeURIComponent(args.session)}`;
const headers = { Authorization: `Bearer ${args.apiKey}` };
const signal = AbortSignal.timeout(20_000);

const events = [];
let review = null;
const stream = await fetch(`${base}/events`, { headers, signal });
if (stream.status !== 200) throw new Error(`events: HTTP ${stream.status} ${await stream.text()}`);
const decoder = new TextDecoder();
let buffer = '';
const reader = stream.body.getReader();
reading: for (;;) {
  const { value, done } = await reader.read();
  if (done) break;
  buffer += decoder.decode(value, { stream: true });
  let end;
  while ((end = buffer.indexOf('\n\n')) >= 0) {
    const block = buffer.slice(0, end);
    buffer = buffer.slice(end + 2);
    const event = {};
    for (const line of block.split('\n')) {
      if (line.startsWith(':')) continue;
      const at = line.indexOf(': ');
      if (at > 0) event[line.slice(0, at)] = line.slice(at + 2);
    }
    if (!event.event) continue;
    events.push({ event: event.event, data: JSON.parse(event.data) });
    if (event.event === 'review' && events.at(-1).data.status !== 'pending') {
      review = events.at(-1).data.status;
      break reading;
    }
  }
}
await reader.cancel();

const page = await fetch(`${base}/messages`, { headers, signal });
if (page.status !== 200) throw new Error(`messages: HTTP ${page.status} ${await page.text()}`);
const messages = (await page.json()).data.map(({ role, content }) => ({ role, content }));
console.log(JSON.stringify({ review, events, messages }));
