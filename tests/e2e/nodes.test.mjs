// End to end: the bundled demo model split over two tensor-parallel ranks in two `tern serve` processes ("nodes",
// --nnodes 2 over loopback, the CPU path): node 0 serves the API and runs rank 0, node 1 runs rank 1 for it. The
// greedy reply is transformers' (demo/eval.json, as in demo.test.mjs). Killing node 1 mid-stream ends that stream
// with an error, later requests get 503 and /health says unhealthy, and node 0 still answers and stops cleanly.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import net from 'node:net';
import { assertRankLossFailsTheStream, bin, demoReplies, startServer, stopServer } from './harness.mjs';

const KEY = 'sk-nodes-test';
const MODEL = 'tern-demo';
const reference = demoReplies();
const CITY = [{ role: 'user', content: 'Write a sentence about the city.' }];
const noThinking = { chat_template_kwargs: { enable_thinking: false } };
let server, worker, workerLog = '', workerExit;

async function freePort() {
  return new Promise((resolve) => {
    const s = net.createServer();
    s.listen(0, '127.0.0.1', () => { const { port } = s.address(); s.close(() => resolve(port)); });
  });
}

before(async () => {
  const addr = `127.0.0.1:${await freePort()}`;
  const common = ['--device', 'cpu', '--context-length', '1024', '--tensor-parallel-size', '2', '--nnodes', '2',
                  '--dist-init-addr', addr, '--dist-timeout', '30'];
  worker = spawn(bin, ['serve', ...common, '--node-rank', '1'], { stdio: ['ignore', 'pipe', 'pipe'] });
  worker.stderr.on('data', (d) => { workerLog += d; });
  worker.stdout.on('data', (d) => { workerLog += d; });
  workerExit = new Promise((r) => worker.on('exit', (code, sig) => r({ code, sig })));
  server = await startServer(null, MODEL, KEY, [...common, '--node-rank', '0']);
});

after(async () => {
  if (worker.exitCode === null && worker.signalCode === null) worker.kill('SIGKILL');
  await stopServer(server);
});

const chat = (messages, extra = {}) => server.client.chat.completions.create({ model: MODEL, messages,
                                                                                 temperature: 0, ...extra });

test('two nodes give transformers\' greedy reply', async () => {
  assert.match(server.log(), /running on 2 tensor-parallel ranks on 2 nodes/);
  assert.match(workerLog, /node 1 of 2: running ranks 1\.\.1 of 2/);
  const r = await chat(CITY, { max_tokens: 96, ...noThinking });
  assert.equal(r.choices[0].finish_reason, 'stop');
  assert.equal(r.choices[0].message.content, reference['enable_thinking=False'].replace(/<\|im_end\|>$/, ''));
});

test('node 1 killed mid-stream: the stream fails, /health is unhealthy, node 0 keeps answering', async () => {
  await assertRankLossFailsTheStream(server, { model: MODEL, messages: CITY, ...noThinking }, async () => {
    worker.kill('SIGKILL');
    const { sig } = await workerExit;
    assert.equal(sig, 'SIGKILL');
  });
});
