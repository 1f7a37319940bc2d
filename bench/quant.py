"""How far each NVFP4 quantizer moves a model from its bf16 self: KL per token, weight error, time.

A model quantized three ways (checkpoint.load_model's `quantizer`), each against the bf16 model:

    rtn     nvfp4.quantize's absmax scales: llm-compressor's NVFP4, bit for bit (the reference)
    mse     the per-block scale search of nvfp4.quantize(scales="mse")
    gptq    gptq.py: error compensation over calibration prompts, layer by layer, its scales from
            the search weighted by the layer's Hessian

For each: the mean KL(bf16 ‖ quantized) of the next-token distribution over every position of
held-out text (nats a token; its 99th percentile and max; how often the top token agrees), the
relative RMS error of all quantized weights (‖W' − W‖ / ‖W‖ over every linear), and how long
load_model took. Both models run in fp32 (the bf16 weights exactly, the NVFP4 ones dequantized), so
the KL is the weights' doing alone, not bf16 arithmetic's.

The SmolLM2-135M that tools/get_smollm2.py builds is a Q4_1 GGUF dequantized to bf16: its weights
already sit on 16 evenly spaced levels per 32, and NVFP4 rounds them a second time onto its uneven
grid, a pessimistic case for every quantizer here (the Hub's bf16 release, not reachable here, is
unmeasured). Results: bench/results/quant_smollm2_cpu.json (prompts) and
quant_smollm2_calib_solutions_cpu.json (prompts + solutions).

The text. Held-out: the first --eval-rows rows of the dataset's test split, each the chat-formatted
question (tasks.encode_prompt, the system prompt of a training run) followed by its gold solution
(GSM8K: the worked answer). Calibration (gptq): the first --calib-rows prompts of the train split, as
a training run would hand them over (prompts only: the run's own training prompts), or with
--calib-solutions each followed by its gold solution (text like what the model will write). Test and
train rows never overlap, so GPTQ is never scored on its own calibration text.

    python bench/quant.py --model <SmolLM2 dir> --data <dir with gsm8k train/test.jsonl> --threads 1 \\
        --shapes 3584x18944,18944x3584 --out bench/results/quant_smollm2_cpu.json
    python bench/quant.py --model <SmolLM2 dir> --data <dir> --threads 1 --quantizers gptq --calib-solutions \\
        --out bench/results/quant_smollm2_calib_solutions_cpu.json

--shapes times nvfp4.quantize (absmax and mse) on random N(0, 0.02²) bf16 matrices of those shapes on
this machine, once each. --random-init times each quantizer on a whole random-init model of a
checkpoint.SHAPES name (or a directory with config.json) instead, on --device, with --calib-rows random
sequences of --calib-len tokens for gptq: its seconds and its peak memory (the cost of quantizing a 7B or
32B model at load; random weights make the KL meaningless, so it is not measured there):

    python bench/quant.py --random-init qwen2.5-7b,qwen2.5-32b --device cuda --out runs/quant_time.json

Prints a table and writes JSON. Test: tests/test_quant_bench.py (a tiny
model, CPU).
"""
import argparse
import json
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import nvfp4  # noqa: E402
import tasks  # noqa: E402
from checkpoint import build_model, load_model, load_tokenizer, random_init_config  # noqa: E402

QUANTIZERS = ("rtn", "mse", "gptq")


def token_sets(tokenizer, source: str, eval_rows: int, calib_rows: int, calib_solutions: bool = False):
    """(held-out sequences: test prompt + gold solution, calibration sequences: train prompts, + their
    solutions with calib_solutions), as token ids."""
    def encode(e, solution: bool):
        text = tokenizer(e.solution or e.answer, add_special_tokens=False)["input_ids"] if solution else []
        return tasks.encode_prompt(tokenizer, e.prompt) + text
    held_out = [encode(e, True) for e in tasks.load_task(source, "test", limit=eval_rows)]
    calibration = [encode(e, calib_solutions) for e in tasks.load_task(source, "train", limit=calib_rows)]
    return held_out, calibration


@torch.no_grad()
def kl_table(ref, models: dict, seqs) -> dict:
    """{name: KL(ref ‖ model) per token (mean, p99, max), top-1 agreement} over every position of seqs."""
    kls, agree = {n: [] for n in models}, {n: 0 for n in models}
    for s in seqs:
        ids = torch.tensor([s])
        logp = F.log_softmax(ref(ids)[0].float(), -1)                         # (T, V)
        for name, model in models.items():
            logq = F.log_softmax(model(ids)[0].float(), -1)
            kls[name].append((logp.exp() * (logp - logq)).sum(-1))            # (T,)
            agree[name] += (logp.argmax(-1) == logq.argmax(-1)).sum().item()
    out = {}
    for name in models:
        kl = torch.cat(kls[name]).double()
        out[name] = {"kl_mean": kl.mean().item(), "kl_p99": kl.quantile(0.99).item(), "kl_max": kl.max().item(),
                     "top1_agree": agree[name] / len(kl), "tokens": len(kl)}
    return out


def weight_error(ref, model) -> float:
    """‖W' − W‖ / ‖W‖ over all quantized linears (W: the reference model's weights)."""
    err = norm = 0.0
    for name, mod in model.named_modules():
        if isinstance(mod, nvfp4.NVFP4Linear):
            w = ref.get_submodule(name).weight.double()
            err += (mod.dequantized_weight(torch.float64) - w).square().sum().item()
            norm += w.square().sum().item()
    return (err / norm) ** 0.5


def time_shapes(shapes: list[str]) -> dict:
    """Seconds of one nvfp4.quantize call per (shape, scales) on random bf16 weights, on the CPU."""
    out = {}
    for shape in shapes:
        n, k = map(int, shape.split("x"))
        w = (torch.randn(n, k) * 0.02).bfloat16()
        for scales in nvfp4.SCALES:
            t0 = time.perf_counter()
            nvfp4.quantize(w, scales=scales)
            out[f"{shape} {scales}"] = time.perf_counter() - t0
            print(f"quantize {shape} scales={scales}: {out[f'{shape} {scales}']:.1f} s", flush=True)
    return out


def describe(device: str) -> str:
    """The machine a timing ran on, in words."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def time_random_init(shapes: list[str], names: list[str], device: str, calib_rows: int, calib_len: int,
                     done=lambda out: None) -> dict:
    """{shape: {quantizer: {"seconds", "peak_gib"}}}: checkpoint.build_model of each random-init shape
    quantized by each quantizer (peak_gib: the device's peak allocated memory; None on a CPU). done(out)
    after each row: a run stopped by a time limit keeps the rows it finished."""
    out = {}
    for shape in shapes:
        cfg = random_init_config(shape)
        gen = torch.Generator().manual_seed(0)
        calibration = torch.randint(0, cfg["vocab_size"], (calib_rows, calib_len), generator=gen).tolist()
        out[shape] = {}
        for name in names:
            cuda = torch.device(device).type == "cuda"
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            model = build_model(cfg, quant="nvfp4", device=device, quantizer=name,
                                calibration=calibration if name == "gptq" else None)
            if cuda:
                torch.cuda.synchronize(device)
            row = {"seconds": time.perf_counter() - t0,
                   "peak_gib": torch.cuda.max_memory_allocated(device) / 2 ** 30 if cuda else None}
            del model
            out[shape][name] = row
            done(out)
            print(f"{shape} {name}: {row['seconds']:.1f} s" + (f", peak {row['peak_gib']:.1f} GiB" if cuda else ""),
                  flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a bf16 checkpoint directory or Hub id (the KL table)")
    ap.add_argument("--data", default="gsm8k", help="a tasks.py source with train and test splits")
    ap.add_argument("--quantizers", default=",".join(QUANTIZERS))
    ap.add_argument("--eval-rows", type=int, default=64, help="held-out rows of the test split")
    ap.add_argument("--calib-rows", type=int, default=128, help="train prompts GPTQ calibrates on")
    ap.add_argument("--calib-solutions", action="store_true", help="calibrate on prompts + gold solutions")
    ap.add_argument("--shapes", default="", help="NxK,... to time nvfp4.quantize on (e.g. 3584x18944)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--random-init", default="", help="SHAPE,...: time each quantizer on a random-init model instead")
    ap.add_argument("--device", default="cpu", help="where --random-init builds its models")
    ap.add_argument("--calib-len", type=int, default=256, help="tokens of each random calibration sequence")
    ap.add_argument("--out", default=None, help="write the results here as JSON")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.quantizers.split(",")
    if set(names) - set(QUANTIZERS):
        ap.error(f"--quantizers: unknown {sorted(set(names) - set(QUANTIZERS))}; choose from {QUANTIZERS}")
    if args.random_init:
        def save(timings):
            if args.out:
                with open(args.out, "w") as f:
                    json.dump({"args": vars(args), "torch": torch.__version__, "device": describe(args.device),
                               "random_init": timings}, f, indent=1)
        time_random_init(args.random_init.split(","), names, args.device, args.calib_rows, args.calib_len, save)
        return
    if not args.model:
        ap.error("--model is required (or --random-init)")
    tokenizer = load_tokenizer(args.model)
    held_out, calibration = token_sets(tokenizer, args.data, args.eval_rows, args.calib_rows, args.calib_solutions)
    print(f"held-out: {len(held_out)} sequences, {sum(map(len, held_out))} tokens; calibration: "
          f"{len(calibration)} prompts, {sum(map(len, calibration))} tokens", flush=True)
    ref = load_model(args.model, quant="bf16", device="cpu", dtype=torch.float32)
    models, rows = {}, {}
    for name in names:
        t0 = time.perf_counter()
        models[name] = load_model(args.model, quant="nvfp4", device="cpu", dtype=torch.float32, quantizer=name,
                                  calibration=calibration if name == "gptq" else None)
        rows[name] = {"load_seconds": time.perf_counter() - t0, "weight_rel_err": weight_error(ref, models[name])}
        print(f"{name}: loaded in {rows[name]['load_seconds']:.1f} s, weight error {rows[name]['weight_rel_err']:.4f}",
              flush=True)
    for name, kl in kl_table(ref, models, held_out).items():
        rows[name].update(kl)
    print(f"{'quantizer':<10} {'KL nats/tok':>11} {'KL p99':>8} {'top-1 agree':>11} {'weight err':>10} {'load s':>7}")
    for name, r in rows.items():
        print(f"{name:<10} {r['kl_mean']:>11.4f} {r['kl_p99']:>8.3f} {r['top1_agree']:>11.3f} "
              f"{r['weight_rel_err']:>10.4f} {r['load_seconds']:>7.1f}")
    timings = time_shapes([s for s in args.shapes.split(",") if s])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "machine": describe("cpu"), "torch": torch.__version__,
                       "held_out_tokens": sum(map(len, held_out)), "calibration_tokens": sum(map(len, calibration)),
                       "table": rows, "quantize_seconds": timings}, f, indent=1)


if __name__ == "__main__":
    main()
