// End to end: hostile request structure against the real server (the demo model, CPU). JSON nested deeper than
// tern's limit, in every place a request carries free-form JSON, gets a 400 naming the limit, and the server stays
// healthy and answers the next request. Run: TERN_BIN=... node --test tests/e2e/
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { startServer, stopServer } from './harness.mjs';

const KEY = 'sk-hostile-test';
const MODEL = 'tern-demo';
let server;

before(async () => {
  server = await startServer(null, MODEL, KEY, ['--device', 'cpu', '--context-length', '512']);
});

after(async () => {
  await stopServer(server);
});

async function post(path, body) {
  const res = await fetch(server.base + path, { method: 'POST', body,
    headers: { Authorization: `Bearer ${KEY}`, 'Content-Type': 'application/json' } });
  return { status: res.status, json: await res.json() };
}

test('JSON nested 30,000 deep is a 400 naming the limit, wherever it sits, and the server stays up', async () => {
  const deep = '['.repeat(30000) + ']'.repeat(30000);
  const user = '{"role": "user", "content": "hi"}';
  const bodies = [
    ['/v1/chat/completions', `{"model": "${MODEL}", "messages": [{"role": "user", "content": "hi", "x": ${deep}}]}`],
    ['/v1/completions', `{"model": "${MODEL}", "prompt": ${deep}}`],
    ['/v1/chat/completions', `{"model": "${MODEL}", "messages": [${user}], "chat_template_kwargs": {"a": ${deep}}}`],
    ['/v1/chat/completions', `{"model": "${MODEL}", "messages": [${user}], "tools": [{"type": "function", ` +
                             `"function": {"name": "f", "parameters": ${'{"a":'.repeat(30000)}1${'}'.repeat(30000)}}}]}`],
  ];
  for (const [path, body] of bodies) {
    const r = await post(path, body);
    assert.equal(r.status, 400, body.slice(0, 80));
    assert.match(r.json.error.message, /nested deeper than 128/);
  }
  const health = await fetch(server.base + '/health');
  assert.equal(health.status, 200);
  const ok = await server.client.chat.completions.create({ model: MODEL, max_tokens: 4, temperature: 0,
    messages: [{ role: 'user', content: 'hi' }] });
  assert.equal(ok.choices[0].message.role, 'assistant');
});

test('a real route under the wrong method is 405 with Allow, an unknown one 404', async () => {
  for (const [method, path, allow] of [['GET', '/v1/chat/completions', 'POST'], ['DELETE', '/v1/completions', 'POST'],
                                       ['POST', '/health', 'GET'], ['PUT', '/v1/models', 'GET']]) {
    const res = await fetch(server.base + path, { method, headers: { Authorization: `Bearer ${KEY}` } });
    assert.equal(res.status, 405, `${method} ${path}`);
    assert.equal(res.headers.get('allow'), allow);
    const j = await res.json();
    assert.match(j.error.message, new RegExp(`${method} is not allowed on ${path}`));
  }
  const missing = await fetch(server.base + '/v1/nothing', { headers: { Authorization: `Bearer ${KEY}` } });
  assert.equal(missing.status, 404);
});
