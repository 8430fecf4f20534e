// One chat completion through the official `openai` Node client, default retries.
// argv[2]: JSON {baseURL, apiKey, model, message, session?, stream?}.
// Prints one JSON line: {ok, content, pieces, finishReason, requests} on success, or
// {ok: false, error: {...}, requests} when the client raised; `requests` counts the HTTP
// requests the client made (its own fetch, wrapped), so a retry shows.
import OpenAI from 'openai';

const args = JSON.parse(process.argv[2]);
let requests = 0;
const client = new OpenAI({
  baseURL: args.baseURL,
  apiKey: args.apiKey,
  timeout: 20_000,
  fetch: (url, init) => {
    requests += 1;
    return fetch(url, init);
  },
});
const options = args.session ? { headers: { 'X-Session-Id': args.session } } : {};
const body = { model: args.model, messages: [{ role: 'user', content: args.message }] };

try {
  if (args.stream) {
    const stream = await client.chat.completions.create({ ...body, stream: true }, options);
    const pieces = [];
    let finishReason = null;
    let role = null;
    for await (const chunk of stream) {
      const choice = chunk.choices[0];
      role ??= choice.delta.role ?? null;
      if (choice.delta.content) pieces.push(choice.delta.content);
      finishReason = choice.finish_reason ?? finishReason;
    }
    console.log(JSON.stringify({ ok: true, role, content: pieces.join(''), pieces: pieces.length, finishReason, requests }));
  } else {
    const done = await client.chat.completions.create(body, options);
    const choice = done.choices[0];
    console.log(JSON.stringify({ ok: true, role: choice.message.role, content: choice.message.content, finishReason: choice.finish_reason, requests }));
  }
} catch (err) {
  console.log(JSON.stringify({
    ok: false,
    error: {
      name: err.constructor.name,
      conflict: err instanceof OpenAI.ConflictError,
      status: err.status ?? null,
      code: err.code ?? null,
      type: err.type ?? null,
      body: err.error ?? null,
      shouldRetry: err.headers?.get?.('x-should-retry') ?? null,
      message: String(err.message),
    },
    requests,
  }));
}
