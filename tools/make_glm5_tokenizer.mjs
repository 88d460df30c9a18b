// Writes the serving files of the tiny GLM-5 test model (tests/data/glm5/): a byte-level BPE tokenizer.json laid
// out like GLM-4.5/GLM-5's (the same pre-tokenizer regex and ByteLevel decoder, GLM's chat and tool-call tokens as
// added tokens), its tokenizer_config.json, and a generation_config.json whose eos_token_id lists <|endoftext|>,
// <|observation|> and <|user|>, as GLM-5's does. The model is tests/fixtures/glm_moe_dsa (vocabulary 512, eos 511,
// pad 510); tests/e2e/glm5.test.mjs serves it with these files and tests/data/templates/glm-5-style.jinja.
//
// Ids 0-255 are the 256 bytes (GPT-2's byte alphabet), 256-489 are 234 merges learned here from the text of the
// GLM-5 template (tests/data/templates/glm-5-style.jinja, whose tool instructions every tools prompt repeats), the
// first 80 texts of tests/data/tokenizer/corpus.json and the phrases of E2E_PHRASES, and 490-511 are the added
// tokens below. Their order is chosen, not GLM's:
// <|user|> sits at 504 so that the first transformers greedy continuation of the fixture (reference.json) contains
// it, which makes the served fixture stop there when the eos list of generation_config.json is honoured.
//
// Deterministic: no randomness, the same files on every run. Usage: node tools/make_glm5_tokenizer.mjs
import { mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const root = join(dirname(fileURLToPath(import.meta.url)), '..');
const out = join(root, 'tests/data/glm5');
const VOCAB = 512;

// [content, special]: special tokens are dropped by decode(skip_special_tokens); GLM's reasoning and tool-call
// markers are not special, so that they reach the reasoning and tool-call parsers.
const ADDED = [
  ['[MASK]', true], ['[gMASK]', true], ['[sMASK]', true], ['<sop>', true], ['<eop>', true],
  ['<think>', false], ['</think>', false], ['<tool_call>', false], ['</tool_call>', false],
  ['<tool_response>', false], ['</tool_response>', false], ['<|system|>', true], ['<|observation|>', true],
  ['<|assistant|>', true], ['<|user|>', true], ['<arg_key>', false], ['</arg_key>', false], ['<arg_value>', false],
  ['</arg_value>', false], ['/nothink', false], ['<|pad|>', true], ['<|endoftext|>', true],
];
const FIRST_ADDED = VOCAB - ADDED.length;  // 490
const id = (content) => FIRST_ADDED + ADDED.findIndex(([c]) => c === content);

// GLM-4.5's pre-tokenizer: this regex (Isolated), then ByteLevel without its own regex.
const SPLIT = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|" +
              '\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+';
// The same for training here (JavaScript has no inline (?i:...)): only the merges' choice depends on it.
const SPLIT_JS = new RegExp(SPLIT.replace("(?i:'s|'t|'re|'ve|'m|'ll|'d)", "'(?:[sStTmMdD]|[rR][eE]|[vV][eE]|[lL][lL])"),
                            'gu');

function byteAlphabet() {
  const map = [];
  let next = 256;
  for (let b = 0; b < 256; ++b) {
    const printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
    map.push(String.fromCodePoint(printable ? b : next++));
  }
  return map;
}

// What tests/e2e/glm5.test.mjs makes its steered model write. A model answers one token at a time from the last
// one, so no token may repeat in its output: these phrases weigh 40 times in training, which makes their words
// whole tokens, as common words are in GLM's real vocabulary.
const E2E_PHRASES = ['User wants a week.', 'Checking now!', 'get_forecast', 'days'];

function trainingTexts() {
  const template = readFileSync(join(root, 'tests/data/templates/glm-5-style.jinja'), 'utf8');
  const corpus = JSON.parse(readFileSync(join(root, 'tests/data/tokenizer/corpus.json'), 'utf8')).slice(0, 80);
  const markers = new RegExp(ADDED.map(([c]) => c.replace(/[[\]|/]/g, '\\$&')).join('|'), 'g');
  const texts = [template, ...corpus, ...Array(40).fill(E2E_PHRASES).flat()];
  return texts.flatMap((t) => t.split(markers)).filter((t) => t.length > 0);
}

// Learns `n` merges, most frequent pair first (ties: the smaller pair in code-unit order).
function trainMerges(texts, bytes, n) {
  const counts = new Map();
  for (const text of texts) {
    for (const piece of text.match(SPLIT_JS) ?? []) counts.set(piece, (counts.get(piece) ?? 0) + 1);
  }
  const words = [...counts].map(([piece, count]) => ({ symbols: [...Buffer.from(piece, 'utf8')].map((b) => bytes[b]),
                                                         count }));
  const merges = [];
  for (let k = 0; k < n; ++k) {
    const pairs = new Map();
    for (const w of words) {
      for (let i = 0; i + 1 < w.symbols.length; ++i) {
        const key = w.symbols[i] + ' ' + w.symbols[i + 1];
        pairs.set(key, (pairs.get(key) ?? 0) + w.count);
      }
    }
    let best = null;
    for (const [key, c] of pairs) {
      if (best === null || c > pairs.get(best) || (c === pairs.get(best) && key < best)) best = key;
    }
    if (best === null) throw new Error(`only ${k} merges could be learned`);
    const [a, b] = best.split(' ');
    merges.push([a, b]);
    for (const w of words) {
      for (let i = 0; i + 1 < w.symbols.length; ++i) {
        if (w.symbols[i] === a && w.symbols[i + 1] === b) w.symbols.splice(i, 2, a + b);
      }
    }
  }
  return merges;
}

const bytes = byteAlphabet();
const merges = trainMerges(trainingTexts(), bytes, FIRST_ADDED - 256);
const vocab = {};
for (const t of [...bytes, ...merges.map(([a, b]) => a + b)]) {
  if (t in vocab) throw new Error(`merge result '${t}' repeats a token`);
  vocab[t] = Object.keys(vocab).length;
}
if (Object.keys(vocab).length !== FIRST_ADDED) throw new Error('vocabulary size');

const addedTokens = ADDED.map(([content, special], i) => ({ id: FIRST_ADDED + i, content, single_word: false,
                                                            lstrip: false, rstrip: false, normalized: false,
                                                            special }));
const tokenizer = {
  version: '1.0', truncation: null, padding: null,
  added_tokens: addedTokens,
  normalizer: null,
  pre_tokenizer: { type: 'Sequence', pretokenizers: [
    { type: 'Split', pattern: { Regex: SPLIT }, behavior: 'Isolated', invert: false },
    { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: false }] },
  post_processor: null,
  decoder: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true },
  model: { type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null, end_of_word_suffix: null,
           fuse_unk: false, byte_fallback: false, ignore_merges: false, vocab, merges },
};
const config = {
  added_tokens_decoder: Object.fromEntries(addedTokens.map(({ id: i, ...t }) => [String(i), t])),
  bos_token: null,
  clean_up_tokenization_spaces: false,
  do_lower_case: false,
  eos_token: '<|endoftext|>',
  extra_special_tokens: [],
  model_max_length: 202752,
  pad_token: '<|pad|>',
  padding_side: 'left',
  remove_space: false,
  tokenizer_class: 'PreTrainedTokenizerFast',
};
const generation = {
  _from_model_config: false,
  eos_token_id: [id('<|endoftext|>'), id('<|observation|>'), id('<|user|>')],
  pad_token_id: id('<|pad|>'),
  temperature: 1.0,
  top_p: 0.95,
};
if (generation.eos_token_id[0] !== 511 || generation.pad_token_id !== 510) throw new Error('the fixture says eos 511, pad 510');

mkdirSync(out, { recursive: true });
writeFileSync(join(out, 'tokenizer.json'), JSON.stringify(tokenizer, null, 1) + '\n');
writeFileSync(join(out, 'tokenizer_config.json'), JSON.stringify(config, null, 2) + '\n');
writeFileSync(join(out, 'generation_config.json'), JSON.stringify(generation, null, 2) + '\n');
console.log(`tests/data/glm5: ${FIRST_ADDED} BPE tokens (${merges.length} merges) + ${ADDED.length} added tokens; ` +
            `eos ${generation.eos_token_id.join(', ')}`);
