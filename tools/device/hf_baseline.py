#!/usr/bin/env python3
"""Hugging Face transformers as the baseline of BENCHMARKS.md: the same shapes `tern bench` runs (a bench/configs
model directory, random bf16 weights on the GPU), timed the way a transformers user serves them: one model() call
per prefill and per decode step with the model's own KV cache (DynamicCache, or the hybrid cache of Qwen3.5).
Needs torch, transformers and a CUDA device; no weights are downloaded.

  prefill:  one sequence of --prefill-len tokens, median of 3 calls after a warm-up; tokens/s and ms.
  decode:   --batch sequences of --context tokens prefilled once, then --steps greedy steps of one token each
            (argmax on the GPU); output tokens/s and ms per step (median step).

usage: hf_baseline.py CONFIG_DIR [--prefill-len 4096] [--batch 1 64] [--context 1024] [--steps 32] [--json FILE]
"""
import argparse
import json
import statistics
import sys
import time

import torch
import transformers


def build(config_dir):
    config = transformers.AutoConfig.from_pretrained(config_dir)
    text = getattr(config, "text_config", None) or config
    if hasattr(text, "quantization_config"):  # the NVFP4 configs: transformers runs them unquantized
        delattr(text, "quantization_config")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(text, dtype=torch.bfloat16)
    # Small random weights keep activations finite through every layer (the speed does not depend on the values).
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype.is_floating_point:
                p.normal_(0.0, 0.02)
    return model.eval(), text


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def bench_prefill(model, vocab, length):
    ids = torch.randint(0, vocab, (1, length), device="cuda")
    run = lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1)  # noqa: E731
    timed(run)
    seconds = statistics.median(timed(run)[1] for _ in range(3))
    return {"kind": "prefill", "tokens": length, "ms": seconds * 1e3, "tokens_per_s": length / seconds}


def bench_decode(model, vocab, batch, context, steps):
    ids = torch.randint(0, vocab, (batch, context), device="cuda")
    out, prefill_s = timed(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1))
    cache = out.past_key_values
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for _ in range(steps):
        out, s = timed(lambda: model(input_ids=nxt, past_key_values=cache, use_cache=True))
        cache = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        times.append(s)
    step = statistics.median(times[2:] if len(times) > 4 else times)
    return {"kind": "decode", "batch": batch, "context": context, "steps": steps, "ms_per_step": step * 1e3,
            "tokens_per_s": batch / step, "prefill_s": prefill_s}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config_dir")
    ap.add_argument("--prefill-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--json")
    args = ap.parse_args()
    model, text = build(args.config_dir)
    rows = []
    with torch.no_grad():
        rows.append(bench_prefill(model, text.vocab_size, args.prefill_len))
        print(json.dumps(rows[-1]), flush=True)
        for b in args.batch:
            rows.append(bench_decode(model, text.vocab_size, b, args.context, args.steps))
            print(json.dumps(rows[-1]), flush=True)
    result = {"generator": "tools/device/hf_baseline.py", "config": args.config_dir,
              "transformers_version": transformers.__version__, "torch_version": torch.__version__,
              "device": torch.cuda.get_device_name(), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
