"""tools/probe_code.py: the probes of tools/probe_integrity.py that bring code: hostile reward
functions and modules (`rewards`: each loaded and scored as train.py does, through reward_funcs) and
a run directory that plants modules for `python train.py --resume .` started inside it (`run_dir`).
"""
import json
import os
import subprocess
import sys
import threading

from probe_files import CKPT, ROOT, Bench, Probe, remanifest   # (which puts qerl on the path)

import reward_funcs
import run_dir
import tasks

REWARD_TIMEOUT_S = 1.0


# The hostile reward functions, one module (each runs in the worker). Every one is refused but those of
# ACCEPTED, which must give these values, and of WATCHED, which RewardWatch must report.
REWARD_MODULE = '''
import math, os, signal, sys, threading, time
import numpy as np

def raises(completions, **kw): raise ValueError("bad completion")
def exits_0(completions, **kw): sys.exit(0)
def exits_1(completions, **kw): sys.exit(1)
def os_exit(completions, **kw): os._exit(0)
def segfault(completions, **kw): os.kill(os.getpid(), signal.SIGSEGV)
def aborts(completions, **kw): os.abort()
def spins(completions, **kw):
    while True: pass
def holds_the_gil(completions, **kw): return [float(10 ** 10 ** 8 % 7)] * len(completions)
def sleeps(completions, **kw): time.sleep(1000)
def keyboard_interrupt(completions, **kw): raise KeyboardInterrupt
def recursion(completions, **kw): return recursion(completions)
def memory_error(completions, **kw): raise MemoryError
def reads_stdin(completions, **kw): return [float(input())] * len(completions)
def dict_(completions, **kw): return {i: 1.0 for i in range(len(completions))}
def set_(completions, **kw): return set(range(len(completions)))
def string(completions, **kw): return "1" * len(completions)
def none(completions, **kw): return None
def generator(completions, **kw): return (1.0 for _ in completions)
def short(completions, **kw): return [1.0]
def long(completions, **kw): return [1.0] * 10 ** 6
def nan(completions, **kw): return [float("nan")] * len(completions)
def inf(completions, **kw): return [float("inf")] * len(completions)
def minus_1e308(completions, **kw): return [-1e308] * len(completions)
def ten_million(completions, **kw): return [1e7] * len(completions)
def bools(completions, **kw): return [True] * len(completions)
def strings(completions, **kw): return ["1.0"] * len(completions)
def lists(completions, **kw): return [[1.0]] * len(completions)
def matrix(completions, **kw): return np.ones((len(completions), 1))
def huge_int(completions, **kw): return [10 ** 400] * len(completions)
def numpy_ok(completions, **kw): return np.arange(len(completions), dtype=np.float32) / 4
def leaves_a_thread(completions, **kw):
    threading.Thread(target=time.sleep, args=(1000,)).start()
    return [0.5] * len(completions)
def floods_stdout(completions, **kw):
    print("a reward that prints " * 300)   # more than a pipe writes at once
    return [0.25] * len(completions)
def closes_stdout(completions, **kw):
    sys.stdout.close()
    return [0.75] * len(completions)
def all_none(completions, **kw): return [None] * len(completions)
def all_equal(completions, **kw): return [1.0] * len(completions)
'''
ACCEPTED = {"numpy_ok": [0.0, 0.25, 0.5, 0.75], "leaves_a_thread": [0.5] * 4, "floods_stdout": [0.25] * 4,
            "closes_stdout": [0.75] * 4}
WATCHED = ("all_none", "all_equal")
IMPORT_TROUBLE = {"a module that blocks at import": "import time\ntime.sleep(1000)\n",
                  "a module that calls sys.exit at import": "import sys\nsys.exit(0)\n",
                  "a module that calls os._exit at import": "import os\nos._exit(3)\n",
                  "a module that raises at import": "raise RuntimeError('no')\n",
                  "a module with a syntax error": "def f(:\n",
                  "a module that segfaults at import": "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n"}


def reward_probes(bench: Bench) -> list[Probe]:
    path = os.path.join(bench.work, "hostile_rewards.py")
    open(path, "w").write(REWARD_MODULE)
    examples = [tasks.Example(f"{i} + 1?", str(i + 1), "numeric") for i in range(4)]
    clean = (reward_funcs.RewardError, ValueError)

    def call(fn):
        f = reward_funcs.load(f"{path}:{fn}")
        return reward_funcs.score([f], examples, ["a", "bb", "ccc", "dddd"], timeout_s=REWARD_TIMEOUT_S)[0]

    probes = []
    for fn in [ln[4:ln.index("(")] for ln in REWARD_MODULE.splitlines() if ln.startswith("def ")]:
        if fn in WATCHED:
            def run(fn=fn):
                watch = reward_funcs.RewardWatch(patience=3)
                for step in range(3):
                    totals, terms = reward_funcs.score([reward_funcs.load(f"{path}:{fn}")], examples, ["a"] * 4)
                    for line in watch.update(step, totals, terms):
                        print(line)
            probes.append(Probe("rewards", f"{fn}, three steps in a row", run, expect="warn", clean=clean))
        elif fn in ACCEPTED:
            probes.append(Probe("rewards", fn, lambda fn=fn: call(fn), expect="accept", clean=clean,
                                check=lambda v, fn=fn: None if v == ACCEPTED[fn] else f"values {v}"))
        else:
            probes.append(Probe("rewards", fn, lambda fn=fn: call(fn), clean=clean, limit_s=30))
    for i, (name, source) in enumerate(IMPORT_TROUBLE.items()):
        def run(i=i, source=source):
            mod = os.path.join(bench.work, f"trouble_{i}.py")
            open(mod, "w").write(source + "def fn(completions, **kw):\n    return [1.0] * len(completions)\n")
            return reward_funcs.load(f"{mod}:fn", timeout_s=REWARD_TIMEOUT_S)
        probes.append(Probe("rewards", name, run, clean=clean, limit_s=30))
    probes.append(Probe("rewards", "no thread or worker left behind", _nothing_left, expect="accept",
                        check=lambda wrong: wrong))
    return probes


def _nothing_left():
    """After close_workers: no worker process alive, no thread but daemons and the main one here."""
    pids = [w.child.proc.pid for w in reward_funcs._WORKERS.values()]
    reward_funcs.close_workers()
    alive = [pid for pid in pids if os.path.exists(f"/proc/{pid}") and
             open(f"/proc/{pid}/stat").read().split()[2] != "Z"]
    extra = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    return f"workers alive {alive}, threads {extra}" if alive or extra else None


def run_dir_probes(bench: Bench) -> list[Probe]:
    """A run directory that plants code: reward modules and files named like qerl's modules (and
    torch's, and Python's startup hooks), each leaving a marker if it runs; run_config.json names the
    planted reward in several ways (the checkpoint's manifest rewritten to match, so that nothing but
    the reward's loading stands in the way). `python train.py --resume .` is started inside it."""
    specs = {"a module name": "reward:fn", "a relative file": "./reward.py:fn",
             "an absolute file": "{run}/sub/reward.py:fn", "a module in a package": "sub.reward:fn"}
    probes = []
    for i, (how, spec) in enumerate(specs.items()):
        out = os.path.join(bench.work, f"planted-{i}")
        marker = os.path.join(out, "MARKER")

        def run(out=out, marker=marker, spec=spec):
            bench.fresh(dst=out)
            code = f"open({marker!r}, 'a').write(__name__ + '\\n')\ndef fn(completions, **kw):\n    return [1.0]\n"
            os.makedirs(os.path.join(out, "sub"))
            for name in ("reward.py", "sub/reward.py", "sub/__init__.py", "rewards.py", "tasks.py", "flags.py",
                         "reward_funcs.py", "torch.py", "sitecustomize.py", "usercustomize.py"):
                open(os.path.join(out, name), "w").write(code)
            config = json.load(open(os.path.join(out, run_dir.RUN_CONFIG)))
            config.update(output_dir=out, reward=[spec.format(run=out)], max_steps=3)
            open(os.path.join(out, run_dir.RUN_CONFIG), "w").write(json.dumps(config))
            remanifest(os.path.join(out, CKPT))
            res = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--resume", "."], cwd=out,
                                 capture_output=True, text=True, timeout=300,
                                 env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
            errors = [ln for ln in res.stderr.splitlines() if "error:" in ln]
            if res.returncode == 0:
                return res   # the run went on: silently wrong (or planted code ran: the marker says)
            if len(errors) == 1 and "Traceback" not in res.stderr:
                raise SystemExit(errors[0])
            raise RuntimeError(f"exit {res.returncode}: {res.stderr[-300:]}")
        probes.append(Probe("run_dir", f"train.py --resume . with the reward as {how}", run, marker=marker,
                            limit_s=300))
    return probes
