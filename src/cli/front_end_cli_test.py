#!/usr/bin/env python3
"""--front-end end to end on the CPU: `tern generate` with the ranks in processes of their own and the serving
process holding none (--tensor-parallel-size 2 --distributed-executor-backend mp --front-end) gives, greedily, the
tokens of one process without tensor parallelism, with speculative decoding on (the drafts' proposals and the
verified rows' tokens come back: some drafts must be accepted) and off, with the routed experts whole on each rank
(--enable-expert-parallel, the MTP layer's too) as with them sliced; and, sampled with a seed and MTP drafts, the
tokens one process draws.

usage: front_end_cli_test.py TERN DEMO_MODEL_DIR
"""
import json
import subprocess
import sys


def generate(tern, model, extra):
    cmd = [tern, "generate", "--model", model, "--device", "cpu", "--prompt", "The capital of France is",
           "--max-tokens", "16", "--json"] + extra
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=240)
    return json.loads(out.stdout)


def main():
    tern, model = sys.argv[1], sys.argv[2]
    greedy = ["--temperature", "0"]
    want = generate(tern, model, greedy)["ids"]
    assert len(want) == 16, want
    front_end = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp", "--front-end"]
    plain = generate(tern, model, front_end + greedy)
    assert plain["ids"] == want, f"front end {plain['ids']} != one process {want}"
    alone = generate(tern, model, ["--distributed-executor-backend", "mp", "--front-end"] + greedy)  # one rank
    assert alone["ids"] == want, f"front end of one rank process {alone['ids']} != one process {want}"
    mtp = ["--speculative-algorithm", "mtp", "--speculative-num-steps", "3"]
    spec = generate(tern, model, front_end + greedy + mtp)
    assert spec["ids"] == want, f"front end with MTP {spec['ids']} != one process {want}"
    assert spec["speculative"]["accepted_tokens"] > 0, spec["speculative"]
    experts = generate(tern, model, front_end + ["--enable-expert-parallel"] + greedy + mtp)
    assert experts["ids"] == want, f"front end with expert parallelism {experts['ids']} != one process {want}"
    assert experts["speculative"]["accepted_tokens"] > 0, experts["speculative"]
    # Sampled with a seed, with MTP drafts: rank 0 draws with the front end's stream, as one process draws.
    sampled = ["--temperature", "0.8", "--seed", "7", "--speculative-algorithm", "mtp"]
    one = generate(tern, model, sampled)
    front = generate(tern, model, front_end + sampled)
    assert front["ids"] == one["ids"], f"front end sampled {front['ids']} != one process {one['ids']}"
    assert one["ids"] != want, "the sampled tokens must differ from the greedy ones, or the check shows nothing"
    print("front end: the same 16 greedy tokens without and with MTP drafts", spec["speculative"],
          "and the same seeded sampled tokens with MTP drafts", front["speculative"])


if __name__ == "__main__":
    main()
