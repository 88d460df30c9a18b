// End to end: the quickstart path. `tern serve` without --model serves the bundled demo model (demo/), and the npm
// openai client gets English text, reasoning_content and tool_calls from it, streamed and not, the same at
// temperature 0 on every run. The expected replies are transformers' own greedy replies to the same chats
// (demo/eval.json's sample_replies, written by tools/train_demo.py from the exported checkpoint in fp32): tern's
// CPU path computes in fp32 too, so its greedy tokens are transformers'. Run: TERN_BIN=... node --test tests/e2e/
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { demoReplies, metrics, startServer, stopServer } from './harness.mjs';

const KEY = 'sk-demo-test';
const MODEL = 'tern-demo';
const reference = demoReplies();
// The chats tools/train_demo.py's sample_replies sent, and its tool.
const TOOLS = [{ type: 'function', function: { name: 'lookup_word',
  description: 'Looks a word up in the corpus and returns a sentence that uses it.',
  parameters: { type: 'object', properties: { word: { type: 'string', description: 'the word' } },
                required: ['word'] } } }];
const STORY = [{ role: 'user', content: 'Continue the story: The old man walked down to the river.' }];
const CITY = [{ role: 'user', content: 'Write a sentence about the city.' }];
const LOOKUP = [{ role: 'user', content: 'Look up the word "church".' }];
const noThinking = { chat_template_kwargs: { enable_thinking: false } };
// More `tern serve` flags for the whole suite (ctest's e2e.demo_mtp runs it with speculative decoding: the demo's MTP
// layer drafts, and every greedy reply must still be transformers').
const extraArgs = (process.env.TERN_E2E_SERVE_ARGS ?? '').split(' ').filter(Boolean);
const speculative = extraArgs.includes('--speculative-algorithm');
let server;

before(async () => {
  server = await startServer(null, MODEL, KEY, ['--device', 'cpu', '--context-length', '1024', ...extraArgs]);
});

after(async () => {
  await stopServer(server);
});

const chat = (messages, extra = {}) => server.client.chat.completions.create({ model: MODEL, messages,
                                                                                 temperature: 0, ...extra });
// Split as a reasoning parser splits the reply: before and after </think>, the newlines around it dropped.
const thought = (reply) => reply.split('</think>')[0].replace(/\n+$/, '');
const answer = (reply) => reply.split('</think>').slice(1).join('</think>').replace(/^\n+/, '');

test('without --model the server says it serves the demo model', () => {
  assert.match(server.log(), /no --model given: serving the demo model .*demo\/tern-demo-bf16/);
});

test('a chat completion returns English text, transformers\' greedy reply', async () => {
  const r = await chat(CITY, { max_tokens: 96, ...noThinking });
  const content = r.choices[0].message.content;
  assert.equal(r.choices[0].finish_reason, 'stop');
  assert.equal(content, reference['enable_thinking=False'].replace(/<\|im_end\|>$/, ''));
  const words = content.split(/[^A-Za-z]+/).filter((w) => w.length > 0);
  assert.ok(words.length >= 4, content);
  assert.ok(words.some((w) => ['the', 'of', 'a', 'was', 'and', 'to', 'in'].includes(w.toLowerCase())), content);
  assert.ok([...content].every((c) => c.charCodeAt(0) < 128), 'ASCII: ' + content);
});

test('generation is deterministic at temperature 0, and streaming gives the same text', async () => {
  const a = await chat(CITY, { max_tokens: 96, ...noThinking });
  const b = await chat(CITY, { max_tokens: 96, ...noThinking });
  assert.equal(a.choices[0].message.content, b.choices[0].message.content);
  let streamed = '';
  const stream = await chat(CITY, { max_tokens: 96, ...noThinking, stream: true });
  for await (const chunk of stream) streamed += chunk.choices[0]?.delta?.content ?? '';
  assert.equal(streamed, a.choices[0].message.content);
});

test('a thinking reply comes back as reasoning_content and content', async () => {
  const ref = reference.thinking;  // 96 new tokens, cut off by the length limit
  const r = await chat(STORY, { max_tokens: 96 });
  const m = r.choices[0].message;
  assert.equal(r.choices[0].finish_reason, 'length');
  assert.equal(m.reasoning_content.replace(/\n+$/, ''), thought(ref));
  assert.equal(m.content, answer(ref));
});

test('a tools request comes back as a parsed tool call', async () => {
  const ref = reference.tools;
  const word = ref.match(/<parameter=word>\n([^\n]*)\n<\/parameter>/)[1];
  for (const stream of [false, true]) {
    let call, finish, reasoning = '';
    if (!stream) {
      const r = await chat(LOOKUP, { max_tokens: 96, tools: TOOLS });
      call = r.choices[0].message.tool_calls?.[0];
      finish = r.choices[0].finish_reason;
      reasoning = r.choices[0].message.reasoning_content;
    } else {
      const s = await chat(LOOKUP, { max_tokens: 96, tools: TOOLS, stream: true });
      let name = '', args = '';
      for await (const chunk of s) {
        const c = chunk.choices[0];
        if (!c) continue;
        reasoning += c.delta?.reasoning_content ?? '';
        for (const t of c.delta?.tool_calls ?? []) {
          name += t.function?.name ?? '';
          args += t.function?.arguments ?? '';
        }
        finish = c.finish_reason ?? finish;
      }
      call = { type: 'function', function: { name, arguments: args } };
    }
    assert.equal(finish, 'tool_calls', `stream=${stream}`);
    assert.equal(call.function.name, 'lookup_word');
    assert.deepEqual(JSON.parse(call.function.arguments), { word });
    assert.equal(reasoning.replace(/\n+$/, ''), thought(ref));
  }
});

test('a text completion continues a prompt in English, the same streamed and not', async () => {
  const req = { model: MODEL, prompt: 'The old man walked down to the river and', max_tokens: 24, temperature: 0 };
  const a = await server.client.completions.create(req);
  const b = await server.client.completions.create(req);
  const text = a.choices[0].text;
  assert.equal(text, b.choices[0].text);
  assert.equal(a.usage.completion_tokens, 24);
  const words = text.split(/[^A-Za-z]+/).filter((w) => w.length > 0);
  assert.ok(words.length >= 4 && [...text].every((c) => c.charCodeAt(0) < 128), text);
  let streamed = '';
  for await (const chunk of await server.client.completions.create({ ...req, stream: true })) {
    streamed += chunk.choices[0]?.text ?? '';
  }
  assert.equal(streamed, text);
});

// vLLM's min_tokens, with --speculative-algorithm too (each row of a verification that crosses it is banned or not by
// its own output): the EOS <|im_end|> (4085) pushed to the top by a +100 bias ends a completion at once, and with
// min_tokens 5 after five other tokens ("stop" both times; the EOS counts as a completion token).
test('min_tokens holds off the EOS', async () => {
  const req = { model: MODEL, prompt: 'The old man walked down to the river.', max_tokens: 12, temperature: 0,
                logit_bias: { 4085: 100 } };
  const atOnce = await server.client.completions.create(req);
  assert.equal(atOnce.choices[0].finish_reason, 'stop');
  assert.equal(atOnce.usage.completion_tokens, 1);
  const held = await server.client.completions.create({ ...req, min_tokens: 5 });
  assert.equal(held.choices[0].finish_reason, 'stop');
  assert.equal(held.usage.completion_tokens, 6);
  assert.notEqual(held.choices[0].text, '');
});

test('with --speculative-algorithm, drafts are verified and accepted, and /metrics counts them', { skip: !speculative },
     async () => {
  assert.match(server.log(), /speculative decoding: the model's MTP layer drafts \d+ tokens per step/);
  await chat(CITY, { max_tokens: 48, ...noThinking });
  const m = await metrics(server);
  const steps = m.tern_spec_verify_steps_total, drafted = m.tern_spec_draft_tokens_total,
        accepted = m.tern_spec_accepted_tokens_total;
  assert.ok(steps > 0 && drafted > 0, JSON.stringify({ steps, drafted }));
  assert.ok(accepted > 0 && accepted < drafted, JSON.stringify({ accepted, drafted }));
  // By draft position: every verification checks a first draft, the positions add up to the totals.
  const at = (name, k) => m[`tern_spec_${name}_tokens_at_position_total{position="${k}"}`];
  const positions = [0, 1, 2, 3];
  assert.equal(at('draft', 0), steps);
  assert.equal(positions.reduce((sum, k) => sum + at('draft', k), 0), drafted);
  assert.equal(positions.reduce((sum, k) => sum + at('accepted', k), 0), accepted);
  assert.equal(at('draft', 3), 0, 'three draft steps were asked for');
  if (extraArgs.includes('--speculative-adaptive')) assert.match(server.log(), /verified only at the batch sizes/);
});
