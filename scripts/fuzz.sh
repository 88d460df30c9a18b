#!/usr/bin/env bash
# Fuzzes the safetensors header parser: builds fuzz/safetensors_header_fuzz with clang, libFuzzer, ASan and UBSan
# in build-fuzz/, writes seed files to a corpus there, and runs the fuzzer for the given seconds (default 60).
# Usage: scripts/fuzz.sh [seconds]. Exits non-zero if the fuzzer finds a crash (the input is kept in
# build-fuzz/fuzz-artifacts/; replay it with build-fuzz/fuzz/safetensors_header_fuzz <file>).
set -euo pipefail

seconds="${1:-60}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$root/build-fuzz"
corpus="$build/fuzz-corpus/safetensors_header"
artifacts="$build/fuzz-artifacts"

CC=clang CXX=clang++ cmake -S "$root" -B "$build" -G Ninja -DTERN_CUDA=OFF -DTERN_BUILD_FUZZERS=ON \
  -DTERN_BUILD_TESTS=OFF -DTERN_BUILD_BENCHMARKS=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
ninja -C "$build" -j2 safetensors_header_fuzz

mkdir -p "$corpus" "$artifacts"
# Seeds: small valid files (laid out as the reference writer does) plus a few near misses, and a dictionary of
# the header's tokens so mutations reach the field checks quickly.
python3 - "$corpus" "$build/safetensors.dict" <<'PY'
import json, os, random, struct, sys

corpus, dict_path = sys.argv[1], sys.argv[2]
sizes = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1,
         "U8": 1, "I8": 1, "I16": 2, "I32": 4, "I64": 8, "BOOL": 1}
rng = random.Random(1)

def file_bytes(tensors, metadata=None, pad=True):
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

seeds = {
    "empty": file_bytes([]),
    "metadata": file_bytes([], {"format": "pt"}),
    "scalar": file_bytes([("s", "F32", [])]),
    "zero_size": file_bytes([("z", "BF16", [0, 4]), ("w", "U8", [3])]),
    "unpadded": file_bytes([("test", "I32", [2, 2])], pad=False),
    "all_dtypes": file_bytes([(f"t.{d}", d, [2, 3]) for d in sizes], {"a": "b", "c": "d"}),
    "layers": file_bytes([(f"model.layers.{i}.weight", "BF16", [4, 2]) for i in range(4)]),
    "overlap": struct.pack("<Q", 96) + b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
               b'"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}'.ljust(96) + b"xyz",
}
for name, data in seeds.items():
    with open(os.path.join(corpus, "seed_" + name), "wb") as f:
        f.write(data)

tokens = ["{", "}", "[", "]", ":", ",", '"dtype"', '"shape"', '"data_offsets"', '"__metadata__"',
          "-1", "0", "1.5", "1e3", "null", "true", "18446744073709551615", "9223372036854775808", '"\\u0000"']
tokens += ['"%s"' % d for d in sizes]
with open(dict_path, "w") as f:
    for t in tokens:
        f.write("%s\n" % json.dumps(t))
PY

echo "fuzzing safetensors_parse_header for ${seconds}s (corpus: $corpus)"
# The fuzzer's progress lines go to a log; on failure its tail (with the crash report) is printed.
log="$build/fuzz.log"
if ! "$build/fuzz/safetensors_header_fuzz" "$corpus" -dict="$build/safetensors.dict" \
  -max_total_time="$seconds" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
  -artifact_prefix="$artifacts/" -print_final_stats=1 >"$log" 2>&1; then
  tail -n 60 "$log"
  echo "fuzz: FAILED (inputs that broke it are in $artifacts/)"
  exit 1
fi
grep -E "^stat::number_of_executed_units|^stat::peak_rss_mb|Done [0-9]+ runs" "$log" || true
echo "fuzz: no crash, no broken invariant in ${seconds}s"
