#!/usr/bin/env python3
"""Smoke test of `tern serve --device cuda` on a GPU machine: health, one completion, 16 concurrent completions
through 8 running slots (continuous batching on the GPU backend, KV blocks and GDN state slots reused across
requests), then SIGTERM and a clean exit. Prints the server's log at the end.

usage: serve_smoke.py TERN MODEL_DIR      (a fixture: prompts are token ids, no tokenizer needed)
"""
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

PORT = 30123


def post(body):
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def wait_healthy(seconds):
    for _ in range(seconds * 2):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=1)
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("the server did not come up")


def main():
    tern, model = sys.argv[1], sys.argv[2]
    name = os.path.basename(model.rstrip("/"))
    command = [tern, "serve", "--model", model, "--device", "cuda", "--port", str(PORT), "--max-running-requests", "8"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(60)
        one = post({"model": name, "prompt": [11, 22, 33, 44], "max_tokens": 8, "temperature": 0})
        print("single:", one["choices"][0]["finish_reason"], one["usage"])
        start = time.time()
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            outs = list(pool.map(lambda i: post({"model": name, "prompt": [5 + i, 40, 7 * i % 400 + 4],
                                                 "max_tokens": 24, "temperature": 0}), range(16)))
        print("16 concurrent:", sorted({o["choices"][0]["finish_reason"] for o in outs}),
              sum(o["usage"]["completion_tokens"] for o in outs), "tokens in", round(time.time() - start, 2), "s")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        print("exit", proc.returncode)
        print(out[-4000:])


if __name__ == "__main__":
    main()
