#!/usr/bin/env python3
"""--front-end end to end on the CPU: `tern generate` with the ranks in processes of their own and the serving
process holding none (--tensor-parallel-size 2 --distributed-executor-backend mp --front-end) gives, greedily, the
tokens of one process without tensor parallelism, with speculative decoding on (the draft steps' logits travel back
too: some drafts must be accepted) and off.

usage: front_end_cli_test.py TERN DEMO_MODEL_DIR
"""
import json
import subprocess
import sys


def generate(tern, model, extra):
    cmd = [tern, "generate", "--model", model, "--device", "cpu", "--prompt", "The capital of France is",
           "--max-tokens", "16", "--temperature", "0", "--json"] + extra
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=240)
    return json.loads(out.stdout)


def main():
    tern, model = sys.argv[1], sys.argv[2]
    want = generate(tern, model, [])["ids"]
    assert len(want) == 16, want
    front_end = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp", "--front-end"]
    plain = generate(tern, model, front_end)
    assert plain["ids"] == want, f"front end {plain['ids']} != one process {want}"
    spec = generate(tern, model, front_end + ["--speculative-algorithm", "mtp", "--speculative-num-steps", "3"])
    assert spec["ids"] == want, f"front end with MTP {spec['ids']} != one process {want}"
    assert spec["speculative"]["accepted_tokens"] > 0, spec["speculative"]
    print("front end: the same 16 greedy tokens without and with MTP drafts", spec["speculative"])


if __name__ == "__main__":
    main()
