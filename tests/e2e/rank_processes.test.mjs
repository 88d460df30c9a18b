// End to end: the bundled demo model over two tensor-parallel ranks with `--distributed-executor-backend mp`, so
// `tern serve` starts rank 1 as a process of its own (the CPU path). The greedy reply is transformers' (demo/eval.json,
// as in demo.test.mjs). Killing the rank process mid-stream ends that stream with an error, later requests get 503
// and /health says unhealthy, and the server still answers and stops cleanly.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import { assertRankLossFailsTheStream, childProcesses, demoReplies, startServer, stopServer } from './harness.mjs';

const KEY = 'sk-rank-processes-test';
const MODEL = 'tern-demo';
const reference = demoReplies();
const CITY = [{ role: 'user', content: 'Write a sentence about the city.' }];
const noThinking = { chat_template_kwargs: { enable_thinking: false } };
let server;

function alive(pid) {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

before(async () => {
  server = await startServer(null, MODEL, KEY, ['--device', 'cpu', '--context-length', '1024',
                                                '--tensor-parallel-size', '2', '--distributed-executor-backend', 'mp',
                                                '--dist-timeout', '30']);
});

after(async () => {
  await stopServer(server);
});

const chat = (messages, extra = {}) => server.client.chat.completions.create({ model: MODEL, messages,
                                                                                 temperature: 0, ...extra });

test('two rank processes give transformers\' greedy reply', async () => {
  const ranks = childProcesses(server.proc.pid);
  assert.equal(ranks.length, 1, JSON.stringify(ranks));
  const args = ranks[0].args;
  assert.equal(args[args.indexOf('--node-rank') + 1], '1', args.join(' '));
  assert.equal(args[args.indexOf('--nnodes') + 1], '2', args.join(' '));
  const r = await chat(CITY, { max_tokens: 96, ...noThinking });
  assert.equal(r.choices[0].finish_reason, 'stop');
  assert.equal(r.choices[0].message.content, reference['enable_thinking=False'].replace(/<\|im_end\|>$/, ''));
});

test('the rank process killed mid-stream: the stream fails, /health is unhealthy, the server keeps answering',
     async () => {
  const [rank] = childProcesses(server.proc.pid);
  await assertRankLossFailsTheStream(server, { model: MODEL, messages: CITY, ...noThinking }, () => {
    process.kill(rank.pid, 'SIGKILL');
  });
  assert.ok(!alive(rank.pid) || fs.readFileSync(`/proc/${rank.pid}/stat`, 'utf8').split(' ')[2] === 'Z');
});
