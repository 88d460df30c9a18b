// End to end: the bundled demo model over two tensor-parallel ranks with `--distributed-executor-backend mp
// --front-end`, so `tern serve` runs no rank itself and starts one process per rank (the CPU path). The greedy reply
// is transformers' (demo/eval.json, as in demo.test.mjs); a seeded sampled reply is the same as one process's
// (rank 0 draws with the front end's random stream). Killing the process holding rank 0 mid-stream ends that stream
// with an error, later requests get 503 and /health says unhealthy, and the server still answers and stops cleanly.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { assertRankLossFailsTheStream, childProcesses, demoReplies, startServer, stopServer } from './harness.mjs';

const KEY = 'sk-front-end-test';
const MODEL = 'tern-demo';
const reference = demoReplies();
const CITY = [{ role: 'user', content: 'Write a sentence about the city.' }];
const noThinking = { chat_template_kwargs: { enable_thinking: false } };
const SAMPLED = { temperature: 0.9, top_p: 0.95, seed: 4242, max_tokens: 24, ...noThinking };
let server, single;

const nodeRank = (p) => p.args[p.args.indexOf('--node-rank') + 1];

before(async () => {
  server = await startServer(null, MODEL, KEY, ['--device', 'cpu', '--context-length', '1024',
                                                '--tensor-parallel-size', '2', '--distributed-executor-backend', 'mp',
                                                '--front-end', '--dist-timeout', '30']);
  single = await startServer(null, MODEL, KEY, ['--device', 'cpu', '--context-length', '1024']);
});

after(async () => {
  await stopServer(server);
  await stopServer(single);
});

const chat = (s, messages, extra = {}) => s.client.chat.completions.create({ model: MODEL, messages, temperature: 0,
                                                                              ...extra });

test('a front end and two rank processes give transformers\' greedy reply', async () => {
  const ranks = childProcesses(server.proc.pid);
  assert.equal(ranks.length, 2, JSON.stringify(ranks));
  assert.deepEqual(ranks.map(nodeRank).sort(), ['1', '2']);
  for (const r of ranks) {
    assert.equal(r.args[r.args.indexOf('--nnodes') + 1], '3', r.args.join(' '));
    assert.ok(r.args.includes('--front-end'), r.args.join(' '));
  }
  const r = await chat(server, CITY, { max_tokens: 96, ...noThinking });
  assert.equal(r.choices[0].finish_reason, 'stop');
  assert.equal(r.choices[0].message.content, reference['enable_thinking=False'].replace(/<\|im_end\|>$/, ''));
});

test('a seeded sampled reply is the one process\'s', async () => {
  const want = await chat(single, CITY, SAMPLED);
  const got = await chat(server, CITY, SAMPLED);
  assert.equal(got.choices[0].message.content, want.choices[0].message.content);
  const greedy = await chat(single, CITY, { max_tokens: 24, ...noThinking });
  assert.notEqual(want.choices[0].message.content, greedy.choices[0].message.content,
                  'the sampled reply must differ from the greedy one, or the test shows nothing');
});

test('the process holding rank 0 killed mid-stream: the stream fails, /health is unhealthy, the server answers',
     async () => {
  const rank0 = childProcesses(server.proc.pid).find((p) => nodeRank(p) === '1');
  await assertRankLossFailsTheStream(server, { model: MODEL, messages: CITY, ...noThinking }, () => {
    process.kill(rank0.pid, 'SIGKILL');
  });
});
