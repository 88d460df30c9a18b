// End to end: a request whose logits go non-finite ends alone with finish_reason "error" and a message, while the
// requests batched with it, and those that reuse its KV blocks afterwards, get exactly their normal output.
// The model is a steerable checkpoint (harness.mjs) written by this test: from the prompt's last token "\n" it
// greedily spells ANSWER, so a normal request's output is known without running the model; the embedding row of
// the token " poison" is NaN, so any prompt holding it poisons its own attention and logits.
// Run: TERN_BIN=... node --test tests/e2e/nan_guard.test.mjs
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import { QWEN3, steerableQwen3, tokenize, startServer, stopServer, metrics, waitIdle, makeRandom } from './harness.mjs';

const KEY = 'sk-nan-test';
const MODEL = 'nan-guard';
const REASONING = 'Some thought.';
const CONTENT = 'The answer!';
const PIECES = ['<think>', REASONING, '</think>', CONTENT];
const ANSWER = PIECES.join('');
let server, modelDir, start, chain, POISON;

before(async () => {
  start = tokenize('<|im_start|>assistant\n').at(-1);
  const poison = tokenize(' poison');
  assert.equal(poison.length, 1);
  POISON = poison[0];
  chain = [start, ...PIECES.flatMap((p) => tokenize(p)), QWEN3.imEnd];
  modelDir = steerableQwen3([chain], { poison: [POISON] });
  // A small prefill budget so prompts are split into chunks and mixed with other requests' decodes.
  server = await startServer(modelDir, MODEL, KEY, ['--max-running-requests', '16', '--context-length', '256',
                                                     '--chunked-prefill-size', '24', '--max-total-tokens', '4096']);
});

after(async () => {
  await stopServer(server);
  if (modelDir) fs.rmSync(modelDir, { recursive: true, force: true });
});

// Token-id prompts of ordinary tokens (never the poison, never a chain token) ending in the chain's start.
const rand = makeRandom(11);
function prompt(length, { poisonAt = -1 } = {}) {
  const ids = [];
  while (ids.length < length - 1) {
    const id = 1000 + Math.floor(rand() * 40000);
    if (!chain.includes(id) && id !== POISON) ids.push(id);
  }
  if (poisonAt >= 0) ids[poisonAt] = POISON;
  return [...ids, start];
}

const completion = (ids) => ({ model: MODEL, prompt: ids, max_tokens: 40, temperature: 0 });

async function streamCompletion(ids) {
  const stream = await server.client.completions.create({ ...completion(ids), stream: true });
  let text = '', finish = null, error = null;
  try {
    for await (const c of stream) {
      text += c.choices[0]?.text ?? '';
      finish = c.choices[0]?.finish_reason ?? finish;
    }
  } catch (e) {
    error = e;
  }
  return { text, finish, error };
}

test('the steerable model answers a normal prompt with the chosen text', async () => {
  const r = await server.client.completions.create(completion(prompt(9)));
  assert.equal(r.choices[0].text, ANSWER);
  assert.equal(r.choices[0].finish_reason, 'stop');
  assert.equal(r.usage.completion_tokens, chain.length - 1);
});

test('a non-streamed request with a NaN embedding ends with finish_reason "error" and a message', async () => {
  const before = await metrics(server);
  const r = await server.client.completions.create(completion(prompt(12, { poisonAt: 4 })));
  assert.equal(r.choices[0].finish_reason, 'error');
  assert.equal(r.choices[0].text, '');
  assert.equal(r.usage.completion_tokens, 0);
  assert.match(r.error?.message ?? '', /NaN/, JSON.stringify(r));
  const m = await waitIdle(server);
  assert.equal(m.tern_nan_aborts_total - before.tern_nan_aborts_total, 1);
  assert.equal(m['tern_requests_total{outcome="error"}'] - before['tern_requests_total{outcome="error"}'], 1);
});

test('poisoned requests end alone; concurrent streams, and later ones on reused KV blocks, are exact', async () => {
  const before = await metrics(server);
  const normal = Array.from({ length: 8 }, (_, i) => prompt(6 + 5 * i));
  const poisoned = [prompt(30, { poisonAt: 0 }), prompt(20, { poisonAt: 17 }), prompt(45, { poisonAt: 30 })];
  const [streamed, whole, late] = await Promise.all([
    Promise.all([...normal, poisoned[0], poisoned[2]].map(streamCompletion)),
    server.client.completions.create(completion(poisoned[1])),
    // Admitted while the others run: its prefill lands in steps that also decode the poisoned requests.
    new Promise((r) => setTimeout(r, 20)).then(() => streamCompletion(prompt(17))),
  ]);
  for (let i = 0; i < normal.length; i++) {
    assert.equal(streamed[i].error, null, `normal request ${i}: ${streamed[i].error}`);
    assert.equal(streamed[i].text, ANSWER, `normal request ${i}`);
    assert.equal(streamed[i].finish, 'stop', `normal request ${i}`);
  }
  assert.equal(late.text, ANSWER);
  assert.equal(late.finish, 'stop');
  for (const p of streamed.slice(normal.length)) {
    assert.equal(p.text, '');
    assert.equal(p.finish, 'error', 'the stream ends with finish_reason "error"');
    assert.match(String(p.error?.message), /NaN/, 'the stream then carries the error message');
  }
  assert.equal(whole.choices[0].finish_reason, 'error');
  assert.match(whole.error?.message ?? '', /NaN/);

  const m = await waitIdle(server);
  const delta = (k) => m[k] - before[k];
  assert.equal(delta('tern_nan_aborts_total'), 3);
  assert.equal(delta('tern_requests_total{outcome="error"}'), 3);
  assert.equal(delta('tern_requests_total{outcome="stop"}'), normal.length + 1);
  assert.equal(delta('tern_generation_tokens_total'), (normal.length + 1) * (chain.length - 1));

  // The poisoned requests' KV blocks (NaN keys and values) are free again; requests that take them over must not
  // see any of it, also through the unused tail of a partly filled block.
  const after = await Promise.all(Array.from({ length: 12 }, (_, i) => streamCompletion(prompt(3 + 7 * i))));
  for (const [i, r] of after.entries()) {
    assert.equal(r.error, null, `request ${i} after the aborts: ${r.error}`);
    assert.equal(r.text, ANSWER, `request ${i} after the aborts`);
  }
  const end = await waitIdle(server);
  assert.equal(end.tern_nan_aborts_total, m.tern_nan_aborts_total);
  assert.equal(end.tern_kv_blocks_used, 0);
});

test('chat: a poisoned prompt fails alone, streamed and not, while chat streams beside it are exact', async () => {
  const before = await metrics(server);
  const chat = (text) => ({ model: MODEL, messages: [{ role: 'user', content: text }], max_tokens: 40,
                            temperature: 0 });
  const streamChat = async (text) => {
    const out = { content: '', reasoning: '', finish: null, error: null };
    try {
      for await (const c of await server.client.chat.completions.create({ ...chat(text), stream: true })) {
        out.content += c.choices[0]?.delta.content ?? '';
        out.reasoning += c.choices[0]?.delta.reasoning_content ?? '';
        out.finish = c.choices[0]?.finish_reason ?? out.finish;
      }
    } catch (e) {
      out.error = e;
    }
    return out;
  };
  const [good, bad, whole] = await Promise.all([
    Promise.all(['Tell me something.', 'What is two plus two?', 'Hello!'].map(streamChat)),
    streamChat('Do not drink the poison, please.'),
    server.client.chat.completions.create(chat('Is this poison?')),
  ]);
  for (const g of good) {
    assert.equal(g.error, null, String(g.error));
    assert.equal(g.reasoning, REASONING);
    assert.equal(g.content, CONTENT);
    assert.equal(g.finish, 'stop');
  }
  assert.equal(bad.content + bad.reasoning, '');
  assert.equal(bad.finish, 'error');
  assert.match(String(bad.error?.message), /NaN/);
  assert.equal(whole.choices[0].finish_reason, 'error');
  assert.equal(whole.usage.completion_tokens, 0);
  assert.match(whole.error?.message ?? '', /NaN/);
  const m = await waitIdle(server);
  assert.equal(m.tern_nan_aborts_total - before.tern_nan_aborts_total, 2);
  assert.equal(m['tern_requests_total{outcome="error"}'] - before['tern_requests_total{outcome="error"}'], 2);
  assert.equal(m['tern_requests_total{outcome="stop"}'] - before['tern_requests_total{outcome="stop"}'], 3);
});
