"""The run directory: the arguments, the metrics, the checkpoints, the plots.

    <output-dir>/run_config.json        the arguments of the run (its identity is checked on --resume)
                 metrics.jsonl          one JSON line per step, TRL's metric names where they exist
                 plots.png              reward, eval accuracy, entropy and completion length against step
                 checkpoint-<step>/     adapter_model.safetensors + adapter_config.json (a PEFT adapter)
                                        + trainer_state.pt (optimizer, schedule, step, data position)
                 latest                 the name of the newest complete checkpoint

Crash safety. Every file is written under a temporary name, flushed to disk and renamed; a checkpoint
is written as the directory .tmp-checkpoint-<step> and renamed whole, and only then does `latest`
name it. So a run killed at any instant leaves the previous checkpoint intact and resumes from it.
trainer_state.pt is read with torch.load(weights_only=True): tensors and numbers, never code.

Test: tests/test_train.py (resume, refusals, a SIGKILL mid-run).
"""
import json
import os
import shutil

import torch

import lora

RUN_CONFIG = "run_config.json"
METRICS = "metrics.jsonl"
LATEST = "latest"
TRAINER_STATE = "trainer_state.pt"
# Arguments that must match for --resume to continue the same run (max_steps sets the AQN schedule).
RUN_IDENTITY = ("max_steps", "model", "quant", "dataset", "lora_rank", "lora_alpha", "group_size", "prompts_per_step", "seed")


def prepare_output_dir(args, write: bool = True) -> str | None:
    """Check (and, if write, create) the output directory; return the checkpoint to resume from.

    A directory that holds another run is never overwritten: without --resume that is an error,
    and with --resume the run's identity (model, dataset, LoRA shape, ...) must match. Every rank
    checks, before rank 0 writes anything, so a refusal stops all ranks with the same message."""
    out = args.output_dir
    cfg_path = os.path.join(out, RUN_CONFIG)
    if os.path.exists(cfg_path):
        if not args.resume:
            raise SystemExit(f"error: {out} already holds a run ({RUN_CONFIG}); pass --resume to continue it "
                             f"or choose another --output-dir")
        with open(cfg_path) as f:
            old = json.load(f)
        diff = {k: (old.get(k), getattr(args, k)) for k in RUN_IDENTITY if old.get(k) != getattr(args, k)}
        if diff:
            raise SystemExit(f"error: --resume with settings that differ from the run in {out}: "
                             + ", ".join(f"{k}: saved {a!r}, given {b!r}" for k, (a, b) in diff.items()))
    elif os.path.isdir(out) and os.listdir(out):
        raise SystemExit(f"error: {out} is not empty and holds no qerl run ({RUN_CONFIG} missing); "
                         f"choose another --output-dir")
    if write:
        os.makedirs(out, exist_ok=True)
        for name in os.listdir(out):  # half-written checkpoints of a killed run
            if name.startswith(".tmp-"):
                shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    return latest_checkpoint(out) if args.resume else None


def write_atomic(path: str, text: str) -> None:
    """Write under a temporary name, flush to disk, rename: readers see the old or the new file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def latest_checkpoint(out: str) -> str | None:
    """The newest complete checkpoint, as named by `latest` (written after the rename)."""
    path = os.path.join(out, LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        name = f.read().strip()
    ckpt = os.path.join(out, name)
    if not os.path.exists(os.path.join(ckpt, TRAINER_STATE)):
        raise SystemExit(f"error: {path} names {name}, which is missing or incomplete")
    return ckpt


def save_checkpoint(out: str, step: int, model, optimizer, scheduler, data_pos: int, base_model: str, keep: int):
    """checkpoint-<step>/ = PEFT adapter + trainer_state.pt, written as .tmp-... and renamed."""
    name = f"checkpoint-{step:06d}"
    tmp, final = os.path.join(out, f".tmp-{name}"), os.path.join(out, name)
    shutil.rmtree(tmp, ignore_errors=True)
    lora.save_adapter(model, tmp, base_model)
    state = {"step": step, "data_pos": data_pos, "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict()}
    torch.save(state, os.path.join(tmp, TRAINER_STATE))
    for f in os.listdir(tmp):  # on disk before the rename makes them the checkpoint (power loss, not just kill)
        with open(os.path.join(tmp, f), "rb") as fh:
            os.fsync(fh.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    write_atomic(os.path.join(out, LATEST), name)
    old = sorted(d for d in os.listdir(out) if d.startswith("checkpoint-") and d != name)
    for d in old[:max(0, len(old) - (keep - 1))]:
        shutil.rmtree(os.path.join(out, d), ignore_errors=True)


def load_checkpoint(ckpt: str, model, optimizer, scheduler, base_model: str) -> dict:
    lora.load_adapter(model, ckpt, base_model)
    # Optimizer state holds only tensors and numbers: weights_only refuses anything that would unpickle code.
    state = torch.load(os.path.join(ckpt, TRAINER_STATE), map_location="cpu", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state


def truncate_metrics(out: str, step: int) -> None:
    """Keep the metric lines of steps before `step`: a resumed run rewrites what came after."""
    path = os.path.join(out, METRICS)
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for ln in f:
            try:
                kept += [ln] if json.loads(ln)["step"] < step else []
            except (ValueError, KeyError):  # a blank line, or one cut by a kill mid-write
                pass
    write_atomic(path, "".join(kept))


def plot_metrics(out: str) -> None:
    """plots.png: reward, eval accuracy, entropy and completion length against step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(os.path.join(out, METRICS)) as f:
        rows = [json.loads(ln) for ln in f if ln.strip()]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.2))
    for ax, key in zip(axes, ("reward", "eval/accuracy", "entropy", "completions/mean_length")):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if key == "eval/accuracy":  # x = optimizer updates applied when it was measured
            pts = [(0, r["eval/accuracy_initial"]) for r in rows if "eval/accuracy_initial" in r]
            pts += [(r["eval/updates"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), marker="." if len(pts) < 50 else None)
        ax.set(title=key, xlabel="step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "plots.png"), dpi=100)
    plt.close(fig)
