#!/usr/bin/env python3
"""`tern loadgen` against `tern serve` on a fixture checkpoint (CPU): what the report says about a workload whose
every count is known in advance.

usage: loadgen_cli_test.py TERN FIXTURE_DIR

The fixture has no tokenizer, so prompts go as token ids (--prompt-token-ids) and `ignore_eos` makes every request
generate exactly --output-len tokens: the prompt and output token counts are exact, and each token comes in a chunk
of its own (loadgen asks for logprobs, which tern streams per token even without text).
"""
import json
import re
import signal
import subprocess
import sys
import time

MODEL = "tiny"


def start_server(tern, fixture):
    server = subprocess.Popen([tern, "serve", "--model", fixture, "--device", "cpu", "--port", "0",
                               "--served-model-name", MODEL, "--max-running-requests", "4"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = ""
    deadline = time.time() + 60
    while time.time() < deadline:
        line = server.stdout.readline()
        if not line:
            break
        log += line
        m = re.search(r"listening on (http://[0-9.]+:\d+)", line)
        if m:
            return server, m.group(1)
    server.kill()
    sys.exit(f"tern serve did not start:\n{log}")


def loadgen(tern, url, *args):
    cmd = [tern, "loadgen", "--url", url, "--seed", "1"] + list(args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def check_exact_counts(tern, url, traffic):
    out = loadgen(tern, url, "--num-requests", "4", "--input-len", "8", "--output-len", "4", "--ignore-eos",
                  "--prompt-token-ids", "512", "--json", *traffic)
    assert out.returncode == 0, f"{traffic}: exit {out.returncode}\n{out.stderr}"
    report = json.loads(out.stdout)
    assert report["config"]["model"] == MODEL, "the model comes from GET /v1/models"
    assert report["completed"] == 4 and report["failed"] == 0, report
    assert report["total_output_tokens"] == 16, report["total_output_tokens"]
    assert report["total_input_tokens"] == 32, report["total_input_tokens"]
    assert report["input_tokens_estimated_requests"] == 0, "the server's usage gives the prompt counts"
    assert report["tpot_ms"]["count"] == 4 and report["itl_ms"]["count"] == 12, (report["tpot_ms"], report["itl_ms"])
    assert len(report["requests"]) == 4
    for r in report["requests"]:
        assert r["ok"] and r["http_status"] == 200, r
        assert r["output_tokens"] == 4 and r["chunks"] == 4 and r["prompt_tokens"] == 8, r
        assert 0 < r["ttft_s"] <= r["e2e_s"], r
    duration = report["duration_s"]
    assert abs(report["output_throughput"] - 16 / duration) <= 1e-6 * report["output_throughput"], report
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = report[key]
        assert s["median"] <= s["p90"] <= s["p99"] <= s["max"], (key, s)
    assert report["ttft_ms"]["max"] <= report["e2e_ms"]["max"]


def check_all_rejected(tern, url):
    # Text prompts need a tokenizer, which the fixture lacks: every request gets HTTP 400 and loadgen exits 1.
    out = loadgen(tern, url, "--model", MODEL, "--num-requests", "3", "--concurrency", "3", "--input-len", "8",
                  "--output-len", "2")
    assert out.returncode == 1, f"exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    assert "every request" in out.stderr and url in out.stderr, out.stderr
    assert re.search(r"3 x HTTP 400: .*tokenizer", out.stdout), out.stdout
    assert re.search(r"Failed requests:\s+3", out.stdout), out.stdout


def main():
    tern, fixture = sys.argv[1], sys.argv[2]
    server, url = start_server(tern, fixture)
    try:
        check_exact_counts(tern, url, ["--concurrency", "2"])
        check_exact_counts(tern, url, ["--request-rate", "40", "--concurrency", "2", "--warmup", "2"])
        check_exact_counts(tern, url + "/v1/", ["--request-rate", "inf"])
        check_all_rejected(tern, url)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
    # The server is gone: a clear message naming the URL, exit 1.
    out = loadgen(tern, url, "--num-requests", "1", "--concurrency", "1", "--input-len", "4", "--output-len", "1")
    assert out.returncode == 1 and f"cannot reach the server at {url}" in out.stderr, (out.returncode, out.stderr)
    print("ok")


if __name__ == "__main__":
    main()
