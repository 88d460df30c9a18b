#!/usr/bin/env python3
"""How decisive the DSA indexer's top-k choice is at each teacher-forced position of a fixture with DeepSeek Sparse
Attention (glm_moe_dsa): transformers in float64 (eager attention, eager experts) on the fixture's prompts, and per
position the smallest, over the indexer layers, gap between the topk-th and (topk+1)-th index score relative to the
largest |score| of that query row (null while the position has no more keys than index_topk). Where that gap is
below NEAR_TIE_BELOW, bf16 rounding of the activations (~2^-9 per element, compounded through the layers) can swap
the two keys, and any bf16 implementation, transformers itself included, then attends over another key set: the
logits there are not determined at bf16 precision. bf16_noise.py and the CUDA model tests leave those positions
out of the logit bound. Writes FIXTURE_DIR/dsa_margins.json. Needs torch + transformers (CPU is enough).

usage: dsa_margins.py FIXTURE_DIR
"""
import json
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import make_fixtures as mf  # noqa: E402

# Measured on the glm_moe_dsa fixture (H200, transformers 5.17.0): transformers in bf16 changed the selection at
# relative gaps up to 4.8e-3 and the CUDA path at up to 3.7e-3; twice the largest of those.
NEAR_TIE_BELOW = 1e-2

_topk = torch.Tensor.topk
_recording = {"layer": None, "rows": {}}


def _recording_topk(self, k, *args, **kwargs):
    # The indexer's one topk call per forward is over its masked index scores [batch, query, key].
    if _recording["layer"] is not None:
        _recording["rows"][_recording["layer"]] = self.detach().double().cpu()
    return _topk(self, k, *args, **kwargs)


def hook_indexers(model):
    n = 0
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Indexer"):
            layer = int(name.split("layers.")[1].split(".")[0])
            module.register_forward_pre_hook(lambda mod, args, layer=layer: _recording.update(layer=layer))
            module.register_forward_hook(lambda mod, args, out: _recording.update(layer=None))
            n += 1
    return n


def main():
    path = Path(sys.argv[1])
    ref = json.load(open(path / "reference.json"))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                              attn_implementation="eager").eval()
    mf.force_eager_experts(model)
    if hook_indexers(model) == 0:
        raise SystemExit(f"{path}: no DSA indexer in this model")
    torch.Tensor.topk = _recording_topk
    topk = model.config.index_topk
    prompts = []
    for ids in ref["prompts"]:
        _recording["rows"] = {}
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), use_cache=False)
        margins = []
        for t in range(len(ids)):
            if t + 1 <= topk:
                margins.append(None)
                continue
            gaps = []
            for scores in _recording["rows"].values():
                v = torch.sort(scores[0, t, : t + 1], descending=True).values
                gaps.append(((v[topk - 1] - v[topk]) / v.abs().max()).item())
            margins.append(float(f"{min(gaps):.4g}"))
        near = [t for t, m in enumerate(margins) if m is not None and m < NEAR_TIE_BELOW]
        prompts.append({"margins": margins, "near_tie": near})
        print(f"prompt of {len(ids)} tokens: near-tie positions {near}")
    torch.Tensor.topk = _topk
    with open(path / "dsa_margins.json", "w") as f:
        json.dump({"generator": "tools/device/dsa_margins.py", "transformers_version": transformers.__version__,
                   "torch_version": torch.__version__, "index_topk": topk, "near_tie_below": NEAR_TIE_BELOW,
                   "prompts": prompts}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
