#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora and dictionaries (scripts/fuzz.sh): ROOT OUT -> OUT/<name>/ files and
OUT/<name>.dict. Seeds are the inputs tern's own tests use: request bodies from the server's unit tests, the
fixtures' and benchmark configs, the synthetic tokenizers, the chat templates, and small valid safetensors files."""
import glob
import json
import os
import random
import re
import struct
import sys

root, out = sys.argv[1], sys.argv[2]


def write_corpus(name, seeds, tokens):
    os.makedirs(os.path.join(out, name), exist_ok=True)
    for i, data in enumerate(seeds):
        with open(os.path.join(out, name, "seed_%03d" % i), "wb") as f:
            f.write(data if isinstance(data, bytes) else data.encode())
    with open(os.path.join(out, name + ".dict"), "w") as f:
        for t in tokens:
            f.write("%s\n" % json.dumps(t))


def read(path):
    with open(path, "rb") as f:
        return f.read()


json_tokens = ["{", "}", "[", "]", ":", ",", "null", "true", "false", "-1", "0", "1.5", "1e308", "-0",
               "18446744073709551615", "9223372036854775808", '"\\u0000"', '"\\ud800"']

# safetensors headers: small valid files laid out as the reference writer does, plus a near miss.
sizes = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1,
         "U8": 1, "I8": 1, "I16": 2, "I32": 4, "I64": 8, "BOOL": 1}
rng = random.Random(1)


def safetensors(tensors, metadata=None, pad=True):
    header, offset, data = {}, 0, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape in tensors:
        n = sizes[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        data += bytes(rng.randrange(1, 256) for _ in range(n))
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


write_corpus("safetensors_header", [
    safetensors([]), safetensors([], {"format": "pt"}), safetensors([("s", "F32", [])]),
    safetensors([("z", "BF16", [0, 4]), ("w", "U8", [3])]), safetensors([("test", "I32", [2, 2])], pad=False),
    safetensors([("t." + d, d, [2, 3]) for d in sizes], {"a": "b", "c": "d"}),
    safetensors([("model.layers.%d.weight" % i, "BF16", [4, 2]) for i in range(4)]),
    struct.pack("<Q", 96) + b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
    b'"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}'.ljust(96) + b"xyz",
], json_tokens + ['"dtype"', '"shape"', '"data_offsets"', '"__metadata__"'] + ['"%s"' % d for d in sizes])

# OpenAI requests: every raw-string body of the server's unit tests, and the e2e tests' shapes.
test_src = read(os.path.join(root, "src/server/openai_request_test.cc")).decode()
bodies = [b for b in re.findall(r'R"\((.*?)\)"', test_src, re.S)]
bodies += [json.dumps(b) for b in [
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0},
    {"model": "m", "prompt": "hello", "max_tokens": 4, "echo": True, "logprobs": 2, "stop": ["\n", "END"]},
    {"model": "m", "prompt": [1, 2, 3], "ignore_eos": True, "min_p": 0.1, "repetition_penalty": 1.1},
    {"model": "m", "messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
     "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}, {"role": "tool", "tool_call_id": "c", "content": "1"}],
     "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
     "tool_choice": {"type": "function", "function": {"name": "f"}}, "separate_reasoning": False},
]]
write_corpus("openai_request", bodies, json_tokens + [
    '"model"', '"messages"', '"prompt"', '"role"', '"content"', '"user"', '"system"', '"assistant"', '"tool"',
    '"max_tokens"', '"max_completion_tokens"', '"temperature"', '"top_p"', '"top_k"', '"min_p"', '"seed"', '"n"',
    '"stop"', '"stop_token_ids"', '"stream"', '"stream_options"', '"include_usage"', '"logprobs"', '"top_logprobs"',
    '"echo"', '"tools"', '"tool_choice"', '"tool_calls"', '"function"', '"arguments"', '"parameters"', '"name"',
    '"chat_template_kwargs"', '"presence_penalty"', '"frequency_penalty"', '"repetition_penalty"', '"ignore_eos"',
    '"skip_special_tokens"', '"type"', '"text"', '"none"', '"auto"', '"required"', '"reasoning_content"'])

# config.json: the fixtures', the benchmark models' and the demo's.
configs = sorted(glob.glob(os.path.join(root, "tests/fixtures/*/config.json")) +
                 glob.glob(os.path.join(root, "bench/configs/*/config.json")) +
                 glob.glob(os.path.join(root, "demo/*/config.json")))
keys = set()
for c in configs:
    keys.update(re.findall(r'"([a-z_0-9]+)"\s*:', read(c).decode()))
write_corpus("model_config", [read(c) for c in configs], json_tokens + ['"%s"' % k for k in sorted(keys)])

# tokenizer.json: the synthetic tokenizers of the tokenizer tests (the real ones are megabytes).
tokenizers = sorted(glob.glob(os.path.join(root, "tests/data/tokenizer/synthetic_*.json")))
write_corpus("tokenizer_load", [read(t) for t in tokenizers], json_tokens + ['"%s"' % t for t in [
    "type", "model", "vocab", "merges", "normalizer", "pre_tokenizer", "decoder", "post_processor", "added_tokens",
    "normalizers", "pretokenizers", "decoders", "Sequence", "NFC", "NFKC", "NFD", "NFKD", "Lowercase", "Strip",
    "Replace", "Prepend", "Split", "ByteLevel", "Metaspace", "WhitespaceSplit", "Whitespace", "Digits",
    "Punctuation", "CharDelimiterSplit", "BPE", "Regex", "String", "pattern", "content", "behavior", "Removed",
    "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous", "invert", "unk_token", "byte_fallback",
    "fuse_unk", "continuing_subword_prefix", "end_of_word_suffix", "ignore_merges", "TemplateProcessing",
    "single", "pair", "special_tokens", "id", "ids", "tokens", "special", "normalized", "lstrip", "rstrip",
    "single_word", "ByteFallback", "Fuse", "replacement", "prepend_scheme"]])

# Chat templates: the test templates, the demo's, and small ones for each construct.
templates = sorted(glob.glob(os.path.join(root, "tests/data/templates/*.jinja")) +
                   glob.glob(os.path.join(root, "demo/*/chat_template.jinja")))
small = ["{{ messages[0]['content'] | upper }}", "{% for m in messages %}{{ m.role ~ ':' ~ m.content }}\n{% endfor %}",
         "{% set ns = namespace(x=0) %}{% for i in range(3) %}{% set ns.x = ns.x + i %}{% endfor %}{{ ns.x }}",
         "{{ tools | tojson(indent=2) }}{% if add_generation_prompt %}<|im_start|>assistant{% endif %}",
         "{% macro f(a, b=2) %}{{ a * b }}{% endmacro %}{{ f(3) }}{{ '%05.2f' | format(3.14159) }}",
         "{{ 'abc'.replace('b', 'x').center(9, '*') }}{{ [1,2,3] | join(',') }}{{ {'a': 1}.items() | list }}",
         "{%- if messages | length > 1 and not (messages[-1].role == 'user') -%}{{ raise_exception('no') }}{%- endif -%}"]
write_corpus("template", [read(t) for t in templates] + small, [
    "{{", "}}", "{%", "%}", "{#", "#}", "{%-", "-%}", "for", "in", "endfor", "if", "elif", "else", "endif", "set",
    "macro", "endmacro", "call", "endcall", "filter", "endfilter", "namespace", "loop.index", "loop.last", "not",
    "and", "or", "is", "defined", "none", "true", "false", "~", "|", "(", ")", "[", "]", ".", ",", "=", "==", "!=",
    "**", "//", "%", "tojson", "trim", "replace", "center", "indent", "format", "join", "map", "select", "reject",
    "selectattr", "length", "list", "items", "upper", "lower", "split", "startswith", "endswith", "range",
    "raise_exception", "messages", "tools", "add_generation_prompt", "content", "role", "string", "mapping",
    "iterable", "'", '"', "generation", "endgeneration", "break", "continue", "strftime_now"])
