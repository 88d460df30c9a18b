#!/usr/bin/env python3
"""`tern bench` under tensor parallelism, on a machine without GPUs: `--plan-only` on the full-size bench configs, its
per-rank numbers against what is worked out here from each config.json (the sharding rules of docs/architecture.md,
not tern's output), a split that cannot be made failing with the tensor's name, the plan staying fast and small; and
a real run at --tp 2 on the CPU reporting the same per-rank numbers as its plan and its all-reduces timed.

usage: bench_tp_cli_test.py TERN SOURCE_DIR FIXTURES_DIR
"""
import json
import math
import random
import resource
import subprocess
import sys
import time

NVFP4 = 0.5 + 1 / 16  # bytes per element: the e2m1 codes and one e4m3 scale per 16


def run(*args):
    return subprocess.run(list(args), capture_output=True, text=True, timeout=120)


def plan(tern, model, *args):
    out = run(tern, "bench", "--plan-only", "--model", model, "--json", *args)
    assert out.returncode == 0, f"{args}: exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    return json.loads(out.stdout)


def vocab_rows(vocab, world):
    """Rank 0's rows: the vocabulary padded to a multiple of 64 x world, split evenly."""
    return min(vocab, math.ceil(vocab / (64 * world)) * 64)


def close(a, b, what):
    assert math.isclose(a, b, rel_tol=1e-12), f"{what}: tern {a}, expected {b}"


def qwen3_5_rank(c, w):
    """Rank 0 of Qwen3.5-MoE at TP w: the routed experts NVFP4, the rest BF16 (the config's ignore list)."""
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    attn = sum((i + 1) % c["full_attention_interval"] == 0 for i in range(layers))
    gdn = layers - attn
    nq, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    e, inter, shared = c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    kv = max(1, nkv // w)  # KV heads: replicated when fewer than the ranks
    gdn_rows = (2 * nk * dk + nv * dv) // w + nv * dv // w + 2 * nv // w  # in_proj_qkv, z, b, a
    gdn_bytes = 2 * h * (gdn_rows + nv * dv // w)  # + out_proj's columns
    attn_bytes = 2 * h * (2 * nq * hd // w + 2 * kv * hd + nq * hd // w)  # q (with its gate), k, v, o
    moe_dense = 2 * h * (e + 3 * shared // w + 1)  # router, shared expert, shared expert gate
    rows = vocab_rows(c["vocab_size"], w)
    dense = gdn * gdn_bytes + attn * attn_bytes + layers * moe_dense + 2 * rows * h  # lm_head
    experts = layers * e * 3 * h * (inter // w) * NVFP4
    return {
        "dense": dense,
        "expert_one": 3 * h * (inter // w) * NVFP4,
        "experts": experts,
        "embedding": 2 * rows * h,
        "kv": attn * 2 * kv * hd * 2,
        "state": gdn * (nv // w * dk * dv * 4
                        + (2 * nk // w * dk + nv // w * dv) * (c["linear_conv_kernel_dim"] - 1) * 2),
        "layers": layers, "e": e, "k": c["num_experts_per_tok"], "h": h, "vocab": c["vocab_size"],
    }


def check_qwen3_5(tern, model, config, w, batches, context, hbm):
    r = plan(tern, model, "--tp", str(w), "--batch", ",".join(map(str, batches)), "--context", str(context),
             "--hbm-gbs", str(hbm))
    x = qwen3_5_rank(config, w)
    what = f"{model} at --tp {w}"
    assert r["tensor_parallel_size"] == w and r["plan_only"] is True, r
    weights = r["weights"]
    close(weights["dense_bytes"], x["dense"], what + " dense")
    close(weights["expert_bytes"], x["experts"], what + " experts")
    close(weights["embedding_bytes"], x["embedding"], what + " embedding")
    total = x["dense"] + x["experts"] + x["embedding"]
    close(weights["per_rank_bytes"], total, what + " per rank")
    close(r["kv_bytes_per_token"], x["kv"], what + " kv")
    close(r["state_bytes_per_sequence"], x["state"], what + " state")
    c = r["collectives_computed"]
    assert c["all_reduces_per_step"] == 2 * x["layers"] + 1, c
    assert r["all_reduce_ms_per_step_measured"] is None and "measured" in r["measured_note"], r
    for row, coll, b in zip(r["rows"], c["decode"], batches):
        assert row["batch"] == b and coll["batch"] == b, (row, coll)
        close(coll["all_reduce_bytes_each"], b * x["h"] * 2, what + " all-reduce")
        close(coll["all_reduce_bytes_per_step"], (2 * x["layers"] + 1) * b * x["h"] * 2, what + " all-reduces")
        close(coll["logits_all_gather_bytes"], b * vocab_rows(x["vocab"], w) * w * 2, what + " all-gather")
        close(row["memory_bytes"], total + b * (context * x["kv"] + x["state"]), what + " memory")
        hit = x["e"] * (1 - (1 - x["k"] / x["e"]) ** b)  # distinct experts of b tokens, top-k of e
        step = x["dense"] + x["layers"] * hit * x["expert_one"] + b * (context * x["kv"] + 2 * x["state"])
        close(row["decode_bytes_per_step"], step, what + " bytes per step")
        close(row["decode_ms_per_step_at_hbm"], step / (hbm * 1e9) * 1e3, what + " ms per step")
    return r


def busiest_rank_experts(experts, ranks, top_k, tokens, draws=3000):
    """Expected distinct chosen experts on the expert-parallel rank holding most of them, uniform routing."""
    rng = random.Random(7)
    total = 0
    for _ in range(draws):
        hit = set()
        for _ in range(tokens):
            hit.update(rng.sample(range(experts), top_k))
        per_rank = [0] * ranks
        for e in hit:
            per_rank[e // (experts // ranks)] += 1
        total += max(per_rank)
    return total / draws


def refuses(tern, model, w, tensor):
    out = run(tern, "bench", "--plan-only", "--model", model, "--tp", str(w))
    assert out.returncode == 2, f"--tp {w}: exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    assert f"tensor '{tensor}'" in out.stderr and f"world size {w}" in out.stderr, out.stderr


def main():
    tern, source, fixtures = sys.argv[1:4]
    configs = f"{source}/bench/configs"
    start = time.monotonic()

    full = f"{configs}/qwen3.5-397b-a17b-nvfp4"
    with open(f"{full}/config.json") as f:
        config = json.load(f)
    ignore = set(config["quantization_config"]["ignore"])
    assert {"lm_head", "*linear_attn*", "*self_attn*", "*mlp.gate", "*shared_expert*"} <= ignore, ignore
    c = config["text_config"]
    r8 = check_qwen3_5(tern, full, c, 8, [1, 8, 64], 4096, 4800)
    check_qwen3_5(tern, full, c, 4, [1, 32], 1024, 3900)
    refuses(tern, full, 3, "model.language_model.layers.0.linear_attn.in_proj_qkv.weight")

    # Expert parallelism: 1/8 of the 512 experts whole on each rank instead of 1/8 of every expert: the same bytes a
    # rank holds; a decode step reads the whole experts the busiest rank holds of those the batch chose (drawn here
    # with Python's generator: within 3% of tern's draws), more than the TP slices' average at a small batch.
    # SGLang's --ep-size 8 says the same, and an --ep-size other than the --tp is refused naming the flag.
    ep_args = ["--tp", "8", "--batch", "1,8,64", "--context", "4096", "--hbm-gbs", "4800"]
    x8 = qwen3_5_rank(c, 8)
    for flags in (["--enable-expert-parallel"], ["--ep-size", "8"]):
        ep = plan(tern, full, *ep_args, *flags)
        assert ep["weights"]["experts"] == c["num_experts"] // 8, (flags, ep["weights"])
        assert ep["weights"]["router_experts"] == c["num_experts"], (flags, ep["weights"])
        assert r8["weights"]["experts"] == c["num_experts"], r8["weights"]
        for key in ("per_rank_bytes", "dense_bytes", "expert_bytes", "embedding_bytes"):
            close(ep["weights"][key], r8["weights"][key], f"expert-parallel {key}")
        for a, b in zip(ep["rows"], r8["rows"]):
            busiest = busiest_rank_experts(x8["e"], 8, x8["k"], a["batch"])
            step = (x8["dense"] + x8["layers"] * busiest * 8 * x8["expert_one"]
                    + a["batch"] * (4096 * x8["kv"] + 2 * x8["state"]))
            assert math.isclose(a["decode_bytes_per_step"], step, rel_tol=0.03), (a, step)
            if a["batch"] == 1:
                assert a["decode_bytes_per_step"] > 1.1 * b["decode_bytes_per_step"], (a, b)
    text = run(tern, "bench", "--plan-only", "--model", full, *ep_args, "--enable-expert-parallel")
    share = f"{c['num_experts'] // 8} of the {c['num_experts']} experts, whole"
    assert text.returncode == 0 and share in text.stdout, text
    bad = run(tern, "bench", "--plan-only", "--model", full, "--tp", "8", "--ep-size", "4")
    assert bad.returncode == 2 and "--expert-parallel-size 4" in bad.stderr, bad

    # The one-GPU share of the 8-way split, unsplit, is the full model's rank 0 at --tp 8.
    tp8 = f"{configs}/qwen3.5-397b-a17b-nvfp4-tp8"
    share = plan(tern, tp8, "--batch", "1,8,64", "--context", "4096")
    for key in ("per_rank_bytes", "dense_bytes", "expert_bytes", "embedding_bytes"):
        close(share["weights"][key], r8["weights"][key], f"tp8 share {key}")
    # Its 31040-row vocabulary over 2 ranks: padded to 2 x 15552 rows (243 x 64 each).
    with open(f"{tp8}/config.json") as f:
        c8 = json.load(f)["text_config"]
    two = plan(tern, tp8, "--tp", "2", "--batch", "3")
    close(two["collectives_computed"]["decode"][0]["logits_all_gather_bytes"], 3 * 15552 * 2 * 2, "padded gather")
    close(two["weights"]["embedding_bytes"], 15552 * c8["hidden_size"] * 2, "padded embedding rows")
    refuses(tern, tp8, 8, "model.language_model.layers.0.linear_attn.in_proj_qkv.weight")

    # GLM-5: its blocks (MLA with the DSA indexer, sigmoid-routed MoE), one rank's weights and caches, and the
    # collectives of a decode step.
    glm = f"{configs}/glm-5-nvfp4"
    with open(f"{glm}/config.json") as f:
        g = json.load(f)
    h, w = g["hidden_size"], 8
    heads, moe_layers = g["num_attention_heads"], g["num_hidden_layers"] - g["first_k_dense_replace"]
    r = plan(tern, glm, "--tp", str(w), "--batch", "1", "--context", "2048")
    assert r["collectives_computed"]["all_reduces_per_step"] == 2 * g["num_hidden_layers"] + 1, r
    close(r["weights"]["expert_bytes"],
          moe_layers * g["n_routed_experts"] * 3 * h * g["moe_intermediate_size"] // w * NVFP4, "GLM-5 experts")
    close(r["weights"]["embedding_bytes"], vocab_rows(g["vocab_size"], w) * h * 2, "GLM-5 embedding")
    qk = g["qk_nope_head_dim"] + g["qk_rope_head_dim"]
    mla = 2 * (g["q_lora_rank"] * h + heads * qk // w * g["q_lora_rank"]  # q_a (replicated), q_b by heads
               + (g["kv_lora_rank"] + g["qk_rope_head_dim"]) * h  # kv_a_proj_with_mqa (replicated)
               + heads * (g["qk_nope_head_dim"] + g["v_head_dim"]) // w * g["kv_lora_rank"]  # kv_b by heads
               + h * heads * g["v_head_dim"] // w)  # o_proj's columns
    indexer = 2 * (g["index_n_heads"] * g["index_head_dim"] * g["q_lora_rank"] + g["index_head_dim"] * h
                   + g["index_n_heads"] * h)  # wq_b, wk, weights_proj (replicated)
    dense_mlp = 2 * 3 * h * g["intermediate_size"] // w
    moe_dense = 2 * (g["n_routed_experts"] * h + 3 * h * g["moe_intermediate_size"] * g["n_shared_experts"] // w)
    dense = (g["num_hidden_layers"] * (mla + indexer) + g["first_k_dense_replace"] * dense_mlp + moe_layers * moe_dense
             + vocab_rows(g["vocab_size"], w) * h * 2)
    close(r["weights"]["dense_bytes"], dense, "GLM-5 dense")
    close(r["kv_bytes_per_token"], g["num_hidden_layers"] * (g["kv_lora_rank"] + g["qk_rope_head_dim"] +
                                                             g["index_head_dim"]) * 2, "GLM-5 latent + indexer keys")
    refuses(tern, glm, 3, "model.layers.0.self_attn.q_b_proj.weight")

    # The one-GPU slice: GLM-5's first 8 layers (3 dense, 5 MoE) and otherwise the same config, the MTP layer's
    # exclusion following it to index 8; its routed experts are those 5 layers' whole experts.
    sl = f"{configs}/glm-5-nvfp4-slice"
    with open(f"{sl}/config.json") as f:
        s = json.load(f)
    same = ("num_hidden_layers", "quantization_config")
    assert {k: v for k, v in s.items() if k not in same} == {k: v for k, v in g.items() if k not in same}
    assert s["num_hidden_layers"] == 8 and "model.layers.8*" in s["quantization_config"]["ignore"], s
    one = plan(tern, sl, "--batch", "1", "--context", "2048")
    close(one["weights"]["expert_bytes"],
          (8 - g["first_k_dense_replace"]) * g["n_routed_experts"] * 3 * h * g["moe_intermediate_size"] * NVFP4,
          "GLM-5 slice experts")

    # Qwen3-8B with every decoder linear NVFP4 (#24's dense 4-bit decode row): the BF16 config plus ModelOpt's
    # quantization config ignoring only lm_head, so the step reads the linears at 9/16 byte per weight and lm_head
    # and the embedding in BF16.
    with open(f"{configs}/qwen3-8b-bf16/config.json") as f:
        d = json.load(f)
    with open(f"{configs}/qwen3-8b-nvfp4/config.json") as f:
        q = json.load(f)
    qc = q.pop("quantization_config")
    assert q == d and qc["quant_algo"] == "NVFP4" and qc["ignore"] == ["lm_head"], qc
    h, hd, inter = d["hidden_size"], d["head_dim"], d["intermediate_size"]
    linears = h * hd * (2 * d["num_attention_heads"] + 2 * d["num_key_value_heads"]) + 3 * h * inter
    dense8 = plan(tern, f"{configs}/qwen3-8b-nvfp4", "--batch", "1")["weights"]
    close(dense8["dense_bytes"], d["num_hidden_layers"] * linears * NVFP4 + d["vocab_size"] * h * 2, "8B NVFP4 dense")
    close(dense8["embedding_bytes"], d["vocab_size"] * h * 2, "8B NVFP4 embedding")

    # The same with Qwen3-FP8's block-wise FP8 config: every decoder linear one byte per weight plus each row's fp32
    # scale per 128 columns (as the devices hold them), lm_head and the embedding BF16.
    with open(f"{configs}/qwen3-8b-fp8/config.json") as f:
        q = json.load(f)
    qc = q.pop("quantization_config")
    assert q == d and qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128], qc
    nq, nkv = hd * d["num_attention_heads"], hd * d["num_key_value_heads"]
    shapes = [(nq, h), (nkv, h), (nkv, h), (h, nq), (inter, h), (inter, h), (h, inter)]  # q k v o gate up down
    fp8_scales = sum(4 * rows * -(-cols // 128) for rows, cols in shapes)
    dense_fp8 = plan(tern, f"{configs}/qwen3-8b-fp8", "--batch", "1")["weights"]
    close(dense_fp8["dense_bytes"], d["num_hidden_layers"] * (linears + fp8_scales) + d["vocab_size"] * h * 2,
          "8B FP8 dense")
    close(dense_fp8["embedding_bytes"], d["vocab_size"] * h * 2, "8B FP8 embedding")

    # A run at --tp 2 on the CPU: rank 0's numbers, the same as its plan's, and the collectives of the fixture.
    fixture = f"{fixtures}/qwen3_5_moe"
    out = run(tern, "bench", "--model", fixture, "--device", "cpu", "--tp", "2", "--prefill", "8", "--batch", "1,3",
              "--context", "8", "--steps", "2", "--repeats", "1", "--json")
    assert out.returncode == 0, out
    ran = json.loads(out.stdout)
    planned = plan(tern, fixture, "--tp", "2", "--batch", "1,3")
    with open(f"{fixture}/config.json") as f:
        fc = json.load(f)["text_config"]
    fc_experts = fc["num_experts"]
    assert ran["tensor_parallel_size"] == 2, ran
    close(ran["weights"]["per_rank_bytes"], planned["weights"]["per_rank_bytes"], "run and plan")
    ep_ran = run(tern, "bench", "--model", fixture, "--device", "cpu", "--tp", "2", "--enable-expert-parallel",
                 "--prefill", "8", "--batch", "1", "--context", "8", "--steps", "2", "--repeats", "1", "--json")
    assert ep_ran.returncode == 0, ep_ran
    ep_ran = json.loads(ep_ran.stdout)
    assert ep_ran["weights"]["experts"] == fc_experts // 2, ep_ran["weights"]
    close(ep_ran["weights"]["per_rank_bytes"], planned["weights"]["per_rank_bytes"], "expert-parallel run")
    assert ran["collectives_computed"] == planned["collectives_computed"], (ran, planned)
    assert ran["collectives_computed"]["all_reduces_per_step"] == 2 * fc["num_hidden_layers"] + 1, ran
    decode = [row for row in ran["rows"] if row["kind"] == "decode"]
    for row, p in zip(decode, planned["rows"]):
        assert row["batch"] == p["batch"], (row, p)
    # The all-reduces timed on the two CPU ranks, one row per decode row: positive, the step's count of them, and
    # (CPU ranks meeting in one process) less than the step they belong to.
    measured = ran["all_reduce_ms_per_step_measured"]
    assert isinstance(measured, list) and [m["batch"] for m in measured] == [1, 3], ran
    assert "measured apart from the step" in ran["measured_note"], ran
    count = ran["collectives_computed"]["all_reduces_per_step"]
    for m, row in zip(measured, decode):
        assert m["ms_each"] > 0 and math.isfinite(m["ms_each"]), m
        close(m["ms_per_step"], m["ms_each"] * count, "all-reduce ms per step")
        close(m["share_of_step"], m["ms_per_step"] / row["ms_per_step"], "all-reduce share of the step")

    # Rank processes (mp): each decode row reports the step plan node 0 broadcast, a few dozen words per sequence
    # whatever the context (the growing lists go as changes); ranks that are threads of one process send none.
    assert all("plan_bytes_per_step" not in row for row in decode), decode
    sent = {}
    for context in ("8", "64"):
        out = run(tern, "bench", "--model", fixture, "--device", "cpu", "--tp", "2", "--distributed-executor-backend",
                  "mp", "--prefill", "0", "--batch", "1,3", "--context", context, "--steps", "2", "--json")
        assert out.returncode == 0, out
        rows = [row for row in json.loads(out.stdout)["rows"] if row["kind"] == "decode"]
        sent[context] = [row["plan_bytes_per_step"] for row in rows]
        for row in rows:
            assert 0 < row["plan_bytes_per_step"] <= row["batch"] * 64 * 8, row
    assert sent["8"] == sent["64"], sent

    # Text output, and nothing of the model's size was allocated.
    text = run(tern, "bench", "--plan-only", "--model", full, "--tp", "8")
    assert text.returncode == 0 and "weights per rank" in text.stdout and "121 all-reduces" in text.stdout, text
    assert "needs the run (tern bench --tensor-parallel-size 8 without --plan-only)" in text.stdout, text.stdout
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    assert peak_mb < 2048, f"a plan took {peak_mb:.0f} MB"
    elapsed = time.monotonic() - start
    print(f"ok: {elapsed:.1f} s, largest plan {peak_mb:.0f} MB")


if __name__ == "__main__":
    main()
