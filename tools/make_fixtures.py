#!/usr/bin/env python3
"""Writes tiny random checkpoints and transformers reference outputs for tern's tests.

    python3 tools/make_fixtures.py --out tests/fixtures

Needs torch and transformers >= 5 (plus safetensors). Every fixture is seeded; weights are drawn in fp32, rounded
to bf16 and saved as BF16 with `save_pretrained`; the references are computed by transformers in fp32 on the CPU
from the checkpoint read back from disk (eager attention, eager experts). See tests/fixtures/README.md.
"""

import argparse
import copy
import fnmatch
import json
import re
import shutil
import struct
import sys
import traceback
import types
from pathlib import Path

import torch
import torch.nn as nn
import transformers
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fixture_nvfp4 as nvfp4  # noqa: E402

VOCAB = 512
EOS_ID = 511
PAD_ID = 510
VISION_IDS = {"image_token_id": 505, "video_token_id": 506, "vision_start_token_id": 507,
              "vision_end_token_id": 508}
PROMPT_LENGTHS = (5, 17, 33)
PROMPT_ID_RANGE = (4, 500)  # below every special id above
TOP_K = 16
NEW_TOKENS = 24
# Prompts are re-drawn until every greedy step of every reference of a fixture has a top-1/top-2 logit gap of at
# least GREEDY_GAP_MIN and no continuation contains EOS, so an fp32 implementation cannot flip a greedy token.
# Small random models tend to fall into repeating one token, which would let a broken KV cache go unnoticed, so
# the search also prefers prompt sets whose continuations hold at least GREEDY_DISTINCT_MIN distinct tokens.
# It also wants every teacher-forced top-(k+1) list to keep neighbouring logits TOP_GAP_MIN apart, so the order of
# the reference top-k does not hinge on the last bits of fp32.
GREEDY_GAP_MIN = 1e-3
GREEDY_DISTINCT_MIN = 10
TOP_GAP_MIN = 1e-5
PROMPT_ATTEMPTS = 40
CALIBRATION_PROMPTS = 4
CALIBRATION_LENGTH = 40
GENERATOR_NAME = "tools/make_fixtures.py"
MODELOPT_PRODUCER = {"name": "modelopt", "version": "0.37.0"}
NVFP4_EXCLUDES = ["lm_head", "model.visual*", "model.language_model.layers.*.linear_attn*", "*mlp.gate",
                  "*shared_expert*", "mtp*"]

VERBOSE = False
FAILURES = []


def log(msg=""):
    print(msg, flush=True)


def bf16_exact(t):
    return t.to(torch.bfloat16).to(torch.float32)


def make_prompts(seed, lengths):
    gen = torch.Generator().manual_seed(seed)
    low, high = PROMPT_ID_RANGE
    return [torch.randint(low, high, (n,), generator=gen).tolist() for n in lengths]


# ----------------------------------------------------------------------------------------------------------------
# configs


def config_qwen3():
    return transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True,
        attention_bias=False, bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=PAD_ID)


def config_qwen3_moe():
    # decoder_sparse_step 2 makes the even layers dense; mlp_only_layers [5] makes layer 5 dense too:
    # MoE layers are 1 and 3, dense layers 0, 2, 4, 5.
    return transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[5],
        tie_word_embeddings=False, attention_bias=False, bos_token_id=None, eos_token_id=EOS_ID,
        pad_token_id=PAD_ID)


def config_qwen3_5_moe():
    text = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-6, linear_conv_kernel_dim=4,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [3, 3, 2], "mrope_interleaved": True},
        tie_word_embeddings=False, attention_bias=False, bos_token_id=None, eos_token_id=EOS_ID,
        pad_token_id=PAD_ID)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
    return transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                                         **VISION_IDS)


def config_glm_moe_dsa(config_cls):
    # index_topk 16 < the longest sequences (33 + 24), so the DSA top-k really drops keys there;
    # index_n_heads 16 keeps an all-zero ReLU score (a tie) unlikely.
    fields = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, v_head_dim=32,
        qk_nope_head_dim=32, n_group=1, topk_group=1, num_experts_per_tok=2, norm_topk_prob=True,
        max_position_embeddings=256, rms_norm_eps=1e-5, index_topk=16, index_head_dim=32, index_n_heads=16,
        first_k_dense_replace=1, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False, attention_bias=False, bos_token_id=None, eos_token_id=EOS_ID,
        pad_token_id=PAD_ID)
    try:  # informational fields of the real GLM-5 config.json
        return config_cls(**fields, scoring_func="sigmoid", topk_method="noaux_tc")
    except (TypeError, ValueError) as err:
        log(f"  GlmMoeDsaConfig refused scoring_func/topk_method ({err}); left out")
        return config_cls(**fields)


# ----------------------------------------------------------------------------------------------------------------
# random weights


def draw_parameter(mod_name, module, pname, p, gen, conventions):
    """Random values around a parameter's init so that a wrong norm convention or a lost bias shows."""
    shape = p.shape
    cls = type(module).__name__

    def normal(std):
        return torch.randn(shape, generator=gen) * std

    if "Norm" in cls or isinstance(module, nn.LayerNorm):
        if pname == "bias":
            return normal(0.1)
        zero_centred = bool(torch.all(p == 0))
        conventions[cls] = "zero-centred, y = x_hat * (1 + w)" if zero_centred else "plain, y = x_hat * w"
        # q_norm / k_norm act with an effective scale near 2 (trained models have large ones too): attention
        # scores then have a std near 4, attention is sharp and greedy continuations depend on the context
        # instead of settling on one repeated token.
        centre = 2.0 if mod_name.endswith(("q_norm", "k_norm")) else 1.0
        return (centre - 1.0) + normal(0.1 * centre) if zero_centred else centre + normal(0.1 * centre)
    if pname == "A_log":
        return torch.log(torch.rand(shape, generator=gen) * 1.9 + 0.1)
    if pname == "dt_bias":
        return 1.0 + normal(0.5)
    if pname == "bias":
        return normal(0.02)
    if isinstance(module, nn.Embedding):
        return normal(0.1)
    if isinstance(module, nn.Conv1d):
        return normal(0.2)
    # 0.1 for every matrix: with smaller values the residual stream stays dominated by the token's own embedding
    # and the tiny models just repeat their input token, which would make the greedy references weak.
    return normal(0.1)


@torch.no_grad()
def randomize_weights(model, seed):
    gen = torch.Generator().manual_seed(seed)
    seen, conventions = set(), {}
    for mod_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            p.copy_(bf16_exact(draw_parameter(mod_name, module, pname, p, gen, conventions)))
        for bname, b in module.named_buffers(recurse=False):
            if b is None or bname in module._non_persistent_buffers_set:
                continue
            if bname == "e_score_correction_bias":
                b.copy_(bf16_exact(torch.randn(b.shape, generator=gen) * 0.1))
            else:
                log(f"  persistent buffer left at its init: {mod_name}.{bname} {tuple(b.shape)}")
    for cls, conv in sorted(conventions.items()):
        log(f"  norm convention (from init values): {cls}: {conv}")


def save_bf16(model, out_dir):
    """save_pretrained in BF16; buffers that transformers keeps in fp32 (e_score_correction_bias) stay fp32."""
    fp32_buffers = {}
    for mod_name, module in model.named_modules():
        for bname, b in module.named_buffers(recurse=False):
            if bname == "e_score_correction_bias":
                fp32_buffers[(mod_name, bname)] = b.detach().clone()
    model.to(torch.bfloat16)
    for (mod_name, bname), value in fp32_buffers.items():
        setattr(model.get_submodule(mod_name), bname, value.float())
    model.save_pretrained(out_dir)


# ----------------------------------------------------------------------------------------------------------------
# safetensors files


def read_safetensors_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def log_tensor_list(path):
    header = read_safetensors_header(path)
    log(f"  tensors in {path.name} ({len(header)}):")
    for name in sorted(header):
        log(f"    {name} {header[name]['dtype']} {header[name]['shape']}")
    return header


def count_file_text_elements(header):
    """What a loader counts from the tensor file: text tensors only, packed FP4 counted as 2 per byte."""
    total = 0
    for name, info in header.items():
        if name.startswith(("model.visual.", "mtp.")):
            continue
        if name.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
            continue
        n = 1
        for d in info["shape"]:
            n *= d
        total += 2 * n if info["dtype"] == "U8" else n
    return total


# ----------------------------------------------------------------------------------------------------------------
# loading and references


def force_eager_experts(model):
    """transformers' eager experts loop is the reference; grouped/batched mm would only reorder sums."""
    for name, module in model.named_modules():
        cfg = getattr(module, "config", None) if hasattr(module, "gate_up_proj") else None
        if cfg is None:
            continue
        impl = getattr(cfg, "_experts_implementation", None)
        if impl not in (None, "eager"):
            try:
                cfg._experts_implementation = "eager"
            except Exception:  # noqa: BLE001
                if hasattr(model, "set_experts_implementation"):
                    model.set_experts_implementation("eager")
        now = getattr(cfg, "_experts_implementation", None)
        log(f"  experts implementation ({type(module).__name__}): {impl} -> {now}")
        if now not in (None, "eager"):
            FAILURES.append(f"could not select the eager experts implementation ({now})")
        return


def load_reference_model(model_cls, path):
    base = dict(dtype=torch.float32, attn_implementation="eager")
    attempts = ({"experts_implementation": "eager", "output_loading_info": True}, {"output_loading_info": True}, {})
    for i, extra in enumerate(attempts):
        try:
            result = model_cls.from_pretrained(path, **base, **extra)
            break
        except (TypeError, ValueError) as err:
            if i == len(attempts) - 1:
                raise
            log(f"  from_pretrained refused {sorted(extra)}: {err}")
    model, info = result if isinstance(result, tuple) else (result, None)
    if info is not None:
        log(f"  loading info: { {k: sorted(v) if isinstance(v, (set, list)) else v for k, v in info.items()} }")
    force_eager_experts(model)
    model.eval()
    return model


def compare_state(expected_sd, model):
    got = model.state_dict()
    missing = sorted(set(expected_sd) - set(got))
    extra = sorted(set(got) - set(expected_sd))
    worst = 0.0
    for k in set(expected_sd) & set(got):
        if expected_sd[k].shape != got[k].shape:
            raise RuntimeError(f"reloaded {k} has shape {tuple(got[k].shape)}, saved {tuple(expected_sd[k].shape)}")
        worst = max(worst, (expected_sd[k].float() - got[k].float()).abs().max().item())
    log(f"  reload check: max |saved - reloaded| = {worst}; missing {missing}; extra {extra}")
    if worst != 0.0 or missing:
        raise RuntimeError("the reloaded checkpoint differs from the weights that were saved")


def round9(v):
    return float(f"{v:.9g}")


@torch.no_grad()
def teacher_forced(model, ids):
    """Top-k of every position, and the smallest gap between neighbours in the top-(k+1) (a near-tie gauge)."""
    logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
    positions, min_gap = [], float("inf")
    for row in logits:
        vals, idx = torch.topk(row, TOP_K + 1)
        min_gap = min(min_gap, (vals[:-1] - vals[1:]).min().item())
        positions.append({"ids": idx[:TOP_K].tolist(), "logits": [round9(v) for v in vals[:TOP_K].tolist()]})
    return positions, logits, min_gap


@torch.no_grad()
def hf_greedy(model, ids):
    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id = None
    gc.do_sample = False
    gc.num_beams = 1
    gc.max_new_tokens = NEW_TOKENS
    gc.min_new_tokens = None
    gc.pad_token_id = PAD_ID
    model.generation_config = gc
    x = torch.tensor([ids])
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                         max_new_tokens=NEW_TOKENS, pad_token_id=PAD_ID)
    cont = out[0, len(ids):].tolist()
    if len(cont) != NEW_TOKENS:
        raise RuntimeError(f"generate returned {len(cont)} new tokens, wanted {NEW_TOKENS}")
    return cont


@torch.no_grad()
def manual_greedy(model, ids):
    """Greedy decoding by full recomputation (no cache), with the smallest top-1/top-2 logit gap seen."""
    seq, min_gap = list(ids), float("inf")
    for _ in range(NEW_TOKENS):
        row = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].float()
        top2 = torch.topk(row, 2).values
        min_gap = min(min_gap, (top2[0] - top2[1]).item())
        seq.append(int(torch.argmax(row)))
    return seq[len(ids):], min_gap


def compute_reference(model, prompts, label, manual):
    """reference.json content; `manual` holds the no-cache greedy continuations the generate() ones must match."""
    teacher, greedy, all_logits = [], [], []
    for ids, (manual_cont, gap) in zip(prompts, manual):
        positions, logits, tf_gap = teacher_forced(model, ids)
        teacher.append({"positions": positions})
        all_logits.append(logits)
        cont = hf_greedy(model, ids)
        agree = "agrees" if manual_cont == cont else f"DIFFERS: no-cache greedy {manual_cont}"
        log(f"  [{label}] prompt len {len(ids)}: greedy {cont} ({agree}); min greedy top1-top2 gap {gap:.3g}; "
            f"min neighbour gap in teacher-forced top-{TOP_K + 1} {tf_gap:.3g}")
        if manual_cont != cont:
            FAILURES.append(f"{label}: generate() and no-cache greedy differ for prompt length {len(ids)}")
        greedy.append({"continuation": cont})
    ref = {"generator": GENERATOR_NAME, "transformers_version": transformers.__version__,
           "torch_version": torch.__version__, "top_k": TOP_K, "prompts": prompts,
           "teacher_forced": teacher, "greedy": greedy}
    return ref, all_logits


def score_prompts(variants, prompts):
    """Runs every variant on a prompt set; stops early once a hard criterion fails."""
    results, m = [], {"greedy_gap": float("inf"), "top_gap": float("inf"), "distinct": NEW_TOKENS, "eos": False}
    for _, model, _ in variants:
        runs = [manual_greedy(model, ids) for ids in prompts]
        results.append(runs)
        m["greedy_gap"] = min([m["greedy_gap"]] + [g for _, g in runs])
        m["distinct"] = min([m["distinct"]] + [len(set(cont)) for cont, _ in runs])
        m["eos"] |= any(EOS_ID in cont for cont, _ in runs)
        m["top_gap"] = min([m["top_gap"]] + [teacher_forced(model, ids)[2] for ids in prompts])
        if m["eos"] or m["greedy_gap"] < GREEDY_GAP_MIN or m["top_gap"] < TOP_GAP_MIN:
            break
    m["complete"] = len(results) == len(variants)
    return results, m


def search_prompts(family, variants, seed):
    """Draws prompt sets until all variants decode greedily with a clear margin, without EOS and without
    collapsing into repeats, with well separated top-k logits; returns the prompts and, per variant, the
    no-cache greedy results. Without a full match it keeps the best set seen and says what it lacks."""
    best, best_key = None, None
    for attempt in range(PROMPT_ATTEMPTS):
        prompts = make_prompts(seed + attempt, PROMPT_LENGTHS)
        results, m = score_prompts(variants, prompts)
        hard = m["complete"] and not m["eos"] and m["greedy_gap"] >= GREEDY_GAP_MIN
        key = (hard, m["top_gap"] >= TOP_GAP_MIN, m["distinct"], m["greedy_gap"])
        ok = hard and key[1] and m["distinct"] >= GREEDY_DISTINCT_MIN
        log(f"  [{family}] prompt seed {seed + attempt}: min greedy gap {m['greedy_gap']:.3g}, min top-k gap "
            f"{m['top_gap']:.3g}, EOS generated: {m['eos']}, fewest distinct tokens in a continuation: "
            f"{m['distinct']} -> {'accepted' if ok else 'rejected'}")
        if ok:
            return prompts, results
        if m["complete"] and (best_key is None or key > best_key):
            best, best_key = (prompts, results), key
    if best is None:
        raise RuntimeError(f"{family}: no prompt set could be evaluated")
    log(f"  [{family}] WARNING: no prompt set met every criterion; using the best one: {best_key}")
    if not best_key[0]:
        FAILURES.append(f"{family}: greedy references have a top-1/top-2 gap below {GREEDY_GAP_MIN} or EOS")
    return best


def write_references(family, variants, seed, fp64_labels=()):
    """variants: (label, model, output path). All variants of a family share one prompt set."""
    prompts, manual = search_prompts(family, variants, seed)
    for (label, model, path), runs in zip(variants, manual):
        ref, logits = compute_reference(model, prompts, label, runs)
        write_json(path, ref, compact=True)
        if label in fp64_labels:
            check_fp64(model, prompts, ref, logits, label)
    return prompts


def check_fp64(model, prompts, ref, logits32, label):
    """Recomputes in fp64: a differing top-k or greedy token means the fp32 reference sits on a near-tie."""
    try:
        m64 = copy.deepcopy(model).double()
    except Exception as err:  # noqa: BLE001
        log(f"  [{label}] fp64 check skipped: {err}")
        return
    worst, same_ids = 0.0, True
    for ids, tf, l32 in zip(prompts, ref["teacher_forced"], logits32):
        with torch.no_grad():
            l64 = m64(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
        worst = max(worst, (l64 - l32.double()).abs().max().item())
        for pos, row in zip(tf["positions"], l64):
            same_ids &= torch.topk(row, TOP_K).indices.tolist() == pos["ids"]
    greedy_same = all(manual_greedy(m64, ids)[0] == g["continuation"] for ids, g in zip(prompts, ref["greedy"]))
    log(f"  [{label}] fp64 vs fp32: max |dlogit| {worst:.3g}; top-{TOP_K} ids equal: {same_ids}; "
        f"greedy equal: {greedy_same}")
    if not greedy_same:
        FAILURES.append(f"{label}: fp64 recomputation changes greedy tokens (near-tie)")
    elif not same_ids:
        log(f"  [{label}] WARNING: fp64 reorders near-equal logits inside a top-{TOP_K} list")


def check_dsa_effect(model, prompts, label):
    """Logs how much the DSA top-k changes the outputs (index_topk raised past every sequence length)."""
    dense = copy.deepcopy(model)
    n = 0
    for module in dense.modules():
        if hasattr(module, "index_topk"):
            module.index_topk = 1 << 20
            n += 1
    with torch.no_grad():
        ids = torch.tensor([prompts[-1]])
        diff = (model(input_ids=ids, use_cache=False).logits - dense(input_ids=ids, use_cache=False).logits)
    greedy_changes = manual_greedy(model, prompts[-1])[0] != manual_greedy(dense, prompts[-1])[0]
    log(f"  [{label}] DSA effect ({n} indexers): max |dlogit| sparse vs dense on the longest prompt "
        f"{diff.abs().max().item():.3g}; greedy changes: {greedy_changes}")


def write_json(path, obj, compact):
    with open(path, "w") as f:
        if compact:
            json.dump(obj, f, separators=(",", ":"))
        else:
            json.dump(obj, f, indent=2)
        f.write("\n")


# ----------------------------------------------------------------------------------------------------------------
# expected `tern info` numbers, from the instantiated modules


def text_part_names(model):
    """Module-name prefixes of the text model: language_model + lm_head for ConditionalGeneration."""
    if hasattr(model.model, "language_model"):
        return model.model.language_model, ("model.language_model.", "lm_head")
    return model.model, ("",)


def in_text(name, prefixes):
    return any(name == p.rstrip(".") or name.startswith(p) for p in prefixes)


def count_total(model, prefixes):
    seen, total = set(), 0
    for name, t in model.state_dict().items():
        if not in_text(name, prefixes):
            continue
        key = (t.data_ptr(), t.numel())
        if key in seen:
            continue
        seen.add(key)
        total += t.numel()
    return total


def routed_expert_size(experts, num_experts):
    if isinstance(experts, nn.ModuleList):
        return sum(p.numel() for p in experts[0].parameters())
    size = sum(p.numel() for p in experts.parameters(recurse=False))
    assert size % num_experts == 0
    return size // num_experts


def list_linears(model, prefixes, num_experts):
    """(name, kind) of every y = x @ W^T matrix of the text model; fused experts are expanded per expert."""
    out, counted = [], set()
    for name, module in model.named_modules():
        if not in_text(name, prefixes):
            continue
        if isinstance(module, nn.Linear):
            out.append((name, "linear"))
            counted.add(id(module.weight))
        elif hasattr(module, "gate_up_proj") and module.gate_up_proj.dim() == 3:
            for e in range(num_experts):
                out += [(f"{name}.{e}.{p}", "expert") for p in ("gate_proj", "up_proj", "down_proj")]
            counted.update({id(module.gate_up_proj), id(module.down_proj)})
        elif "Router" in type(module).__name__ and getattr(module, "weight", None) is not None:
            out.append((name, "router"))
            counted.add(id(module.weight))
    for name, p in model.named_parameters():
        if in_text(name, prefixes) and p.dim() >= 2 and id(p) not in counted:
            log(f"  not a linear layer (by the definition): {name} {tuple(p.shape)}")
    return out


def expected_info(model, quantized=None):
    text_model, prefixes = text_part_names(model)
    tcfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    num_experts = getattr(tcfg, "num_experts", None) or getattr(tcfg, "n_routed_experts", None) or 0
    top_k = getattr(tcfg, "num_experts_per_tok", 0) if num_experts else 0
    layers = {"full_attention": 0, "linear_attention": 0, "moe": 0, "dense_mlp": 0}
    inactive = 0
    for layer in text_model.layers:
        layers["linear_attention" if hasattr(layer, "linear_attn") else "full_attention"] += 1
        if hasattr(layer.mlp, "experts"):
            layers["moe"] += 1
            inactive += (num_experts - top_k) * routed_expert_size(layer.mlp.experts, num_experts)
        else:
            layers["dense_mlp"] += 1
    total = count_total(model, prefixes)
    linears = list_linears(model, prefixes, num_experts)
    n_fp4 = sum(1 for name, kind in linears if quantized is not None and quantized(name, kind))
    info = {"architecture": model.config.model_type,
            "parameters": {"total": total, "active_per_token": total - inactive},
            "linear_layers": {"nvfp4": n_fp4, "bf16": len(linears) - n_fp4},
            "layers": layers, "experts": {"num_experts": num_experts, "top_k": top_k}}
    return info, linears


# ----------------------------------------------------------------------------------------------------------------
# BF16 fixtures


def append_mtp_tensors(path, hidden, seed):
    """Qwen3.5 checkpoints carry an MTP head under mtp.*; transformers ignores it (^mtp.*)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(str(path))

    def zero_centred_norm():
        return (torch.randn(hidden, generator=gen) * 0.1).to(torch.bfloat16)

    tensors["mtp.fc.weight"] = (torch.randn(hidden, 2 * hidden, generator=gen) * 0.05).to(torch.bfloat16)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm", "layers.0.input_layernorm"):
        tensors[f"mtp.{name}.weight"] = zero_centred_norm()
    save_file(tensors, str(path), metadata={"format": "pt"})


def build_bf16_fixture(name, model_cls, config, out_root, seed):
    """Writes the checkpoint and expected_info.json; returns the fp32 model read back from disk."""
    log(f"=== {name}: {model_cls.__name__} ===")
    out_dir = out_root / name
    shutil.rmtree(out_dir, ignore_errors=True)
    torch.manual_seed(seed)
    model = model_cls(config)
    model.eval()
    randomize_weights(model, seed)
    if VERBOSE:
        log(str(model))
    saved_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_bf16(model, out_dir)
    if name == "qwen3_5_moe":
        append_mtp_tensors(out_dir / "model.safetensors", config.text_config.hidden_size, seed + 100)
    log(f"  files: {sorted(p.name for p in out_dir.iterdir())}")
    log(f"  config.json: {json.dumps(json.load(open(out_dir / 'config.json')), sort_keys=True)}")
    header = log_tensor_list(out_dir / "model.safetensors")
    ref_model = load_reference_model(model_cls, out_dir)
    compare_state(saved_sd, ref_model)
    info, _ = expected_info(ref_model)
    write_json(out_dir / "expected_info.json", info, compact=False)
    log(f"  expected_info: {json.dumps(info)}")
    file_total = count_file_text_elements(header)
    log(f"  file-based text element count {file_total} vs expected total {info['parameters']['total']}")
    if file_total != info["parameters"]["total"]:
        FAILURES.append(f"{name}: tensor-file element count {file_total} != module count")
    return ref_model


def build_simple_family(name, model_cls, config, out_root, seed, prompt_seed):
    model = build_bf16_fixture(name, model_cls, config, out_root, seed)
    prompts = write_references(name, [(name, model, out_root / name / "reference.json")], prompt_seed,
                               fp64_labels=(name,))
    if name == "glm_moe_dsa":
        check_dsa_effect(model, prompts, name)


def build_fused_variant(out_root, reference_model):
    """The qwen3_5_moe weights in the layout of the real Qwen3.5 BF16 release: routed experts fused as
    mlp.experts.gate_up_proj [E, 2I, H] (gate rows first) and mlp.experts.down_proj [E, H, I]."""
    log("=== qwen3_5_moe_fused: qwen3_5_moe with fused expert tensors ===")
    src_dir, out_dir = out_root / "qwen3_5_moe", out_root / "qwen3_5_moe_fused"
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    tensors = load_file(str(src_dir / "model.safetensors"))
    tcfg = json.load(open(src_dir / "config.json"))["text_config"]
    for i in range(tcfg["num_hidden_layers"]):
        prefix = f"model.language_model.layers.{i}"
        experts = expert_weights(tensors, prefix, tcfg["num_experts"], tcfg["moe_intermediate_size"])
        tensors[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u, _ in experts])
        tensors[f"{prefix}.mlp.experts.down_proj"] = torch.stack([d for _, _, d in experts])
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for f in ("config.json", "generation_config.json"):
        shutil.copy(src_dir / f, out_dir / f)
    log_tensor_list(out_dir / "model.safetensors")
    model = load_reference_model(transformers.Qwen3_5MoeForConditionalGeneration, out_dir)
    compare_state(reference_model.state_dict(), model)


# ----------------------------------------------------------------------------------------------------------------
# NVFP4 fixture (ModelOpt export layout, derived from the qwen3_5_moe fixture)


def expert_weights(sd, prefix, num_experts, inter):
    """(gate, up, down) bf16 weights of each routed expert, whichever layout transformers saved."""
    fused = f"{prefix}.mlp.experts.gate_up_proj"
    if fused in sd:
        gate_up, down = sd.pop(fused), sd.pop(f"{prefix}.mlp.experts.down_proj")
        return [(gate_up[e, :inter], gate_up[e, inter:], down[e]) for e in range(num_experts)]
    out = []
    for e in range(num_experts):
        base = f"{prefix}.mlp.experts.{e}"
        out.append(tuple(sd.pop(f"{base}.{p}_proj.weight") for p in ("gate", "up", "down")))
    return out


def put_quantized(dst, name, w, wsf2):
    packed, scale = nvfp4.quantize_weight(w.contiguous(), wsf2)
    dst[f"{name}.weight"] = packed
    dst[f"{name}.weight_scale"] = scale
    dst[f"{name}.weight_scale_2"] = wsf2.reshape(()).clone()


def quantize_checkpoint(sd, tcfg):
    """Replaces full-attention q/k/v/o and the routed experts by NVFP4 tensors (input_scale added later)."""
    out = dict(sd)
    for i, layer_type in enumerate(tcfg["layer_types"]):
        prefix = f"model.language_model.layers.{i}"
        if layer_type == "full_attention":
            names = {p: f"{prefix}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
            ws = {p: out.pop(f"{n}.weight") for p, n in names.items()}
            qkv_scale = nvfp4.scale_from_amax(max(nvfp4.weight_amax(ws[p]) for p in ("q_proj", "k_proj", "v_proj")))
            for p in ("q_proj", "k_proj", "v_proj"):
                put_quantized(out, names[p], ws[p], qkv_scale)
            put_quantized(out, names["o_proj"], ws["o_proj"], nvfp4.scale_from_amax(nvfp4.weight_amax(ws["o_proj"])))
        experts = expert_weights(out, prefix, tcfg["num_experts"], tcfg["moe_intermediate_size"])
        for e, (gate, up, down) in enumerate(experts):
            base = f"{prefix}.mlp.experts.{e}"
            gate_up_scale = nvfp4.scale_from_amax(torch.maximum(nvfp4.weight_amax(gate), nvfp4.weight_amax(up)))
            put_quantized(out, f"{base}.gate_proj", gate, gate_up_scale)
            put_quantized(out, f"{base}.up_proj", up, gate_up_scale)
            put_quantized(out, f"{base}.down_proj", down, nvfp4.scale_from_amax(nvfp4.weight_amax(down)))
    return out


def dequant(tensors, name):
    return nvfp4.dequantize_weight(tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"],
                                   tensors[f"{name}.weight_scale_2"])


@torch.no_grad()
def apply_nvfp4_weights(model, tensors):
    """Sets the fp32 model's quantized weights to their ModelOpt dequantization (W4A16)."""
    for i, layer in enumerate(model.model.language_model.layers):
        prefix = f"model.language_model.layers.{i}"
        if hasattr(layer, "self_attn"):
            for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer.self_attn, p).weight.copy_(dequant(tensors, f"{prefix}.self_attn.{p}"))
        experts = layer.mlp.experts
        for e in range(experts.gate_up_proj.shape[0]):
            base = f"{prefix}.mlp.experts.{e}"
            gate_up = torch.cat([dequant(tensors, f"{base}.gate_proj"), dequant(tensors, f"{base}.up_proj")])
            experts.gate_up_proj[e].copy_(gate_up)
            experts.down_proj[e].copy_(dequant(tensors, f"{base}.down_proj"))


def attention_linears(model):
    for i, layer in enumerate(model.model.language_model.layers):
        if hasattr(layer, "self_attn"):
            for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
                yield f"model.language_model.layers.{i}.self_attn.{p}", getattr(layer.self_attn, p)


def moe_experts(model):
    for i, layer in enumerate(model.model.language_model.layers):
        yield f"model.language_model.layers.{i}.mlp.experts", layer.mlp.experts


@torch.no_grad()
def calibrate(model, prompts):
    """Input amax of every quantized linear over the calibration prompts, on the W4A16 model."""
    amax, handles = {}, []

    def record(key, x):
        value = x.detach().abs().amax().float()
        amax[key] = torch.maximum(amax[key], value) if key in amax else value
        return x

    for name, lin in attention_linears(model):
        handles.append(lin.register_forward_pre_hook(lambda m, args, key=name: (record(key, args[0]),)))
    for name, experts in moe_experts(model):
        experts.forward = types.MethodType(nvfp4.make_experts_forward(
            lambda e, x, key=f"{name}.gate_up": record(key, x),
            lambda e, h, key=f"{name}.down": record(key, h)), experts)
    for ids in prompts:
        model(input_ids=torch.tensor([ids]), use_cache=False)
    for h in handles:
        h.remove()
    for _, experts in moe_experts(model):
        del experts.forward
    return amax


def add_input_scales(tensors, amax, tcfg):
    for i, layer_type in enumerate(tcfg["layer_types"]):
        prefix = f"model.language_model.layers.{i}"
        if layer_type == "full_attention":
            attn = f"{prefix}.self_attn"
            qkv = torch.stack([amax[f"{attn}.{p}"] for p in ("q_proj", "k_proj", "v_proj")]).max()
            for p in ("q_proj", "k_proj", "v_proj"):
                tensors[f"{attn}.{p}.input_scale"] = nvfp4.scale_from_amax(qkv).reshape(())
            tensors[f"{attn}.o_proj.input_scale"] = nvfp4.scale_from_amax(amax[f"{attn}.o_proj"]).reshape(())
        gate_up = nvfp4.scale_from_amax(amax[f"{prefix}.mlp.experts.gate_up"]).reshape(())
        down = nvfp4.scale_from_amax(amax[f"{prefix}.mlp.experts.down"]).reshape(())
        for e in range(tcfg["num_experts"]):
            base = f"{prefix}.mlp.experts.{e}"
            tensors[f"{base}.gate_proj.input_scale"] = gate_up.clone()
            tensors[f"{base}.up_proj.input_scale"] = gate_up.clone()
            tensors[f"{base}.down_proj.input_scale"] = down.clone()


def install_w4a4(model, tensors):
    """Fake-quantizes the input of every quantized linear (attention q/k/v/o, each routed expert's gate/up and
    down) with the input_scale the checkpoint stores for it."""
    for name, lin in attention_linears(model):
        scale = tensors[f"{name}.input_scale"]
        lin.register_forward_pre_hook(lambda m, args, s=scale: (nvfp4.fake_quantize_activation(args[0], s),))
    for name, experts in moe_experts(model):
        gate = [tensors[f"{name}.{e}.gate_proj.input_scale"] for e in range(experts.gate_up_proj.shape[0])]
        up = [tensors[f"{name}.{e}.up_proj.input_scale"] for e in range(experts.gate_up_proj.shape[0])]
        down = [tensors[f"{name}.{e}.down_proj.input_scale"] for e in range(experts.gate_up_proj.shape[0])]
        assert all(torch.equal(g, u) for g, u in zip(gate, up)), "gate and up must share their input_scale"
        experts.forward = types.MethodType(nvfp4.make_experts_forward(
            lambda e, x, s=gate: nvfp4.fake_quantize_activation(x, s[e]),
            lambda e, h, s=down: nvfp4.fake_quantize_activation(h, s[e])), experts)


def check_custom_experts(model, prompt):
    """The patched experts loop, with nothing replaced, must reproduce transformers' own experts forward."""
    with torch.no_grad():
        base = model(input_ids=torch.tensor([prompt]), use_cache=False).logits
        for _, experts in moe_experts(model):
            experts.forward = types.MethodType(nvfp4.make_experts_forward(lambda e, x: x, lambda e, h: h), experts)
        patched = model(input_ids=torch.tensor([prompt]), use_cache=False).logits
        for _, experts in moe_experts(model):
            del experts.forward
    diff = (base - patched).abs().max().item()
    log(f"  patched experts loop vs transformers experts: max |dlogit| = {diff}")
    if diff > 1e-5:
        raise RuntimeError("the patched experts forward does not reproduce transformers")


def nvfp4_quantized(name, kind):
    if kind == "expert":
        return True
    return re.search(r"\.self_attn\.[qkvo]_proj$", name) is not None


def check_excludes(linears):
    for name, kind in linears:
        excluded = any(fnmatch.fnmatchcase(name, pat) for pat in NVFP4_EXCLUDES)
        if excluded == nvfp4_quantized(name, kind):
            raise RuntimeError(f"exclude list and quantized set disagree on {name}")
    log(f"  exclude patterns agree with the quantized set on all {len(linears)} linear layers")


def write_quant_configs(src_dir, out_dir):
    cfg = json.load(open(src_dir / "config.json"))
    cfg["quantization_config"] = {
        "quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": NVFP4_EXCLUDES,
        "config_groups": {"group_0": {
            "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
            "input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
            "targets": ["Linear"]}},
        "producer": MODELOPT_PRODUCER}
    write_json(out_dir / "config.json", cfg, compact=False)
    hf_quant = {"producer": MODELOPT_PRODUCER,
                "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                 "exclude_modules": NVFP4_EXCLUDES}}
    write_json(out_dir / "hf_quant_config.json", hf_quant, compact=False)
    if (src_dir / "generation_config.json").exists():
        shutil.copy(src_dir / "generation_config.json", out_dir / "generation_config.json")


def log_quant_stats(tensors, sd):
    worst = 0.0
    for name in sorted(k[:-len(".weight_scale_2")] for k in tensors if k.endswith(".weight_scale_2")):
        if f"{name}.weight" in sd:
            w = sd[f"{name}.weight"].float()
            worst = max(worst, ((dequant(tensors, name) - w).norm() / w.norm()).item())
    log(f"  worst relative NVFP4 weight error over the quantized matrices: {worst:.3f}")


def log_input_scales(tensors):
    for name in sorted(k for k in tensors if k.endswith(".input_scale")):
        if ".experts." in name and ".experts.0." not in name:
            continue
        log(f"    {name} = {tensors[name].item():.6g}")


def build_nvfp4_fixture(out_root, calib_prompts):
    """Writes the NVFP4 checkpoint; returns the W4A16 and W4A4 fp32 models built from what the file stores."""
    log("=== qwen3_5_moe_nvfp4: ModelOpt NVFP4 export of the qwen3_5_moe weights ===")
    log(f"  NVFP4 self test: weight round-trip relative error {nvfp4.self_test():.3f}")
    src_dir, out_dir = out_root / "qwen3_5_moe", out_root / "qwen3_5_moe_nvfp4"
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    cls = transformers.Qwen3_5MoeForConditionalGeneration
    tcfg = json.load(open(src_dir / "config.json"))["text_config"]
    sd = load_file(str(src_dir / "model.safetensors"))
    tensors = quantize_checkpoint(sd, tcfg)
    log_quant_stats(tensors, sd)
    model = load_reference_model(cls, src_dir)
    apply_nvfp4_weights(model, tensors)
    add_input_scales(tensors, calibrate(model, calib_prompts), tcfg)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    write_quant_configs(src_dir, out_dir)
    header = log_tensor_list(out_dir / "model.safetensors")
    log("  input scales (experts: expert 0 shown; all experts of a layer share them):")
    stored = load_file(str(out_dir / "model.safetensors"))  # the references use what the file says
    log_input_scales(stored)
    w4a16 = load_reference_model(cls, src_dir)
    apply_nvfp4_weights(w4a16, stored)
    check_custom_experts(w4a16, calib_prompts[0])
    info, linears = expected_info(w4a16, nvfp4_quantized)
    check_excludes(linears)
    write_json(out_dir / "expected_info.json", info, compact=False)
    log(f"  expected_info: {json.dumps(info)}")
    file_total = count_file_text_elements(header)
    log(f"  file-based text element count {file_total} vs expected total {info['parameters']['total']}")
    if file_total != info["parameters"]["total"]:
        FAILURES.append(f"qwen3_5_moe_nvfp4: tensor-file element count {file_total} != module count")
    w4a4 = load_reference_model(cls, src_dir)
    apply_nvfp4_weights(w4a4, stored)
    install_w4a4(w4a4, stored)
    return w4a16, w4a4


def build_qwen3_5_family(out_root, prompt_seed, calib_prompts):
    """qwen3_5_moe (BF16), its fused-expert twin and its NVFP4 export; all references share one prompt set."""
    bf16 = build_bf16_fixture("qwen3_5_moe", transformers.Qwen3_5MoeForConditionalGeneration,
                              config_qwen3_5_moe(), out_root, 1003)
    run_step("qwen3_5_moe_fused", lambda: build_fused_variant(out_root, bf16))
    w4a16, w4a4 = build_nvfp4_fixture(out_root, calib_prompts)
    nv_dir = out_root / "qwen3_5_moe_nvfp4"
    variants = [("qwen3_5_moe", bf16, out_root / "qwen3_5_moe" / "reference.json"),
                ("nvfp4 W4A16", w4a16, nv_dir / "reference_w4a16.json"),
                ("nvfp4 W4A4", w4a4, nv_dir / "reference_w4a4.json")]
    write_references("qwen3_5_moe family", variants, prompt_seed, fp64_labels=("qwen3_5_moe", "nvfp4 W4A16"))
    fused_dir = out_root / "qwen3_5_moe_fused"
    if (fused_dir / "model.safetensors").exists():
        for f in ("reference.json", "expected_info.json"):
            shutil.copy(out_root / "qwen3_5_moe" / f, fused_dir / f)


# ----------------------------------------------------------------------------------------------------------------


def run_step(label, fn):
    try:
        fn()
    except Exception:  # noqa: BLE001 - one broken fixture must not hide the others
        FAILURES.append(f"{label}: {traceback.format_exc()}")
        log(f"!!! {label} failed:\n{traceback.format_exc()}")


def main():
    global VERBOSE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="fixture root, e.g. tests/fixtures")
    parser.add_argument("--only", nargs="*", help="families to build: qwen3 qwen3_moe glm_moe_dsa qwen3_5_moe")
    parser.add_argument("--verbose", action="store_true", help="also print each model's module tree")
    args = parser.parse_args()
    VERBOSE = args.verbose
    torch.set_num_threads(1)
    log(f"torch {torch.__version__}, transformers {transformers.__version__}")
    args.out.mkdir(parents=True, exist_ok=True)
    calib = make_prompts(4321, (CALIBRATION_LENGTH,) * CALIBRATION_PROMPTS)
    glm_cls = getattr(transformers, "GlmMoeDsaForCausalLM", None)
    steps = {
        "qwen3": lambda: build_simple_family("qwen3", transformers.Qwen3ForCausalLM, config_qwen3(), args.out,
                                             1001, 10_000),
        "qwen3_moe": lambda: build_simple_family("qwen3_moe", transformers.Qwen3MoeForCausalLM, config_qwen3_moe(),
                                                 args.out, 1002, 20_000),
        "glm_moe_dsa": (lambda: build_simple_family("glm_moe_dsa", glm_cls,
                                                    config_glm_moe_dsa(transformers.GlmMoeDsaConfig), args.out,
                                                    1004, 40_000)) if glm_cls else None,
        "qwen3_5_moe": lambda: build_qwen3_5_family(args.out, 30_000, calib),
    }
    for name, step in steps.items():
        if args.only and name not in args.only:
            continue
        if step is None:
            log(f"=== {name}: skipped, transformers {transformers.__version__} has no GlmMoeDsaForCausalLM ===")
            continue
        run_step(name, step)
    total = 0
    for p in sorted(args.out.rglob("*")):
        if p.is_file():
            total += p.stat().st_size
            log(f"  {p.relative_to(args.out)}: {p.stat().st_size} bytes")
    log(f"  total {total} bytes")
    if FAILURES:
        log("FAILURES:\n" + "\n".join(FAILURES))
        sys.exit(1)
    log("all fixtures written")


if __name__ == "__main__":
    main()
