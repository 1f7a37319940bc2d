"""What a run tells its user as it goes: the progress line, the sampled completions, and the metrics
sent to an experiment tracker.

    step 12/50 | reward 0.312 | kept 0.500 | loss 0.0041 | grad_norm 0.21 | σ 6.9e-03 | 14.2 s/step | eval 0.285

`reward` is the mean of everything the step sampled; `kept`, of the groups the loss trained on (dynamic
sampling keeps the groups with a spread, so their mean stays near the middle while the policy improves).
Steps count from 1, on screen and in the records alike: step 12 is the twelfth, the one checkpoint-000012
is saved after. `record` writes rank 0's records of a step. `progress_line` is what it prints every
--log-every steps (under the progress bar). A step's
completions go to <run>/completions.jsonl (--log-completions per step: its prompt, the completion, its
reward and advantage, and each reward term), drawn at random but seeded by (seed, step), so a resumed
run writes the rows the uninterrupted one would have. metrics.jsonl (run_dir.py) stays the record;
a tracker is a copy of it for viewing.

Callbacks (train.train's callbacks=, Python code): `Callback`'s hooks, called by `notify` on rank 0.

Trackers (--report-to, one or several): TensorBoard (event files in <run>/tensorboard), Weights & Biases
and Trackio (project "qerl", or WANDB_PROJECT / TRACKIO_PROJECT; the run is named after its directory).
None of them is a dependency: each is imported only when chosen, and checks.py refuses one that is not
installed before anything loads, naming the package to install.

Test: tests/test_report.py (the progress line, the completion rows, a tracker's calls).
"""
import json
import os
import random

from tqdm import tqdm

from run_dir import COMPLETIONS, METRICS, plot_metrics

# metric -> (its label on the progress line, its format), in the order printed
PROGRESS = {"reward": ("reward", "{:.3f}"), "reward/kept": ("kept", "{:.3f}"), "loss": ("loss", "{:.4f}"),
            "grad_norm": ("grad_norm", "{:.3g}"), "aqn/sigma": ("σ", "{:.1e}"), "step_time": ("s/step", "{:.1f}"), "eval/accuracy": ("eval", "{:.3f}")}
PROJECT = "qerl"


def progress_line(m: dict, total: int) -> str:
    """One line for a step's metrics (those it has), e.g. the module docstring's."""
    parts = [f"step {m['step']}/{total}"]
    for key, (label, fmt) in PROGRESS.items():
        if isinstance(m.get(key), (int, float)):
            value = fmt.format(m[key])
            parts.append(f"{value} {label}" if key == "step_time" else f"{label} {value}")
    if m.get("skipped"):
        parts.append("skipped: no group with a reward spread")
    elif m.get("skipped_nonfinite_updates"):
        parts.append(f"{m['skipped_nonfinite_updates']} update(s) skipped: gradient not finite")
    return " | ".join(parts)


def completion_rows(step: int, samples: list[dict], n: int, seed: int) -> list[dict]:
    """n of a step's samples (dicts with prompt, completion, reward, ...) chosen by (seed, step)."""
    rng = random.Random(f"{seed}/{step}/completions")
    picked = sorted(rng.sample(range(len(samples)), min(n, len(samples))))
    return [{"step": step, **samples[i]} for i in picked]


def record(args, m: dict, samples: list, tracker, stop: bool) -> None:
    """Rank 0's records of a step: its metrics line, sampled completions, the progress line, the tracker,
    and the plots, redrawn at each evaluation."""
    with open(os.path.join(args.output_dir, METRICS), "a") as f:
        f.write(json.dumps(m) + "\n")
    if args.log_completions:
        with open(os.path.join(args.output_dir, COMPLETIONS), "a", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n"
                         for row in completion_rows(m["step"], samples, args.log_completions, args.seed))
    if args.log_every and (m["step"] % args.log_every == 0 or stop or "eval/accuracy" in m):
        tqdm.write(progress_line(m, args.max_steps))
    tracker.log(m, m["step"])
    if "eval/accuracy" in m:
        plot_metrics(args.output_dir)


class Callback:
    """What a run tells Python code as it goes (train's callbacks=): subclass it and override any hook.
    Called on rank 0, with steps counted from 1 as on screen; an exception in a hook stops the run.

        on_step_end(step, metrics)    after the step's metrics are written (metrics: its metrics.jsonl row)
        on_evaluate(step, metrics)    after an evaluation ({"eval/accuracy": ...}; step 0: before training)
        on_save(step, checkpoint)     after checkpoint-<step> is written (its directory)
    """

    def on_step_end(self, step: int, metrics: dict) -> None:
        pass

    def on_evaluate(self, step: int, metrics: dict) -> None:
        pass

    def on_save(self, step: int, checkpoint: str) -> None:
        pass


def notify(callbacks: list, hook: str, step: int, what) -> None:
    """Call each callback's hook (on_step_end, on_evaluate, on_save) that it has."""
    for cb in callbacks:
        if hasattr(cb, hook):
            getattr(cb, hook)(step, what)


class Tracker:
    """The experiment trackers of --report-to ('tensorboard,wandb': each of them): log(metrics, step) and
    close(); 'none' does nothing. `runs` maps each tracker's name to its open run."""

    def __init__(self, kinds: str, out: str, config: dict):
        self.runs = {}
        name = os.path.basename(os.path.normpath(out))
        for kind in kinds.split(","):
            if kind == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter
                self.runs[kind] = SummaryWriter(log_dir=os.path.join(out, "tensorboard"))
                self.runs[kind].add_text("run_config", "```\n" + json.dumps(config, indent=1) + "\n```")
            elif kind == "wandb":
                import wandb
                self.runs[kind] = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=name, config=config,
                                             dir=out)
            elif kind == "trackio":
                import trackio
                trackio.init(project=os.environ.get("TRACKIO_PROJECT", PROJECT), name=name, config=config)
                self.runs[kind] = trackio

    def log(self, metrics: dict, step: int) -> None:
        """The step's numeric metrics (booleans and text left out)."""
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                   and k != "step"}
        for kind, run in self.runs.items():
            if kind == "tensorboard":
                for k, v in numbers.items():
                    run.add_scalar(k, v, step)
            else:
                run.log(numbers, step=step)

    def close(self) -> None:
        for kind, run in self.runs.items():
            if kind == "tensorboard":
                run.close()
            else:
                run.finish()
        self.runs = {}
