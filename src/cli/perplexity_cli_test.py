#!/usr/bin/env python3
"""Checks `tern perplexity` end to end on the CPU: its error paths (exit 2 with a message naming the problem, exit 1
for non-finite logits) and its numbers against the protocol of src/runtime/perplexity.h computed here, in Python,
from the full logits `tern score` prints for each window's tokens.

No committed fixture has a tokenizer, so the test makes model directories in a temporary folder: a fixture's
config.json and model.safetensors next to a small BPE tokenizer.json written here (single letters and a space, ids
inside the fixtures' vocabulary of 512, plus two merges). The reference numbers therefore come from tern's own
`score` command, a separate code path (one forward over given ids), not from transformers; what this checks is
the windowing, the scoring and the KL arithmetic of `tern perplexity`.

usage: perplexity_cli_test.py TERN FIXTURES_DIR
"""
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile

TERN = None
FIXTURES = None


def run(args, expect_rc=0):
    out = subprocess.run([TERN] + args, capture_output=True, text=True)
    assert out.returncode == expect_rc, (
        f"{args}: exit {out.returncode}, expected {expect_rc}\nstdout: {out.stdout}\nstderr: {out.stderr}")
    return out


def expect_error(args, message, rc=2):
    out = run(args, expect_rc=rc)
    assert message in out.stderr, f"{args}: stderr lacks {message!r}:\n{out.stderr}"
    assert out.stdout == "", f"{args}: an error printed to stdout: {out.stdout!r}"
    assert "Assertion" not in out.stderr and "terminate" not in out.stderr, out.stderr


def write_tokenizer(path, letters_first_id=4, permute=False):
    """A BPE tokenizer.json without normalizer or pre-tokenizer: 'a'..'z' and ' ' are single tokens, and the
    merges 't'+'h' and 'th'+'e' make 'th' and 'the'. `permute` reverses the letters' ids (same vocabulary size)."""
    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [" "]
    ids = list(range(letters_first_id, letters_first_id + len(chars)))
    if permute:
        ids.reverse()
    vocab = dict(zip(chars, ids))
    vocab["th"] = letters_first_id + len(chars)
    vocab["the"] = letters_first_id + len(chars) + 1
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": None, "post_processor": None, "decoder": None,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [["t", "h"], ["th", "e"]]},
    }
    with open(path, "w") as f:
        json.dump(tokenizer, f)


def model_dir(root, name, fixture, tokenizer=True, permute=False, config_edit=None, safetensors=None):
    """A model directory: the fixture's files (config.json possibly edited, model.safetensors possibly replaced) and
    a tokenizer.json."""
    d = os.path.join(root, name)
    os.makedirs(d)
    src = os.path.join(FIXTURES, fixture)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if config_edit:
        config_edit(config)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    if safetensors is None:
        shutil.copy(os.path.join(src, "model.safetensors"), os.path.join(d, "model.safetensors"))
    else:
        with open(os.path.join(d, "model.safetensors"), "wb") as f:
            f.write(safetensors)
    if tokenizer:
        write_tokenizer(os.path.join(d, "tokenizer.json"), permute=permute)
    return d


def poisoned_safetensors(fixture, tensor):
    """The fixture's model.safetensors with every element of a BF16 tensor set to NaN (0x7fc0)."""
    with open(os.path.join(FIXTURES, fixture, "model.safetensors"), "rb") as f:
        data = bytearray(f.read())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    info = header[tensor]
    assert info["dtype"] == "BF16", info
    begin, end = info["data_offsets"]
    base = 8 + n
    data[base + begin:base + end] = struct.pack("<H", 0x7FC0) * ((end - begin) // 2)
    return bytes(data)


def tokenize(tokenizer_dir, text):
    out = run(["tokenize", "--tokenizer", tokenizer_dir, "--text", text])
    return [int(x) for x in out.stdout.strip().split(",")]


def score_rows(model, ids, vocab=512):
    """Full logits rows of one forward over `ids` (a fresh sequence), from `tern score`."""
    out = run(["score", "--model", model, "--prompt-ids", ",".join(map(str, ids)), "--top-k", str(vocab), "--json",
               "--device", "cpu"])
    rows = []
    for p in json.loads(out.stdout)["positions"]:
        row = [None] * vocab
        for i, v in zip(p["ids"], p["logits"]):
            row[i] = v
        assert None not in row
        rows.append(row)
    return rows


def log_softmax(row):
    m = max(row)
    lse = m + math.log(sum(math.exp(x - m) for x in row))
    return [x - lse for x in row]


def protocol(tokens, n, s):
    """[(begin, end, first_target)] of the protocol, written from its definition."""
    windows, prev_e, b = [], 0, 0
    while True:
        e = min(b + n, len(tokens))
        windows.append((b, e, max(prev_e, b + 1)))
        prev_e = e
        if e == len(tokens):
            return windows
        b += s


def expected_numbers(model, tokens, n, s, reference=None):
    nll, ref_nll, kls, agree, scored = 0.0, 0.0, [], 0, 0
    windows = protocol(tokens, n, s)
    for b, e, first in windows:
        rows = score_rows(model, tokens[b:e])
        ref_rows = score_rows(reference, tokens[b:e]) if reference else None
        for j in range(first, e):
            q = log_softmax(rows[j - 1 - b])
            nll -= q[tokens[j]]
            scored += 1
            if reference:
                p = log_softmax(ref_rows[j - 1 - b])
                ref_nll -= p[tokens[j]]
                kls.append(sum(math.exp(lp) * (lp - lq) for lp, lq in zip(p, q)))
                agree += p.index(max(p)) == q.index(max(q))
    got = {"windows": len(windows), "scored": scored, "mean_nll": nll / scored}
    if reference:
        v = sorted(kls)
        pos = 0.99 * (len(v) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(v) - 1)
        got.update(reference_mean_nll=ref_nll / scored, kl_mean=sum(kls) / scored, kl_max=max(kls),
                   kl_p99=v[lo] + (v[hi] - v[lo]) * (pos - lo), top1_agreement=agree / scored)
    return got


def close(a, b, rel=1e-6, abs_=1e-12):
    return abs(a - b) <= max(rel * abs(b), abs_)


def perplexity_json(model, text_file, extra):
    out = run(["perplexity", "--model", model, "--text-file", text_file, "--json", "--device", "cpu"] + extra)
    return json.loads(out.stdout)


def check_happy_paths(root, qwen3, qwen3_moe):
    text = ("the quick brown fox jumps over the lazy dog while the other dogs sleep in the warm sun "
            "and then they all wake up together")
    text_file = os.path.join(root, "text.txt")
    with open(text_file, "w") as f:
        f.write(text)
    tokens = tokenize(qwen3, text)
    assert tokens == tokenize(qwen3_moe, text)
    t = len(tokens)
    assert 60 < t < 128, t  # the merges made 'the' one token: fewer tokens than characters
    assert len(text) > t

    for n, s in [(32, 16), (24, 24), (200, 100), (16, 5)]:
        got = perplexity_json(qwen3, text_file, ["--context", str(n), "--stride", str(s)])
        want = expected_numbers(qwen3, tokens, n, s)
        assert got["tokens"] == t and got["context"] == n and got["stride"] == s, got
        assert got["windows"] == want["windows"] and got["scored"] == want["scored"], (got, want)
        if s < n:
            assert got["scored"] == t - 1, got
        assert close(got["mean_nll"], want["mean_nll"]), (n, s, got["mean_nll"], want["mean_nll"])
        assert close(got["perplexity"], math.exp(want["mean_nll"])), got
        assert "kl" not in got and "kl_reference" not in got
    print(f"perplexity: {t} tokens, mean NLL as the protocol over tern score's logits")

    # The default stride is context / 2.
    assert perplexity_json(qwen3, text_file, ["--context", "30"])["stride"] == 15

    # KL against a reference: qwen3_moe's weights behind the same tokenizer.
    n, s = 40, 16
    got = perplexity_json(qwen3, text_file, ["--context", str(n), "--stride", str(s), "--kl-reference", qwen3_moe])
    want = expected_numbers(qwen3, tokens, n, s, reference=qwen3_moe)
    assert got["kl_reference"] == qwen3_moe
    for key, ours in [("mean_nll", got["mean_nll"]), ("reference_mean_nll", got["reference_mean_nll"]),
                      ("kl_mean", got["kl"]["mean"]), ("kl_max", got["kl"]["max"]), ("kl_p99", got["kl"]["p99"]),
                      ("top1_agreement", got["top1_agreement"])]:
        assert close(ours, want[key]), (key, ours, want[key])
    assert close(got["reference_perplexity"], math.exp(want["reference_mean_nll"])), got
    assert got["kl"]["mean"] > 0 and got["kl"]["max"] >= got["kl"]["p99"] >= 0, got
    print(f"kl: mean {got['kl']['mean']:.6g} max {got['kl']['max']:.6g} top-1 {got['top1_agreement']:.4f}")

    # A model against itself: KL 0 everywhere, every argmax agrees, the same perplexity twice.
    same = perplexity_json(qwen3, text_file, ["--context", "32", "--kl-reference", qwen3])
    assert same["kl"] == {"mean": 0, "max": 0, "p99": 0}, same["kl"]
    assert same["top1_agreement"] == 1 and same["reference_mean_nll"] == same["mean_nll"], same

    # The keys, in order, and the floats printed so they read back exactly (17 significant digits).
    out = run(["perplexity", "--model", qwen3, "--text-file", text_file, "--json", "--device", "cpu", "--context",
               "32", "--kl-reference", qwen3_moe]).stdout
    assert out.count("\n") == 1, out
    assert list(json.loads(out)) == ["model", "text_file", "tokens", "scored", "windows", "context", "stride",
                                     "mean_nll", "perplexity", "kl_reference", "reference_mean_nll",
                                     "reference_perplexity", "kl", "top1_agreement"], out
    value = json.loads(out)["mean_nll"]
    assert f"{value:.17g}" in out, out

    # Human-readable output.
    human = run(["perplexity", "--model", qwen3, "--text-file", text_file, "--device", "cpu", "--context", "32",
                 "--kl-reference", qwen3_moe]).stdout
    for line in ["model: ", f"{t} tokens, {t - 1} scored", "windows: ", "mean NLL: ", "perplexity: ",
                 "KL(reference || model): mean ", "top-1 agreement: "]:
        assert line in human, (line, human)
    return text_file


def check_errors(root, qwen3, text_file):
    base = ["perplexity", "--device", "cpu"]
    bare = os.path.join(FIXTURES, "qwen3")
    expect_error(base + ["--model", qwen3, "--text-file", os.path.join(root, "missing.txt")], "does not exist")
    expect_error(base + ["--model", qwen3, "--text-file", root], "is not a regular file")
    empty = os.path.join(root, "empty.txt")
    open(empty, "w").close()
    expect_error(base + ["--model", qwen3, "--text-file", empty, "--context", "16"], "is empty")
    one = os.path.join(root, "one.txt")
    with open(one, "w") as f:
        f.write("the")  # one token after the merges
    assert tokenize(qwen3, "the") == [32], tokenize(qwen3, "the")  # after a-z (4-29), " " (30), "th" (31)
    expect_error(base + ["--model", qwen3, "--text-file", one, "--context", "16"], "encodes to 1 token(s)")
    # Text that encodes to nothing at all (characters outside this tokenizer's vocabulary, no unk token).
    nothing = os.path.join(root, "nothing.txt")
    with open(nothing, "w") as f:
        f.write("123")
    expect_error(base + ["--model", qwen3, "--text-file", nothing, "--context", "16"], "encodes to 0 token(s)")
    expect_error(base + ["--model", bare, "--text-file", text_file, "--context", "16"], "has no tokenizer.json")
    expect_error(base + ["--model", os.path.join(root, "no_such_model"), "--text-file", text_file, "--context", "16"],
                 "is not a directory")
    expect_error(base + ["--model", qwen3, "--text-file", text_file, "--context=1"], "--context must be at least 2")
    expect_error(base + ["--model", qwen3, "--text-file", text_file, "--context", "257"],
                 "exceeds the max_position_embeddings (256)")
    # The default context (512) is more than the fixture's 256 positions.
    expect_error(base + ["--model", qwen3, "--text-file", text_file], "--context 512 exceeds")
    expect_error(base + ["--model", qwen3, "--text-file", text_file, "--context", "abc"], "--context 'abc' is not an integer")
    expect_error(base + ["--model", qwen3, "--text-file", text_file, "--context", "16", "--stride", "8x"],
                 "--stride '8x' is not an integer")
    expect_error(base + ["--model", qwen3, "--text-file", text_file, "--context", "16", "--stride=-3"],
                 "--stride must be between 1 and --context (16), got -3")
    expect_error(base + ["--model", qwen3, "--text-file", text_file, "--context", "16", "--stride", "0"],
                 "--stride must be between 1 and --context (16), got 0")
    expect_error(base + ["--model", qwen3, "--text-file", text_file, "--context", "16", "--stride", "17"],
                 "--stride must be between 1 and --context (16), got 17")
    # References that do not match.
    wide = model_dir(root, "wide_vocab", "qwen3", config_edit=lambda c: c.update(vocab_size=1024))
    expect_error(base + ["--model", qwen3, "--text-file", text_file, "--context", "16", "--kl-reference", wide],
                 f"--model '{qwen3}' has vocab_size 512, --kl-reference '{wide}' has 1024")
    permuted = model_dir(root, "permuted", "qwen3", permute=True)
    expect_error(base + ["--model", qwen3, "--text-file", text_file, "--context", "16", "--kl-reference", permuted],
                 "encodes")
    expect_error(base + ["--model", qwen3, "--text-file", text_file, "--context", "16", "--kl-reference", bare],
                 "--kl-reference '" + bare + "' has no tokenizer.json")
    # NaN weights: the logits of the first window are not finite; exit 1, naming the position and the window.
    nan = model_dir(root, "nan", "qwen3", safetensors=poisoned_safetensors("qwen3", "model.norm.weight"))
    expect_error(base + ["--model", nan, "--text-file", text_file, "--context", "16"],
                 "at token position 0 (the row after that token; vocabulary id 0) in window 0 (tokens [0, 16))", rc=1)
    print("errors: each named, exit 2 (1 for non-finite logits)")


def main():
    global TERN, FIXTURES
    TERN, FIXTURES = sys.argv[1], sys.argv[2]
    root = tempfile.mkdtemp(prefix="tern-perplexity-")
    try:
        qwen3 = model_dir(root, "qwen3", "qwen3")
        qwen3_moe = model_dir(root, "qwen3_moe", "qwen3_moe")
        text_file = check_happy_paths(root, qwen3, qwen3_moe)
        check_errors(root, qwen3, text_file)
    finally:
        shutil.rmtree(root)
    print("ok")


if __name__ == "__main__":
    main()
