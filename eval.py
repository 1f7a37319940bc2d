"""eval.py: accuracy of a (quantized, optionally adapted) model on GSM8K, MATH500 or a JSONL file.

    python eval.py --model Qwen/Qwen2.5-7B-Instruct --adapter runs/gsm8k/checkpoint-000200 --dataset gsm8k

Each question is formatted with the tokenizer's chat template and the system prompt of tasks.py
(final answer in \\boxed{}), sampled by the same paged engine that training uses (rollout.py),
and scored by the training reward (rewards.reward: numeric equality for GSM8K-style answers,
math-verify for MATH). Accuracy is the mean over questions and samples. For GSM8K it also reports
lm-evaluation-harness' two matchers (strict: the `#### N` line; flexible: the last number) so
the numbers can be set beside published ones; both read the same completions.

Greedy by default (--temperature 0); with --samples k > 1 and a temperature, the figure is the
mean accuracy over k samples per question (an estimate of pass@1).
"""
import argparse
import json
import os
import tempfile
import time

import torch

import lora
import rewards
import rollout
import tasks
from checkpoint import load_model, load_tokenizer

# ----------------------------------------------------------------------------------------------


def evaluate(engine, tokenizer, examples, params, batch_size: int = 256,
             system_prompt: str = tasks.SYSTEM_PROMPT, chat_template_kwargs: dict | None = None) -> tuple[dict, list]:
    """Generate for every example and score. Returns (metrics, one record per example)."""
    stats = rewards.RewardStats()
    records, correct, strict, flexible, t0 = [], [], [], [], time.perf_counter()
    for s in range(0, len(examples), batch_size):
        chunk = examples[s:s + batch_size]
        ids = [tasks.encode_prompt(tokenizer, e.question, system_prompt, chat_template_kwargs) for e in chunk]
        for e, comps in zip(chunk, engine.generate(ids, params)):
            texts = tokenizer.batch_decode([c.token_ids for c in comps], skip_special_tokens=True)
            scores = [rewards.reward(e, t, stats) for t in texts]
            correct += scores
            if e.kind == "numeric":
                strict += [rewards.gsm8k_strict_match(t, e.answer) for t in texts]
                flexible += [rewards.gsm8k_flexible_match(t, e.answer) for t in texts]
            records.append({"question": e.question, "answer": e.answer, "completions": texts, "scores": scores,
                            "finish_reasons": [c.finish_reason for c in comps]})
    engine.free_cache()
    metrics = {"accuracy": sum(correct) / max(1, len(correct)), "n_questions": len(examples),
               "n_samples": len(correct), "seconds": time.perf_counter() - t0, **stats.as_dict()}
    if strict:
        metrics["gsm8k_strict_match"] = sum(strict) / len(strict)
        metrics["gsm8k_flexible_match"] = sum(flexible) / len(flexible)
    return metrics, records


def output_problem(path: str) -> str | None:
    """Why --output cannot be written (else None), found before the evaluation: it is a directory, or
    its directory cannot be made or written to (probed with a temporary file)."""
    if os.path.isdir(path):
        return f"{path} is a directory"
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        return f"cannot write in {parent} ({e.strerror or e})"
    return None


def adapter_problem(path: str) -> str | None:
    """Why --adapter is not a PEFT adapter directory (else None)."""
    missing = [f for f in (lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS) if not os.path.isfile(os.path.join(path, f))]
    return f"{path} has no {' or '.join(missing)}" if missing else None


def main(argv=None):
    p = argparse.ArgumentParser(description="Evaluate a model (+ LoRA adapter) on GSM8K / MATH500 / JSONL")
    # model
    p.add_argument("--model", required=True, help="Hugging Face hub id or local checkpoint directory")
    p.add_argument("--adapter", default=None, help="PEFT-format LoRA adapter directory (e.g. a train.py checkpoint)")
    p.add_argument("--quant", choices=["nvfp4", "bf16"], default="nvfp4")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--device", default=None)
    # data
    p.add_argument("--dataset", default="gsm8k", help="gsm8k | math500 | addition | path to JSONL")
    p.add_argument("--split", default="test")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--system-prompt", default=tasks.SYSTEM_PROMPT, help="the training run's, if it set one")
    p.add_argument("--chat-template-kwargs", type=tasks.parse_chat_template_kwargs, default=None, metavar="JSON",
                   help="""extra chat-template variables, a JSON object: '{"enable_thinking": false}' (Qwen3)""")
    # sampling
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--samples", type=int, default=1, help="samples per question")
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    # output
    p.add_argument("--output", default=None, help="write one JSON line per question (predictions.jsonl)")
    args = p.parse_args(argv)
    print(json.dumps(vars(args)))
    for name in ("samples", "max_new_tokens", "max_model_len") + (("limit",) if args.limit is not None else ()):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.temperature < float("inf"):
        p.error(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        p.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if not 0 <= args.seed < 2 ** 63:
        p.error(f"--seed must be in [0, 2**63), got {args.seed}")
    if args.samples > 1 and args.temperature == 0:
        p.error("--samples > 1 needs --temperature > 0 (greedy samples are identical)")
    # Everything that can be checked without the model is, before it loads (so is --output).
    problems = {"--dataset": tasks.source_problem(args.dataset, args.split),
                "--model": tasks.local_path_missing(args.model) and f"{args.model} does not exist",
                "--adapter": args.adapter and adapter_problem(args.adapter),
                "--output": args.output and output_problem(args.output)}
    for flag, problem in problems.items():
        if problem:
            p.error(f"{flag}: {problem}")
    try:
        torch.device(args.device or "cpu")
    except (RuntimeError, ValueError) as e:
        p.error(f"--device: {e}")

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        examples = tasks.load_task(args.dataset, args.split, limit=args.limit, seed=args.seed)
    except (ValueError, FileNotFoundError) as e:  # bad data, an empty file, a split that is not there
        raise SystemExit(f"error: --dataset: {e}") from None
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, quant=args.quant, device=device, dtype=getattr(torch, args.dtype))
    if args.adapter:
        try:
            lora.load_adapter(model, args.adapter, args.model)
        except (ValueError, FileNotFoundError) as e:  # another base or shape, NaN or Inf in it
            raise SystemExit(f"error: --adapter: {e}") from None
    model.eval()
    engine = rollout.LLMEngine(model, max_model_len=args.max_model_len)
    params = rollout.SamplingParams(temperature=args.temperature, top_p=args.top_p, n=args.samples,
                                    max_tokens=args.max_new_tokens, seed=args.seed)
    metrics, records = evaluate(engine, tokenizer, examples, params, system_prompt=args.system_prompt,
                                chat_template_kwargs=args.chat_template_kwargs)
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(f"{args.output}.tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        os.replace(f"{args.output}.tmp", args.output)
    print(json.dumps(metrics))
    line = f"{args.dataset}: accuracy {100 * metrics['accuracy']:.2f}% over {metrics['n_samples']} samples"
    if "gsm8k_strict_match" in metrics:
        line += (f" | lm-eval strict {100 * metrics['gsm8k_strict_match']:.2f}%"
                 f", flexible {100 * metrics['gsm8k_flexible_match']:.2f}%")
    print(line)
    return metrics


if __name__ == "__main__":
    main()
