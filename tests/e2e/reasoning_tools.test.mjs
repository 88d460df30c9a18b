// End to end: reasoning_content and tool_calls through the npm openai client, streamed and not. The model is a
// steerable checkpoint (harness.mjs) written by this test, over the real Qwen3 tokenizer and chat template: after a
// thinking prompt (which ends "<|im_start|>assistant\n") it greedily writes THINKING, and after a prompt with
// thinking off (which ends "</think>\n\n") it writes a Qwen3 JSON tool call. The expected fields follow from those
// strings and the OpenAI API, not from the server. Run: TERN_BIN=... node --test tests/e2e/
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import { QWEN3, steerableQwen3, tokenize, startServer, stopServer, streamChat, waitIdle } from './harness.mjs';

const KEY = 'sk-reasoning-test';
const MODEL = 'steered-qwen3';
const REASONING = 'The user greets me.';
const ANSWER = 'Hello there!';
const THINKING = ['<think>', REASONING, '</think>', ANSWER];
// Written so that no token repeats (each token has one successor): '":' then ' "' instead of a second '":"'.
const CALL_JSON = ['{"name":"get_weather","arguments":{"city":', ' "Paris"}}'];
const TOOL_CALL = ['<tool_call>', ...CALL_JSON, '</tool_call>'];
const WEATHER = { type: 'function', function: { name: 'get_weather', description: 'Weather of a city',
  parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] } } };
let server, modelDir;

before(async () => {
  assert.deepEqual(tokenize('<think></think><tool_call></tool_call>'),
                   [QWEN3.think, QWEN3.thinkEnd, QWEN3.toolCall, QWEN3.toolCallEnd]);
  const chain = (promptEnd, pieces) => [tokenize(promptEnd).at(-1), ...pieces.flatMap((p) => tokenize(p)), QWEN3.imEnd];
  modelDir = steerableQwen3([chain('<|im_start|>assistant\n', THINKING),
                             chain('<think>\n\n</think>\n\n', TOOL_CALL)]);
  server = await startServer(modelDir, MODEL, KEY, ['--context-length', '512', '--reasoning-parser', 'auto',
                                                     '--tool-call-parser', 'auto']);
});

after(async () => {
  await stopServer(server);
  if (modelDir) fs.rmSync(modelDir, { recursive: true, force: true });
});

const chat = (extra = {}) => ({ model: MODEL, messages: [{ role: 'user', content: 'Hi! Weather in Paris?' }],
                                max_tokens: 64, temperature: 0, ...extra });
const noThinking = { chat_template_kwargs: { enable_thinking: false } };

test('thinking output is split into reasoning_content and content', async () => {
  const r = await server.client.chat.completions.create(chat());
  const m = r.choices[0].message;
  assert.equal(m.reasoning_content, REASONING);
  assert.equal(m.content, ANSWER);
  assert.equal(m.tool_calls, undefined);
  assert.equal(r.choices[0].finish_reason, 'stop');
  // <think>, the reasoning's tokens, </think>, the answer's tokens and <|im_end|>.
  assert.equal(r.usage.completion_tokens, THINKING.flatMap((p) => tokenize(p)).length + 1);
});

test('streamed thinking output gives reasoning_content deltas, then content deltas', async () => {
  const s = await streamChat(server, chat());
  assert.equal(s.reasoning, REASONING);
  assert.equal(s.content, ANSWER);
  assert.equal(s.finish, 'stop');
  assert.equal(s.calls.length, 0);
  const lastReasoning = s.deltas.findLastIndex((d) => d.reasoning_content);
  const firstContent = s.deltas.findIndex((d) => d.content);
  assert.ok(lastReasoning >= 0 && firstContent > lastReasoning, 'reasoning comes before the answer');
  assert.ok(s.deltas.filter((d) => d.reasoning_content).length > 1, 'reasoning is streamed, not sent at the end');
  assert.ok(s.deltas.every((d) => !(d.content ?? '').includes('think>')), 'no marker leaks into content');
  assert.equal(s.usage.completion_tokens, THINKING.flatMap((p) => tokenize(p)).length + 1);
});

test('separate_reasoning false keeps the thinking in content, streamed and not', async () => {
  const r = await server.client.chat.completions.create(chat({ separate_reasoning: false }));
  assert.equal(r.choices[0].message.content, THINKING.join(''));
  assert.equal(r.choices[0].message.reasoning_content, undefined);
  const s = await streamChat(server, chat({ separate_reasoning: false }));
  assert.equal(s.content, THINKING.join(''));
  assert.equal(s.reasoning, '');
});

test('a Qwen3 JSON tool call becomes tool_calls with finish_reason "tool_calls"', async () => {
  const r = await server.client.chat.completions.create(chat({ tools: [WEATHER], ...noThinking }));
  const m = r.choices[0].message;
  assert.equal(r.choices[0].finish_reason, 'tool_calls');
  assert.ok(m.content === null || m.content === '', `no text content: ${JSON.stringify(m.content)}`);
  assert.equal(m.reasoning_content, undefined);
  assert.equal(m.tool_calls.length, 1);
  const call = m.tool_calls[0];
  assert.equal(call.type, 'function');
  assert.equal(typeof call.id, 'string');
  assert.ok(call.id.length > 0);
  assert.equal(call.function.name, 'get_weather');
  assert.deepEqual(JSON.parse(call.function.arguments), { city: 'Paris' });
});

test('a streamed tool call arrives as tool_calls deltas with finish_reason "tool_calls"', async () => {
  const s = await streamChat(server, chat({ tools: [WEATHER], ...noThinking }));
  assert.equal(s.finish, 'tool_calls');
  assert.equal(s.content, '');
  assert.equal(s.reasoning, '');
  assert.equal(s.calls.length, 1);
  assert.equal(s.calls[0].type, 'function');
  assert.ok(typeof s.calls[0].id === 'string' && s.calls[0].id.length > 0);
  assert.equal(s.calls[0].function.name, 'get_weather');
  assert.deepEqual(JSON.parse(s.calls[0].function.arguments), { city: 'Paris' });
  assert.ok(s.deltas.every((d) => !(d.content ?? '').includes('tool_call')), 'no marker leaks into content');
});

test('a call to a function that was not offered stays text, streamed and not', async () => {
  const other = { type: 'function', function: { name: 'get_time', parameters: { type: 'object', properties: {} } } };
  const text = TOOL_CALL.join('');
  const r = await server.client.chat.completions.create(chat({ tools: [other], ...noThinking }));
  assert.equal(r.choices[0].message.content, text);
  assert.equal(r.choices[0].message.tool_calls, undefined);
  assert.equal(r.choices[0].finish_reason, 'stop');
  const s = await streamChat(server, chat({ tools: [other], ...noThinking }));
  assert.equal(s.content, text);
  assert.equal(s.calls.length, 0);
  assert.equal(s.finish, 'stop');
});

test('without tools in the request, tool-call markup is plain content', async () => {
  const r = await server.client.chat.completions.create(chat(noThinking));
  assert.equal(r.choices[0].message.content, TOOL_CALL.join(''));
  assert.equal(r.choices[0].finish_reason, 'stop');
  await waitIdle(server);
});
