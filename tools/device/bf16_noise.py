#!/usr/bin/env python3
"""How far transformers itself moves from the fixtures' fp32 reference when it runs in bf16 on the GPU: per fixture,
max |logit_bf16 - logit_fp32| / max |logit_fp32| over the reference's top-16 ids, and whether bf16 greedy decoding
reproduces the 24-token continuation. This is the noise floor a bf16-activation path lives with: the CUDA model
tests (src/runtime/cuda_runner_test.cc) allow no more than it. Positions that the fixture's dsa_margins.json lists
as near ties of the DSA indexer's selection (dsa_margins.py) are left out of the maximum, as the tests leave them
out. Writes FIXTURES_DIR/<name>/bf16_noise.json. Needs torch + transformers and a CUDA device.

usage: bf16_noise.py FIXTURES_DIR [NAME ...]   (default: every fixture below)
"""
import json
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import make_fixtures as mf  # noqa: E402

# fixture -> (class, reference file); the NVFP4 fixture runs as W4A16: the qwen3_5_moe model with its quantized
# weights replaced by their ModelOpt dequantization, as make_fixtures.py computes reference_w4a16.json.
CLASSES = {"qwen3": ("Qwen3ForCausalLM", "reference.json"), "qwen3_moe": ("Qwen3MoeForCausalLM", "reference.json"),
           "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", "reference.json"),
           "qwen3_5_moe_fused": ("Qwen3_5MoeForConditionalGeneration", "reference.json"),
           "qwen3_5_moe_nvfp4": ("Qwen3_5MoeForConditionalGeneration", "reference_w4a16.json"),
           "glm_moe_dsa": ("GlmMoeDsaForCausalLM", "reference.json")}


def load_bf16(root, name, cls):
    if name != "qwen3_5_moe_nvfp4":
        # GLM-5 with eager attention: transformers' SDPA path of the DSA indexer skipped its causal mask
        # (huggingface/transformers#48289); its reference was made with eager too.
        extra = {"attn_implementation": "eager"} if name == "glm_moe_dsa" else {}
        return getattr(transformers, cls).from_pretrained(f"{root}/{name}", dtype=torch.bfloat16, **extra)
    model = getattr(transformers, cls).from_pretrained(f"{root}/qwen3_5_moe", dtype=torch.float32)
    mf.apply_nvfp4_weights(model, load_file(f"{root}/{name}/model.safetensors"))
    return model.to(torch.bfloat16)


def main():
    root = sys.argv[1]
    names = sys.argv[2:] or list(CLASSES)
    for name in names:
        cls, reference = CLASSES[name]
        path = f"{root}/{name}"
        ref = json.load(open(f"{path}/{reference}"))
        model = load_bf16(root, name, cls).cuda().eval()
        margins = Path(f"{path}/dsa_margins.json")
        near_tie = [set(p["near_tie"]) for p in json.load(open(margins))["prompts"]] if margins.exists() else None
        worst, greedy_ok, skipped = 0.0, [], 0
        with torch.no_grad():
            for p, ids in enumerate(ref["prompts"]):
                logits = model(input_ids=torch.tensor([ids]).cuda(), use_cache=False).logits[0].float().cpu()
                for t, pos in enumerate(ref["teacher_forced"][p]["positions"]):
                    if near_tie and t in near_tie[p]:
                        skipped += 1
                        continue
                    want = torch.tensor(pos["logits"])
                    got = logits[t, pos["ids"]]
                    worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
                seq = list(ids)
                for _ in range(len(ref["greedy"][p]["continuation"])):
                    row = model(input_ids=torch.tensor([seq]).cuda(), use_cache=False).logits[0, -1]
                    seq.append(int(row.argmax()))
                greedy_ok.append(seq[len(ids):] == ref["greedy"][p]["continuation"])
        print(f"{name}: transformers bf16 vs fp32 reference: max rel logit error {worst:.4f} ({skipped} near-tie "
              f"positions skipped); "
              f"greedy continuations equal {sum(greedy_ok)}/{len(ref['prompts'])}")
        with open(f"{path}/bf16_noise.json", "w") as f:
            json.dump({"generator": "tools/device/bf16_noise.py", "transformers_version": transformers.__version__,
                       "torch_version": torch.__version__, "device": torch.cuda.get_device_name(),
                       "max_rel_logit_error": round(worst, 6), "near_tie_positions_skipped": skipped,
                       "greedy_equal": sum(greedy_ok),
                       "prompts": len(ref["prompts"]), "greedy_equal_per_prompt": greedy_ok}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
