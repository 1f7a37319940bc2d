"""export.py: what leaves a run, in the three forms the Hugging Face stack and vLLM read.

    python export.py --adapter runs/gsm8k/checkpoint-000200 --out exported      # or --adapter runs/gsm8k

writes, each with the base model's tokenizer beside it:

    exported/adapter/   the PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors): load it
                        with peft.PeftModel.from_pretrained on the base, or serve it beside the NVFP4 base
    exported/merged/    a bf16 Hugging Face checkpoint with the adapter folded in, W + s·B·A (the NVFP4
                        base dequantized first where the run trained on one): transformers and vLLM load
                        it as any model
    exported/nvfp4/     the base in compressed-tensors NVFP4 (the run's own 4-bit weights, bit for bit:
                        nvfp4-pack-quantized, what llm-compressor writes), which vLLM serves on Hopper and
                        Blackwell with the adapter on top

Serving and evaluating them:

    vllm serve exported/nvfp4 --enable-lora --lora-modules qerl=exported/adapter --max-lora-rank 32
    vllm serve exported/merged
    python eval.py --model exported/merged --quant bf16 --dataset gsm8k          # the merged model
    python eval.py --model exported/nvfp4 --adapter exported/adapter --dataset gsm8k   # base + adapter

The run decides. An adapter inside a train.py run directory (or the run directory itself: its newest
checkpoint that verifies) brings the run's run_config.json: the base (--model), the format it trained
on (--quant: a merged model of an NVFP4 run is its dequantized 4-bit base plus the adapter, of a bf16
run the bf16 base plus the adapter), how its codes were chosen (--quantizer; a gptq run's base is the one
the run saved in its directory) and its prompt. A flag given overrides the run's, and a --quant or
--quantizer other than the run's is said on screen. The run's system prompt and chat-template variables become the
defaults of the exported tokenizers' chat template (tasks.template_with_defaults): a server that applies
the model's template to a user's messages without a system message prompts it as training did. An
adapter from elsewhere needs --model (and --system-prompt for a template default). --formats picks a
subset (default: all three, without nvfp4 for a bf16 base). The base loads on the CPU unless --device
says otherwise. Every adapter_config.json written (here and in a run's checkpoints) names the base as
PEFT can load it from anywhere: a local directory by its absolute path.

What is checked. --adapter is verified as --resume verifies a checkpoint (run_dir.verify_adapter: its
manifest's sizes and sha256; a train.py checkpoint without a manifest is refused), and --model's
config.json and tokenizer are looked at, before anything loads; every refusal is one line. The exports
are written under <out>/.tmp-export-<pid>/ and each takes its place only once all are complete, so a
failed export leaves the previous ones as they were; an existing one is replaced only with
--overwrite. The exported adapter carries a manifest of its own, so eval.py verifies it too.

Test: tests/test_export.py (each export loaded by transformers / PEFT against our model; a bf16 and an
NVFP4 run exported with no flag but --adapter: the merged model gives the run's logits, its template the
run's prompt; refusals; a failed --overwrite keeps the previous exports); tests/test_probes.py
(corrupted adapters).
"""
import argparse
import json
import os
import shutil

import torch

import lora
import tasks
from checkpoint import load_model, load_tokenizer, save_pretrained
from model import Transformer
from run_dir import RUN_CONFIG, resume_checkpoint, run_base, run_settings, verify_adapter, write_manifest, write_problem

FORMATS = ("adapter", "merged", "nvfp4")


def export_merged(model, directory: str) -> None:
    """The bf16 checkpoint of model with its adapters folded in (lora.merge_lora)."""
    merged = lora.merge_lora(model, torch.bfloat16)
    with torch.device("meta"):
        dense = Transformer(model.config, "bf16", torch.bfloat16)
    expected = set(dense.state_dict()) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    if set(merged) != expected:
        raise ValueError(f"export: merged weights do not match the architecture: missing "
                         f"{sorted(expected - set(merged))[:4]}, unexpected {sorted(set(merged) - expected)[:4]}")
    dense.load_state_dict(merged, strict=False, assign=True)
    dense.tie_weights()
    save_pretrained(dense, directory)


def write_exports(args, formats: list[str], staging: str) -> None:
    """Each format into staging/<format>, each with the tokenizer (its chat template defaulting to the
    run's prompt, run_template); the adapter with a manifest."""
    try:
        tokenizer = load_tokenizer(args.model)
        model = load_model(args.weights or args.model, quant=args.quant, device=args.device, dtype=torch.bfloat16,
                           quantizer=args.quantizer)
    except (OSError, ValueError) as e:  # offline, a damaged checkpoint
        raise SystemExit(f"error: --model: {tasks.load_problem(args.model, e)}") from None
    run_template(tokenizer, args)
    if "nvfp4" in formats:                                 # the base first, while it has no adapters
        save_pretrained(model, os.path.join(staging, "nvfp4"))
    try:
        lora.load_adapter(model, args.adapter, args.model)
    except (ValueError, FileNotFoundError) as e:  # another base or shape, NaN or Inf in it
        raise SystemExit(f"error: --adapter: {e}") from None
    if "adapter" in formats:
        lora.save_adapter(model, os.path.join(staging, "adapter"), args.model)
    if "merged" in formats:
        export_merged(model, os.path.join(staging, "merged"))
    for f in formats:
        tokenizer.save_pretrained(os.path.join(staging, f))
    if "adapter" in formats:   # so that eval.py --adapter <out>/adapter verifies it, as a checkpoint
        write_manifest(os.path.join(staging, "adapter"))


def run_template(tokenizer, args) -> None:
    """Make the run's system prompt and chat-template variables the defaults of the tokenizer's chat
    template (tasks.template_with_defaults), so that the exported model, served, prompts as the run trained
    it; a tokenizer without a template, or an adapter from outside a run without --system-prompt, is left
    as it is, and said."""
    if args.system_prompt is None:
        print("note: the adapter comes from outside a train.py run and --system-prompt is not given: the chat "
              "template is exported as the base has it")
    elif not getattr(tokenizer, "chat_template", None):
        print("warning: the base's tokenizer has no chat template: the run's system prompt cannot be made its default")
    else:
        tokenizer.chat_template = tasks.template_with_defaults(tokenizer.chat_template, args.system_prompt,
                                                               args.chat_template_kwargs)


def resolve_run(p, args) -> None:
    """Fill in what the run recorded (run_dir.run_settings): the base (--model), its format and quantizer
    (--quant, --quantizer; run_dir.run_base: a gptq run's saved base) and the prompt (--system-prompt,
    --chat-template-kwargs), where not given; a --quant or --quantizer other than the run's is said. An
    --adapter that is a run directory means its newest checkpoint that verifies."""
    if os.path.isfile(os.path.join(args.adapter, RUN_CONFIG)) and not os.path.exists(
            os.path.join(args.adapter, lora.ADAPTER_CONFIG)):
        ckpt = resume_checkpoint(args.adapter)
        if ckpt is None:
            p.error(f"--adapter: the run in {args.adapter} has no checkpoint yet")
        args.adapter = ckpt
    run = run_settings(args.adapter)
    if isinstance(run, str):
        p.error(f"--adapter: {run}, so the base and prompt it was trained with are unknown: restore it")
    for flag in ("quant", "quantizer"):
        if getattr(args, flag) and run.get(flag) and getattr(args, flag) != run[flag]:
            print(f"warning: --{flag} {getattr(args, flag)}, but the run trained on a {run[flag]} base: the exports "
                  f"will not be the model the run trained")
    base = run_base(args.adapter, run, args.quant, args.quantizer)
    if isinstance(base, str):
        p.error(f"--quantizer: {base}")
    args.weights, args.quant, args.quantizer = base
    args.model = args.model or run.get("model")
    if args.system_prompt is None:
        args.system_prompt = run.get("system_prompt")
    if args.chat_template_kwargs is None:
        args.chat_template_kwargs = run.get("chat_template_kwargs")
    if not args.model:
        p.error("--model is required: the adapter is not in a train.py run directory that names its base")


def main(argv=None):
    p = argparse.ArgumentParser(description="Export a run's adapter, a merged bf16 model and the NVFP4 base")
    p.add_argument("--adapter", required=True, help="a checkpoint-<step>/ of a run, its run directory (the newest "
                                                     "checkpoint), or any PEFT adapter directory")
    p.add_argument("--out", required=True, help="directory that receives adapter/, merged/, nvfp4/")
    p.add_argument("--model", default=None, help="the base the run trained: a Hub id or a local checkpoint dir "
                                                 "(default: the run's, from its run_config.json)")
    p.add_argument("--quant", choices=["nvfp4", "bf16"], default=None,
                   help="the base format the run trained on (default: the run's, else nvfp4)")
    p.add_argument("--quantizer", choices=["rtn", "mse", "gptq"], default=None,
                   help="how the run's NVFP4 codes were chosen (default: the run's, else rtn); a gptq run's base is "
                        "the one it saved")
    p.add_argument("--system-prompt", default=None, help="the default system prompt of the exported chat template "
                                                         "(default: the run's; '' for none)")
    p.add_argument("--chat-template-kwargs", type=tasks.parse_chat_template_kwargs, default=None, metavar="JSON",
                   help="template variables the exported chat template sets by default (default: the run's)")
    p.add_argument("--formats", default=None, help=f"comma-separated, of {', '.join(FORMATS)} (default: all; "
                                                   f"without nvfp4 for a bf16 base)")
    p.add_argument("--device", default="cpu", help="where to load the base (cpu needs the bf16 model's RAM)")
    p.add_argument("--overwrite", action="store_true", help="replace existing exports in --out (once the new "
                                                             "ones are complete)")
    args = p.parse_args(argv)
    resolve_run(p, args)
    formats = [f for f in args.formats.split(",") if f] if args.formats is not None else \
        [f for f in FORMATS if f != "nvfp4" or args.quant == "nvfp4"]
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        p.error(f"--formats: unknown {bad or '(none)'}; choose from {', '.join(FORMATS)}")
    if "nvfp4" in formats and args.quant != "nvfp4":
        p.error("--formats nvfp4 needs --quant nvfp4: the NVFP4 export is the run's own 4-bit base")
    for f in formats:
        if os.path.exists(os.path.join(args.out, f)) and not args.overwrite:
            p.error(f"{os.path.join(args.out, f)} exists: pass --overwrite or choose another --out")
    problems = {"--adapter": verify_adapter(args.adapter),
                "--model": tasks.model_problem(args.model) or tasks.tokenizer_problem(args.model),
                "--out": f"{args.out} is a file, not a directory" if os.path.isfile(args.out) else
                write_problem(args.out)}
    for flag, problem in problems.items():
        if problem:
            p.error(f"{flag}: {problem}")
    print(f"exporting {args.adapter} on {args.model} ({args.quant}) to {args.out}: {', '.join(formats)}")

    staging = os.path.join(args.out, f".tmp-export-{os.getpid()}")
    try:
        write_exports(args, formats, staging)
        for f in formats:   # each complete export takes its place; a previous one goes only now
            final, old = os.path.join(args.out, f), os.path.join(staging, f".old-{f}")
            if os.path.exists(final):
                os.replace(final, old)
            os.replace(os.path.join(staging, f), final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(json.dumps({f: os.path.join(args.out, f) for f in formats}))


if __name__ == "__main__":
    main()
