"""The stall watchdog: a run that stops making progress ends, with every thread's stack, instead of
waiting forever.

A GPU kernel that never finishes (a program spinning on a flag that no program will set, a collective
that one rank never joins) leaves the host blocked in its next synchronisation: the process lives, uses
no CPU and prints nothing, so neither its user nor a job scheduler learns that it has stopped. train.py
therefore trains, and eval.py evaluates, under a watchdog (`watching`). The work that must advance
says so with `beat(what)`: each decode step whose tokens the sampler reads back (rollout.py), each
micro-batch of the training pass and each optimizer update (train.py). A thread looks every tenth of the limit; once `limit`
seconds pass without a beat it prints which beat came last, every thread's stack (faulthandler), and
ends the process with EXIT_STALLED, 75 (EX_TEMPFAIL in BSD's sysexits.h: a temporary failure, worth
retrying). Checkpoints are written under a temporary name and renamed, so the last one is whole
whenever the process ends, and `python train.py --resume` (or a scheduler's retry) goes on from it.

Two cases that thread alone would miss:
  - a main thread stuck in C code that holds the GIL: then no Python thread runs. So at each look the
    thread also arms faulthandler's own watchdog, a C thread that needs no GIL, to fire a little after
    its own deadline; if the Python thread never looks again, that one prints the stacks and ends the
    process with status 1 (faulthandler's header: "Timeout (h:mm:ss)!").
  - code that may rightly take long and is not the run's own: the reward functions (--reward-timeout
    bounds each call, in their own worker process), the answer checks of an evaluation (bounded by
    rewards.py's own timeouts), callbacks and experiment trackers. `paused(what)` stops the clock
    around them.

A beat stores an int and a string: well under a microsecond, beside decode steps of milliseconds. One
watchdog runs at a time in a process. train.py's and eval.py's --stall-timeout set the limit (0: none,
for a run under a debugger, whose breakpoints stop every beat).

Test: tests/test_watchdog.py (a stall in Python, a stall holding the GIL, a run that beats, a pause;
train.py stalled in its training pass exits 75 naming the last checkpoint and how to resume; eval.py
stalled exits 75 having written nothing).
"""
import contextlib
import faulthandler
import os
import sys
import threading
import time

EXIT_STALLED = 75
BACKSTOP_LOOKS = 2    # faulthandler's C watchdog fires this many looks after the Python thread's deadline

_beats = 0            # beats so far in this process; the watching thread compares counts
_last = "the start"   # what the last beat was
_paused = 0           # open paused() blocks: while any is, the clock stands still


def beat(what: str) -> None:
    """Progress: `what` (a short noun phrase, shown if the run stalls after it) has just happened."""
    global _beats, _last
    _beats += 1
    _last = what


@contextlib.contextmanager
def paused(what: str):
    """Stop the clock while the block runs (code that may rightly take long, bounded elsewhere or not
    the run's own); its end is a beat, so the limit counts again from there."""
    global _paused
    _paused += 1
    try:
        yield
    finally:
        _paused -= 1
        beat(what)


@contextlib.contextmanager
def watching(limit_s: float, advice=lambda: ""):
    """Watch the block: `limit_s` seconds without a beat (and outside every paused block) end the
    process as the module docstring says; advice() is printed after the first line (how to go on).
    limit_s 0: no watchdog."""
    if not limit_s:
        yield
        return
    stop = threading.Event()
    thread = threading.Thread(target=_watch, args=(limit_s, advice, stop), name="qerl-watchdog", daemon=True)
    beat("the start of the watch")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        faulthandler.cancel_dump_traceback_later()


def _watch(limit_s: float, advice, stop: threading.Event) -> None:
    """The watching thread: every limit/10 s compare the beats with the last look's; a still count for
    limit_s (outside pauses) is a stall. Each look re-arms the C backstop to fire BACKSTOP_LOOKS looks
    after the moment this thread would have fired."""
    look = limit_s / 10
    seen, since = _beats, time.monotonic()
    while not stop.wait(look):
        now = time.monotonic()
        if _beats != seen or _paused:
            seen, since = _beats, now
        quiet = now - since
        if quiet >= limit_s:
            _stalled(quiet, advice)
        faulthandler.dump_traceback_later(limit_s - quiet + BACKSTOP_LOOKS * look, exit=True, file=_stderr())


def _stalled(quiet: float, advice) -> None:
    """Say what stalled, dump every thread's stack, and end the process: the main thread cannot be
    asked to stop, as it is blocked where no Python runs."""
    err = _stderr()
    print(f"\nerror: no progress for {quiet:.1f} s (the last: {_last}): the run is stuck, most likely in a GPU "
          f"kernel or a collective that never finishes; every thread's stack follows. {advice()}", file=err,
          flush=True)
    faulthandler.dump_traceback(file=err, all_threads=True)
    err.flush()
    os._exit(EXIT_STALLED)


def _stderr():
    """sys.stderr where it is a file with a descriptor (faulthandler writes to descriptors), else the
    process's original stderr (a notebook or a capturing test runner replaces sys.stderr)."""
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):
        return sys.__stderr__
