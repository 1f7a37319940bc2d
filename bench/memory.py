"""Where the memory of a GRPO step goes, worked out without a GPU: a table of every piece and a verdict.

    python bench/memory.py --model qwen2.5-72b --prompts 1 --group 8 --prompt-len 256 --completion 2048 \\
        --budget-gib 76

The paper's 32B recipe (1 prompt x 8 samples, 256 + 2048 tokens, LoRA r32, AdamW) on Qwen2.5-72B: does
a step stay within 76 GiB (an 80 GB card, 79.2 GiB to CUDA, less the context, cuBLAS and Triton
workspaces and the allocator's slack)? A step passes through five peaks, one column each; a piece is
counted in every column where it is alive:

    load       checkpoint.load_bytes: the weights + what quantize-on-load holds in flight
    probe      plan.py's start-up probe: forward + backward over 1 and 2 x PROBE_TOKENS tokens, no
               recomputation (the second pass only where plan.second_probe_fits)
    rollout    the KV cache (sized as rollout.LLMEngine sizes it) + the engine's activation reserve
    train      the training pass: one micro-batch of plan.decide's plan through forward and backward
    optimizer  AdamW's step (foreach: one adapter-sized fp32 temporary)

Exact, from the meta model and the code's own rules: the weights (checkpoint.weight_bytes on a meta
Transformer, split into NVFP4 codes and scales, embedding, lm_head, the rest), the in-flight allowance of
quantize-on-load (load_bytes - weight_bytes), the LoRA parameters (r · (in + out) of every adapted linear)
with their fp32 gradients, AdamW's two fp32 states and the bf16 copies the sampler keeps, a bf16 base's
copies of its adapted weights where the plan merges for sampling (lora.keep_bases), the KV cache
(2 · layers · kv heads · head_dim · 2 bytes a token, in blocks of 16, as many as the call asks for, capped
at --gpu-memory-utilization of what is free), the engine's reserve (rollout.activation_reserve), the
prefill CUDA graphs' staging rows and pool (graphs.prefill_cap), the decode graphs' pool (kept between
steps), the plan (plan.decide on the free memory make_plan sees) and the micro-batches it cuts
(plan.micro_batches).

Estimated: what a token of the training pass keeps (plan.py's b, in peak = a + b · tokens). plan.py
measures it on the GPU at start-up; here it is such a measurement from a reference run (--reference: a
bench/step.py JSON whose step plan says "a token keeps X MiB (Y with recomputation)"; by default the 32B
H100 step, bench/results/step_32b_nvfp4_2048_h100.json) scaled by layers x hidden size, and, with
recomputation, never below plan.recompute_bytes's floor (every layer's input, and one layer again). The
same rule takes the 7B measurement (step_7b_h100.json) to within 4% of the 32B one. The token-independent
a is the lm_head chunk (its fp32 logits and their bf16 gradient, chunk x vocab) and, without dense copies,
the largest weight group dequantized to bf16. --token-mib puts a figure of your own in place of b. The
probe's b is rough: its two passes of a few hundred tokens see the lm_head chunk grow with the rows (it
stops at one chunk in a real micro-batch), and only the first allocates the adapter gradients, so their
4 bytes a parameter / PROBE_TOKENS (4 MiB a token at 32B) drop out of the difference. Where the plan
recomputes, the floor decides, and the floor is exact but for one layer's share.

The plan sees, after the build, the budget less the weights, the adapters and 12 bytes an adapter
parameter (gradient and AdamW). On the GPU it sees less: the allocator keeps what the build freed (the
32B step's plan saw 48.3 GiB where this arithmetic gives 54.4); --plan-free-gib puts train.py's start-up
figure in its place. So checked against the one measured step with recomputation (32B, 16 x 8, 256 + 2048,
H100), the table's training and rollout peaks and its KV blocks are within 3% of the measured ones
(tests/test_memory_bench.py). Without recomputation b overestimates large micro-batches (7B, 6 x 1280
tokens: 65.3 GiB from the table, 52.2 measured); a 72B step recomputes.

Left out: the CUDA context and workspaces (outside the budget), the allocator's fragmentation (reserved -
allocated: 1.5 GiB at the 32B step, with expandable segments), the flat gradient buffer of data
parallelism (one more adapter-sized fp32 tensor a rank). When the recipe does not fit, the verdict names
the columns over the budget, and the tool looks for the longest completion (in steps of 256) that fits
at the same prompts x group.

Test: tests/test_memory_bench.py (a tiny shape by hand, the 72B verdict, the 32B check).
"""
import argparse
import json
import os
import re
import sys
from dataclasses import asdict, dataclass, replace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch

import checkpoint as qckpt
import graphs
import lora
import model as qmodel
import nvfp4
import plan
import rollout

GIB, MIB = 2 ** 30, 2 ** 20
HERE = os.path.dirname(os.path.abspath(__file__))
REFERENCE = os.path.join(HERE, "results", "step_32b_nvfp4_2048_h100.json")
PHASES = ("load", "probe", "rollout", "train", "optimizer")
BLOCK = 16                     # rollout.LLMEngine's KV block (tokens)
MAX_BATCHED_TOKENS = 16384     # rollout.LLMEngine's default max_num_batched_tokens (train.py keeps it)
MAX_NUM_SEQS = 256             # rollout.LLMEngine's default max_num_seqs: the most sequences a step decodes


@dataclass
class Recipe:
    """A GRPO step's shape: prompts x group completions of prompt_len + completion tokens, and train.py's
    settings that size its memory."""
    prompts: int = 1
    group: int = 8
    prompt_len: int = 256
    completion: int = 2048
    lora_rank: int = 32
    logprob_chunk: int = 1024
    gpu_memory_utilization: float = 0.5


# ----------------------------------------------------------------------------------------------
# what a token keeps: a measured figure, scaled


def shape_of(name: str) -> dict:
    """A checkpoint.SHAPES name, or a bench/step.py model name (7b, 32b, 72b, qwen3-8b)."""
    return qckpt.SHAPES.get(name) or qckpt.SHAPES[f"qwen2.5-{name}"]


def reference_token_bytes(path: str) -> tuple[dict, float, float]:
    """(the reference model's config, b without recomputation, b with it) in bytes a token, read from a
    bench/step.py JSON: the first row whose step plan says what a token keeps."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    for r in rows:
        why = (r.get("step_plan") or {}).get("why", "")
        m = re.search(r"a token keeps ([\d.]+) MiB \(([\d.]+) with recomputation\)", why)
        if m:
            return shape_of(r["model"]), float(m.group(1)) * MIB, float(m.group(2)) * MIB
    raise SystemExit(f"error: --reference {path}: no row's step plan says what a token keeps")


def token_bytes(cfg: qmodel.ModelConfig, reference: str, token_mib: float | None) -> tuple[float, float, str]:
    """(b_full, b_ckpt, where they come from): the reference's measurement scaled by layers x hidden, or
    --token-mib and 0 (memory_table raises b_ckpt to plan.recompute_bytes's floor, as make_plan does)."""
    if token_mib is not None:
        b_full, b_ckpt, why = token_mib * MIB, 0.0, f"--token-mib {token_mib:g}"
    else:
        ref, full, ckpt = reference_token_bytes(reference)
        scale = cfg.num_layers * cfg.hidden_size / (ref["num_hidden_layers"] * ref["hidden_size"])
        b_full, b_ckpt = full * scale, ckpt * scale
        why = (f"{os.path.basename(reference)}'s {full / MIB:.2f} MiB ({ckpt / MIB:.2f} with recomputation) x "
               f"{scale:.3f} (layers x hidden)")
    return b_full, b_ckpt, why


# ----------------------------------------------------------------------------------------------
# the pieces


def meta_model(config: dict, quant: str, dtype) -> qmodel.Transformer:
    with torch.device("meta"):
        return qmodel.Transformer(qmodel.ModelConfig.from_hf(config), quant, dtype)


def adapted(meta) -> list:
    """The linears train.py adapts: every one lora.DEFAULT_TARGETS names."""
    return [m for name, m in meta.named_modules() if name.rpartition(".")[2] in lora.DEFAULT_TARGETS]


def lora_parameters(meta, rank: int) -> int:
    """Adapter parameters train.py adds: r · (in + out) for every adapted linear."""
    return sum(rank * (m.in_features + m.out_features) for m in adapted(meta))


def merge_copy_bytes(meta) -> int:
    """What lora.keep_bases holds where a bf16 sampler merges: a copy of every adapted plain weight."""
    return sum(m.weight.numel() * m.weight.element_size() for m in adapted(meta) if isinstance(m, torch.nn.Linear))


def weight_pieces(meta) -> list[tuple[str, int]]:
    """checkpoint.weight_bytes split: NVFP4 codes and scales, embedding, lm_head, the rest."""
    q = [m for m in meta.modules() if isinstance(m, nvfp4.NVFP4Linear)]
    quant = sum(t.numel() * t.element_size() for m in q
                for t in (m.weight_packed, m.weight_scale, m.weight_global_scale))
    emb = meta.model.embed_tokens.weight
    head = 0 if meta.config.tie_word_embeddings else meta.lm_head.weight.numel() * meta.lm_head.weight.element_size()
    out = [(f"NVFP4 linears: e2m1 codes, e4m3 scales, fp32 global scales ({len(q)} linears)", quant)] if q else []
    out += [(f"embedding ({emb.dtype}, {emb.shape[0]} x {emb.shape[1]})", emb.numel() * emb.element_size())]
    out += [("lm_head (untied)", head)] if head else []
    rest = qckpt.weight_bytes(meta) - sum(b for _, b in out)
    return out + [("norms, biases, RoPE" + ("" if q else ", linears"), rest)]


def prefill_graph_bytes(cfg, dtype, prefill_tokens: int) -> int:
    """The prefill CUDA graphs' K/V staging rows (for the largest bucket, graphs.prefill_cap) and their
    pool (the bucket this prefill replays, its activations), alive from the first rollout on; 0 where the
    prefill is too long for a graph."""
    cap = graphs.prefill_cap(cfg, dtype)
    if not cap or prefill_tokens > cap:
        return 0
    bucket = next(t for t in graphs.PREFILL_TOKENS if t >= prefill_tokens)
    per_token = (4 * cfg.hidden_size + 3 * cfg.intermediate_size) * dtype.itemsize
    return 2 * cfg.num_layers * cap * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize + bucket * per_token


def decode_graph_bytes(cfg, dtype, rows: int) -> int:
    """The decode CUDA graphs' pool, alive from the first rollout on (the graphs outlive the KV cache):
    one step's activations and fp32 logits at the bucket of `rows` sequences, the most a step decodes."""
    bucket = next(b for b in graphs.BUCKETS if b >= min(rows, graphs.BUCKETS[-1]))
    return bucket * ((4 * cfg.hidden_size + 3 * cfg.intermediate_size) * dtype.itemsize + 4 * cfg.vocab_size)


def kv_cache(cfg, recipe: Recipe, free: float, itemsize: int) -> tuple[int, int, int]:
    """(blocks allocated, blocks the call asks for, bytes a block) as rollout.LLMEngine sizes the cache:
    every sequence's blocks (no sharing assumed), capped at gpu_memory_utilization of what is free."""
    per_block = 2 * cfg.num_layers * BLOCK * cfg.num_kv_heads * cfg.head_dim * itemsize
    need = recipe.prompts * recipe.group * -(-(recipe.prompt_len + recipe.completion) // BLOCK)
    return max(1, min(need, int(recipe.gpu_memory_utilization * free) // per_block)), need, per_block


def probed(a: float, b: float, limit: float) -> tuple[float, float, float, int]:
    """(a, b, peak, sequences of the larger pass) as plan._probe measures a pass that keeps a + b·tokens:
    both passes where the second fits (plan.second_probe_fits), else the first alone, its peak counted
    as all per-token."""
    first = a + b * plan.PROBE_TOKENS
    if plan.second_probe_fits(first, limit):
        return a, b, a + 2 * b * plan.PROBE_TOKENS, 2
    return 0.0, first / plan.PROBE_TOKENS, first, 1


def training_fixed_bytes(meta, chunk: int, dense: bool) -> int:
    """plan.py's a (token-independent): the lm_head chunk's fp32 logits and bf16 gradient (chunk x vocab),
    and, without dense copies, the largest weight group dequantized to bf16 in flight."""
    cfg = meta.config
    groups = [cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim,   # q/k/v
              cfg.hidden_size * 2 * cfg.intermediate_size, cfg.hidden_size * cfg.intermediate_size]
    dequantized = 0 if dense or meta.quant != "nvfp4" else 2 * max(groups)
    return chunk * cfg.vocab_size * (4 + 2) + dequantized


# ----------------------------------------------------------------------------------------------
# the table


def memory_table(config: dict, recipe: Recipe, budget: float, b_full: float, b_ckpt: float, quant: str = "nvfp4",
                 dtype=torch.bfloat16, plan_free: float | None = None) -> dict:
    """Every piece with the phases it is alive in, each phase's total, the plan and the verdict (bytes).
    plan_free: the free memory make_plan saw (its start-up line), in place of the arithmetic's."""
    meta = meta_model(config, quant, dtype)
    cfg, n = meta.config, lora_parameters(meta, recipe.lora_rank)
    everywhere, steady = set(PHASES), {"rollout", "train", "optimizer"}
    rows = [(label, b, everywhere) for label, b in weight_pieces(meta)]
    rows += [("quantize-on-load in flight (checkpoint.load_bytes: a bf16 group or the embedding, and temporaries)",
              qckpt.load_bytes(meta) - qckpt.weight_bytes(meta), {"load"}),
             (f"LoRA r{recipe.lora_rank} adapters, {n / 1e6:.1f} M fp32 parameters", 4 * n, everywhere - {"load"}),
             ("LoRA gradients (fp32; alive from a backward to the next step's zero_grad)", 4 * n, steady | {"probe"}),
             ("AdamW exp_avg and exp_avg_sq (fp32)", 8 * n, steady),
             ("LoRA copies in the activation dtype, kept for sampling", n * dtype.itemsize * (dtype != torch.float32),
              steady)]
    prefill_tokens = min(MAX_BATCHED_TOKENS, recipe.prompts * recipe.prompt_len)
    rows.append(("prefill CUDA graphs: K/V staging rows and pool", prefill_graph_bytes(cfg, dtype, prefill_tokens),
                 steady))
    rows.append(("decode CUDA graphs' pool (one step at the largest bucket)",
                 decode_graph_bytes(cfg, dtype, min(recipe.prompts * recipe.group, MAX_NUM_SEQS)), steady))

    # the plan, as make_plan sees memory after the build: the weights and adapters allocated, 12 bytes a
    # parameter set aside for gradients and AdamW
    free = budget - qckpt.weight_bytes(meta) - 4 * n - 12 * n
    dense_bytes = 2 * plan.nvfp4_weights(meta)
    dense = plan.copies_fit(dense_bytes, free)
    merge_bytes = merge_copy_bytes(meta)
    merged = plan.copies_fit(merge_bytes, free)
    rows.append(("copies of the adapted bf16 weights, the merged sampler's restore (lora.keep_bases)",
                 merge_bytes * merged, everywhere - {"load"}))
    free = plan_free if plan_free is not None else free - dense_bytes * dense - merge_bytes * merged
    a = training_fixed_bytes(meta, recipe.logprob_chunk, dense)
    a_full, b_full, probe_full, passes = probed(a, b_full, plan.BUDGET_SHARE * free)
    a_ckpt, b_ckpt, probe_ckpt, _ = probed(a, b_ckpt, plan.BUDGET_SHARE * free)
    b_ckpt = plan.recompute_bytes(b_ckpt, b_full, cfg.num_layers, cfg.hidden_size, dtype.itemsize)
    seq = recipe.prompt_len + recipe.completion
    step_plan = plan.decide(free, a_full, b_full, a_ckpt, b_ckpt, seq, plan.parameters(meta) + n, None, None, dense,
                            merged)
    spans = plan.micro_batches([seq] * (recipe.prompts * recipe.group), step_plan)
    mb = max(e - s for s, e in spans)
    a, b = (a_ckpt, b_ckpt) if step_plan.grad_checkpointing else (a_full, b_full)
    rows.append(("dense bf16 copies of the NVFP4 weights (training pass)", dense_bytes * dense, {"probe", "train"}))

    # the rollout: the engine sizes its cache from what the steady state leaves free, less its reserve
    reserve = rollout.activation_reserve(cfg, prefill_tokens, recipe.prompts * recipe.group)
    steady_bytes = sum(bts for _, bts, ph in rows if "rollout" in ph)
    blocks, need, per_block = kv_cache(cfg, recipe, budget - steady_bytes - reserve, dtype.itemsize)
    kept = blocks * per_block <= step_plan.keep_cache_bytes
    rows += [(f"KV cache: {blocks} blocks of {BLOCK} tokens, {per_block // BLOCK // 1024} KiB a token"
              + ("" if blocks == need else f" (the call asks for {need}: preemption)")
              + (", kept between steps" if kept else ", freed before the training pass"),
              blocks * per_block, steady if kept else {"rollout"}),
             ("rollout's activation reserve (rollout.activation_reserve: prefill, sampler, slack)", reserve,
              {"rollout"}),
             (f"plan.py's start-up probe: {passes} x {plan.PROBE_TOKENS} tokens, no recomputation",
              max(probe_full, probe_ckpt), {"probe"}),
             (f"training pass: {mb} x {seq} tokens a micro-batch ({len(spans)} micro-batches) x {b / MIB:.2f} MiB, "
              f"recomputation {'on' if step_plan.grad_checkpointing else 'off'}", mb * seq * b, {"train"}),
             (f"training pass, token-independent: lm_head chunk of {recipe.logprob_chunk} rows"
              + ("" if dense or quant != "nvfp4" else ", one dequantized weight group"), a, {"train"}),
             ("AdamW step's temporaries (foreach: one fp32 adapter-sized buffer)", 4 * n, {"optimizer"})]
    totals = {ph: sum(bts for _, bts, p in rows if ph in p) for ph in PHASES}
    over = [ph for ph in PHASES if totals[ph] > budget]
    too_small = blocks < -(-seq // BLOCK)   # not one sequence's blocks: generate() refuses
    return dict(rows=[(label, bts, sorted(p, key=PHASES.index)) for label, bts, p in rows if bts], totals=totals,
                budget=budget, plan=step_plan, micro_batch=mb, fits=not over and not too_small, over=over,
                kv_too_small=too_small, lora_parameters=n, token_bytes=(b_full, b_ckpt), kv_blocks=blocks)


def longest_completion(config: dict, recipe: Recipe, budget: float, b_full: float, b_ckpt: float, **kw) -> int | None:
    """The longest completion, in steps of 256 below the recipe's, that fits at its prompts x group."""
    for c in range(recipe.completion - 256, 0, -256):
        if memory_table(config, replace(recipe, completion=c), budget, b_full, b_ckpt, **kw)["fits"]:
            return c
    return None


# ----------------------------------------------------------------------------------------------
# the report


def print_table(t: dict) -> None:
    print("| piece | GiB | " + " | ".join(PHASES) + " |\n|---|---|" + "---|" * len(PHASES))
    for label, bts, phases in t["rows"]:
        print(f"| {label} | {bts / GIB:.2f} | " + " | ".join("x" if ph in phases else "" for ph in PHASES) + " |")
    print("| **total** | | " + " | ".join(f"**{t['totals'][ph] / GIB:.2f}**" for ph in PHASES) + " |")
    print(f"| headroom to {t['budget'] / GIB:g} GiB | | "
          + " | ".join(f"{(t['budget'] - t['totals'][ph]) / GIB:.2f}" for ph in PHASES) + " |")


def verdict(t: dict) -> str:
    p = t["plan"]
    peak = max(PHASES, key=lambda ph: t["totals"][ph])
    how = (f"plan: micro-batches of {t['micro_batch']} sequence{'s' * (t['micro_batch'] > 1)}, recomputation "
           f"{'on' if p.grad_checkpointing else 'off'}, dense copies {'on' if p.dense_weights else 'off'}")
    if t["fits"]:
        return f"fits: peak {t['totals'][peak] / GIB:.2f} GiB ({peak}) of {t['budget'] / GIB:g} GiB; {how}"
    why = [f"{ph} {t['totals'][ph] / GIB:.2f} GiB > {t['budget'] / GIB:g} GiB" for ph in t["over"]]
    why += ["the KV cache left for the rollout holds less than one sequence"] * t["kv_too_small"]
    return "does not fit: " + "; ".join(why) + f" ({how})"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-72b", help=f"one of {', '.join(qckpt.SHAPES)}")
    ap.add_argument("--quant", choices=["nvfp4", "bf16"], default="nvfp4")
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--completion", type=int, default=2048)
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--logprob-chunk", type=int, default=1024)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="train.py's KV-cache share")
    ap.add_argument("--budget-gib", type=float, default=76.0, help="what the process may allocate")
    ap.add_argument("--reference", default=REFERENCE, help="a bench/step.py JSON: the measured bytes a token keeps")
    ap.add_argument("--token-mib", type=float, default=None, help="bytes a token keeps without recomputation "
                    "(MiB), in place of the reference's scaled")
    ap.add_argument("--plan-free-gib", type=float, default=None, help="the free memory train.py's start-up line "
                    "says the plan saw (GiB), in place of the arithmetic's")
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    args = ap.parse_args(argv)
    if args.model not in qckpt.SHAPES:
        ap.error(f"--model: one of {', '.join(qckpt.SHAPES)}, got {args.model!r}")
    config = qckpt.SHAPES[args.model]
    recipe = Recipe(args.prompts, args.group, args.prompt_len, args.completion, args.lora_rank, args.logprob_chunk,
                    args.gpu_memory_utilization)
    cfg = qmodel.ModelConfig.from_hf(config)
    b_full, b_ckpt, source = token_bytes(cfg, args.reference, args.token_mib)
    budget = args.budget_gib * GIB
    plan_free = None if args.plan_free_gib is None else args.plan_free_gib * GIB
    t = memory_table(config, recipe, budget, b_full, b_ckpt, args.quant, plan_free=plan_free)
    used = t["token_bytes"]   # as the plan uses them: the probe's reading, the recomputation floor
    print(f"{args.model} {args.quant}, {recipe.prompts} x {recipe.group} completions of {recipe.prompt_len} + "
          f"{recipe.completion} tokens, LoRA r{recipe.lora_rank}; a token of the training pass keeps "
          f"{used[0] / MIB:.2f} MiB ({used[1] / MIB:.2f} with recomputation): {source}\n")
    print_table(t)
    print("\n" + verdict(t))
    shorter = None
    if not t["fits"]:
        shorter = longest_completion(config, recipe, budget, b_full, b_ckpt, quant=args.quant, plan_free=plan_free)
        print(f"the longest completion that fits at {recipe.prompts} x {recipe.group}: {shorter} tokens" if shorter
              else f"no completion of 256 tokens or more fits at {recipe.prompts} x {recipe.group}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(model=args.model, quant=args.quant, recipe=asdict(recipe), token_bytes=used,
                           token_source=source, rows=t["rows"], totals=t["totals"], budget=budget, fits=t["fits"],
                           plan=t["plan"].as_dict(), micro_batch=t["micro_batch"], longest_completion=shorter),
                      f, indent=1)
    return dict(t, longest_completion=shorter)


if __name__ == "__main__":
    main()
