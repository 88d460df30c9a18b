// Writes tests/data/tokenizer/corpus.json: strings chosen to stress every stage of a Hugging Face tokenizer
// (scripts, whitespace kinds, digits, emoji sequences, combining marks, special tokens, pathological lengths).
// Usage: node tools/tokenizer_golden/make_corpus.mjs
import { writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const root = join(dirname(fileURLToPath(import.meta.url)), '..', '..');

// A small deterministic generator so the corpus is reproducible.
let seed = 12345;
function rand(n) {
  seed = (seed * 1103515245 + 12345) % 2147483648;
  return seed % n;
}

const base = [
  '', ' ', '  ', 'a', 'Hello', 'Hello world', 'Hello, world!', ' Hello world ', 'hello   world',
  "I'm here, you're there, he's gone, we've been, they'll go, I'd say",
  "I'M HERE, YOU'RE THERE, HE'S GONE, WE'VE BEEN, THEY'LL GO, I'D SAY",
  "It'S mIxEd: dOn'T wOn'T cAn'T sHe'Ll",
  "rock 'n' roll ''quoted'' 'single' ' s 't",
  'The quick brown fox jumps over the lazy dog.',
  'THE QUICK BROWN FOX', 'camelCaseIdentifier PascalCase snake_case SCREAMING_CASE kebab-case',
  'Café naïve résumé façade coöperate Ångström Øresund Straße œuvre',
  'Cafe\u0301 nai\u0308ve re\u0301sume\u0301 A\u030angstro\u0308m',
  'e\u0301\u0302\u0303\u0304 a\u0300\u0300\u0300 \u0301 starts with a combining mark',
  'Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a\u032f\u031e\u0320\u034dA\u036b\u0357\u0334\u0362\u0335\u031c\u0330\u0354L\u0368\u0367\u0369\u0358\u0320G\u0311\u0357\u030e\u0305\u035b\u0341\u0334\u033b\u0348\u034d\u0354\u0339O\u0342\u030c\u030c\u0358\u0328\u0335\u0339\u033b\u031d\u0333',
  'Привет, мир! Съешь же ещё этих мягких французских булок.',
  'Γειά σου Κόσμε! Ξεσκεπάζω την ψυχοφθόρα βδελυγμία. ς σ Σ',
  'مرحبا بالعالم! هذا نص عربي مع أرقام ١٢٣٤٥٦٧٨٩٠.',
  'שלום עולם! זהו טקסט בעברית.',
  'नमस्ते दुनिया! यह हिंदी पाठ है। क्षत्रिय',
  'สวัสดีชาวโลก นี่คือข้อความภาษาไทย',
  '你好，世界！这是中文文本。我爱北京天安门。',
  '繁體中文測試：臺灣、香港。',
  'こんにちは世界！これは日本語のテキストです。カタカナ、ひらがな、漢字。',
  'ｶﾀｶﾅ ﾊﾝｶｸ　全角スペース　ＡＢＣ１２３',
  '안녕하세요 세계! 이것은 한국어 텍스트입니다.',
  '\u1100\u1161\u11a8 decomposed hangul jamo \u110b\u1161\u11ab',
  'Tiếng Việt có dấu: Trường Đại học Bách khoa',
  'Türkçe: İstanbul ıĞüŞöÇ İI ıi',
  'ﬁﬂ ligatures ﬀ ℌℍ ① ⅻ ㎏ ™ ½ ²³ ﬃ',
  '𝐀𝐁𝐂 𝕏𝕐 mathematical alphanumerics 𝟘𝟙𝟚',
  '😀 😃 😄 😁 😆 😅 😂 🤣',
  '👨‍👩‍👧‍👦 family 👩🏽‍💻 technologist 🏳️‍🌈 flag 👍🏻👍🏼👍🏽👍🏾👍🏿',
  '🇺🇸🇫🇷🇯🇵 flags ❤️ ✔️ ☺︎ keycap 1️⃣ #️⃣',
  '🧑‍🤝‍🧑🫶🏼🫠',
  '\t', '\n', '\r\n', '\n\n\n', '\t\t\ttabs\tinside\t', 'line1\nline2\r\nline3\rline4',
  'a\n\n\nb', 'trailing spaces   ', '   leading spaces', 'a \n b \n\n c', '  \n  \n', ' \t \n \r ',
  'nbsp\u00a0here\u00a0\u00a0twice', 'ideographic\u3000space\u3000\u3000', 'line\u2028separator\u2029para',
  'next\u0085line', 'vertical\u000btab\u000cformfeed', 'zero\u200bwidth\u200bspace\u200c\u200d\u2060joiner',
  'en\u2002em\u2003thin\u2009hair\u200a', '\ufeffBOM at start', 'mixed \u00a0\t\u3000 \n run',
  '0', '7', '12', '123', '1234', '12345', '3.14159265358979323846', '1,234,567.89', '-42 +17 1e10 0x1F 0b1010',
  '2024-11-29T18:16:00Z', '+1 (555) 123-4567', '٣٤٥ ۱۲۳ १२३ ١٢٣٤', '１２３４５ fullwidth digits',
  'Version 3.10.12 vs 3.9.7', '$1,000,000 €500 £20 ¥1000 ₹100 ₿0.5',
  'def foo(x):\n    return x ** 2  # square\n',
  'int main(int argc, char** argv) {\n\tprintf("%d\\n", argc);\n\treturn 0;\n}\n',
  'fn main() { let v: Vec<u32> = (0..10).map(|x| x * x).collect(); println!("{:?}", v); }',
  'const f = async (a, b) => { await Promise.all([a(), b()]); return a?.b ?? null; };',
  '<html><body><div class="x" id=\'y\'>&nbsp;&amp;&lt;</div></body></html>',
  'SELECT * FROM users WHERE id = 42 AND name LIKE \'%o\\\'brien%\';',
  '{"key": "value", "list": [1, 2, 3], "nested": {"a": null, "b": true}}',
  '#!/bin/bash\nfor i in $(seq 1 10); do echo "$i"; done 2>&1 | tee /tmp/log.txt',
  'package main\n\nimport "fmt"\n\nfunc main() {\n\tfmt.Println("hi")\n}\n',
  '    indented with four\n        eight spaces\n',
  '\\n \\t \\\\ escaped backslashes \\u0041',
  'https://example.com/path/to/page?query=1&b=two#frag',
  'user@example.com, first.last+tag@sub.domain.org',
  '!!!???...,,,;;;:::---___===+++***&&&^^^%%%$$$###@@@',
  '((([[[{{{<<<>>>}}}]]])))', '~`|\\/"\'', '....', '---', '    ', '\u00a0', '\u3000',
  'a\u0000b', '\u0000', 'control\u0001\u0002\u0003\u001f\u007fchars',
  '\u00ad soft hyphen \u2011 non-breaking hyphen \u2013 en dash \u2014 em dash',
  '«guillemets» „Anführungszeichen“ “curly” ‘quotes’ ‹›',
  '\ufffd replacement char \ufffd\ufffd', '\uffff\ufffe noncharacters', '\ue000 private use \udb80\udc00',
  'Ⅰ Ⅱ Ⅲ Ⅳ roman numerals ⅰ ⅱ', '½ ¾ ⅓ vulgar fractions', '° ± × ÷ ∞ ≠ ≤ ≥ √ ∑ ∫ π',
  'ÀÁÂÃÄÅ àáâãäå ÈÉÊË ÌÍÎÏ Ñ ÒÓÔÕÖ ÙÚÛÜ Ýÿ',
  'Mixed中文and英文text混合', 'русский English 中文 日本語 한국어 عربي',
  'word-with-hyphens and_underscores and.dots and/slashes',
  'ALLCAPS lowercase Titlecase mIxEdCaSe ǅ ǈ ǋ titlecase digraphs',
  '<s> </s> <unk> <pad> [CLS] [SEP] [MASK]',
];

// Each tokenizer's own special and added tokens, in and around text.
const specials = [
  '<|im_start|>user\nhi<|im_end|>', '<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n',
  '<|endoftext|>', 'text<|endoftext|>more', '<|im_start|><|im_end|><|im_start|>',
  '<think>\nreasoning here\n</think>\n\nanswer', '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
  '<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>', ' <|im_start|> spaced <|im_end|> ',
  '<|im_start', 'im_start|>', '<|im_start|<|im_end|>>', '<<|im_end|>>',
  '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>',
  '<|begin_of_text|>', '<|reserved_special_token_5|>x<|reserved_special_token_250|>', '<|python_tag|>print(1)<|eom_id|>',
  '<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜>Hello<｜end▁of▁sentence｜>',
  '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
  '<｜fim▁begin｜>a<｜fim▁hole｜>b<｜fim▁end｜>', '<|EOT|>', 'x<｜User｜>y',
  '<|startoftext|><|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final<|message|>Hello<|return|>',
  '<|start|>assistant<|channel|>analysis<|message|>think<|end|><|call|><|constrain|>json',
  '<|endofprompt|>', '<|reserved_200000|>',
  // Added tokens of the synthetic tokenizers (lstrip / rstrip / single_word / normalized).
  'a   <mask>   b', '<mask>', 'x<mask>y', '[WORD] [WORD]x x[WORD] _[WORD]_ é[WORD]', 'HELLO Hello hello <Raw> <raw>',
  'call <tool>   {"a": 1}', 'one <sep> two\t<sep>', 'word words sword word. (word)', '<s>text</s>',
  'snake-case-words: co-op; A:B;C ABC||DEF||', 'UPPER lower MiXeD 123abc456',
];

const strings = [...base, ...specials];

// Generated stress strings.
strings.push('a'.repeat(3000));
strings.push('abc'.repeat(1500));
strings.push('x' + ' '.repeat(2000) + 'y');
strings.push('\n'.repeat(500));
strings.push('9'.repeat(2000));
strings.push('1234567890'.repeat(100));
strings.push('中'.repeat(1200));
strings.push('🤗'.repeat(600));
strings.push('e\u0301'.repeat(500));
strings.push('supercalifragilisticexpialidocious'.repeat(80));
strings.push('Ab'.repeat(1000));
strings.push('!?'.repeat(800));
strings.push(Array.from({ length: 400 }, (_, i) => i).join(' '));
strings.push(Array.from({ length: 300 }, (_, i) => String.fromCodePoint(0x4e00 + i * 7)).join(''));

// Random mixtures of fragments from the strings above, so boundaries between scripts get exercised.
const pieces = [...base.filter((s) => s.length > 0), ...specials];
for (let i = 0; i < 60; ++i) {
  const n = 2 + rand(5);
  let s = '';
  for (let j = 0; j < n; ++j) {
    const p = pieces[rand(pieces.length)];
    const cut = rand(p.length + 1);
    s += rand(2) ? p.slice(0, cut) : p.slice(cut);
    s += ['', ' ', '\n', '  ', '\t', '\u00a0'][rand(6)];
  }
  strings.push(s);
}

// Random code points from many blocks (surrogates excluded), to catch class and normalisation mismatches.
const blocks = [[0x20, 0x7e], [0xa0, 0x24f], [0x300, 0x36f], [0x370, 0x52f], [0x590, 0x6ff], [0x900, 0xdff],
  [0xe00, 0xeff], [0x1100, 0x11ff], [0x1e00, 0x1fff], [0x2000, 0x2bff], [0x3000, 0x30ff], [0x3400, 0x4dbf],
  [0xac00, 0xd7a3], [0xf900, 0xfaff], [0xfb00, 0xfffd], [0x10000, 0x1ffff], [0x20000, 0x2a6df], [0xe0000, 0xe007f]];
for (let i = 0; i < 40; ++i) {
  let s = '';
  const n = 5 + rand(40);
  for (let j = 0; j < n; ++j) {
    const [lo, hi] = blocks[rand(blocks.length)];
    s += String.fromCodePoint(lo + rand(hi - lo + 1));
  }
  strings.push(s);
}

// Surrogate halves cannot be encoded as UTF-8; drop any string holding one.
const valid = strings.filter((s) => !/[\ud800-\udbff](?![\udc00-\udfff])|(?<![\ud800-\udbff])[\udc00-\udfff]/.test(s));
writeFileSync(join(root, 'tests/data/tokenizer/corpus.json'), JSON.stringify(valid, null, 0) + '\n');
console.log(`corpus: ${valid.length} strings`);
