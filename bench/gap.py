"""The sampler/trainer gap: how far apart the two engines' log-probs of the same tokens are, and why.

GRPO's loss compares the training forward's log π(token) with the log-prob the sampler recorded when
it drew the token. In one process with one set of weights the two differ only by arithmetic: the
sampler decodes a token at a time (a few-row GEMV for the lm_head, paged attention over a bf16 KV
cache, the fused kernels), the trainer runs whole sequences (large-M GEMMs, SDPA). This measures, per
completion token at the first step of a run (LoRA B = 0, so the adapters add nothing yet), NVFP4
rounded to nearest (--quantizer rtn: the gap is the engines' arithmetic, whatever codes the base holds):

    sampler - trainer      the gap the loss sees (TRL's sampling/sampling_logp_difference/mean)
    sampler - fp32         each side against an fp32 forward of the same tokens and the same weights
    trainer - fp32         (for NVFP4 the same dequantized values, in fp32)
    bf16 <op> - fp32       the fp32 forward with one kind of op computed as a bf16 engine computes it
                           (inputs and output rounded to bf16; the lm_head's inputs only, its logits
                           stay fp32 as in both engines): linear, attention, norm (with the residual
                           stream), lm_head. Which op puts a bf16 forward where it is. The fp32
                           forwards take ops.py's torch references (tuning's fused off).

and the first three again with both sides' logits rounded to bf16 before the log-softmax (what a
bf16-output lm_head GEMM writes; the engines keep fp32 logits), to show what that rounding adds.
Tokens are sampled at temperature 1 from --prompts prompts of --dataset, --group completions each,
as train.py's first step (without AQN).

    python bench/gap.py --model /root/smol --dataset addition --quants bf16,nvfp4 --out gap.json

Writes the table as JSON (mean |Δ log p| per token, and its 99th percentile) and prints it.
"""
import argparse
import contextlib
import dataclasses
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import logprobs  # noqa: E402
import ops  # noqa: E402
import plan  # noqa: E402
import rollout  # noqa: E402
import tasks  # noqa: E402
from kernels import tuning  # noqa: E402
from checkpoint import load_model, load_tokenizer  # noqa: E402
from flags import parse_args  # noqa: E402
from model import RMSNorm  # noqa: E402
from train import Group, build_policy  # noqa: E402

BF16 = torch.bfloat16


@contextlib.contextmanager
def logits_rounded_to_bf16():
    """Both sides' logits rounded to bf16 after their fp32 sums, as a bf16-output lm_head GEMM writes them."""
    saved = ops.logits, ops.head_matmul
    ops.logits = lambda h, head: saved[0](h, head).to(BF16).float()
    ops.head_matmul = lambda h, w: saved[1](h, w).to(BF16).float()
    try:
        yield
    finally:
        ops.logits, ops.head_matmul = saved


def sample(engine, tokenizer, examples, group: int, max_new: int, seed: int):
    """One train.py-like rollout at temperature 1 -> the groups collate() takes."""
    prompts = [tasks.encode_prompt(tokenizer, e.prompt) for e in examples]
    params = rollout.SamplingParams(temperature=1.0, max_tokens=max_new, n=group, seed=seed)
    comps = engine.generate(prompts, params)
    return [Group(e, p, c, None) for e, p, c in zip(examples, prompts, comps)]   # no rewards: none are used


def reference(path: str, policy, device):
    """An fp32 model with the policy's frozen weights: nvfp4 layers as their dequantized values."""
    ref = load_model(path, quant="bf16", device=device, dtype=torch.float32)
    for name, m in policy.named_modules():
        if hasattr(m, "dequantized_weight"):
            ref.get_submodule(name.replace(".base_layer", "")).weight.data.copy_(m.dequantized_weight(torch.float32))
    return ref.eval()


def torch_ops():
    """The reference's forwards take ops.py's torch references, never the sampler's fused kernels (which
    would bypass the per-module patches below: q/k/v and gate/up run as one stacked kernel there)."""
    return tuning.using(dataclasses.replace(tuning.current(), fused=False))


@contextlib.contextmanager
def one_op_in_bf16(ref, op: str):
    """ref with one kind of op computed as the bf16 engines compute it: from bf16-rounded inputs to a
    bf16-rounded output (the lm_head: bf16 inputs, fp32 logits, as both engines compute them)."""
    undo = []
    try:
        yield from _patched(ref, op, undo)
    finally:
        for u in undo:
            u()


def _patched(ref, op: str, undo: list):
    """Apply op's patch to ref (or to the module it calls through), each with its undo in undo."""
    if op == "linear":
        for name, m in ref.named_modules():
            if isinstance(m, torch.nn.Linear) and name != "lm_head":
                w, b = m.weight.to(BF16), None if m.bias is None else m.bias.to(BF16)
                m.forward = lambda x, w=w, b=b: F.linear(x.to(BF16), w, b).float()
                undo.append(lambda m=m: m.__dict__.pop("forward"))
    elif op == "attention":
        sdpa = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = lambda q, k, v, **kw: sdpa(q.to(BF16), k.to(BF16), v.to(BF16), **kw).float()
        undo.append(lambda: setattr(F, "scaled_dot_product_attention", sdpa))
    elif op == "norm":
        fwd = RMSNorm.forward

        def norm16(self, x, residual=None):
            out = ops.rms_norm(x.to(BF16), self.weight, self.eps, None if residual is None else residual.to(BF16))
            return tuple(t.float() for t in out) if isinstance(out, tuple) else out.float()
        RMSNorm.forward = norm16
        undo.append(lambda: setattr(RMSNorm, "forward", fwd))
    elif op == "lm_head":                    # bf16 inputs, fp32 sums and output (ops.head_matmul)
        saved = ops.head_matmul
        ops.head_matmul = lambda h, w: saved(h.to(BF16), w.to(BF16))
        undo.append(lambda: setattr(ops, "head_matmul", saved))
    yield


def gaps(a, b, mask) -> dict:
    """|a - b| over the completion tokens (mask): its mean and 99th percentile."""
    d = (a - b).abs()[mask]
    return {"mean": round(d.mean().item(), 5), "p99": round(d.quantile(0.99).item(), 5)}


def measure(args, quant: str, device) -> dict:
    """The table's rows for one base format: the policy as train.py builds it (build_policy), its fp32
    twin, one rollout per logits arm, and every row of the module docstring."""
    targs = parse_args(["--model", args.model, "--quant", quant, "--quantizer", "rtn", "--dtype", args.dtype, "--no-aqn",
                        "--max-new-tokens", str(args.max_new_tokens),
                        "--group-size", str(args.group), "--prompts-per-step", str(args.prompts)])
    policy = build_policy(targs, device)
    model, engine, step_plan = policy.model, policy.engine, policy.step_plan
    tokenizer = load_tokenizer(args.model)
    examples = tasks.load_task(args.dataset, "train")[:args.prompts]
    ref = reference(args.model, model, device)
    out = {"plan": step_plan.as_dict()}
    for logits in ("fp32", "bf16"):
        with logits_rounded_to_bf16() if logits == "bf16" else contextlib.nullcontext():
            engine.free_cache()                           # no CUDA graph captured outside this arm's logits
            groups = sample(engine, tokenizer, examples, args.group, args.max_new_tokens, args.seed)
            batch = logprobs.collate(groups, tokenizer.pad_token_id or 0, device)
            ids, pl, cl = batch["input_ids"], batch["prompt_lens"], batch["comp_lens"]
            model.train()
            with plan.dense_weights(model, step_plan.dense_weights), torch.enable_grad():
                trainer = logprobs.completion_logprobs(model, ids, pl, cl, 1.0)[0].detach()
            model.eval()
        L = batch["sampler_logp"].shape[1]
        mask = torch.arange(L, device=device)[None] < cl[:, None]                        # (B, L)
        with torch.no_grad(), torch_ops():                # the reference keeps its fp32 logits
            fp32 = logprobs.completion_logprobs(ref, ids, pl, cl, 1.0)[0]
            row = {"sampler-trainer": gaps(batch["sampler_logp"], trainer, mask),
                   "sampler-fp32": gaps(batch["sampler_logp"], fp32, mask),
                   "trainer-fp32": gaps(trainer, fp32, mask), "tokens": int(mask.sum())}
            if logits == "fp32":
                for op in ("linear", "attention", "norm", "lm_head"):
                    with one_op_in_bf16(ref, op):
                        row[f"bf16 {op}-fp32"] = gaps(logprobs.completion_logprobs(ref, ids, pl, cl, 1.0)[0], fp32, mask)
        out[f"logits {logits}"] = row
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dataset", default="addition")
    ap.add_argument("--quants", default="bf16,nvfp4")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="both engines' activations (float32: the gap a CPU test can check is ~0)")
    ap.add_argument("--out", default=None, help="write the table here as JSON")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    table = {q: measure(args, q, device) for q in args.quants.split(",")}
    print(json.dumps(table, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       "table": table}, f, indent=1)


if __name__ == "__main__":
    main()
