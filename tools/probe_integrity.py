"""tools/probe_integrity.py: feed qerl what a new user (or a bad disk, or someone else's run directory)
feeds it, and count what happens. Nothing should be silently wrong, hang, end in a traceback, or run
code that came with a run directory.

    python tools/probe_integrity.py --model ~/.cache/qerl/SmolLM2-135M-Instruct [--classes rewards,data]

--model is any small local model directory with its tokenizer (tests/test_probes.py passes a tiny
random one). Each probe is one action done the way the tools do it (eval.main, export.main, the resume
path of run_dir.py, tasks.load_task, reward_funcs.load and score, flags.parse_args, train.main,
`python train.py --resume .` inside a planted run directory) and an expectation, and lands in one column:

    refused         it stopped with one clear line: SystemExit with an error code, or the named
                    exception the caller turns into one line (reward_funcs' RewardError, ValueError)
    accepted        a control that must work did (a pristine checkpoint, a valid odd reward)
    warned          a damage that need not stop a run was said on screen (a metrics.jsonl row missing)
    wrongly refused a control that must work was refused
    silently wrong  it went on (or exited 0) where it should have refused or warned, or gave other values
    hangs           it ran past its time limit
    tracebacks      any other exception
    code from run   a file planted in a run directory ran (it leaves a marker when it does)

The classes: `checkpoint` (corruptions of a train.py checkpoint given to eval.py and export.py, and
of adapters without a manifest), `resume` (the same corruptions and damaged run files met by
--resume), `model` (damaged model directories), `data` (rows that cannot train, bad files), `rewards`
(hostile reward functions and modules), `run_dir` (a run directory that plants code for
`train.py --resume .`), `flags` (flags and a resumed run's record that train.py refuses before anything
loads: run_config.json edited or mistyped, reward code changed since the run started, steps that
cannot be taken) and `train` (runs that go wrong on the way: a model that does not load, rewards
without signal, gradients that are not finite, Ctrl-C), built in tools/probe_files.py,
tools/probe_code.py and tools/probe_run.py. The table is printed; --json writes every probe's verdict
and message.
"""
import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from probe_files import Bench, Probe, checkpoint_probes, data_probes, make_run, model_probes, resume_probes  # noqa: E402
from probe_code import reward_probes, run_dir_probes  # noqa: E402, I001
from probe_run import flag_probes, train_probes  # noqa: E402, I001

import reward_funcs  # noqa: E402  (probe_files has put qerl on the path)

COLUMNS = ("refused", "accepted", "warned", "wrongly refused", "silently wrong", "hangs", "tracebacks",
           "code from run")
CLASSES = ("checkpoint", "resume", "model", "data", "rewards", "run_dir", "flags", "train")
MAKERS = {"checkpoint": checkpoint_probes, "resume": resume_probes, "model": model_probes, "data": data_probes,
          "rewards": reward_probes, "run_dir": run_dir_probes, "flags": flag_probes, "train": train_probes}


class Hang(BaseException):
    """The probe's time limit (a SIGALRM in the main thread): no `except Exception` swallows it."""


@dataclass
class Result:
    cls: str
    name: str
    verdict: str
    message: str = ""
    seconds: float = 0.0


# ----------------------------------------------------------------------------------------------
# running one probe


def _one_line(e: BaseException, err: str) -> str:
    """A refusal's message: the exception's text, or (argparse) the error line it printed."""
    text = str(e.code if isinstance(e, SystemExit) else e)
    if isinstance(e, SystemExit) and isinstance(e.code, int):
        text = "\n".join(ln for ln in err.splitlines() if "error:" in ln)
    return text


def _hang(signum, frame):
    raise Hang()


def run_probe(p: Probe) -> Result:
    """Run one probe, its output captured, under its time limit; its verdict is one of COLUMNS."""
    out, err = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, _hang)
    signal.setitimer(signal.ITIMER_REAL, p.limit_s)
    t0 = time.monotonic()
    verdict, message = None, ""
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            value = p.run()
    except Hang:
        verdict, message = "hangs", f"past {p.limit_s:g} s"
    except p.clean as e:
        message = _one_line(e, err.getvalue())
        refused = not (isinstance(e, SystemExit) and e.code in (0, None))
        one = bool(message) and "\n" not in message.strip() and "Traceback" not in err.getvalue()
        if not refused:   # an exit 0 (or None): the run would end as if it had succeeded
            verdict = "silently wrong"
        elif not one:
            verdict = "tracebacks"
        else:
            verdict = "refused" if p.expect == "refuse" else "wrongly refused"
        if verdict != "refused":
            message = f"{type(e).__name__}({message!r}) where {p.expect} was expected"
    except BaseException as e:  # noqa: B036 - any other ending is what the table counts
        verdict, message = "tracebacks", f"{type(e).__name__}: {e}"[:300]
    else:
        said = out.getvalue() + err.getvalue()
        if p.expect == "accept":
            wrong = p.check(value) if p.check else None
            verdict, message = ("silently wrong", wrong) if wrong else ("accepted", "")
        elif p.expect == "warn":
            lines = [ln for ln in said.splitlines() if "warning:" in ln]
            verdict, message = ("warned", lines[0][:300]) if lines else ("silently wrong", "no warning")
        else:
            verdict, message = "silently wrong", "went on without a word"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    if p.marker and os.path.exists(p.marker):
        verdict, message = "code from run", f"{p.marker} was written: planted code ran"
    return Result(p.cls, p.name, verdict, message, time.monotonic() - t0)


def table(results: list[Result]) -> str:
    rows = [("class", "probes", *COLUMNS)]
    for cls in [c for c in CLASSES if any(r.cls == c for r in results)] + ["total"]:
        mine = [r for r in results if cls in ("total", r.cls)]
        rows.append((cls, str(len(mine)), *(str(sum(r.verdict == c for r in mine)) for c in COLUMNS)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([fmt(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, rows[1:])])


# ----------------------------------------------------------------------------------------------
# the run


def build(classes, model: str, work: str) -> list[Probe]:
    """The probes of the classes, on a fresh fixture in work (probe_files.make_run)."""
    bench = Bench(os.path.abspath(model), os.path.abspath(work))
    make_run(bench)
    return [p for c in classes for p in MAKERS[c](bench)]


def run_all(classes, model: str, work: str, say=print) -> list[Result]:
    results = []
    for p in build(classes, model, work):
        r = run_probe(p)
        results.append(r)
        if r.verdict not in ("refused", "accepted", "warned"):
            say(f"  {r.verdict}: {r.cls}: {r.name}: {r.message}")
    reward_funcs.close_workers()
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a small local model directory with its tokenizer")
    p.add_argument("--classes", default=",".join(CLASSES), help=f"comma-separated, of {', '.join(CLASSES)}")
    p.add_argument("--work", default=None, help="scratch directory (default: a new temporary one, removed after)")
    p.add_argument("--json", default=None, help="write every probe's verdict and message here")
    args = p.parse_args(argv)
    classes = [c for c in args.classes.split(",") if c]
    if set(classes) - set(CLASSES):
        p.error(f"--classes: unknown {sorted(set(classes) - set(CLASSES))}; choose from {', '.join(CLASSES)}")
    work = args.work or tempfile.mkdtemp(prefix="qerl-probe-")
    t0 = time.monotonic()
    try:
        results = run_all(classes, args.model, work)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print(table(results))
    print(f"{len(results)} probes in {time.monotonic() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in results], f, indent=1)
    return results


if __name__ == "__main__":
    main()
