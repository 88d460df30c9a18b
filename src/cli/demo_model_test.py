#!/usr/bin/env python3
"""tern perplexity on the bundled demo model (demo/) against the figures tools/train_demo.py computed with
transformers in fp32 from the exported checkpoints (demo/eval.json), over the same held-out text and windows.

    demo_model_test.py TERN DEMO_DIR bf16 [--device cpu|cuda]   mean NLL of the BF16 copy
    demo_model_test.py TERN DEMO_DIR nvfp4 [--device cpu]        NLL of the NVFP4 copy and its KL from the BF16 copy

Tolerances. CPU (fp32 activations, as the reference): 1e-3 relative on the mean NLL. CUDA (bf16 activations): 1%.
NVFP4: the reference's KL(P_bf16 || Q_nvfp4) is the format's own error (the NVFP4 weights dequantized, computed by
transformers); tern's W4A16 path reads the same dequantized weights, so its KL may exceed that figure by at most
0.1% (plus 1e-6 for fp32 summation), i.e. tern adds no error of its own beyond the format. Exits 1 on a mismatch.
"""
import json
import subprocess
import sys
from pathlib import Path


def perplexity(tern, args):
    out = subprocess.run([tern, "perplexity", "--json", *args], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"tern perplexity {' '.join(args)} exited {out.returncode}:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def close(name, got, want, rel, failures):
    ok = abs(got - want) <= rel * abs(want)
    print(f"{name}: tern {got!r}, reference {want!r} (relative {abs(got - want) / abs(want):.3g}, allowed {rel})")
    if not ok:
        failures.append(name)


def main():
    tern, demo, which = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu"
    ref = json.loads((demo / "eval.json").read_text())
    common = ["--text-file", str(demo / ref["text_file"]), "--context", str(ref["context"]), "--stride",
              str(ref["stride"]), "--device", device]
    failures = []
    rel = 1e-3 if device == "cpu" else 1e-2
    if which == "bf16":
        r = perplexity(tern, ["--model", str(demo / "tern-demo-bf16"), *common])
        close("bf16 mean NLL", r["mean_nll"], ref["bf16"]["mean_nll"], rel, failures)
    else:
        r = perplexity(tern, ["--model", str(demo / "tern-demo-nvfp4"), "--kl-reference",
                              str(demo / "tern-demo-bf16"), *common])
        q = ref["nvfp4_w4a16"]
        close("nvfp4 mean NLL", r["mean_nll"], q["mean_nll"], rel, failures)
        close("bf16 mean NLL (the reference model)", r["reference_mean_nll"], ref["bf16"]["mean_nll"], rel, failures)
        bound = q["kl_from_bf16"]["mean"] * 1.001 + 1e-6
        print(f"KL(bf16 || nvfp4) mean: tern {r['kl']['mean']!r}, bound {bound!r} (transformers "
              f"{q['kl_from_bf16']['mean']!r})")
        if not 0 < r["kl"]["mean"] <= bound:
            failures.append("KL mean")
        close("KL max", r["kl"]["max"], q["kl_from_bf16"]["max"], 1e-2, failures)
        if abs(r["top1_agreement"] - q["top1_agreement"]) > 1e-3:
            failures.append(f"top-1 agreement {r['top1_agreement']} vs {q['top1_agreement']}")
    for key in ("tokens", "scored", "windows"):
        if r[key] != ref[key]:
            failures.append(f"{key}: tern {r[key]}, reference {ref[key]}")
    if failures:
        sys.exit("FAILED: " + "; ".join(failures))
    print("ok")


if __name__ == "__main__":
    main()
