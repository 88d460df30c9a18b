"""NVFP4 arithmetic for tools/make_fixtures.py.

Two independent quantizers live here on purpose:
- the weight path follows ModelOpt's export (`NVFP4QTensor.quantize` / `dequantize`): per-tensor
  weight_scale_2 = amax / (6 * 448), per-16 block FP8-E4M3 scales, E2M1 codes found with searchsorted plus the
  odd-bound adjustment (ties to even), two codes per byte with the even element in the low nibble;
- the activation path follows vLLM's emulation reference (`ref_nvfp4_quant` + dequantize): block scale
  fp8(g * vmax / 6) with g = 1 / input_scale, threshold rounding to E2M1, x_dq = q * (s / g).
`self_test` checks that both E2M1 roundings agree, including every tie.
"""

import torch
import torch.nn.functional as F

BLOCK = 16
FP4_MAX = 6.0
FP8_MAX = 448.0
E2M1_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
E2M1_VALUES = torch.tensor(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float32
)


def scale_from_amax(amax):
    """weight_scale_2 / input_scale convention of ModelOpt: amax / (6 * 448), in fp32."""
    return torch.as_tensor(amax).float() / (FP4_MAX * FP8_MAX)


def weight_amax(w):
    return w.abs().amax().float()


def e2m1_codes(x):
    """ModelOpt `_cast_fp4`: 4-bit codes (bit 3 = sign) of fp32 values, ties to even."""
    sign = (x < 0).to(torch.uint8)
    mag = x.abs()
    order = torch.searchsorted(E2M1_BOUNDS, mag.contiguous(), out_int32=True).to(torch.uint8)
    odd_bounds = E2M1_BOUNDS[[1, 3, 5]]  # 0.75, 1.75, 3.5 round up to the even neighbour
    at_odd = torch.any(mag.unsqueeze(-1) == odd_bounds, dim=-1).to(torch.uint8)
    return (sign << 3) + order + at_odd


def quantize_weight(w, weight_scale_2):
    """w: bf16 [out, in]. Returns (packed uint8 [out, in/2], block scales float8_e4m3fn [out, in/16])."""
    n_out, n_in = w.shape
    assert n_in % BLOCK == 0, f"in_features {n_in} is not a multiple of {BLOCK}"
    blocks = w.view(n_out, n_in // BLOCK, BLOCK)
    block_amax = blocks.abs().amax(dim=-1).float()
    scale = block_amax / (FP4_MAX * weight_scale_2)
    scale[scale == 0] = 1.0
    scale = scale.clamp(min=2.0**-9).to(torch.float8_e4m3fn)
    scaled = blocks / (scale.to(torch.float32) * weight_scale_2).unsqueeze(-1)
    codes = e2m1_codes(scaled.reshape(n_out, n_in))
    packed = (codes[..., 1::2] << 4) | codes[..., 0::2]
    return packed.contiguous(), scale.contiguous()


def unpack_codes(packed):
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequantize_weight(packed, scale, weight_scale_2):
    """ModelOpt `dequantize`: e2m1 * (float(scale) * weight_scale_2), kept in fp32."""
    values = E2M1_VALUES[unpack_codes(packed).long()]
    n_out, n_in = values.shape
    per_block = scale.to(torch.float32) * weight_scale_2.float()
    return (values.view(n_out, n_in // BLOCK, BLOCK) * per_block.unsqueeze(-1)).reshape(n_out, n_in)


def round_e2m1_thresholds(x):
    """vLLM `cast_to_fp4` thresholds (round to nearest, ties to even), on clamped fp32 values."""
    sign = torch.sign(x)
    mag = x.abs()
    out = torch.zeros_like(mag)
    out = torch.where((mag > 0.25) & (mag < 0.75), 0.5, out)
    out = torch.where((mag >= 0.75) & (mag <= 1.25), 1.0, out)
    out = torch.where((mag > 1.25) & (mag < 1.75), 1.5, out)
    out = torch.where((mag >= 1.75) & (mag <= 2.5), 2.0, out)
    out = torch.where((mag > 2.5) & (mag < 3.5), 3.0, out)
    out = torch.where((mag >= 3.5) & (mag <= 5.0), 4.0, out)
    out = torch.where(mag > 5.0, 6.0, out)
    return out * sign


def fake_quantize_activation(x, input_scale):
    """Quantize-dequantize x per 16-element block along the last dim, in fp32 (vLLM emulation reference)."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1]).float()
    n_rows, n_cols = rows.shape
    assert n_cols % BLOCK == 0, f"activation width {n_cols} is not a multiple of {BLOCK}"
    g = torch.tensor(1.0, dtype=torch.float32) / input_scale.float()
    blocks = rows.view(n_rows, n_cols // BLOCK, BLOCK)
    vmax = blocks.abs().amax(dim=-1, keepdim=True)
    s = g * (vmax * (1.0 / FP4_MAX))
    s = s.clamp(min=-FP8_MAX, max=FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    denom = s * (torch.tensor(1.0, dtype=torch.float32) / g)
    out_scale = torch.where(denom == 0, torch.zeros_like(denom), 1.0 / denom)
    q = round_e2m1_thresholds((blocks * out_scale).clamp(-FP4_MAX, FP4_MAX))
    x_dq = q * (s / g)
    return x_dq.reshape(shape).to(x.dtype)


def self_test():
    """Both E2M1 roundings must agree on a grid that contains every tie and the saturation range."""
    grid = torch.arange(-7.0, 7.0001, 0.03125, dtype=torch.float32)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
    values = torch.cat([grid, ties, -ties])
    by_codes = E2M1_VALUES[e2m1_codes(values).long()]
    by_thresholds = round_e2m1_thresholds(values.clamp(-FP4_MAX, FP4_MAX))
    mismatch = (by_codes != by_thresholds).nonzero().flatten().tolist()
    assert not mismatch, f"E2M1 roundings disagree at {[values[i].item() for i in mismatch]}"
    expected_ties = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    assert torch.equal(E2M1_VALUES[e2m1_codes(ties).long()], expected_ties), "tie rounding is not to even"
    w = (torch.randn(8, 64, generator=torch.Generator().manual_seed(7)) * 0.05).to(torch.bfloat16)
    wsf2 = scale_from_amax(weight_amax(w))
    packed, scale = quantize_weight(w, wsf2)
    codes = unpack_codes(packed)
    assert torch.equal(codes[:, 0::2], packed & 0x0F), "even elements must sit in the low nibble"
    deq = dequantize_weight(packed, scale, wsf2)
    rel = ((deq - w.float()).norm() / w.float().norm()).item()
    assert rel < 0.15, f"NVFP4 weight round trip error {rel} is implausible"
    return rel


def make_experts_forward(on_input, on_hidden):
    """A forward for HF's fused experts module (gate_up_proj [E, 2I, H], down_proj [E, H, I]) that follows the
    eager loop of transformers and lets the caller see or replace the inputs of gate/up (on_input(e, x)) and of
    down (on_hidden(e, h)) for each routed expert."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for expert in range(self.gate_up_proj.shape[0]):
            top_k_pos, token_idx = torch.where((top_k_index == expert).transpose(0, 1))
            if token_idx.numel() == 0:
                continue
            x = on_input(expert, hidden_states[token_idx])
            gate, up = F.linear(x, self.gate_up_proj[expert]).chunk(2, dim=-1)
            h = on_hidden(expert, self.act_fn(gate) * up)
            y = F.linear(h, self.down_proj[expert]) * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    return forward
