"""eval.py: accuracy of a (quantized, optionally adapted) model on GSM8K, MATH500 or any dataset tasks.py reads.

    python eval.py --model Qwen/Qwen2.5-7B-Instruct --adapter runs/gsm8k/checkpoint-000200 --dataset gsm8k

Each question is formatted with the tokenizer's chat template and a system prompt (final answer in
\\boxed{}), sampled by the same paged engine that training uses (rollout.py), and scored by the
training reward's correctness check (rewards.reward: numeric equality for GSM8K-style answers,
math-verify for MATH). Accuracy is the mean over questions and samples. On GSM8K-style data (a gold
solution ending in a `#### N` line) it also reports lm-evaluation-harness' two matchers (strict: the
`#### N` line; flexible: the last number) so the numbers can be set beside published ones; both read the
same completions. Elsewhere (MATH, the arithmetic tasks, data without worked solutions) they would
measure a format the model was never asked for, and are left out.

The prompt is the one the model was trained on: for an adapter inside a train.py run directory
(runs/x/checkpoint-N), the system prompt and chat-template variables of its run_config.json, unless
--system-prompt / --chat-template-kwargs say otherwise; else tasks.SYSTEM_PROMPT. So is the base: the
run's --quant and --quantizer unless given, and a --quantizer gptq run's own saved base (run_dir.run_base).

Greedy by default (--temperature 0); with --samples k > 1 and a temperature, the figure is the
mean accuracy over k samples per question (an estimate of pass@1).

What is checked before the model loads: --adapter by its manifest, as --resume checks a checkpoint
(run_dir.verify_adapter: a train.py checkpoint without one is refused; a PEFT adapter from elsewhere
has none, and the loader's checks alone apply to it), --model's config.json and tokenizer
(tasks.model_problem, tasks.tokenizer_problem), the chat template on the first question, the data, and
--output. An unreadable run_config.json beside the adapter is refused unless --system-prompt is given:
the prompt the adapter was trained on would be unknown. Each refusal is one line. The evaluation runs
under train.py's stall watchdog (watchdog.py): no sampler step for --stall-timeout seconds (scoring not
counted) ends it with every thread's stack and exit status 75, before anything is written.
"""
import argparse
import json
import os
import time

import torch
from tqdm import tqdm

import lora
import rewards
import rollout
import tasks
import watchdog
from checkpoint import load_model, load_tokenizer
from data import one_line
from flags import HelpFormatter, add_column_flags, add_flags
from run_dir import MANIFEST, RUN_CONFIG, run_base, run_settings, verify_adapter, write_problem

# ----------------------------------------------------------------------------------------------


def evaluate(engine, tokenizer, examples, params, batch_size: int = 256, system_prompt: str = tasks.SYSTEM_PROMPT,
             chat_template_kwargs: dict | None = None, progress: bool = False) -> tuple[dict, list]:
    """Generate for every example and score; progress shows a bar over the questions (advanced a batch
    at a time). Returns (metrics, one record per example)."""
    stats = rewards.RewardStats()
    records, correct, strict, flexible, t0 = [], [], [], [], time.perf_counter()
    bar = tqdm(total=len(examples), desc="eval", unit="q", disable=not progress, leave=False)
    for s in range(0, len(examples), batch_size):
        chunk = examples[s:s + batch_size]
        ids = [tasks.encode_prompt(tokenizer, e.prompt, system_prompt, chat_template_kwargs) for e in chunk]
        for e, comps in zip(chunk, engine.generate(ids, params)):
            texts = tokenizer.batch_decode([c.token_ids for c in comps], skip_special_tokens=True)
            with watchdog.paused("scoring"):   # each check bounded by rewards' own timeouts
                scores = [rewards.reward(e, t, stats) for t in texts]
            correct += scores
            if "####" in e.solution:   # a GSM8K-style gold: lm-eval's matchers mean something here
                strict += [rewards.gsm8k_strict_match(t, e.answer) for t in texts]
                flexible += [rewards.gsm8k_flexible_match(t, e.answer) for t in texts]
            records.append({"question": e.question, "answer": e.answer, "completions": texts, "scores": scores,
                            "finish_reasons": [c.finish_reason for c in comps]})
        bar.update(len(chunk))
    bar.close()
    engine.free_cache(keep_warm=True)  # the cache goes; the model is unchanged, so its graphs may stay
    metrics = {"accuracy": sum(correct) / max(1, len(correct)), "n_questions": len(examples),
               "n_samples": len(correct), "seconds": time.perf_counter() - t0, **stats.as_dict()}
    if strict:
        metrics["gsm8k_strict_match"] = sum(strict) / len(strict)
        metrics["gsm8k_flexible_match"] = sum(flexible) / len(flexible)
    return metrics, records


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Evaluate a model (+ LoRA adapter) on GSM8K / MATH500 / a dataset",
                                usage="%(prog)s --model MODEL [--adapter DIR] [--dataset DATASET] [flags] "
                                      "(--help lists them)", formatter_class=HelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model", required=True, help="Hugging Face hub id or local checkpoint directory (required)")
    g.add_argument("--adapter", default=None, help="PEFT-format LoRA adapter directory, e.g. a train.py checkpoint (default: none)")
    g.add_argument("--quant", choices=("nvfp4", "bf16"), default=None,
                   help="the base weights' format (default: the run's, beside --adapter; else nvfp4)")
    g.add_argument("--quantizer", choices=("rtn", "mse", "gptq"), default=None,
                   help="how NVFP4's codes are chosen (train.py --help; default: the run's, else rtn); a gptq "
                        "run's adapter is evaluated on the base the run saved")
    add_flags(g, ("dtype",))
    g.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default="gsm8k",
                   help="gsm8k | math500 | addition | multiplication | a Hub dataset id | a .jsonl/.csv/.parquet file | a directory")
    g.add_argument("--dataset-config", default=None, help="the Hub dataset's configuration, e.g. main (default: its only or default one)")
    g.add_argument("--split", default="test", help="the split evaluated")
    add_column_flags(g)
    g.add_argument("--limit", type=int, default=None, help="the first N questions (default: all)")
    g.add_argument("--system-prompt", default=None,
                   help="default: the run's (run_config.json beside --adapter), else tasks.SYSTEM_PROMPT")
    g.add_argument("--chat-template-kwargs", type=tasks.parse_chat_template_kwargs, default=None, metavar="JSON",
                   help="""extra chat-template variables, a JSON object: '{"enable_thinking": false}' (Qwen3); """
                        "default: the run's")
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--samples", type=int, default=1, help="samples per question")
    g.add_argument("--max-new-tokens", type=int, default=1024, help="completion length limit")
    g.add_argument("--max-model-len", type=int, default=4096, help="prompt + completion tokens the KV cache holds")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (and the arithmetic tasks' split)")
    g.add_argument("--stall-timeout", type=float, default=600.0,
                   help="seconds without a sampler step after which eval.py prints every thread's stack and exits "
                        "with status 75 (watchdog.py); 0: never")
    g = p.add_argument_group("output")
    g.add_argument("--output", default=None, help="write one JSON line per question to this file (default: none)")
    return p


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    run = run_settings(args.adapter)
    if isinstance(run, str):
        if args.system_prompt is None:
            p.error(f"--adapter: {run}, so the prompt it was trained with is unknown: restore it, or pass "
                    f"--system-prompt (and --chat-template-kwargs if the run set them)")
        run = {}
    base = run_base(args.adapter, run, args.quant, args.quantizer)
    if isinstance(base, str):
        p.error(f"--quantizer: {base}")
    weights, args.quant, quantizer = base
    for key in ("system_prompt", "chat_template_kwargs"):
        if getattr(args, key) is None and key in run:
            setattr(args, key, run[key])
    if args.system_prompt is None:
        args.system_prompt = tasks.SYSTEM_PROMPT
    print(json.dumps(vars(args)))
    if run:
        print(f"prompt and base settings of the run: {os.path.dirname(os.path.abspath(args.adapter))}/{RUN_CONFIG}")
    for name in ("samples", "max_new_tokens", "max_model_len") + (("limit",) if args.limit is not None else ()):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.temperature < float("inf"):
        p.error(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        p.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if not 0 <= args.stall_timeout < float("inf"):
        p.error(f"--stall-timeout must be >= 0 (0 = never), got {args.stall_timeout}")
    if not 0 <= args.seed < 2 ** 63:
        p.error(f"--seed must be in [0, 2**63), got {args.seed}")
    if args.samples > 1 and args.temperature == 0:
        p.error("--samples > 1 needs --temperature > 0 (greedy samples are identical)")
    # Everything that can be checked without the model is, before it loads (so is --output).
    columns = tasks.Columns(args.prompt_column, args.answer_column)
    problems = {"--dataset": tasks.source_problem(args.dataset, args.split, args.dataset_config, columns),
                "--model": tasks.model_problem(args.model) or tasks.tokenizer_problem(args.model),
                "--adapter": args.adapter and verify_adapter(args.adapter),
                "--output": args.output and (f"{args.output} is a directory" if os.path.isdir(args.output) else
                                             write_problem(os.path.dirname(os.path.abspath(args.output))))}
    for flag, problem in problems.items():
        if problem:
            p.error(f"{flag}: {problem}")
    try:
        torch.device(args.device or "cpu")
    except (RuntimeError, ValueError) as e:
        p.error(f"--device: {e}")

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        examples = tasks.load_task(args.dataset, args.split, limit=args.limit, seed=args.seed,
                                   config=args.dataset_config, columns=columns)
    except (ValueError, FileNotFoundError) as e:  # bad data, an empty file, a split that is not there, offline
        raise SystemExit(f"error: --dataset: {one_line(e)}") from None
    if any(e.answer is None for e in examples):
        raise SystemExit(f"error: --dataset {args.dataset} has no gold answers (no 'answer' column): pass --answer-column")
    print(f"{args.dataset} [{args.split}]: {len(examples)} questions; loading {weights or args.model} ({args.quant}"
          f"{', ' + ('gptq, saved by the run' if weights else quantizer) if args.quant == 'nvfp4' else ''}) ...")
    try:
        tokenizer = load_tokenizer(args.model)
        tasks.build_prompt(tokenizer, examples[0].prompt, args.system_prompt, args.chat_template_kwargs)
        model = load_model(weights or args.model, quant=args.quant, device=device, dtype=getattr(torch, args.dtype),
                           quantizer=quantizer)
    except tasks.PromptError as e:
        raise SystemExit(f"error: --model: {e}") from None
    except (OSError, ValueError) as e:  # a Hub id that cannot be fetched (offline), a damaged checkpoint
        raise SystemExit(f"error: --model: {tasks.load_problem(args.model, e)}") from None
    if args.adapter:
        note = "its manifest verifies" if os.path.exists(os.path.join(args.adapter, MANIFEST)) else \
            f"no {MANIFEST}, so its files are not checksummed (a PEFT adapter from elsewhere)"
        print(f"--adapter {args.adapter}: {note}")
        try:
            lora.load_adapter(model, args.adapter, args.model)
        except (ValueError, FileNotFoundError) as e:  # another base or shape, NaN or Inf in it
            raise SystemExit(f"error: --adapter: {e}") from None
    model.eval()
    engine = rollout.LLMEngine(model, max_model_len=args.max_model_len)
    params = rollout.SamplingParams(temperature=args.temperature, top_p=args.top_p, n=args.samples,
                                    max_tokens=args.max_new_tokens, seed=args.seed)
    try:
        with watchdog.watching(args.stall_timeout, lambda: "Nothing was written; run the command again."):
            metrics, records = evaluate(engine, tokenizer, examples, params, system_prompt=args.system_prompt,
                                        chat_template_kwargs=args.chat_template_kwargs, progress=True)
    except tasks.PromptError as e:  # a template that fails on a later prompt than the first
        raise SystemExit(f"error: --model: {e}") from None
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
