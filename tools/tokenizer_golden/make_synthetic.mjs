// Writes small synthetic tokenizer.json files (tests/data/tokenizer/synthetic_<name>.json) that exercise the
// components the four real tokenizers do not use (Metaspace, byte fallback, unk, normalizers, Digits,
// Punctuation, every Split behaviour, lstrip/rstrip/single_word added tokens, TemplateProcessing, decoders).
// The vocabularies come from a tiny BPE training run on the corpus. make_golden.mjs then records the reference
// outputs for them. Usage: node tools/tokenizer_golden/make_synthetic.mjs
import { readFileSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const root = join(dirname(fileURLToPath(import.meta.url)), '..', '..');
const corpus = JSON.parse(readFileSync(join(root, 'tests/data/tokenizer/corpus.json'), 'utf8'));
const training = corpus.slice(0, 120).filter((s) => s.length < 400);

// GPT-2 byte alphabet.
function byteAlphabet() {
  const map = [];
  let next = 256;
  for (let b = 0; b < 256; ++b) {
    const printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
    map.push(String.fromCodePoint(printable ? b : next++));
  }
  return map;
}

// Learns `n` merges over words given as arrays of symbols; returns [merges, new tokens].
function trainMerges(words, n) {
  const merges = [];
  const tokens = [];
  for (let k = 0; k < n; ++k) {
    const counts = new Map();
    for (const w of words) for (let i = 0; i + 1 < w.length; ++i) {
      const key = w[i] + '\u0000' + w[i + 1];
      counts.set(key, (counts.get(key) ?? 0) + 1);
    }
    let best = null, bestCount = 1;
    for (const [key, c] of counts) if (c > bestCount || (c === bestCount && best !== null && key < best)) { best = key; bestCount = c; }
    if (best === null) break;
    const [a, b] = best.split('\u0000');
    merges.push([a, b]);
    tokens.push(a + b);
    for (const w of words) for (let i = 0; i + 1 < w.length; ++i) if (w[i] === a && w[i + 1] === b) w.splice(i, 2, a + b);
  }
  return [merges, tokens];
}

function vocabFrom(list) {
  const vocab = {};
  for (const t of list) if (!(t in vocab)) vocab[t] = Object.keys(vocab).length;
  return vocab;
}

function bpe(vocab, merges, extra = {}) {
  return { type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null, end_of_word_suffix: null,
           fuse_unk: false, byte_fallback: false, ignore_merges: false, vocab, merges, ...extra };
}

function added(id, content, special, extra = {}) {
  return { id, content, single_word: false, lstrip: false, rstrip: false, normalized: !special, special, ...extra };
}

// 1. SentencePiece-style (Llama 2 / Mistral): Prepend + Replace normalizer, byte fallback, fused unk-free decode.
function metaspaceByteFallback() {
  const words = training.map((s) => Array.from('▁' + s.replaceAll(' ', '▁')));
  const alphabet = [...new Set(training.join('').replaceAll(' ', '▁'))].filter((c) => c.codePointAt(0) < 0x250 || c === '▁');
  const byteTokens = Array.from({ length: 256 }, (_, b) => `<0x${b.toString(16).toUpperCase().padStart(2, '0')}>`);
  const [merges, merged] = trainMerges(words.map((w) => w.filter((c) => alphabet.includes(c))), 300);
  const vocab = vocabFrom(['<unk>', '<s>', '</s>', ...byteTokens, ...alphabet, ...merged]);
  const n = Object.keys(vocab).length;
  return {
    version: '1.0', truncation: null, padding: null,
    added_tokens: [added(0, '<unk>', true), added(1, '<s>', true), added(2, '</s>', true),
                   added(n, '<mask>', false, { lstrip: true, rstrip: true, normalized: false }),
                   added(n + 1, '[WORD]', false, { single_word: true, normalized: false })],
    normalizer: { type: 'Sequence', normalizers: [{ type: 'Prepend', prepend: '▁' },
                                                  { type: 'Replace', pattern: { String: ' ' }, content: '▁' }] },
    pre_tokenizer: null,
    post_processor: { type: 'TemplateProcessing',
      single: [{ SpecialToken: { id: '<s>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
      pair: [{ SpecialToken: { id: '<s>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } },
             { SpecialToken: { id: '<s>', type_id: 1 } }, { Sequence: { id: 'B', type_id: 1 } }],
      special_tokens: { '<s>': { id: '<s>', ids: [1], tokens: ['<s>'] } } },
    decoder: { type: 'Sequence', decoders: [{ type: 'Replace', pattern: { String: '▁' }, content: ' ' },
                                            { type: 'ByteFallback' }, { type: 'Fuse' },
                                            { type: 'Strip', content: ' ', start: 1, stop: 0 }] },
    model: bpe(vocab, merges.map(([a, b]) => `${a} ${b}`), { unk_token: '<unk>', fuse_unk: true, byte_fallback: true }),
  };
}

// 2. Metaspace pre-tokenizer (prepend_scheme first) with NFKC + Lowercase, unknown characters as <unk>, and
//    normalized added tokens.
function metaspaceUnk() {
  const words = training.flatMap((s) => s.normalize('NFKC').toLowerCase().split(' ').map((w) => Array.from('▁' + w)));
  const alphabet = [...new Set(words.flat())].filter((c) => c.codePointAt(0) < 0x180);
  const [merges, merged] = trainMerges(words.map((w) => w.filter((c) => alphabet.includes(c))), 250);
  const vocab = vocabFrom(['<unk>', '<bos>', '<eos>', ...alphabet, ...merged]);
  const n = Object.keys(vocab).length;
  return {
    version: '1.0', truncation: null, padding: null,
    added_tokens: [added(0, '<unk>', true), added(1, '<bos>', true), added(2, '<eos>', true),
                   added(n, 'Hello', false, { normalized: true }), added(n + 1, '<Raw>', false, { normalized: false })],
    normalizer: { type: 'Sequence', normalizers: [{ type: 'NFKC' }, { type: 'Lowercase' },
                                                  { type: 'Replace', pattern: { Regex: '\\s{2,}' }, content: ' ' }] },
    pre_tokenizer: { type: 'Metaspace', replacement: '▁', prepend_scheme: 'first', split: true },
    post_processor: { type: 'TemplateProcessing',
      single: [{ SpecialToken: { id: '<bos>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } },
               { SpecialToken: { id: '<eos>', type_id: 0 } }],
      pair: [{ Sequence: { id: 'A', type_id: 0 } }, { Sequence: { id: 'B', type_id: 1 } }],
      special_tokens: { '<bos>': { id: '<bos>', ids: [1], tokens: ['<bos>'] },
                        '<eos>': { id: '<eos>', ids: [2], tokens: ['<eos>'] } } },
    decoder: { type: 'Metaspace', replacement: '▁', prepend_scheme: 'first', split: true },
    model: bpe(vocab, merges, { unk_token: '<unk>', fuse_unk: false }),
  };
}

// 3. Byte-level with every Split behaviour, Digits, Punctuation, NFD + mark removal, Strip, and ByteLevel's own
//    regex with add_prefix_space.
function byteLevelSplits() {
  const bytes = byteAlphabet();
  const words = training.flatMap((s) => s.split(/\s+/).map((w) => Array.from(Buffer.from(' ' + w, 'utf8')).map((b) => bytes[b])));
  const [merges, merged] = trainMerges(words, 300);
  const vocab = vocabFrom([...bytes, ...merged, '<bos>', '<eos>', '<sep>']);
  const n = Object.keys(vocab).length;
  const split = (pattern, behavior, invert = false) => ({ type: 'Split', pattern, behavior, invert });
  return {
    version: '1.0', truncation: null, padding: null,
    added_tokens: [added(vocab['<bos>'], '<bos>', true), added(vocab['<eos>'], '<eos>', true),
                   added(vocab['<sep>'], '<sep>', true, { lstrip: true }),
                   added(n, '<tool>', false, { rstrip: true, normalized: false }),
                   added(n + 1, 'word', false, { single_word: true, normalized: true })],
    normalizer: { type: 'Sequence', normalizers: [{ type: 'NFD' }, { type: 'Replace', pattern: { Regex: '\\p{Mn}' }, content: '' },
                                                  { type: 'Strip', strip_left: false, strip_right: true }] },
    pre_tokenizer: { type: 'Sequence', pretokenizers: [
      split({ String: '-' }, 'MergedWithPrevious'),
      split({ Regex: '[:;]' }, 'MergedWithNext'),
      split({ Regex: '[A-Z]+' }, 'Contiguous'),
      split({ String: '||' }, 'Removed'),
      split({ Regex: '\\p{L}+' }, 'Isolated', true),
      { type: 'Digits', individual_digits: true },
      { type: 'Punctuation', behavior: 'Isolated' },
      { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true }] },
    post_processor: { type: 'Sequence', processors: [
      { type: 'ByteLevel', add_prefix_space: true, trim_offsets: false, use_regex: true },
      { type: 'TemplateProcessing',
        single: [{ SpecialToken: { id: '<bos>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } },
                 { SpecialToken: { id: '<eos>', type_id: 0 } }],
        pair: [{ Sequence: { id: 'A', type_id: 0 } }, { Sequence: { id: 'B', type_id: 1 } }],
        special_tokens: { '<bos>': { id: '<bos>', ids: [vocab['<bos>']], tokens: ['<bos>'] },
                          '<eos>': { id: '<eos>', ids: [vocab['<eos>']], tokens: ['<eos>'] } } }] },
    decoder: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true },
    model: bpe(vocab, merges, { ignore_merges: true }),
  };
}

// 4. Whitespace / WhitespaceSplit / Digits (contiguous) with a Lowercase + NFKD normalizer and no decoder.
function whitespaceWords() {
  const words = training.flatMap((s) => s.normalize('NFKD').toLowerCase().split(/\s+/).map((w) => Array.from(w)));
  const alphabet = [...new Set(words.flat())].filter((c) => c.codePointAt(0) < 0x300);
  const [merges, merged] = trainMerges(words.map((w) => w.filter((c) => alphabet.includes(c))), 200);
  const vocab = vocabFrom(['[UNK]', '[CLS]', '[SEP]', ...alphabet, ...merged]);
  return {
    version: '1.0', truncation: null, padding: null,
    added_tokens: [added(0, '[UNK]', true), added(1, '[CLS]', true), added(2, '[SEP]', true)],
    normalizer: { type: 'Sequence', normalizers: [{ type: 'NFKD' }, { type: 'Lowercase' }] },
    pre_tokenizer: { type: 'Sequence', pretokenizers: [{ type: 'WhitespaceSplit' }, { type: 'Whitespace' },
                                                       { type: 'Digits', individual_digits: false }] },
    post_processor: { type: 'BertProcessing', sep: ['[SEP]', 2], cls: ['[CLS]', 1] },
    decoder: null,
    model: bpe(vocab, merges, { unk_token: '[UNK]', fuse_unk: true }),
  };
}

export const synthetic = {
  metaspace_byte_fallback: metaspaceByteFallback,
  metaspace_unk: metaspaceUnk,
  byte_level_splits: byteLevelSplits,
  whitespace_words: whitespaceWords,
};

for (const [name, make] of Object.entries(synthetic)) {
  const json = make();
  writeFileSync(join(root, `tests/data/tokenizer/synthetic_${name}.json`), JSON.stringify(json) + '\n');
  console.log(`synthetic_${name}: ${Object.keys(json.model.vocab).length} tokens, ${json.model.merges.length} merges`);
}
