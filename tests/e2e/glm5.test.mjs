// End to end: GLM-5 (model_type glm_moe_dsa) served by `tern serve` through the npm openai client, with GLM-5's chat
// template (tests/data/templates/glm-5-style.jinja), its reasoning split and its GLM-4.7 tool calls. Both servers run
// the tiny glm_moe_dsa fixture's architecture with the GLM-5 serving files of tests/data/glm5 (a GLM-style byte-level
// BPE tokenizer; generation_config.json lists <|endoftext|>, <|observation|> and <|user|> as eos, config.json only
// <|endoftext|>; tools/make_glm5_tokenizer.mjs). The expected values come from outside tern:
//  - the fixture itself (transformers' weights): completions of its reference prompts are transformers' greedy
//    continuations (tests/fixtures/glm_moe_dsa/reference.json) stopped at the first id generation_config.json lists,
//    as text from the Rust `tokenizers` library; a chat prompt is the Rust tokenization of Python Jinja2's render
//    (tests/data/templates/golden.json), and the chat reply is that prompt's completion, split at </think>.
//  - a steered checkpoint of the same architecture (harness.mjs steerableGlm) that, after the template's generation
//    prompt "<|assistant|><think>", writes reasoning, </think>, an answer, a GLM-4.7 tool call and <|observation|>:
//    the expected fields follow from those strings and the OpenAI API.
// Run: TERN_BIN=... node --test tests/e2e/
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import { glm5DataDir, glm5ModelDir, glmFixtureDir, root, rustTokenizer, startServer, steerableGlm, stopServer,
         streamChat, waitIdle } from './harness.mjs';

const KEY = 'sk-glm5-test';
const readJson = (f) => JSON.parse(fs.readFileSync(f, 'utf8'));
const reference = readJson(path.join(glmFixtureDir, 'reference.json'));
const fixtureConfig = readJson(path.join(glmFixtureDir, 'config.json'));
const EOS = readJson(path.join(glm5DataDir, 'generation_config.json')).eos_token_id;
const conversations = Object.fromEntries(readJson(path.join(root, 'tests/data/templates/conversations.json'))
  .map((c) => [c.name, c]));
const jinja2 = Object.fromEntries(readJson(path.join(root, 'tests/data/templates/golden.json'))
  .filter((c) => c.template === 'glm-5-style').map((c) => [c.conversation, c.text]));

// What the steered model writes after "<think>": each piece is tokenized alone (no token may repeat).
const REASONING = 'User wants a week.';
const ANSWER = 'Checking now!';
const CALL = ['<tool_call>', 'get_forecast', '<arg_key>', 'days', '</arg_key>', '<arg_value>', '7', '</arg_value>',
              '</tool_call>'];
const OUTPUT = ['<think>', REASONING, '</think>', ANSWER, ...CALL, '<|observation|>'];
const forecast = (daysType) => ({ type: 'function', function: { name: 'get_forecast', description: 'Weather forecast.',
  parameters: { type: 'object', properties: { days: { type: daysType } }, required: ['days'] } } });

let tok, fixture, steered, chainIds;
const dirs = [];

before(async () => {
  tok = await rustTokenizer(path.join(glm5DataDir, 'tokenizer.json'));
  assert.deepEqual(fixtureConfig.eos_token_id, 511, 'config.json lists only <|endoftext|>');
  assert.deepEqual(await tok.encode('<|endoftext|><|observation|><|user|>'), EOS);
  const fixtureDir = glm5ModelDir();
  const pieces = await Promise.all(OUTPUT.map((p) => tok.encode(p)));
  chainIds = pieces.flat();
  const steeredDir = glm5ModelDir({ tensors: steerableGlm([chainIds]), configEdit: { max_position_embeddings: 2048 } });
  dirs.push(fixtureDir, steeredDir);
  fixture = await startServer(fixtureDir, 'glm5-fixture', KEY, ['--device', 'cpu']);
  steered = await startServer(steeredDir, 'glm5-steered', KEY, ['--device', 'cpu', '--context-length', '1024',
                                                                 '--reasoning-parser', 'auto', '--tool-call-parser',
                                                                 'auto']);
});

after(async () => {
  await stopServer(fixture);
  await stopServer(steered);
  for (const d of dirs) fs.rmSync(d, { recursive: true, force: true });
});

// A conversation of conversations.json as an OpenAI client sends it: tool-call arguments as JSON strings.
const asRequest = (messages) => messages.map((m) => (m.tool_calls ? { ...m, tool_calls: m.tool_calls.map((c) => (
  { ...c, function: { ...c.function, arguments: JSON.stringify(c.function.arguments) } })) } : m));

// ---- The fixture with transformers' weights ----

test('completions of the reference prompts are transformers\' greedy tokens, stopped at generation_config\'s eos ids',
     async () => {
  let stopped = 0;
  for (const [i, prompt] of reference.prompts.entries()) {
    const continuation = reference.greedy[i].continuation;
    const cut = continuation.findIndex((id) => EOS.includes(id));
    const expected = cut < 0 ? continuation : continuation.slice(0, cut + 1);
    const r = await fixture.client.completions.create({ model: 'glm5-fixture', prompt, max_tokens: continuation.length,
                                                        temperature: 0 });
    assert.equal(r.choices[0].text, await tok.decode(expected, true), `prompt ${i}`);
    assert.equal(r.usage.completion_tokens, expected.length, `prompt ${i}`);
    assert.equal(r.choices[0].finish_reason, cut < 0 ? 'length' : 'stop', `prompt ${i}`);
    // Streamed, the same text (a character the last tokens leave incomplete ends it as U+FFFD, as in the decode).
    let streamed = '';
    const stream = await fixture.client.completions.create({ model: 'glm5-fixture', prompt, temperature: 0,
                                                             max_tokens: continuation.length, stream: true });
    for await (const c of stream) streamed += c.choices[0]?.text ?? '';
    assert.equal(streamed, r.choices[0].text, `prompt ${i}`);
    if (cut >= 0) {
      ++stopped;
      assert.notEqual(continuation[cut], fixtureConfig.eos_token_id, 'an id only generation_config.json lists');
      // ignore_eos: the whole continuation.
      const all = await fixture.client.completions.create({ model: 'glm5-fixture', prompt, temperature: 0,
                                                            max_tokens: continuation.length, ignore_eos: true });
      assert.equal(all.choices[0].text, await tok.decode(continuation, true));
      assert.equal(all.choices[0].finish_reason, 'length');
    }
  }
  assert.ok(stopped >= 1, 'a reference continuation holds an eos id of generation_config.json');
});

test('a chat prompt is Python Jinja2\'s render, tokenized as the Rust tokenizers library does', async () => {
  const conv = conversations.glm5_e2e_chat;
  const ids = await tok.encode(jinja2.glm5_e2e_chat);
  assert.ok(jinja2.glm5_e2e_chat.endsWith('<|assistant|><think>'));
  const chat = await fixture.client.chat.completions.create({ model: 'glm5-fixture', messages: conv.messages,
                                                              max_tokens: 16, temperature: 0,
                                                              separate_reasoning: false });
  assert.equal(chat.usage.prompt_tokens, ids.length);
  const completion = await fixture.client.completions.create({ model: 'glm5-fixture', prompt: ids, max_tokens: 16,
                                                               temperature: 0 });
  assert.equal(chat.choices[0].message.content, completion.choices[0].text);
  assert.equal(chat.choices[0].finish_reason, completion.choices[0].finish_reason);
  assert.equal(chat.usage.completion_tokens, completion.usage.completion_tokens);
});

test('the fixture\'s chat reply is split at </think>, streamed and not', async () => {
  const conv = conversations.glm5_e2e_chat;
  const ids = await tok.encode(jinja2.glm5_e2e_chat);
  const raw = (await fixture.client.completions.create({ model: 'glm5-fixture', prompt: ids, max_tokens: 24,
                                                         temperature: 0 })).choices[0].text;
  // The prompt opened the block: reasoning up to </think>, the answer after it, leading whitespace dropped.
  const end = raw.indexOf('</think>');
  const want = end < 0 ? { reasoning: raw.trimStart(), content: '' }
                       : { reasoning: raw.slice(0, end).trimStart(), content: raw.slice(end + 8).trimStart() };
  const req = { model: 'glm5-fixture', messages: conv.messages, max_tokens: 24, temperature: 0 };
  const r = await fixture.client.chat.completions.create(req);
  assert.equal(r.choices[0].message.reasoning_content ?? '', want.reasoning);
  assert.equal(r.choices[0].message.content, want.content);
  const s = await streamChat(fixture, req);
  assert.equal(s.reasoning, want.reasoning);
  assert.equal(s.content, want.content);
  assert.equal(s.finish, r.choices[0].finish_reason);
  assert.equal(s.usage.completion_tokens, r.usage.completion_tokens);
  await waitIdle(fixture);
});

// ---- The steered checkpoint ----

const ask = { model: 'glm5-steered', messages: [{ role: 'user', content: 'Forecast for a week, please.' }],
              max_tokens: 64, temperature: 0 };
const CALL_TEXT = CALL.join('');

test('the server picks the glm47 tool-call parser and the eos ids of both configs', () => {
  assert.match(steered.log(), /tool-call parser: glm47 \(auto\)/);
  assert.match(steered.log(), /end-of-sequence token ids \(config.json and generation_config.json\): 511, 502, 504/);
});

test('thinking output becomes reasoning_content; without tools the call stays text; <|observation|> ends it',
     async () => {
  const r = await steered.client.chat.completions.create(ask);
  const m = r.choices[0].message;
  assert.equal(m.reasoning_content, REASONING);
  assert.equal(m.content, ANSWER + CALL_TEXT);
  assert.equal(m.tool_calls, undefined);
  assert.equal(r.choices[0].finish_reason, 'stop');
  // Everything after the prompt's <think>, <|observation|> included.
  assert.equal(r.usage.completion_tokens, chainIds.length - 1);
});

test('a GLM-4.7 tool call becomes tool_calls, its value typed by the tool\'s schema', async () => {
  for (const [type, days] of [['integer', 7], ['string', '7'], ['number', 7]]) {
    const r = await steered.client.chat.completions.create({ ...ask, tools: [forecast(type)] });
    const m = r.choices[0].message;
    assert.equal(r.choices[0].finish_reason, 'tool_calls', type);
    assert.equal(m.reasoning_content, REASONING);
    assert.equal(m.content, ANSWER);
    assert.equal(m.tool_calls.length, 1);
    assert.equal(m.tool_calls[0].type, 'function');
    assert.ok(typeof m.tool_calls[0].id === 'string' && m.tool_calls[0].id.length > 0);
    assert.equal(m.tool_calls[0].function.name, 'get_forecast');
    assert.deepEqual(JSON.parse(m.tool_calls[0].function.arguments), { days }, type);
  }
});

test('streamed: reasoning deltas, then content, then one tool_calls delta', async () => {
  const s = await streamChat(steered, { ...ask, tools: [forecast('integer')] });
  assert.equal(s.reasoning, REASONING);
  assert.equal(s.content, ANSWER);
  assert.equal(s.finish, 'tool_calls');
  assert.equal(s.calls.length, 1);
  assert.equal(s.calls[0].type, 'function');
  assert.ok(typeof s.calls[0].id === 'string' && s.calls[0].id.length > 0);
  assert.equal(s.calls[0].function.name, 'get_forecast');
  assert.deepEqual(JSON.parse(s.calls[0].function.arguments), { days: 7 });
  assert.ok(s.deltas.filter((d) => d.reasoning_content).length > 1, 'reasoning is streamed, not sent at the end');
  const lastReasoning = s.deltas.findLastIndex((d) => d.reasoning_content);
  const firstContent = s.deltas.findIndex((d) => d.content);
  const call = s.deltas.findIndex((d) => d.tool_calls);
  assert.ok(lastReasoning < firstContent && firstContent < call, 'reasoning, answer, call in order');
  for (const d of s.deltas) {
    assert.ok(!/think>|tool_call>|arg_/.test((d.content ?? '') + (d.reasoning_content ?? '')), JSON.stringify(d));
  }
  assert.equal(s.usage.completion_tokens, chainIds.length - 1);
});

test('separate_reasoning false keeps the thinking in content; an unknown function stays text', async () => {
  const kept = await steered.client.chat.completions.create({ ...ask, tools: [forecast('integer')],
                                                              separate_reasoning: false });
  assert.equal(kept.choices[0].message.content, REASONING + '</think>' + ANSWER);
  assert.equal(kept.choices[0].message.tool_calls.length, 1);
  const other = { type: 'function', function: { name: 'get_time', parameters: { type: 'object', properties: {} } } };
  const s = await streamChat(steered, { ...ask, tools: [other] });
  assert.equal(s.content, ANSWER + CALL_TEXT);
  assert.equal(s.calls.length, 0);
  assert.equal(s.finish, 'stop');
});

test('a tool result sent back renders as Python Jinja2 renders it', async () => {
  const conv = conversations.glm5_e2e_tool_result;
  const ids = await tok.encode(jinja2.glm5_e2e_tool_result);
  const r = await steered.client.chat.completions.create({ ...ask, messages: asRequest(conv.messages),
                                                           tools: conv.tools });
  assert.equal(r.usage.prompt_tokens, ids.length);
  assert.equal(r.choices[0].message.reasoning_content, REASONING);
  assert.equal(r.choices[0].finish_reason, 'tool_calls');
  await waitIdle(steered);
});
