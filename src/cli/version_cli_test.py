#!/usr/bin/env python3
"""`tern --version`, `tern version --json`, the "build" object of `tern doctor --json` and the first line `tern serve`
logs, checked against what CMake configured (passed here by CMake, not read from the binary's generated header).

usage: version_cli_test.py TERN FIXTURE_DIR PROJECT_VERSION BUILD_TYPE HAVE_CUDA(0|1) CUDA_ARCHITECTURES(a,b,...)
"""
import json
import re
import subprocess
import sys


def run(*args):
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"{args}: exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out.stdout


def gpu_code_names(archs):
    """CMAKE_CUDA_ARCHITECTURES entries as nvcc names the code they give: 90a -> sm_90a, 90-virtual -> compute_90."""
    names = []
    for a in archs.split(","):
        if a.endswith("-virtual"):
            names.append("compute_" + a[: -len("-virtual")])
        elif a[:1].isdigit():
            names.append("sm_" + a.removesuffix("-real"))
        else:
            names.append(a)
    return names


def main():
    tern, fixture, version, build_type, have_cuda, archs = sys.argv[1:7]
    cuda = have_cuda in ("1", "ON", "TRUE")

    text = run(tern, "--version")
    lines = text.rstrip("\n").split("\n")
    assert lines[0] == f"tern {version}", lines[0]
    facts = {}
    for line in lines[1:]:
        m = re.fullmatch(r"  (\S.*?) {2,}(\S.*)", line)
        assert m, f"not a '  name  value' line: {line!r}"
        facts[m.group(1)] = m.group(2)
    assert re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?|unknown", facts["commit"]), facts["commit"]
    assert facts["build type"] == build_type, facts
    assert facts["compiler"], facts
    if cuda:
        assert facts["CUDA support"] == "yes", facts
        assert re.fullmatch(r"\d+\.\d+\.\d+", facts["CUDA toolkit"]), facts
        assert facts["GPU architectures"].split() == gpu_code_names(archs), (facts, archs)
        for name in ("CUDA runtime", "CUDA driver", "cuBLASLt"):  # the driver may be "none found" (no GPU here)
            assert re.fullmatch(r"(\d+\.\d+(\.\d+)?|none found)( \(compiled against [\d.]+\))?", facts[name]), facts
    else:
        assert facts["CUDA support"].startswith("no"), facts
        assert "GPU architectures" not in facts and "cuBLASLt" not in facts, facts
    assert run(tern, "version") == text, "tern version prints what tern --version prints"

    build = json.loads(run(tern, "version", "--json"))
    assert build["version"] == version and build["commit"] == facts["commit"], build
    assert build["build_type"] == build_type and build["cuda"] == cuda, build
    assert build["cuda_architectures"] == (gpu_code_names(archs) if cuda else []), build
    assert sorted(build["libraries"]) == (["cublaslt", "cuda_driver", "cuda_runtime"] if cuda else []), build

    doctor = ["doctor", "--device", "cpu", "--selftest", "fast", "--model", fixture]
    assert json.loads(run(tern, *doctor, "--json"))["build"] == build, "tern doctor --json carries the build object"
    assert run(tern, *doctor).startswith(text), "tern doctor's report starts with the version header"

    server = subprocess.Popen([tern, "serve", "--model", fixture, "--device", "cpu", "--port", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = server.stdout.readline()
    finally:
        server.kill()
        server.wait()
    assert f"tern {version} (commit {facts['commit']}, {build_type}, " in first, first
    print("ok")


if __name__ == "__main__":
    main()
