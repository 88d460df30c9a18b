#!/usr/bin/env python3
"""--distributed-executor-backend mp (src/cli/rank_processes.h) on the CPU: the rank processes tern starts stop with
it, whether it ends cleanly or is killed; one lost during start-up stops it at once; the user's node options are not
passed on; a combination it cannot run exits 2 naming the flag. (That the split
model computes transformers' logits and greedy tokens is cli.model.qwen3_mp, model_cli_test.py with these flags.)

usage: rank_processes_cli_test.py TERN FIXTURES_DIR
"""
import os
import signal
import subprocess
import sys
import time

MARKER = "173"  # a --dist-timeout no other test uses, to find this test's rank processes


def rank_processes():
    """Pids of the rank processes (node rank >= 1) started for this test's commands."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=True).stdout
    pids = []
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        if f"--dist-timeout {MARKER}" in args and "--node-rank" in args:
            pids.append(int(pid))
    return pids


def wait_until(predicate, seconds, what):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {seconds} s: {what}")


def main():
    tern, fixtures = sys.argv[1], sys.argv[2]
    model = f"{fixtures}/qwen3"
    common = ["--model", model, "--device", "cpu", "--tensor-parallel-size", "2", "--distributed-executor-backend",
              "mp", "--dist-timeout", MARKER]
    assert rank_processes() == [], "rank processes left over from an earlier run"

    # A clean run: rank 1 ran in a process of its own, and it is gone when tern returns.
    done = subprocess.run([tern, "generate", *common, "--prompt-ids", "1,2,3", "--max-tokens", "4",
                           "--temperature", "0", "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "node 1 of 2: running ranks 1..1 of 2" in done.stderr, done.stderr
    assert '"ids":[' in done.stdout and "node 1" not in done.stdout, done.stdout  # the rank's log is on stderr
    assert rank_processes() == [], f"rank processes outlived tern generate: {rank_processes()}"

    # node 0 killed: its rank process dies with it.
    server = subprocess.Popen([tern, "serve", *common, "--port", "0"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: len(rank_processes()) == 1, 60, "the rank process started")
        child = rank_processes()[0]
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=30)
        wait_until(lambda: not os.path.exists(f"/proc/{child}") or
                   open(f"/proc/{child}/stat").read().split()[2] == "Z", 10,
                   f"rank process {child} ended after node 0 was killed")
    finally:
        if server.poll() is None:
            server.kill()
        for pid in rank_processes():
            os.kill(pid, signal.SIGKILL)

    # A rank process lost while the group forms stops node 0 at once (not after --dist-timeout, 173 s here).
    start = time.monotonic()
    starting = subprocess.Popen([tern, "generate", *common, "--prompt-ids", "1,2,3", "--max-tokens", "4"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: len(rank_processes()) == 1, 60, "the rank process started")
        os.kill(rank_processes()[0], signal.SIGKILL)
        _, err = starting.communicate(timeout=60)
    finally:
        if starting.poll() is None:
            starting.kill()
    assert starting.returncode != 0, err
    assert time.monotonic() - start < 60, f"node 0 took {time.monotonic() - start:.0f} s to stop"
    # Killed before joining: the start-up report; after: the lost node's error from the first collective.
    assert "rank 1" in err or "node" in err, err
    wait_until(lambda: rank_processes() == [], 10, "no rank process left")

    # The user's own --node-rank / --nnodes / --dist-init-addr are not repeated to the rank processes.
    done = subprocess.run([tern, "generate", *common, "--node-rank", "0", "--nnodes=1", "--prompt-ids", "1,2",
                           "--max-tokens", "2", "--temperature", "0", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "node 1 of 2" in done.stderr, done.stderr

    # What mp cannot do is bad input (exit 2) naming the flag.
    bad = subprocess.run([tern, "generate", *common, "--nnodes", "2", "--prompt-ids", "1", "--max-tokens", "1"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--distributed-executor-backend mp" in bad.stderr, (bad.returncode, bad.stderr)
    bad = subprocess.run([tern, "generate", "--model", model, "--device", "cpu", "--distributed-executor-backend",
                          "ray", "--prompt-ids", "1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--distributed-executor-backend" in bad.stderr, (bad.returncode, bad.stderr)
    assert rank_processes() == []
    print("rank processes: ok")


if __name__ == "__main__":
    main()
