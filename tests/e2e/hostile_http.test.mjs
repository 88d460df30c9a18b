// End to end: hostile HTTP against the real server (the demo model, CPU), over raw sockets where a client library
// would not send it: compressed and chunked bodies past the limit, a Content-Length past it with no body, framing
// headers that contradict each other, headers trickled byte by byte, a prompt longer than the context can hold,
// a client that leaves a non-streamed request, pipelined requests, HTTP/1.0. After each the server answers /health
// and a chat, and at the end its memory is back near its idle size. Run: TERN_BIN=... node --test tests/e2e/
import { test, before, after, afterEach } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import net from 'node:net';
import path from 'node:path';
import zlib from 'node:zlib';
import { metrics, root, startServer, stopServer, waitIdle } from './harness.mjs';

const KEY = 'sk-hostile-http';
const MODEL = 'tern-demo';
const BODY_LIMIT = 1 << 20;
const READ_TIMEOUT_S = 2;
const CONTEXT = 2048;
// --max-running-requests 4 and --max-queued-requests 4 give the server 4 + 4 + 16 = 24 connection threads.
const THREADS = 24;
let server;
let idleRssKb;

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function rssKb() {
  const status = fs.readFileSync(`/proc/${server.proc.pid}/status`, 'utf8');
  return Number(status.match(/^VmRSS:\s+(\d+) kB/m)[1]);
}

async function chat(content = 'hi') {
  return server.client.chat.completions.create({ model: MODEL, max_tokens: 4, temperature: 0,
    messages: [{ role: 'user', content }] });
}

before(async () => {
  server = await startServer(null, MODEL, KEY, ['--device', 'cpu', '--context-length', String(CONTEXT),
    '--max-body-bytes', String(BODY_LIMIT), '--request-read-timeout', String(READ_TIMEOUT_S),
    '--max-running-requests', '4', '--max-queued-requests', '4']);
  // Idle after one of each kind of ordinary request, so that first-use allocations count as idle.
  for (let i = 0; i < 3; i++) await chat();
  await server.client.completions.create({ model: MODEL, prompt: 'hello', max_tokens: 4 });
  await waitIdle(server);
  idleRssKb = rssKb();
});

after(async () => {
  await stopServer(server);
});

// After every hostile case: the server is healthy and still answers a chat.
afterEach(async () => {
  const health = await fetch(server.base + '/health', { signal: AbortSignal.timeout(10000) });
  assert.equal(health.status, 200);
  const ok = await chat();
  assert.equal(ok.choices[0].message.role, 'assistant');
});

// Raw HTTP: `parts` are written in order (a number is a pause in ms); resolves with what the server sent until it
// closed the connection or `waitMs` passed, and whether it closed.
async function exchange(parts, { waitMs = 10000 } = {}) {
  const url = new URL(server.base);
  const sock = net.connect({ host: url.hostname, port: Number(url.port) });
  const chunks = [];
  let closed = false;
  const done = new Promise((resolve) => {
    sock.on('data', (d) => chunks.push(d));
    sock.on('close', () => { closed = true; resolve(); });
    sock.on('error', () => {});
  });
  const start = Date.now();
  for (const p of Array.isArray(parts) ? parts : [parts]) {
    if (closed) break;
    if (typeof p === 'number') await sleep(p);
    else sock.write(p);
  }
  await Promise.race([done, sleep(Math.max(0, waitMs - (Date.now() - start)))]);
  sock.destroy();
  return { raw: Buffer.concat(chunks), closed, ms: Date.now() - start };
}

// The HTTP/1.1 responses in `raw`: status, headers (lower-case names, repeated ones joined by ','), body.
function responses(raw) {
  const out = [];
  let at = 0;
  while (at < raw.length) {
    const end = raw.indexOf('\r\n\r\n', at);
    if (end < 0) break;
    const lines = raw.subarray(at, end).toString('latin1').split('\r\n');
    const status = Number(lines[0].split(' ')[1]);
    const headers = {};
    for (const line of lines.slice(1)) {
      const k = line.slice(0, line.indexOf(':')).toLowerCase();
      const v = line.slice(line.indexOf(':') + 1).trim();
      headers[k] = k in headers ? `${headers[k]},${v}` : v;
    }
    at = end + 4;
    let body;
    if ('content-length' in headers) {
      body = raw.subarray(at, at + Number(headers['content-length']));
      at += body.length;
    } else if (headers['transfer-encoding'] === 'chunked') {
      const parts = [];
      for (;;) {
        const eol = raw.indexOf('\r\n', at);
        const size = parseInt(raw.subarray(at, eol).toString('latin1'), 16);
        at = eol + 2;
        if (!(size > 0)) { at += 2; break; }
        parts.push(raw.subarray(at, at + size));
        at += size + 2;
      }
      body = Buffer.concat(parts);
    } else {
      body = raw.subarray(at);
      at = raw.length;
    }
    out.push({ status, headers, body: body.toString('utf8') });
  }
  return out;
}

function head(method, target, headers = {}, version = 'HTTP/1.1') {
  const all = { Host: 'localhost', Authorization: `Bearer ${KEY}`, ...headers };
  return `${method} ${target} ${version}\r\n` + Object.entries(all).map(([k, v]) => `${k}: ${v}\r\n`).join('') + '\r\n';
}

function post(target, body, headers = {}, version = 'HTTP/1.1') {
  const bytes = Buffer.from(typeof body === 'string' ? body : JSON.stringify(body));
  return Buffer.concat([Buffer.from(head('POST', target, { 'Content-Type': 'application/json',
    'Content-Length': bytes.length, ...headers }, version)), bytes]);
}

function only(raw) {
  const r = responses(raw);
  assert.equal(r.length, 1, 'one response: ' + raw.toString('latin1').slice(0, 300));
  return { ...r[0], json: JSON.parse(r[0].body) };
}

const chatBody = { model: MODEL, max_tokens: 4, temperature: 0, messages: [{ role: 'user', content: 'hi' }] };

test('a compressed body is refused with 415 before it is inflated (gzip and deflate bombs)', async () => {
  const before = rssKb();
  for (const [coding, squeeze] of [['gzip', zlib.gzipSync], ['deflate', zlib.deflateSync]]) {
    // 64 MiB of spaces after a valid start: ~64 KB on the wire, well under the body limit.
    const json = Buffer.concat([Buffer.from('{"model": "tern-demo", "prompt": "hi"'), Buffer.alloc(64 << 20, ' '),
                                Buffer.from('}')]);
    const body = squeeze(json);
    assert.ok(body.length < BODY_LIMIT);
    const res = await exchange(Buffer.concat([Buffer.from(head('POST', '/v1/completions', {
      'Content-Type': 'application/json', 'Content-Encoding': coding, 'Content-Length': body.length })), body]));
    const r = only(res.raw);
    assert.equal(r.status, 415, coding);
    assert.match(r.json.error.message, new RegExp(`Content-Encoding '${coding}' is not accepted`));
  }
  // Nothing near the inflated size was ever held.
  assert.ok(rssKb() - before < 32 << 10, `RSS grew by ${rssKb() - before} kB`);
});

test('a chunked body past --max-body-bytes is a 413; one under it is served', async () => {
  const chunk = Buffer.alloc(64 << 10, ' ');
  const parts = [head('POST', '/v1/completions', { 'Content-Type': 'application/json',
                                                   'Transfer-Encoding': 'chunked' })];
  parts.push(`${(1).toString(16)}\r\n{\r\n`);
  for (let sent = 0; sent <= 2 * BODY_LIMIT; sent += chunk.length) {
    parts.push(`${chunk.length.toString(16)}\r\n`, chunk, '\r\n');
  }
  parts.push('0\r\n\r\n');
  const big = only((await exchange(parts)).raw);
  assert.equal(big.status, 413);
  assert.match(big.json.error.message, new RegExp(`exceeds the limit of ${BODY_LIMIT} bytes`));

  const body = JSON.stringify({ model: MODEL, prompt: 'hello', max_tokens: 2, temperature: 0 });
  const small = only((await exchange([head('POST', '/v1/completions', { 'Content-Type': 'application/json',
    'Transfer-Encoding': 'chunked', Connection: 'close' }), `5\r\n${body.slice(0, 5)}\r\n`,
    `${Buffer.byteLength(body.slice(5)).toString(16)}\r\n${body.slice(5)}\r\n0\r\n\r\n`])).raw);
  assert.equal(small.status, 200, JSON.stringify(small.json));
  assert.equal(small.json.object, 'text_completion');
});

test('a Content-Length past the limit gets its 413 at once, from the header alone', async () => {
  const res = await exchange([head('POST', '/v1/chat/completions', { 'Content-Type': 'application/json',
                                                                     'Content-Length': 100 << 20 }), '{"mo']);
  const r = only(res.raw);
  assert.equal(r.status, 413);
  assert.match(r.json.error.message, new RegExp(`${100 << 20} bytes by its Content-Length\\) exceeds the limit of ` +
                                                `${BODY_LIMIT} bytes`));
  assert.equal(r.headers.connection, 'close');
  assert.ok(res.closed, 'the server closes the connection (the body is never read)');
  assert.ok(res.ms < 3000, `answered after ${res.ms} ms`);
});

test('framing that contradicts itself is refused: 400, 411, 501', async () => {
  const body = JSON.stringify(chatBody);
  const n = Buffer.byteLength(body);
  const cases = [
    [{ 'Content-Length': n, 'content-length': n + 5 }, 400, /more than one Content-Length/],
    [{ 'Content-Length': n, 'Content-length': n }, 400, /more than one Content-Length/],
    [{ 'Content-Length': n, 'Transfer-Encoding': 'chunked' }, 400, /both Content-Length and Transfer-Encoding/],
    [{ 'Content-Length': `${n}, ${n}` }, 400, /is not a byte count/],
    [{ 'Content-Length': '-1' }, 400, /is not a byte count/],
    [{}, 411, /needs a Content-Length/],
    [{ 'Transfer-Encoding': 'gzip, chunked' }, 501, /not supported \(only chunked\)/],
  ];
  for (const [headers, status, message] of cases) {
    const res = await exchange(head('POST', '/v1/chat/completions', { 'Content-Type': 'application/json',
                                                                        ...headers }) + body);
    const r = only(res.raw);
    assert.equal(r.status, status, JSON.stringify(headers));
    assert.match(r.json.error.message, message);
    assert.ok(res.closed, 'closed after a refused body: ' + JSON.stringify(headers));
  }
});

test('headers trickled byte by byte end in 408 at the read deadline; /health is not starved', async () => {
  const start = Date.now();
  const slow = [];
  for (let i = 0; i < THREADS + 16; i++) {
    const parts = ['POST /v1/chat/completions HTTP/1.1\r\n'];
    for (let k = 0; k < 60; k++) parts.push(250, `X-Slow-${k}: y\r\n`);  // 15 s of headers, never the blank line
    slow.push(exchange(parts, { waitMs: 20000 }));
  }
  await sleep(200);
  const health = await fetch(server.base + '/health', { signal: AbortSignal.timeout(3 * READ_TIMEOUT_S * 1000) });
  assert.equal(health.status, 200);
  assert.ok(Date.now() - start < 3 * READ_TIMEOUT_S * 1000);
  for (const res of await Promise.all(slow)) {
    const r = only(res.raw);
    assert.equal(r.status, 408);
    assert.match(r.json.error.message, new RegExp(`did not arrive within ${READ_TIMEOUT_S} s`));
    assert.ok(res.closed);
    assert.ok(res.ms < 4 * READ_TIMEOUT_S * 1000, `closed after ${res.ms} ms`);
  }
  // A connection that sends nothing after its request line is ended the same way.
  const silent = await exchange(['POST /v1/completions HTTP/1.1\r\n'], { waitMs: 4 * READ_TIMEOUT_S * 1000 });
  assert.equal(only(silent.raw).status, 408);
  assert.ok(silent.closed);
});

test('a prompt longer than the context can hold is refused by its bytes, before tokenizing', async () => {
  // The bound from the tokenizer's own files: its longest token in bytes (at least 4, an unknown character) times
  // 3 for its NFC normalizer (the most Unicode composition shrinks text), times the context.
  const tok = JSON.parse(fs.readFileSync(path.join(root, 'demo/tern-demo-bf16/tokenizer.json'), 'utf8'));
  assert.equal(tok.normalizer.type, 'NFC');
  let longest = 4;
  for (const t of Object.keys(tok.model.vocab)) longest = Math.max(longest, Buffer.byteLength(t));
  for (const t of tok.added_tokens) longest = Math.max(longest, Buffer.byteLength(t.content));
  const limit = CONTEXT * longest * 3;
  const prompt = 'abc '.repeat(Math.ceil((limit + 1) / 4));
  for (const [target, body, param] of [
    ['/v1/completions', { model: MODEL, prompt, max_tokens: 1 }, 'prompt'],
    ['/v1/chat/completions', { model: MODEL, max_tokens: 1, messages: [{ role: 'user', content: prompt }] }, 'messages'],
  ]) {
    const r = only((await exchange(post(target, body, { Connection: 'close' }))).raw);
    assert.equal(r.status, 400);
    assert.equal(r.json.error.param, param);
    assert.equal(r.json.error.code, 'context_length_exceeded');
    assert.match(r.json.error.message, new RegExp(`holds at most ${limit} bytes`));
  }
});

test('a non-streamed request whose client left stops generating', async () => {
  const m0 = await metrics(server);
  const clients = [];
  for (let i = 0; i < 4; i++) {
    clients.push(exchange(post('/v1/completions', { model: MODEL, prompt: `story ${i}`, max_tokens: CONTEXT - 16,
                                                    ignore_eos: true, temperature: 0 }), { waitMs: 1000 }));
  }
  const left = await Promise.all(clients);  // each socket is closed after 1 s, before any answer
  for (const res of left) assert.equal(res.raw.length, 0, 'no answer within 1 s');
  // Run to max_tokens they take tens of seconds (41 s measured on a 2-core machine with a build running); the
  // server must end them within 5 s of their clients leaving.
  let m1 = await metrics(server);
  for (let i = 0; i < 50 && m1.tern_num_requests_running > 0; i++) {
    await sleep(100);
    m1 = await metrics(server);
  }
  assert.equal(m1.tern_num_requests_running, 0, 'ended within 5 s of their clients leaving');
  await sleep(1000);
  const m2 = await metrics(server);
  assert.equal(m2['tern_requests_total{outcome="abort"}'] - m0['tern_requests_total{outcome="abort"}'], 4);
  assert.equal(m2.tern_generation_tokens_total, m1.tern_generation_tokens_total, 'no token after they left');
  assert.ok(m1.tern_generation_tokens_total - m0.tern_generation_tokens_total < 4 * (CONTEXT - 16),
            'ended before their max_tokens');
});

test('pipelined requests are all answered, in order', async () => {
  const res = await exchange([head('GET', '/health') +
    post('/v1/completions', { model: MODEL, prompt: 'hello', max_tokens: 2, temperature: 0 }).toString('latin1') +
    head('GET', '/v1/models', { Connection: 'close' })]);
  const r = responses(res.raw);
  assert.deepEqual(r.map((x) => x.status), [200, 200, 200]);
  assert.equal(JSON.parse(r[0].body).status, 'ok');
  assert.equal(JSON.parse(r[1].body).object, 'text_completion');
  assert.equal(JSON.parse(r[2].body).data[0].id, MODEL);
  assert.ok(res.closed);
  // A request refused before its body was read ends the connection: the unread body is never taken for the next
  // request.
  const refused = await exchange([post('/v1/completions', { model: MODEL, prompt: 'x' }, { Authorization: 'Bearer no' })
    .toString('latin1') + head('GET', '/health')]);
  const rr = responses(refused.raw);
  assert.deepEqual(rr.map((x) => x.status), [401]);
  assert.equal(rr[0].headers.connection, 'close');
  assert.ok(refused.closed);
});

test('an HTTP/1.0 client gets its stream close-delimited, never chunked', async () => {
  const res = await exchange(post('/v1/chat/completions', { ...chatBody, stream: true, max_tokens: 6 }, {},
                                  'HTTP/1.0'));
  const r = responses(res.raw);
  assert.equal(r.length, 1);
  assert.equal(r[0].status, 200);
  assert.equal(r[0].headers['transfer-encoding'], undefined, 'no chunked encoding for HTTP/1.0');
  assert.equal(r[0].headers.connection, 'close');
  assert.ok(res.closed, 'the end of the stream is the end of the connection');
  const events = r[0].body.split('\n\n').filter((e) => e.length);
  assert.equal(events.at(-1), 'data: [DONE]');
  const chunks = events.slice(0, -1).map((e) => JSON.parse(e.replace(/^data: /, '')));
  assert.ok(chunks.length >= 2);
  for (const c of chunks) assert.equal(c.object, 'chat.completion.chunk');
  assert.ok(chunks.at(-1).choices[0].finish_reason, 'the last chunk finishes');
  // Not streamed, HTTP/1.0 is answered with a Content-Length as before.
  const plain = only((await exchange(post('/v1/chat/completions', chatBody, {}, 'HTTP/1.0'))).raw);
  assert.equal(plain.status, 200);
  assert.equal(plain.json.object, 'chat.completion');
});

// Every hostile request above was refused or ended without holding on to what it sent. The bound: the body limit
// (1 MiB) for each of the server's 24 connection threads' malloc arenas, plus 8 MiB for the engine's own buffers;
// far below what the classes above used to cost (a 64 MiB gzip bomb inflated into a string that doubles as it
// grows; ~55 bytes of tokenizer state per prompt byte).
test('memory is back near its idle size after the hostile requests', async () => {
  await waitIdle(server);
  const grown = rssKb() - idleRssKb;
  const bound = (THREADS * BODY_LIMIT + (8 << 20)) / 1024;
  assert.ok(grown < bound, `RSS grew by ${grown} kB from ${idleRssKb} kB idle (bound ${bound} kB)`);
});
