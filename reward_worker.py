"""The reward worker: one user reward module in a process of its own, its functions called by name.

reward_funcs.py starts a `Worker` for each user module a run names (when the spec is loaded) and keeps
it for the run; the worker (`serve`, the child's whole life) imports the module there, never in the
training process, and each batch goes there and back over a private pipe pair (rewards.Child: the
arguments pickled by us, the values back as one JSON line, so the training process never unpickles
what user code made). The function's module-level state lives in the worker from call to call, as it
would in-process. What a process boundary buys:
  - a deadline that always holds: past --reward-timeout the worker is killed (SIGKILL), which stops
    C code holding the GIL too, where an in-process timer cannot;
  - sys.exit, os._exit, a segfault or the out-of-memory killer end the worker, not the run, and
    become a RewardError naming the function; a thread the function leaves running dies with it;
  - a module that blocks or exits while importing is named at parse time (a note after
    IMPORT_NOTE_S, an error at the timeout) instead of hanging flag parsing without a word;
  - Ctrl-C is the run's: the worker ignores SIGINT and ends with the run.
It costs the pickling of the batch and a pipe round trip per call: for a trivial function on 64
completions, 0.5 ms at 200 tokens each, 3 ms at 1000, 12 ms at 4000 on a 2-core CPU (in-process: under
a µs; tests/test_reward_funcs.py measures the first), nothing beside a training step of seconds. A
reward model on the GPU loads in the worker's own CUDA context. The worker guards against accidents,
not malice: it runs as the same user, with the same rights. It sets WORKER_ENV, so that a script it
imports (a reward function defined in a training script) cannot start a run inside it.

This file imports neither torch nor anything of qerl but rewards.py's pipes: the worker starts fast.
Test: tests/test_reward_funcs.py, tests/test_probes.py (hostile reward functions and modules).
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import math
import os
import pickle
import signal
import sys
import time
import traceback

import rewards

IMPORT_NOTE_S = 5.0      # an import still running after this is announced on stderr
WORKER_ENV = "QERL_REWARD_WORKER"   # set in a worker: train.train refuses to start there


class RewardError(Exception):
    """A user reward function failed: it raised, exited, crashed, overran, or returned something that is
    not one finite number (or None) per completion. The message names the function; train.py stops on it."""


def search_path() -> list[str]:
    """sys.path without '', the entry `python -c` and the REPL put first to mean "the current directory"."""
    return [p for p in sys.path if p]


# ----------------------------------------------------------------------------------------------
# the parent's side


class Worker:
    """One user module in a process of its own (the module docstring), its functions called by name:
    `describe` says a function's name and parameters, `call` runs it on a batch, `close` ends the
    process. The functions of one module share its state, as they would in-process. A worker whose
    call failed is gone; the next load starts another."""

    def __init__(self, spec: str, module: str | None, file: str, timeout_s: float):
        """Start the worker of `spec`: import `module` (a dotted name on the Python path) or, None, `file`."""
        job = json.dumps({"path": search_path(), "module": module, "file": file})
        self.child = rewards.Child(f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
                                   f"import reward_worker; reward_worker.serve()", (job,), quiet=False)
        what = f"{spec!r}: importing {file}"
        line = self.child.read_line(time.monotonic() + min(IMPORT_NOTE_S, timeout_s))
        if line is None and self.child.usable() and timeout_s > IMPORT_NOTE_S:
            print(f"reward {spec}: still importing {file} after {IMPORT_NOTE_S:g} s "
                  f"(waiting up to {timeout_s:g} s)", file=sys.stderr, flush=True)
            line = self.child.read_line(time.monotonic() + timeout_s - IMPORT_NOTE_S)
        if line is None:
            if self.child.usable():
                self.close()
                raise ValueError(f"{what} took more than {timeout_s:g} s (does it block at import?)")
            raise ValueError(f"{what} ended its worker process ({self.child.exit_status()}) (does the module "
                             f"exit or crash at import?)")
        reply = json.loads(line)
        if "error" in reply:
            self.close()
            raise ValueError(f"{what} failed: {reply['error']}")

    def _ask(self, request: tuple, timeout_s: float | None, spec: str) -> dict:
        """Send one request, return its JSON reply; RewardError if the worker overran, exited or crashed."""
        try:
            payload = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise RewardError(f"reward {spec}: the batch's arguments cannot be sent to its worker "
                              f"({type(e).__name__}: {e})") from None
        t0 = time.monotonic()
        deadline = t0 + (math.inf if timeout_s is None else timeout_s)
        sent = self.child.send(len(payload).to_bytes(8, "little") + payload, deadline)
        line = self.child.read_line(deadline) if sent else None
        if line is not None:
            return json.loads(line)
        if self.child.usable():
            self.close()
            raise RewardError(f"reward {spec} took more than --reward-timeout {timeout_s:g} s on {request[2]} "
                              f"completions ({time.monotonic() - t0:.1f} s): stopped")
        raise RewardError(f"reward {spec} ended its worker process during a call ({self.child.exit_status()}): "
                          f"a reward function must return its values, not exit or crash")

    def describe(self, attr: str, timeout_s: float, spec: str) -> tuple[str, tuple | None]:
        """(the function's __name__, its parameters as (name, kind, has a default), or None when it has
        no signature); ValueError when the module has no such function."""
        try:
            reply = self._ask((attr, None, 0), timeout_s, spec)
        except RewardError as e:
            raise ValueError(str(e)) from None
        if "error" in reply:
            raise ValueError(f"{spec!r}: {reply['error']}")
        return reply["name"], reply["params"] and tuple(map(tuple, reply["params"]))

    def call(self, attr: str, kwargs: dict, n: int, timeout_s: float | None, spec: str) -> dict:
        """The worker's reply to one batch of n completions (see as_reply)."""
        return self._ask((attr, kwargs, n), timeout_s, spec)

    def usable(self) -> bool:
        return self.child.usable()

    def close(self) -> None:
        self.child.kill()


# ----------------------------------------------------------------------------------------------
# the worker's side (and, for a function that runs in the training process, reward_funcs')


def _where(e: BaseException) -> str:
    frame = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    return f" (at {frame.filename}:{frame.lineno})" if frame else ""


def what_raised(e: BaseException) -> str:
    """What user code raised, with where: 'KeyError: 'x' (at f.py:3)', or 'sys.exit(0) (at f.py:3)'."""
    what = f"sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"{type(e).__name__}: {e}"[:500].rstrip(": ")
    return what + _where(e)


def as_reply(out, n: int) -> dict:
    """The worker's JSON reply for what the function returned: {"values": [...]} with a {"bad": repr}
    for an entry that is not a number or None, else {"container": type} or {"length": k}."""
    if isinstance(out, (list, tuple)):
        values = list(out)
    elif hasattr(out, "tolist") and getattr(out, "ndim", None) == 1:   # a numpy array, a torch tensor
        values = out.tolist()
    else:
        return {"container": type(out).__name__}
    if len(values) != n:
        return {"length": len(values)}
    entries = []
    for v in values:
        if hasattr(v, "item") and getattr(v, "ndim", None) == 0:   # numpy / torch scalars
            v = v.item()
        if v is None:
            entries.append(None)
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            entries.append({"bad": repr(v)[:80]})
        else:
            try:
                entries.append(float(v))   # nan and inf too: the parent names them
            except OverflowError:
                entries.append({"bad": "an integer past the float range"})
    return {"values": entries}


def parameters(fn) -> list | None:
    """fn's parameters as [name, kind, has a default] lists (JSON's shape), or None when it has no
    signature (a builtin: found out on the first call)."""
    try:
        return [[p.name, p.kind.name, p.default is not p.empty] for p in inspect.signature(fn).parameters.values()]
    except (TypeError, ValueError):
        return None


def fitted(kwargs: dict, params) -> dict:
    """The keywords a function with these parameters takes: all where it takes **kwargs (or has no
    signature), else those it names."""
    if params is None or any(kind == "VAR_KEYWORD" for _, kind, _ in params):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in {p[0] for p in params}}


def _function(module, attr: str) -> tuple:
    """(fn, its parameters) of module.attr, a dotted attribute path."""
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
    if not callable(fn):
        raise LookupError(f"{module.__name__} has no function {attr!r}")
    return fn, parameters(fn)


def serve() -> None:
    """The worker's life: import the module (sys.path the parent's search_path()), say "ready", then per
    request a pickled (function, kwargs, n) in and one JSON reply out, until the parent closes the pipe;
    kwargs None asks for the function's name and parameters."""
    requests, out = rewards.child_pipes()
    job = json.loads(sys.argv[3])
    sys.path[:] = job["path"]
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the run's to handle; it ends the worker at exit
    os.environ[WORKER_ENV] = "1"

    def reply(obj):
        out.write(json.dumps(obj).encode() + b"\n")

    try:
        if job["module"] is None:
            name = os.path.splitext(os.path.basename(job["file"]))[0]
            name = name if name not in sys.modules else f"{name}_reward"   # a json.py must not replace json
            spec = importlib.util.spec_from_file_location(name, job["file"])
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module   # dataclasses and pickle look their module up there
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(job["module"])
    except BaseException as e:   # SystemExit and KeyboardInterrupt at import too
        reply({"error": what_raised(e)})
        os._exit(0)
    reply({"ready": True})
    functions = {}
    while head := requests.read(8):
        attr, kwargs, n = pickle.loads(requests.read(int.from_bytes(head, "little")))   # our parent's own bytes
        try:
            if attr not in functions:
                functions[attr] = _function(module, attr)
            fn, params = functions[attr]
            if kwargs is None:
                reply({"name": getattr(fn, "__name__", attr), "params": params})
                continue
            result = as_reply(fn(**fitted(kwargs, params)), n)
        except LookupError as e:
            result = {"error": str(e)} if kwargs is None else {"error": f"raised {what_raised(e)}"}
        except SystemExit as e:
            result = {"error": f"called {what_raised(e)}: a reward function must return its values, not exit"}
        except BaseException as e:   # KeyboardInterrupt, RecursionError, ...: named, not fatal here
            result = {"error": f"raised {what_raised(e)}"}
        for stream in (sys.stdout, sys.stderr):   # what the function printed shows before the run moves on
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):   # a function that closed or replaced it
                pass
        reply(result)
    os._exit(0)   # not sys.exit: a thread the function left running must not keep the worker alive
