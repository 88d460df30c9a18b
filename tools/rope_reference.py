#!/usr/bin/env python3
"""RoPE frequency tables of scaled RoPE variants, computed independently of tern, for layers/rope_test.cc.

    python3 tools/rope_reference.py > tests/fixtures/rope_tables.json

Transcribes transformers 5's rope init functions (modeling_rope_utils: _compute_default_rope_parameters,
_compute_linear_scaling_rope_parameters, _compute_yarn_parameters) and DeepseekV3Attention's softmax scale with
the standard library only: torch's float32 tensor arithmetic is emulated by rounding every operation's result to
float32 (for +, -, *, / and a correctly rounded pow, an exact double result rounded once is the float32 result), and
the Python-float steps (the correction range, the attention factor) stay in double as there. Each case lists the
RoPE parameters (config.json's rope_parameters), the rotary width, inv_freq[rotary_dim / 2] and attention_factor,
and for MLA configs the softmax scale multiplier.
"""
import json
import math
import struct


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def pos_freqs(theta, dim):
    # base ** (torch.arange(0, dim, 2).float() / dim): an fp32 division, then an fp32 pow
    return [f32(math.pow(f32(theta), f32(f32(2 * i) / f32(dim)))) for i in range(dim // 2)]


def default(theta, dim):
    return [f32(1.0 / p) for p in pos_freqs(theta, dim)], 1.0


def linear(theta, dim, factor):
    inv, att = default(theta, dim)
    return [f32(v / f32(factor)) for v in inv], att


def get_mscale(scale, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn(theta, dim, p):
    factor = p["factor"]
    original = p["original_max_position_embeddings"]
    attention = p.get("attention_factor")
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if attention is None:
        if mscale and mscale_all_dim:
            attention = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention = get_mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pf = pos_freqs(theta, dim)
    inv = []
    for i, pos in enumerate(pf):
        extrapolation = f32(1.0 / pos)
        interpolation = f32(1.0 / f32(f32(factor) * pos))
        ramp = min(max(f32(f32(f32(i) - f32(low)) / f32(high - low)), 0.0), 1.0)
        keep = f32(1.0 - ramp)
        inv.append(f32(f32(interpolation * f32(1.0 - keep)) + f32(extrapolation * keep)))
    return inv, attention


def mla_mscale(p):
    # DeepseekV3Attention: scaling *= mscale * mscale, mscale = yarn_get_mscale(factor, mscale_all_dim)
    if p.get("rope_type", "default") == "default" or not p.get("mscale_all_dim"):
        return 1.0
    m = get_mscale(p["factor"], p["mscale_all_dim"])
    return m * m


CASES = [
    # Qwen3 with YaRN as its model card enables it (factor 4 over 32768).
    ("qwen3_yarn_4", 128, {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                           "original_max_position_embeddings": 32768}),
    # Qwen3.5's partial rotary (64 of 256) with YaRN to 1M (factor 4 over 262144).
    ("qwen3_5_yarn_partial", 64, {"rope_type": "yarn", "rope_theta": 10000000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 262144}),
    # DeepSeek-V3: factor 40 over 4096, beta 32 / 1, mscale = mscale_all_dim = 1 (attention factor 1).
    ("deepseek_v3", 64, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0}),
    # Unrounded correction range, another beta pair, a given attention factor.
    ("yarn_untruncated", 128, {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0,
                               "original_max_position_embeddings": 8192, "beta_fast": 16, "beta_slow": 2,
                               "truncate": False, "attention_factor": 0.8}),
    ("linear_2", 128, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    ("default", 96, {"rope_type": "default", "rope_theta": 1000000.0}),
]


def main():
    out = []
    for name, dim, p in CASES:
        theta = p["rope_theta"]
        if p["rope_type"] == "yarn":
            inv, att = yarn(theta, dim, p)
        elif p["rope_type"] == "linear":
            inv, att = linear(theta, dim, p["factor"])
        else:
            inv, att = default(theta, dim)
        out.append({"name": name, "rotary_dim": dim, "rope_parameters": p, "inv_freq": inv,
                    "attention_factor": att, "mla_softmax_mscale": mla_mscale(p)})
    print(json.dumps({"generator": "tools/rope_reference.py", "cases": out}, indent=1))


if __name__ == "__main__":
    main()
