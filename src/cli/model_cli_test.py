#!/usr/bin/env python3
"""Checks `tern score --json` and `tern generate --json` against a fixture's transformers reference
(tests/fixtures/README.md): per prompt, the top-K teacher-forced logits within 1e-3 * max |reference logit| with
the same ids wherever the reference gaps exceed that, and the 24-token greedy continuation exactly.

usage: model_cli_test.py TERN FIXTURE_DIR REFERENCE_JSON [--bf16-noise FILE] [extra tern flags...]

--bf16-noise, for paths with bf16 activations (the CUDA path): the logit bound is the deviation transformers itself
shows in bf16 (FILE, written by tools/device/bf16_noise.py) instead of 1e-3, and greedy continuations must equal the
reference only where transformers-bf16 reproduced them (src/runtime/cuda_runner_test.cc explains why).
"""
import json
import subprocess
import sys


def run(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


LOGIT_TOLERANCE = 1e-3
GREEDY_MUST_MATCH = None  # per prompt; None: every prompt


def check_score(tern, model, prompt, positions, extra):
    ids_arg = ",".join(map(str, prompt))
    got = run([tern, "score", "--model", model, "--prompt-ids", ids_arg, "--top-k", "16", "--json"] + extra)
    assert len(got["positions"]) == len(prompt), "one entry per prompt position"
    for t, (ours, ref) in enumerate(zip(got["positions"], positions)):
        tol = LOGIT_TOLERANCE * max(abs(v) for v in ref["logits"])
        ours_by_id = dict(zip(ours["ids"], ours["logits"]))
        assert ours["logits"] == sorted(ours["logits"], reverse=True), f"position {t}: logits not highest first"
        kth = ref["logits"][-1]
        for rid, rv in zip(ref["ids"], ref["logits"]):
            if rv - kth > tol:
                assert rid in ours_by_id, f"position {t}: reference top id {rid} missing"
            if rid in ours_by_id:
                assert abs(ours_by_id[rid] - rv) <= tol, f"position {t} id {rid}: {ours_by_id[rid]} vs {rv}"
        for oid, ov in ours_by_id.items():
            if oid not in ref["ids"]:
                assert ov - kth <= tol, f"position {t}: id {oid} only in our top-K"


def greedy_must_match(p):
    return GREEDY_MUST_MATCH is None or GREEDY_MUST_MATCH[p]


def check_generate(tern, model, prompt, continuation, extra, must_match):
    ids_arg = ",".join(map(str, prompt))
    got = run([tern, "generate", "--model", model, "--prompt-ids", ids_arg, "--max-tokens", str(len(continuation)),
               "--temperature", "0", "--json", "--logprobs", "2"] + extra)
    assert got["prompt_ids"] == prompt
    assert len(got["ids"]) == len(continuation)
    if must_match:
        assert got["ids"] == continuation, f"greedy {got['ids']} != reference {continuation}"
    assert got["text"] == "", "fixtures have no tokenizer: text must be empty"
    assert got["finish_reason"] == "length"
    assert len(got["logprobs"]) == len(continuation)
    for step, chosen in zip(got["logprobs"], got["ids"]):
        assert step[0]["id"] == chosen and step[0]["logprob"] <= 0 and step[0]["logprob"] >= step[1]["logprob"]


def check_sampling_and_stop(tern, model, prompt, continuation, extra):
    ids_arg = ",".join(map(str, prompt))
    base = [tern, "generate", "--model", model, "--prompt-ids", ids_arg, "--json"] + extra
    if not greedy_must_match(0):  # the stop-id check then works on this path's own greedy continuation
        continuation = run(base + ["--max-tokens", str(len(continuation)), "--temperature", "0"])["ids"]
    # A stop token id ends generation right after that token, with finish_reason "stop".
    cut = next(i for i in range(1, len(continuation)) if continuation[i] not in continuation[:i])
    got = run(base + ["--max-tokens", "24", "--temperature", "0", "--stop-token-ids", str(continuation[cut])])
    assert got["ids"] == continuation[:cut + 1], f"stop id: {got['ids']} != {continuation[:cut + 1]}"
    assert got["finish_reason"] == "stop"
    # Seeded sampling is reproducible; another seed gives another sample (deterministic: same binary, same input).
    sample = base + ["--max-tokens", "24", "--temperature", "1.0", "--top-k", "50"]
    first = run(sample + ["--seed", "7"])["ids"]
    assert first == run(sample + ["--seed", "7"])["ids"], "same seed, different output"
    assert first != run(sample + ["--seed", "8"])["ids"], "different seeds gave the same 24 tokens"
    assert first != continuation, "temperature 1 reproduced the greedy output exactly"


def main():
    global LOGIT_TOLERANCE, GREEDY_MUST_MATCH
    tern, model, reference = sys.argv[1], sys.argv[2], sys.argv[3]
    extra = sys.argv[4:]
    if extra[:1] == ["--bf16-noise"]:
        with open(extra[1]) as f:
            noise = json.load(f)
        LOGIT_TOLERANCE = noise["max_rel_logit_error"]
        GREEDY_MUST_MATCH = noise["greedy_equal_per_prompt"]
        extra = extra[2:]
    with open(f"{model}/{reference}") as f:
        ref = json.load(f)
    for p, prompt in enumerate(ref["prompts"]):
        check_score(tern, model, prompt, ref["teacher_forced"][p]["positions"], extra)
        check_generate(tern, model, prompt, ref["greedy"][p]["continuation"], extra, greedy_must_match(p))
    check_sampling_and_stop(tern, model, ref["prompts"][0], ref["greedy"][0]["continuation"], extra)
    print(f"{model} {reference} {' '.join(extra)}: ok")


if __name__ == "__main__":
    main()
